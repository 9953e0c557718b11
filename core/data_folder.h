#pragma once
// The user's own data in a folder (x.npy + y.npy, or MNIST-format IDX files),
// and the checks of data and model against each other that every program runs
// before its first round: the simulator, the server (its test set) and the
// client (its shard).

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "core/datasets.h"
#include "core/models.h"

namespace sparrow::core {

// A folder of the user's data, in this order of preference:
//   x.npy + y.npy   x float32 [N, ...] (C order); y [N] of integer class labels
//                   (int8/16/32/64, uint8/16/32/64, or float32/float64 holding
//                   whole numbers);
//   train-images-idx3-ubyte[.gz] + train-labels-idx1-ubyte[.gz]
//                   MNIST-format IDX (images scaled to [0, 1] and normalised
//                   as Fashion-MNIST, load_mnist_format).
// ConfigError when the folder holds neither; FormatError for malformed files
// or x and y of different lengths.
Dataset load_data_folder(const std::string& dir);

// The folder's own test split, if it has one: a `test/` subfolder in the same
// format as above, or MNIST-format t10k-images-idx3-ubyte[.gz] +
// t10k-labels-idx1-ubyte[.gz] next to the train files. nullopt when neither.
std::optional<Dataset> load_data_folder_test(const std::string& dir);

// Whether the folder has its own test split (what load_data_folder_test reads).
bool has_data_folder_test(const std::string& dir);

// The folder's own partition over its clients, LEAF/FEMNIST style: a
// `client_id.npy` next to x.npy (or the IDX files) holding one integer client id
// per training sample, [N] (int64, or any integer dtype read_npy_labels takes).
// The file name every program looks for:
constexpr const char* kClientIdFile = "client_id.npy";
// Whether `dir` carries kClientIdFile (the folder need not exist).
bool has_client_ids(const std::string& dir);
// The ids as int64 [n]; nullopt when the folder has no kClientIdFile.
// FormatError for a malformed file or a length other than `n` (the samples).
std::optional<at::Tensor> load_client_ids(const std::string& dir, int64_t n);

// The natural partition of `client_ids` (int64 [N]): one part per distinct id,
// in ascending id order, each the sorted indices of that id's samples. The
// index-th part is "client index" in every program (the simulator's client
// `index`, sparrow-client's `index`).
std::vector<std::vector<int64_t>> natural_partition(const at::Tensor& client_ids);

// How every program splits a folder's training samples over clients, so that
// sparrow-client's shard `index` is the simulator's client `index`:
// `partition` = "natural" takes natural_partition(*client_ids) (ConfigError
// naming the file when there are none) and returns all its parts, whatever
// `clients` (callers take what they need); any other spec is
// core::partition(labels, clients, partition, seed).
std::vector<std::vector<int64_t>> partition_folder(const at::Tensor& labels,
                                                   const std::optional<at::Tensor>& client_ids, int clients,
                                                   const std::string& partition, uint64_t seed);

// Moves `k` samples of `d`, drawn with `seed`, out of it into the returned set
// (0 < k < N is the caller's to check): a holdout or a test share. `ids`, when
// given, is a per-sample tensor ([N, ...], e.g. the client ids) kept in step:
// it is left holding the rows of the samples that stay in `d`.
Dataset hold_out(Dataset& d, int64_t k, uint64_t seed, at::Tensor* ids = nullptr);

// One forward pass of `model` (named `name` in messages) on the first few
// samples of `d` (already through check_data_for_model): the TorchScript
// contract (docs/data-and-models.md) is that forward(x[B, ...]) returns
// logits [B, C] with C greater than every label. A model that cannot take the
// samples, or returns anything else, is a ConfigError that says which (one
// line, without LibTorch's backtrace). `max_label` defaults to d.y's maximum.
void check_model_on_data(Model& model, const Dataset& d, const std::string& name, int64_t max_label = -1);

// y as labels: reads a .npy file of integer (or whole-number float) labels,
// shape [N]. FormatError for anything else.
at::Tensor read_npy_labels(const std::string& path);

// Checks (and, when only the layout differs, reshapes) `d` for `model`:
// N >= 1, x floating and y int64 [N] with labels in [0, classes) (10 for the
// built-in models; only >= 0 for TorchScript models), and each sample's
// numel equal to the model's input (then reshaped to [N, input shape...]).
// ConfigError naming the expected and actual shapes otherwise.
Dataset check_data_for_model(Dataset d, const std::string& model);

}  // namespace sparrow::core
