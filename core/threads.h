#pragma once
// Threads and BLAS: which BLAS LibTorch is running on, and one place that sets
// how many threads a program's compute uses.
//
// Debian's LibTorch calls the generic libblas.so.3, so the BLAS is whatever the
// alternatives system points at: OpenBLAS or BLIS when installed, otherwise the
// netlib reference BLAS (about 8x slower on every GEMM). Three pools can run a
// program's compute: ATen's intra-op pool (OpenMP; oneDNN convolutions and
// elementwise kernels), OpenBLAS's or BLIS's own threads, and the simulator's
// workers. configure_threads() sizes the first two so that workers x threads
// never exceeds the cores: oversubscribed, spinning BLAS threads make two
// workers slower than one.
//
// OpenBLAS picks its kernels from the CPU (Cooperlake, i.e. AVX-512, on the
// AMD Zen 5 CI machine) unless OPENBLAS_CORETYPE forces a core; forcing an
// AVX2 core on an AVX-512 CPU costs 1.2-1.7x on GEMMs (docs/performance.md),
// so blas_warning() says so.

#include <cstdint>
#include <functional>
#include <string>

namespace sparrow::core {

struct BlasInfo {
  std::string name;        // "OpenBLAS", "BLIS", "MKL", "reference", or "unknown"
  std::string detail;      // e.g. OpenBLAS's config string and core name
  std::string library;     // the libblas.so.3 (or libopenblas) file actually loaded, if found
  int threads = 0;         // the BLAS's own thread count (0 = unknown / not threaded)
  bool reference = false;  // the netlib reference BLAS: slow
};

// What this process runs on (looked up in the loaded libraries; cheap).
BlasInfo blas_info();

// The number of CPU cores this process may run on (its affinity mask).
int available_cores();

// glibc malloc settings for training loops: blocks from the heap (none
// mmap'ed and unmapped every step; in a worker thread's own arena, blocks over
// 64 MiB still are), the heap trimmed only above 1 GiB free.
// configure_threads calls it. Does nothing when SPARROW_SYSTEM_MALLOC is set
// to anything but "0" or "" (glibc's defaults, as for the setting below).
void tune_allocator();

// glibc malloc settings for programs that receive large ZeroMQ messages
// (sparrow-server, sparrow-client, sparrow-edge, the server bench): one arena,
// no mmap'ed blocks, the heap trimmed only above 1 GiB free. libzmq allocates
// every message it receives; by default each block of 32 MiB or more (in a
// thread's own arena, also each block over its 64 MiB heap) is mmap'ed fresh
// and unmapped on free, so every 100 MB update is received into
// new pages and read once more after the kernel filled them. On the 2-vCPU
// development VM that costs about 0.5 s per 100 MB (page faults at ~20 us
// each, plus ~0.14 s for the first user read of the pages recv() filled,
// invisible to the guest's fault counters), more than the transfer itself;
// with the blocks reused the same update is received and folded 8-12x faster
// (docs/performance.md, "Server"). The cost: the resident size stays near its
// peak, and all threads share one malloc lock. Call first in main(), before
// any thread exists (an arena a thread already has stays). Does nothing and
// returns false when SPARROW_SYSTEM_MALLOC is set to anything but "0" or "".
bool tune_allocator_for_messages();
// Whether tune_allocator_for_messages() applied its settings in this process.
bool allocator_tuned_for_messages();

// OMP_NUM_THREADS when it holds one positive integer, else 0.
int env_threads();

// Sets ATen's intra-op threads and the BLAS's threads to `threads`; when
// threads <= 0, to OMP_NUM_THREADS if the environment sets it (the usual knob,
// e.g. several clients sharing a machine), else max(1, available_cores() /
// workers). Returns the count set. Call once at start-up, before worker
// threads exist.
int configure_threads(int workers, int threads = 0);

// Runs f(begin, end) over chunks of [0, n) (at least `grain` each) on ATen's
// intra-op threads, with the BLAS held to one thread meanwhile, so that each
// thread's GEMMs run in that thread: for loops whose iterations are
// independent and whose results must not depend on the thread count (the
// batched fast paths' clients, evaluation's images). A threaded OpenBLAS
// called from inside such a loop would queue the threads on its one pool,
// and after each GEMM its workers spin (sched_yield) for about 2^28 cycles,
// taking a core from the intra-op threads: a 3-round CNN run at 2 threads
// made 200,000 sched_yield calls and spent 2.2 s in the kernel; and
// OpenBLAS's results depend on its thread count. With one intra-op thread
// (configure_threads gives the BLAS as many), or inside a parallel region,
// it calls f(0, n) directly.
// Several callers at once (workers) share the hold: the BLAS gets its count
// back when the last one leaves.
void parallel_for_single_blas(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& f);

// Raises ATen's intra-op threads to n for its lifetime (then sets them back;
// n no more than now does nothing): for work that runs while a program's
// other compute threads are idle, such as the simulator's evaluation between
// rounds. Call from the thread that configured them, with no other thread
// starting ATen work meanwhile.
class ScopedIntraOpThreads {
 public:
  explicit ScopedIntraOpThreads(int n);
  ~ScopedIntraOpThreads();
  ScopedIntraOpThreads(const ScopedIntraOpThreads&) = delete;
  ScopedIntraOpThreads& operator=(const ScopedIntraOpThreads&) = delete;

 private:
  int saved_ = 0;
};

// One line for logs: "BLAS: OpenBLAS 0.3.21 (SkylakeX), 1 thread; small GEMMs: libxsmm (cpx); ATen 1
// thread x 2 workers on 2 cores".
std::string threads_summary(int workers);

// A warning line when the BLAS is the reference one (naming the Debian
// package that fixes it) or when OPENBLAS_CORETYPE forces AVX2 kernels on an
// AVX-512 CPU; empty otherwise.
std::string blas_warning();

}  // namespace sparrow::core
