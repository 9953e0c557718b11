#pragma once
// Reading and writing NumPy .npy files (format versions 1.0–3.0), float32,
// C order, little endian. Anything else is rejected with a FormatError that says
// what was found; a truncated or malformed file never yields a partial tensor.

#include <cstdint>
#include <string>
#include <vector>

namespace sparrow::npy {

struct Array {
  std::vector<int64_t> shape;
  std::vector<float> data;  // numel(shape) values, C order
};

// Parses a whole .npy file image held in memory.
Array parse(const std::string& bytes);
Array read(const std::string& path);

// Serialises as format 1.0 ('<f4', fortran_order False).
std::string serialize(const std::vector<int64_t>& shape, const float* data);
// Writes to path atomically (temporary file, then rename).
void write(const std::string& path, const std::vector<int64_t>& shape, const float* data);

}  // namespace sparrow::npy
