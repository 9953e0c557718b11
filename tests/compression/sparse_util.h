#pragma once
// Helpers shared by the sparse-codec tests (sparse_test.cc, dgc_test.cc).

#include <ATen/ATen.h>

#include <vector>

#include "compression/codec_util.h"

namespace sparrow::compression::test {

inline std::vector<int64_t> to_vec(const at::Tensor& t) {
  at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// The values of a kSparse Encoded as floats (sign values as ±magnitude, int8 as q · scale).
inline std::vector<float> values_of(const Encoded& e) {
  std::vector<float> v(e.count);
  detail::unpack_values(e.values.data(), e.count, e.value_type, detail::value_scale(e), v.data());
  return v;
}

}  // namespace sparrow::compression::test
