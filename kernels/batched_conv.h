#pragma once
// A 2-D convolution for K stacked clients at once (the batched trainer's
// layout), forward and backward, on raw float arrays: each client has its own
// weights, and clients never mix. Any kernel size, stride and padding;
// dilation 1, groups 1. im2col + GEMM over a few of a client's images at a
// time (as many as keep their im2col within ~1 MiB; kernels/linear.h: libxsmm's
// JIT kernels where it has one for the shape, else the BLAS), with the bias
// (and ReLU, when fused) applied as the output is written.
//
// Layouts, row-major and contiguous:
//   x [K, B, C, H, W], weight [K, O, C, kh, kw], bias [K, O] (or null),
//   y and dy [K, B, O, Ho, Wo], Ho = (H + 2 ph - kh) / sh + 1 (Wo likewise).
//
// Runs on the calling thread. Against ATen's grouped convolution (oneDNN,
// groups = K over [B, K C, H, W]) on one thread, see batched_conv2d_preferred
// and docs/performance.md for where each is faster.

#include <cstdint>

namespace sparrow::kernels {

struct ConvShape {
  int64_t clients = 1, batch = 1, in_channels = 1, height = 1, width = 1;
  int64_t out_channels = 1, kernel_h = 1, kernel_w = 1;
  int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;

  int64_t out_height() const { return (height + 2 * pad_h - kernel_h) / stride_h + 1; }
  int64_t out_width() const { return (width + 2 * pad_w - kernel_w) / stride_w + 1; }
};

// y = conv(x, weight) + bias, then max(y, 0) when relu. Throws sparrow::Error
// for a shape with a non-positive size or an empty output.
void batched_conv2d_forward(const ConvShape& s, const float* x, const float* weight, const float* bias, bool relu,
                            float* y);

// The backward of batched_conv2d_forward. dy: the gradient of y. relu_y: the
// forward's output when it fused the ReLU (dy counts only where relu_y > 0),
// else null. Writes dL/dx into dx [K, B, C, H, W] unless it is null;
// gw = beta gw + alpha dL/dw and gb = beta gb + alpha dL/db (beta = 0
// overwrites what they held, NaN included; gb may be null), the contract of
// Model::loss_backward_clients: gw may be the weight itself (an SGD step
// fused in), which is read for the last time before gw is written.
void batched_conv2d_backward(const ConvShape& s, const float* x, const float* weight, const float* relu_y,
                             const float* dy, float* dx, float* gw, float* gb, float alpha, float beta);

// Whether batched_conv2d_* measured faster than ATen's grouped convolution
// (forward + backward, one thread) for shapes like s; where not, callers run
// ATen's. The rule and its figures: docs/performance.md.
bool batched_conv2d_preferred(const ConvShape& s);

}  // namespace sparrow::kernels
