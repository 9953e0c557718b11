#pragma once
// The LibTorch boundary of the codecs' building blocks: input checks on
// at::Tensor, the Context and State forms of the torch-free helpers in
// codec_bits.h (which this header includes), for the LibTorch-only codecs
// (PowerSGD, ACP, the CUDA paths) and the aggregation side.
// Internal to compression/: not part of the public interface.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "compression/codec_bits.h"
#include "compression/compressor.h"
#include "core/error.h"
#include "core/spec.h"

namespace sparrow::compression::detail {

// Checks x is defined, float32, on the CPU and finite (sparrow::Error otherwise,
// before any state is touched); returns a contiguous view or copy.
at::Tensor as_input(const at::Tensor& x, const char* method);
std::vector<int64_t> shape_of(const at::Tensor& x);

// ctx as the kernels read it, borrowing its name and mask (ctx must outlive it).
CodecView view_of(const Context& ctx);

uint64_t tensor_key(const Context& ctx);
uint64_t step_key(const Context& ctx, uint64_t step);
// codec_bits.h's mask helpers against ctx.mask (a contiguous 1-D int64 CPU
// tensor; mask_data throws sparrow::Error for any other).
MaskLayout mask_layout_for(const Encoded& e, const Context& ctx);
const int64_t* mask_data(const Context& ctx, int64_t numel);
std::vector<int64_t> decode_masked_indices(const Encoded& e, const Context& ctx);

// Applies `policy` to the named slots of `state` for the rounds skipped between
// state.last_round and ctx.round, then records ctx.round. A no-op for the slots
// when either round is unknown (-1); returns the rounds skipped (0 when unknown).
// The slots may live on any device (the CUDA paths age theirs with it).
int64_t age_state(State& state, const Context& ctx, const StalePolicy& policy,
                  std::initializer_list<const char*> slots);

// The error-feedback residual (State slot "residual", zeros of x's shape when
// missing), made contiguous, as a raw pointer for fused kernels.
float* residual_data(State& state, const at::Tensor& x);

}  // namespace sparrow::compression::detail
