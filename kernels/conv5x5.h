#pragma once
// The built-in CNN's conv1: a 5x5 convolution (stride 1, padding 2) of one
// single-channel image, with and without ReLU + 2x2 max pooling fused, and
// its weight gradient.

#include <cstdint>

namespace sparrow::kernels {

// A 5x5 convolution (stride 1, padding 2) of one single-channel h x w image
// into cout channels, plus bias: out [cout, h, w] = weight [cout, 25] x the
// image's 25 shifted copies (im2col into col, 25 h w floats of scratch). The
// CNN's conv1: ATen's convolution with one input channel ran at 14 GFLOP/s.
void conv5x5_one_channel(const float* x, int64_t h, int64_t w, const float* weight, const float* bias, int64_t cout,
                         float* out, float* col);

// conv5x5_one_channel then relu_maxpool2 (h, w even): out [cout, h/2, w/2]
// and arg as relu_maxpool2 gives them; the CNN's conv1 in training and
// evaluation. Where the CPU has AVX-512 (and w <= 32, h <= 60, cout a
// multiple of 4) a fused register-blocked kernel pools straight from its
// accumulators (1.7x the two kernels on the CNN's 28x28 images, in cache); otherwise
// the two kernels run, in scratch ((25 + cout) h w floats;
// unused by the fused kernel). The two agree to float rounding: the fused
// kernel sums the 25 products in kernel order and adds the bias last, as
// LibTorch 1.13's convolution does (on this machine its outputs were
// bit-identical to ATen's); the GEMM's order differs by up to ~4e-7. Which
// of two nearly equal values wins a pooling window follows from that, and a
// different winner moves a whole window's gradient. The two kernels are the
// reference variant; the fused one is avx512's.
void conv5x5_one_channel_relu_pool(const float* x, int64_t h, int64_t w, const float* weight, const float* bias,
                                   int64_t cout, float* out, int32_t* arg, float* scratch);

// col [25, h, w]: the 25 copies of one h x w image shifted by (ky - 2,
// kx - 2), zero outside (im2col for a 5x5 kernel, padding 2).
void im2col5x5(const float* x, int64_t h, int64_t w, float* col);

// conv5x5_one_channel's weight and bias gradients for one image: gw [cout,
// 25] += dy [cout, h, w] x im2col(x)^T and gb [cout] += the sums of dy's
// planes (col, colt: 25 h w floats of scratch each). Image by image, right
// after the pooling's backward, dy stays in cache (ATen's
// convolution_backward over the whole minibatch cost 9% of a CNN step).
void conv5x5_one_channel_weight_grad(const float* x, int64_t h, int64_t w, const float* dy, int64_t cout, float* gw,
                                     float* gb, float* col, float* colt);

}  // namespace sparrow::kernels
