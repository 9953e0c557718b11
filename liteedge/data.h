#pragma once
// sparrow-edge-lite's data, as sparrow-edge reads the same keys
// (edge/device_config.cc) for the cases the lite device supports: all of a
// folder of x.npy + y.npy in its order (its test split: test/x.npy +
// test/y.npy), or all of Fashion-MNIST's training split in file order,
// normalised as core/idx.h does (mean 0.2860, std 0.3530), its test split
// from the t10k files. The evaluated test samples are the first eval_samples.

#include <cstdint>
#include <string>
#include <vector>

#include "liteedge/config.h"

namespace sparrow::liteedge {

struct Samples {
  std::vector<float> x;    // size() samples of `per_sample` floats, row-major
  std::vector<int64_t> y;  // labels in [0, 10)
  int64_t size() const { return static_cast<int64_t>(y.size()); }
};

struct DeviceData {
  Samples train, test;  // test empty: no evaluation
};

// `input_size`: floats per sample the model takes. ConfigError for missing
// files or data that does not fit the model, FormatError for malformed files.
DeviceData load_device_data(const DeviceConfig& cfg, int64_t input_size);

// MNIST-format IDX images and labels (gzip or plain) of `split` ("train" or
// "t10k") in `dir`, the images normalised as Fashion-MNIST's.
Samples load_mnist_idx(const std::string& dir, const std::string& split);

}  // namespace sparrow::liteedge
