#pragma once
// The layers of a batched program (program.h): K clients' copies of one layer
// evaluated in one call. Activations are [K, B, ...] (client, sample,
// per-sample dims); parameters are stacked along a leading client dimension
// ([K, ...shape]). Each op is one function, differentiable by autograd, so a
// faster kernel (a hand-written backward, a batched convolution of the
// kernels library) can replace one without touching the program.

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <vector>

namespace sparrow::batched {

// x [K, B, ..., in], weight [K, out, in], bias [K, out] or undefined.
// Feature-major GEMMs (core::linear_clients): the result is the transposed
// view of a [K, out, rows] product, so a following Linear reads it without a
// copy and weight gradients come out in the parameters' own layout.
at::Tensor linear_clients(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// x [K, B, C, H, W], weight [K, O, C, kh, kw], bias [K, O] or undefined;
// dilation 1, groups 1.
at::Tensor conv2d_clients(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                          std::array<int64_t, 2> stride, std::array<int64_t, 2> padding);

// BatchNorm in training mode with each client's own batch statistics (never
// pooled across clients): x [K, B, C, ...], gamma/beta [K, C] or undefined.
// mask [K, B] (1 for a real sample, 0 for padding; undefined: all real): the
// statistics cover a client's real samples only. Writes the batch mean and
// the unbiased variance (what running statistics take) of every client and
// channel into *mean and *var ([K, C], detached) when they are not null.
at::Tensor batch_norm_clients(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta, double eps,
                              const at::Tensor& mask, at::Tensor* mean, at::Tensor* var);

// LayerNorm over the trailing dims `shape` of x [K, B, ...]; weight/bias
// [K, ...shape] or undefined.
at::Tensor layer_norm_clients(const at::Tensor& x, const std::vector<int64_t>& shape, const at::Tensor& weight,
                              const at::Tensor& bias, double eps);

// Indices x [K, B, ...] (any number type), weight [K, V, D] -> [K, B, ..., D].
at::Tensor embedding_clients(const at::Tensor& x, const at::Tensor& weight);

// Per-sample ops on [K, B, ...]: applied to the [K * B, ...] view.
at::Tensor max_pool2d_clients(const at::Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                              std::array<int64_t, 2> padding, std::array<int64_t, 2> dilation, bool ceil_mode);
at::Tensor avg_pool2d_clients(const at::Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                              std::array<int64_t, 2> padding, bool ceil_mode, bool count_include_pad);
at::Tensor adaptive_avg_pool2d_clients(const at::Tensor& x, std::array<int64_t, 2> out);

}  // namespace sparrow::batched
