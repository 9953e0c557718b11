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

// glibc malloc settings for training loops (large blocks stay in the heap
// instead of being mmap'ed and unmapped every step). configure_threads calls it.
void tune_allocator();

// OMP_NUM_THREADS when it holds one positive integer, else 0.
int env_threads();

// Sets ATen's intra-op threads and the BLAS's threads to `threads`; when
// threads <= 0, to OMP_NUM_THREADS if the environment sets it (the usual knob,
// e.g. several clients sharing a machine), else max(1, available_cores() /
// workers). Returns the count set. Call once at start-up, before worker
// threads exist.
int configure_threads(int workers, int threads = 0);

// One line for logs: "BLAS: OpenBLAS 0.3.21 (SkylakeX), 1 thread; small GEMMs: libxsmm (cpx); ATen 1
// thread x 2 workers on 2 cores".
std::string threads_summary(int workers);

// A warning line when the BLAS is the reference one (naming the Debian
// package that fixes it) or when OPENBLAS_CORETYPE forces AVX2 kernels on an
// AVX-512 CPU; empty otherwise.
std::string blas_warning();

}  // namespace sparrow::core
