#pragma once
// Fixtures the simulator's test files share: a run folder per test, and a
// small MLP data folder.

#include <ATen/ATen.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <set>
#include <string>

#include "core/npy.h"

namespace sparrow::simulator::testing {

// A folder unique to this test and process (ctest runs each case in a process
// of its own), removed on scope exit.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& name) : path("sim_test_" + name + "_" + std::to_string(getpid())) {
    std::filesystem::remove_all(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

// A data folder for the MLP, `name`_pid: x.npy [360, 784] and y.npy (labels
// i mod 10), x = wave(freq * i) / 10 + label / 10 with wave cos or sin. Made
// once per process and removed when it ends.
inline std::string mlp_data(const std::string& name, double freq, bool cosine) {
  struct Made {
    std::set<std::string> dirs;
    ~Made() {
      for (const auto& d : dirs) std::filesystem::remove_all(d);
    }
  };
  static Made made;
  const std::string dir = name + "_" + std::to_string(getpid());
  if (!std::filesystem::exists(dir + "/y.npy")) {
    std::filesystem::create_directories(dir);
    made.dirs.insert(dir);
    const int64_t n = 360;
    const at::Tensor y = at::arange(n, at::kFloat).fmod(10);
    const at::Tensor i = at::arange(n * 784, at::kFloat).reshape({n, 784}).mul(freq);
    const at::Tensor x = ((cosine ? i.cos() : i.sin()) * 0.1 + y.unsqueeze(1) / 10).contiguous();
    sparrow::npy::write(dir + "/x.npy", {n, 784}, x.data_ptr<float>());
    sparrow::npy::write(dir + "/y.npy", {n}, y.data_ptr<float>());
  }
  return dir;
}

}  // namespace sparrow::simulator::testing
