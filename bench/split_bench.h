#pragma once
// sparrow-bench split (see split_bench.cc).

#include <cstdint>
#include <string>
#include <vector>

namespace sparrow::bench {

struct SplitBenchOptions {
  int64_t pretrain_steps = 150;  // full CNN on classes 0-4
  int64_t steps = 150;           // split fine-tuning steps per case, all classes
  int64_t batch = 64;
  int64_t eval_samples = 10000;  // test images (all 10,000 by default)
  double lr = 0.02;
  bool freeze_bottom = false;
  std::string data_dir;  // empty: core's default Fashion-MNIST folder
  // Activation codec specs to compare (the uncompressed "none" always runs first).
  std::vector<std::string> cases;
};

// The default cases: streaming lowrank with 8-bit factors (rank 256, basis
// every 75 or 50 steps) and 4-bit factors (rank 384), streaming lowrank rank 64
// with fp32 factors, q8, q4.
std::vector<std::string> split_bench_default_cases();

// Prints one "pretrain" line, then one "split" line per case (JSON lines).
int bench_split(const SplitBenchOptions& options);

}  // namespace sparrow::bench
