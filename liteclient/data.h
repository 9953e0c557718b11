#pragma once
// The lite client's training data: a folder of the user's own data as
// sparrow-client reads it (`data = "folder:PATH"`, core/data_folder.h), the
// x.npy + y.npy form: x float32 (or float64, rounded) [N, ...] in C order,
// y [N] integer class labels (int8..int64, uint8..uint64, or floats holding
// whole numbers). The whole folder is this client's data (one shard).

#include <cstdint>
#include <string>
#include <vector>

namespace sparrow::liteclient {

struct LocalData {
  std::vector<float> x;    // N samples of input_size floats, row-major
  std::vector<int64_t> y;  // N labels
};

// Reads PATH/x.npy and PATH/y.npy and checks them against a model taking
// `input_size` floats per sample into `classes` classes: N >= 1, the same N
// in both, each sample of input_size values, labels in [0, classes).
// ConfigError for a missing file or data that does not fit the model (naming
// the file and the expected and actual shapes), FormatError for a malformed
// file.
LocalData load_local_data(const std::string& path, int64_t input_size, int64_t classes);

// y as labels from a whole .npy file image (`what` names it in errors).
std::vector<int64_t> parse_npy_labels(const std::string& bytes, const std::string& what);

}  // namespace sparrow::liteclient
