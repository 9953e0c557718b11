#pragma once
// ReLU + 2x2 max pooling and its backward on raw float planes.

#include <cstdint>

namespace sparrow::kernels {

// ReLU then 2x2 max pooling (stride 2) of `planes` planes of h x w (even):
// out [planes, h/2, w/2]. arg (same size, or null) receives each window's
// winner, 0..3 in row-major order (4: the ReLU zeroed the window). The same
// as ATen's relu + max_pool2d_with_indices, NaN included (it passes), whose
// CPU kernel in LibTorch 1.13 is scalar and cost a fifth of a CNN training
// step.
// Variants: reference (a portable loop the compiler vectorises), avx512
// (intrinsics, 16 windows per step); identical results.
void relu_maxpool2(const float* in, int64_t planes, int64_t h, int64_t w, float* out, int32_t* arg);

// The gradient of relu_maxpool2's input: din [planes, h, w] is dout at each
// window's winner and 0 elsewhere.
void relu_maxpool2_backward(const int32_t* arg, const float* dout, int64_t planes, int64_t h, int64_t w, float* din);

}  // namespace sparrow::kernels
