#include "core/threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <link.h>
#include <malloc.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

#include "kernels/cpu.h"
#include "kernels/linear.h"

namespace sparrow::core {
namespace {

template <typename F>
F sym(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

// The BLAS's own thread count (OpenBLAS or BLIS; 0 when neither is loaded).
int blas_threads() {
  static const auto get = sym<int (*)()>("openblas_get_num_threads");
  static const auto get_blis = sym<long (*)()>("bli_thread_get_num_threads");
  return get ? get() : get_blis ? static_cast<int>(get_blis()) : 0;
}

// Sets OpenBLAS's and BLIS's thread counts (whichever is loaded).
void set_blas_threads(int n) {
  static const auto set = sym<void (*)(int)>("openblas_set_num_threads");
  static const auto set_blis = sym<void (*)(long)>("bli_thread_set_num_threads");
  if (set) set(n);
  if (set_blis) set_blis(n);
}

int find_blas_library(dl_phdr_info* info, size_t, void* data) {
  const char* name = info->dlpi_name;
  if (name == nullptr || *name == '\0') return 0;
  const char* base = std::strrchr(name, '/');
  base = base ? base + 1 : name;
  if (std::strncmp(base, "libblas.so", 10) == 0 || std::strncmp(base, "libopenblas", 11) == 0 ||
      std::strncmp(base, "libblis", 7) == 0) {
    auto* out = static_cast<std::string*>(data);
    char resolved[PATH_MAX];
    *out = realpath(name, resolved) ? resolved : name;
    return 1;
  }
  return 0;
}

}  // namespace

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return 1;
}

BlasInfo blas_info() {
  BlasInfo b;
  dl_iterate_phdr(find_blas_library, &b.library);
  if (auto config = sym<char* (*)()>("openblas_get_config")) {
    b.name = "OpenBLAS";
    std::ostringstream os;
    os << config();
    if (auto core = sym<char* (*)()>("openblas_get_corename")) os << ", core " << core();
    if (const char* forced = std::getenv("OPENBLAS_CORETYPE")) os << " (OPENBLAS_CORETYPE=" << forced << ")";
    b.detail = os.str();
    b.threads = blas_threads();
  } else if (auto ver = sym<const char* (*)()>("bli_info_get_version_str")) {
    b.name = "BLIS";
    b.detail = std::string("BLIS ") + ver();
    b.threads = blas_threads();
  } else if (sym<void*>("MKL_Get_Version_String") != nullptr) {
    b.name = "MKL";
    b.detail = "Intel MKL";
  } else if (b.library.find("/blas/libblas.so") != std::string::npos ||
             b.library.find("/libblas.so") != std::string::npos) {
    // Debian's netlib BLAS lives in .../blas/; an optimised one would export
    // its own symbols above.
    b.name = "reference";
    b.detail = "netlib reference BLAS";
    b.reference = true;
    b.threads = 1;
  } else {
    b.name = "unknown";
  }
  return b;
}

// Free heap glibc keeps instead of returning it to the system.
constexpr int kKeepFreeHeap = 1 << 30;

namespace {
// SPARROW_SYSTEM_MALLOC set to anything but "0" or "": glibc's defaults.
bool system_malloc_requested() {
  const char* v = std::getenv("SPARROW_SYSTEM_MALLOC");
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

// What both policies share: no mmap'ed blocks, and the heap trimmed only
// above 1 GiB of free memory. True when glibc took both settings.
bool keep_blocks_in_heap() {
  const bool ok = mallopt(M_MMAP_MAX, 0) == 1;
  return mallopt(M_TRIM_THRESHOLD, kKeepFreeHeap) == 1 && ok;
}
}  // namespace

void tune_allocator() {
  if (system_malloc_requested()) return;
  // glibc serves blocks >= 128 KiB-32 MiB (dynamic) with mmap and returns
  // them on free, so every training step's activation and gradient buffers
  // are fresh pages: page faults were ~20% of a batched-clients run. Serve
  // blocks from the heap (no mmap: the CNN's stacked parameters for 10
  // clients are 66 MB, past any mmap threshold, and were fresh pages in every
  // pass) and do not trim it below 1 GiB of free memory. This holds for the
  // main thread's arena; a worker thread's own arena still mmaps a block
  // larger than its 64 MiB heap whatever M_MMAP_MAX says (see below).
  keep_blocks_in_heap();
}

namespace {
std::atomic<bool> g_message_malloc{false};
}  // namespace

bool allocator_tuned_for_messages() { return g_message_malloc.load(); }

bool tune_allocator_for_messages() {
  if (system_malloc_requested()) return false;
  // Every thread in the main arena: a thread's own arena serves a block larger
  // than its 64 MiB heap with mmap even when M_MMAP_MAX is 0.
  const bool one_arena = mallopt(M_ARENA_MAX, 1) == 1;
  const bool ok = keep_blocks_in_heap() && one_arena;
  g_message_malloc.store(ok);
  return ok;
}

int env_threads() {
  const char* s = std::getenv("OMP_NUM_THREADS");
  if (s == nullptr) return 0;
  char* end = nullptr;
  const long n = std::strtol(s, &end, 10);
  // "4", not "4,2" (nested levels) or junk: those leave the automatic choice.
  if (end == s || *end != '\0' || n < 1 || n > 1024) return 0;
  return static_cast<int>(n);
}

int configure_threads(int workers, int threads) {
  tune_allocator();
  if (threads <= 0) threads = env_threads();
  const int n = threads > 0 ? threads : std::max(1, available_cores() / std::max(1, workers));
  at::set_num_threads(n);
  set_blas_threads(n);
  return n;
}

namespace {

std::mutex g_blas_hold_mutex;
int g_blas_holders = 0;
int g_blas_saved = 0;  // the BLAS's thread count before the first holder

// Holds the BLAS (OpenBLAS or BLIS) to one thread while it lives.
class BlasSingleThread {
 public:
  BlasSingleThread() {
    std::lock_guard<std::mutex> lock(g_blas_hold_mutex);
    if (g_blas_holders++ > 0) return;
    g_blas_saved = blas_threads();
    if (g_blas_saved > 1) set_blas_threads(1);
  }
  ~BlasSingleThread() {
    std::lock_guard<std::mutex> lock(g_blas_hold_mutex);
    if (--g_blas_holders == 0 && g_blas_saved > 1) set_blas_threads(g_blas_saved);
  }
  BlasSingleThread(const BlasSingleThread&) = delete;
  BlasSingleThread& operator=(const BlasSingleThread&) = delete;
};

}  // namespace

void parallel_for_single_blas(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  if (n <= 0) return;
  if (at::get_num_threads() <= 1 || at::in_parallel_region()) {  // (the BLAS has as many threads as ATen)
    f(0, n);
    return;
  }
  // Held even for one chunk, so that a GEMM's bits never depend on the BLAS's
  // thread count (OpenBLAS's do).
  BlasSingleThread hold;
  if (n <= grain)
    f(0, n);
  else
    at::parallel_for(0, n, grain, f);
}

ScopedIntraOpThreads::ScopedIntraOpThreads(int n) {
  const int now = at::get_num_threads();
  if (n > now) {
    saved_ = now;
    at::set_num_threads(n);
  }
}

ScopedIntraOpThreads::~ScopedIntraOpThreads() {
  if (saved_ > 0) at::set_num_threads(saved_);
}

std::string threads_summary(int workers) {
  const BlasInfo b = blas_info();
  std::ostringstream os;
  os << "BLAS: " << (b.detail.empty() ? b.name : b.detail);
  if (!b.library.empty()) os << " [" << b.library << "]";
  if (b.threads > 0) os << ", " << b.threads << (b.threads == 1 ? " thread" : " threads");
  os << "; small GEMMs: " << kernels::gemm_backend();
  const int t = at::get_num_threads();
  os << "; ATen " << t << (t == 1 ? " thread" : " threads") << " x " << workers
     << (workers == 1 ? " worker" : " workers") << " on " << available_cores() << " cores";
  return os.str();
}

std::string blas_warning() {
  const BlasInfo b = blas_info();
#if defined(__x86_64__)
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (b.name == "OpenBLAS" && forced != nullptr &&
      (std::string(forced) == "Haswell" || std::string(forced) == "Zen" || std::string(forced) == "Sandybridge")) {
    if (kernels::cpu_features().avx512)
      return std::string("warning: OPENBLAS_CORETYPE=") + forced +
             " in the environment makes OpenBLAS run AVX2 kernels on this AVX-512 CPU; unset it for 1.2-1.7x "
             "faster GEMMs (docs/performance.md)";
  }
#endif
  if (!b.reference) return {};
  return "warning: LibTorch runs on the netlib reference BLAS, about 8x slower than an optimised one; install "
         "libopenblas0-pthread (scripts/setup.sh does) or select it with update-alternatives --config "
         "libblas.so.3-x86_64-linux-gnu";
}

}  // namespace sparrow::core
