#include "core/threads.h"

#include <ATen/Parallel.h>
#include <doctest/doctest.h>
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
// this process starts any thread, as the programs' main() does.
TEST_CASE("allocator: with the message policy a thread's freed 100 MB block is reused without page faults") {
  ::unsetenv("SPARROW_SYSTEM_MALLOC");
  REQUIRE(sparrow::core::tune_allocator_for_messages());
  CHECK(sparrow::core::allocator_tuned_for_messages());
  long faults[2] = {-1, -1};
  std::thread t([&] {  // as libzmq's I/O thread allocates a received message
    const size_t n = size_t{100} << 20;
    for (long& f : faults) {
      const long f0 = minor_faults();
      g_block = static_cast<char*>(std::malloc(n));
      std::memset(g_block, 1, n);
      f = minor_faults() - f0;
      std::free(g_block);
    }
  });
  t.join();
  CHECK(faults[0] > 10000);  // 25,600 fresh 4 KiB pages the first time
  CHECK(faults[1] < 1000);   // the same pages again (glibc's default: 25,600 again)
}

TEST_CASE("allocator: SPARROW_SYSTEM_MALLOC keeps glibc's default") {
  ::setenv("SPARROW_SYSTEM_MALLOC", "1", 1);
  CHECK_FALSE(sparrow::core::tune_allocator_for_messages());
  ::unsetenv("SPARROW_SYSTEM_MALLOC");
}
