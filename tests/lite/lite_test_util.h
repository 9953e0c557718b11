#pragma once
// Shared by the lite tests: moving arrays between the lite runtime and
// LibTorch, and the relative difference the tests bound.

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "lite/tensor.h"

namespace sparrow::lite::testing {

inline at::Tensor to_torch(const Shape& shape, const std::vector<float>& data) {
  return at::from_blob(const_cast<float*>(data.data()), shape, at::kFloat).clone();
}
inline at::Tensor to_torch(const Tensor& t) { return to_torch(t.shape, t.data); }

inline std::vector<float> to_vec(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kFloat).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

inline Tensor from_torch(const at::Tensor& t) {
  Tensor out;
  out.shape = t.sizes().vec();
  out.data = to_vec(t);
  return out;
}

// max |a - b| / max |b| (b the reference); 0 when both are all zeros.
inline double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return den == 0 ? num : num / den;
}

}  // namespace sparrow::lite::testing
