#pragma once
// The deployed client's training data: a shard of a built-in dataset (every
// client of a run computes the same partition and takes its own shard) or a
// folder of the user's own data. Whatever the source, the result is checked
// against the model before any connection is made: samples must fit the
// model's input shape and labels its classes.

#include <string>

#include "client/session.h"
#include "core/datasets.h"

namespace sparrow::client {

// Loads the data DataConfig names (see its comment) and checks it with
// check_data_for_model(). ConfigError for a bad setting or a missing file,
// FormatError for a file that does not hold what it should.
core::Dataset load_client_data(const DataConfig& cfg, const std::string& model);

// A folder of the user's data, in this order of preference:
//   x.npy + y.npy   x float32 [N, ...] (C order); y [N] of integer class labels
//                   (int8/16/32/64, uint8/16/32/64, or float32/float64 holding
//                   whole numbers);
//   train-images-idx3-ubyte[.gz] + train-labels-idx1-ubyte[.gz]
//                   MNIST-format IDX (images scaled to [0, 1] and normalised
//                   as Fashion-MNIST, core::load_mnist_format).
// ConfigError when the folder holds neither; FormatError for malformed files
// or x and y of different lengths.
core::Dataset load_data_folder(const std::string& dir);

// y as labels: reads a .npy file of integer (or whole-number float) labels,
// shape [N]. FormatError for anything else.
at::Tensor read_npy_labels(const std::string& path);

// Checks (and, when only the layout differs, reshapes) `d` for `model`:
// N >= 1, x floating and y int64 [N] with labels in [0, classes) (10 for the
// built-in models; only >= 0 for TorchScript models), and each sample's
// numel equal to the model's input (then reshaped to [N, input shape...]).
// ConfigError naming the expected and actual shapes otherwise.
core::Dataset check_data_for_model(core::Dataset d, const std::string& model);

}  // namespace sparrow::client
