#include "core/threads.h"

#include <ATen/Parallel.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <string>

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
