#include "core/threads.h"

#include <ATen/Parallel.h>
#include <doctest/doctest.h>
#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

// Sets OMP_NUM_THREADS for one scope and restores what was there.
struct EnvThreads {
  std::string old;
  bool had = false;
  explicit EnvThreads(const char* value) {
    if (const char* s = std::getenv("OMP_NUM_THREADS")) {
      old = s;
      had = true;
    }
    if (value)
      ::setenv("OMP_NUM_THREADS", value, 1);
    else
      ::unsetenv("OMP_NUM_THREADS");
  }
  ~EnvThreads() {
    if (had)
      ::setenv("OMP_NUM_THREADS", old.c_str(), 1);
    else
      ::unsetenv("OMP_NUM_THREADS");
  }
};

}  // namespace

TEST_CASE("threads: OMP_NUM_THREADS sets the automatic count and an explicit count wins") {
  using sparrow::core::configure_threads;
  const int cores = sparrow::core::available_cores();
  {
    EnvThreads env(nullptr);
    CHECK(sparrow::core::env_threads() == 0);
    CHECK(configure_threads(1) == cores);
    CHECK(at::get_num_threads() == cores);
  }
  {
    EnvThreads env("1");
    CHECK(sparrow::core::env_threads() == 1);
    CHECK(configure_threads(1) == 1);  // several clients on one machine: each keeps to its one
    CHECK(at::get_num_threads() == 1);
    CHECK(configure_threads(1, 3) == 3);  // a configured `threads` wins
  }
  for (const char* junk : {"", "0", "-2", "2,1", "two", "99999"}) {
    EnvThreads env(junk);
    CHECK_MESSAGE(sparrow::core::env_threads() == 0, "OMP_NUM_THREADS=" << junk);
    CHECK(configure_threads(2) == std::max(1, cores / 2));
  }
  configure_threads(1, 1);
}

namespace {

long minor_faults() {
  rusage r{};
  getrusage(RUSAGE_SELF, &r);
  return r.ru_minflt;
}

char* volatile g_block = nullptr;  // keeps the compiler from eliding the allocations

}  // namespace

// ctest runs each case in a process of its own: the policy is set here before
// this process starts any thread, as the programs' main() does. (Run as one
// process after other cases, a thread may inherit an arena they created.)
// Sanitizer runtimes replace malloc and make mallopt a stub: skipped there.
#if defined(__SANITIZE_ADDRESS__)
#define SPARROW_SANITIZED_MALLOC 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(memory_sanitizer) || __has_feature(thread_sanitizer)
#define SPARROW_SANITIZED_MALLOC 1
#endif
#endif
#ifndef SPARROW_SANITIZED_MALLOC
TEST_CASE("allocator: with the message policy a thread's freed 100 MB block is reused without page faults") {
  ::unsetenv("SPARROW_SYSTEM_MALLOC");
  REQUIRE(sparrow::core::tune_allocator_for_messages());
  CHECK(sparrow::core::allocator_tuned_for_messages());
  char* where[2] = {nullptr, nullptr};
  size_t new_mapped[2] = {1, 1};  // mmap'ed blocks the allocation added
  long faults[2] = {-1, -1};
  std::thread t([&] {  // as libzmq's I/O thread allocates a received message
    const size_t n = size_t{100} << 20;
    for (int i = 0; i < 2; ++i) {
      const long f0 = minor_faults();
      const size_t mapped0 = mallinfo2().hblks;
      g_block = static_cast<char*>(std::malloc(n));
      std::memset(g_block, 1, n);
      faults[i] = minor_faults() - f0;
      where[i] = g_block;
      new_mapped[i] = mallinfo2().hblks - mapped0;  // glibc's default: 1 (the block is mmap'ed)
      std::free(g_block);
    }
  });
  t.join();
  CHECK(new_mapped[0] == 0);  // from the heap, not mmap
  CHECK(new_mapped[1] == 0);
  CHECK(where[1] == where[0]);  // the same block again
  CHECK(faults[1] < 1000);      // on pages already touched (glibc's default: 25,600 new ones)
  MESSAGE("page faults touching 100 MB: first " << faults[0] << ", again " << faults[1]);
}
#endif

TEST_CASE("allocator: SPARROW_SYSTEM_MALLOC keeps glibc's default") {
  ::setenv("SPARROW_SYSTEM_MALLOC", "1", 1);
  CHECK_FALSE(sparrow::core::tune_allocator_for_messages());
  ::unsetenv("SPARROW_SYSTEM_MALLOC");
}
