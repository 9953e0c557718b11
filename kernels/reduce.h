#pragma once
// Reductions the kernels here share (private to kernels/).

#include <cstdint>

namespace sparrow::kernels::detail {

// The sum of x[0, n) in 16 partial sums, so that it vectorises without
// -ffast-math (the bias gradients of the convolution kernels).
float sum(const float* x, int64_t n);

}  // namespace sparrow::kernels::detail
