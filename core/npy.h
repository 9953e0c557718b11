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
  std::vector<float> data;    // numel(shape) values, C order
  bool from_float64 = false;  // the file held float64, converted (only with convert_float64)
};

// Parses a whole .npy file image held in memory. With convert_float64, a
// float64 ('<f8') array (numpy's default dtype) is also read, rounded to
// float32; a finite value outside float32's range is a FormatError.
Array parse(const std::string& bytes, bool convert_float64 = false);
Array read(const std::string& path, bool convert_float64 = false);

// Serialises as format 1.0 ('<f4', fortran_order False).
std::string serialize(const std::vector<int64_t>& shape, const float* data);
// Writes to path atomically (temporary file, then rename).
void write(const std::string& path, const std::vector<int64_t>& shape, const float* data);

}  // namespace sparrow::npy
