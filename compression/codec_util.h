#pragma once
// Building blocks shared by the codecs: input checks, per-tensor random keys,
// value packing (fp32/fp16/bf16/sign bits), index coding (delta varint or bitmap,
// whichever is smaller; seeded for random-k).
// Internal to compression/: not part of the public interface.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "compression/compressor.h"
#include "core/error.h"

namespace sparrow::compression::detail {

// Checks x is defined, float32, on the CPU and finite (sparrow::Error otherwise,
// before any state is touched); returns a contiguous view or copy.
at::Tensor as_input(const at::Tensor& x, const char* method);
std::vector<int64_t> shape_of(const at::Tensor& x);
int64_t numel_of(const std::vector<int64_t>& shape);

// Key of the tensor's random stream: same on every party for the same
// (seed, name); `step` separates successive encodes.
uint64_t tensor_key(const Context& ctx);
uint64_t step_key(const Context& ctx, uint64_t step);

// ---- values -----------------------------------------------------------------
size_t value_bytes(ValueType vt, uint64_t n);
// Appends n packed values of src to out (kSign: bit i set when src[i] < 0).
void pack_values(const float* src, uint64_t n, ValueType vt, Bytes& out);
// Unpacks n values; kSign gives ±magnitude. bytes must hold value_bytes(vt, n).
void unpack_values(const uint8_t* bytes, uint64_t n, ValueType vt, float magnitude, float* dst);
ValueType parse_value_type(const std::string& text);  // "fp32" | "fp16" | "bf16"

// ---- indices ----------------------------------------------------------------
// Sets e.index_coding / e.indices / e.count for k strictly ascending indices in
// [0, numel), choosing the smaller of delta-varint and bitmap.
void encode_indices(const int64_t* idx, uint64_t k, int64_t numel, Encoded& e);
size_t delta_varint_bytes(const int64_t* idx, uint64_t k);
// Decodes e's indices (any coding but kNone), checking ranges, order and count;
// throws FormatError when they are invalid.
std::vector<int64_t> decode_indices(const Encoded& e);
// k distinct indices in [0, n), ascending, a pure function of (key, k, n).
std::vector<int64_t> seeded_indices(uint64_t key, uint64_t k, int64_t n);

// The error-feedback residual (State slot "residual", zeros of x's shape when
// missing), made contiguous, as a raw pointer for fused kernels.
float* residual_data(State& state, const at::Tensor& x);

// Builds a kSparse Encoded from ascending indices and their values.
Encoded make_sparse(const std::vector<int64_t>& shape, const int64_t* idx, const float* vals, uint64_t k, ValueType vt,
                    float sign_magnitude = 0.0f);

}  // namespace sparrow::compression::detail
