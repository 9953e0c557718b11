#pragma once
// Building blocks shared by the codecs: input checks, per-tensor random keys,
// value packing (fp32/fp16/bf16/sign bits), index coding (delta varint or bitmap,
// whichever is smaller; seeded for random-k).
// Internal to compression/: not part of the public interface.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "compression/compressor.h"
#include "core/error.h"
#include "core/spec.h"

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
// Appends n packed values of src to out (kSign: bit i set when src[i] < 0;
// kInt8: round(src[i] / scale) clamped to [-127, 127], 0 when scale is 0).
void pack_values(const float* src, uint64_t n, ValueType vt, Bytes& out, float scale = 0.0f);
// Unpacks n values; kSign gives ±magnitude, kInt8 q · magnitude. bytes must hold value_bytes(vt, n).
void unpack_values(const uint8_t* bytes, uint64_t n, ValueType vt, float magnitude, float* dst);
// The scale unpack_values needs for e's values: scales[0] for kSign and kInt8, else 0.
float value_scale(const Encoded& e);
// kF16 and kBF16: values beyond the type's largest finite one are clamped to it
// (rather than round to inf, which the receiver would refuse); a no-op otherwise.
void saturate(float* a, uint64_t n, ValueType vt);
// kInt8's scale for these values: max |v| / 127 (0 when all are 0).
float int8_scale(const float* v, uint64_t n);
ValueType parse_value_type(const std::string& text);  // "fp32" | "fp16" | "bf16" | "int8"

// ---- indices ----------------------------------------------------------------
// kAuto: the smaller of delta-varint and bitmap (what every peer since 1.0 reads);
// kRice: the smallest of Rice-coded gaps (protocol 1.2), delta-varint and bitmap.
enum class IndexMode : uint8_t { kAuto, kRice };
IndexMode parse_index_mode(const std::string& text);  // "auto" | "rice"

// Sets e.index_coding / e.indices / e.count (and, for kRice, e.params) for k
// strictly ascending indices in [0, numel), choosing per `mode`.
void encode_indices(const int64_t* idx, uint64_t k, int64_t numel, Encoded& e, IndexMode mode = IndexMode::kAuto);
size_t delta_varint_bytes(const int64_t* idx, uint64_t k);
// The Rice parameter that minimises the coded size of these gaps, and that size in bytes.
struct RiceChoice {
  uint32_t b = 0;
  size_t bytes = 0;
};
RiceChoice best_rice(const int64_t* idx, uint64_t k);
// Sets e's positions as a Rice stream with parameter b (<= 40), whatever its size.
void encode_indices_rice(const int64_t* idx, uint64_t k, uint32_t b, Encoded& e);
// Decodes e's indices (any coding but kNone), checking ranges, order and count;
// throws FormatError when they are invalid.
std::vector<int64_t> decode_indices(const Encoded& e);
// The k ascending positions in [0, numel) of a Golomb-Rice stream with
// parameter b (IndexCoding::kRice's layout); FormatError on a truncated or
// out-of-range stream or trailing bits.
std::vector<int64_t> decode_rice_positions(const std::vector<uint8_t>& indices, uint64_t k, uint32_t b, int64_t numel);
// kMask (time-correlated sparsification): params {b, m[, block[, kept]]}. The
// round's mask has m = params[1] positions; the update carries values at `kept`
// of them (all m without params[3]; with it, the kept mask entries are
// seeded_indices(e.seed, kept, m), so a client can send a random share of a
// large mask without index bits), then count - kept own positions, Rice coded.
// block: one scale per block mask values (absent, or 0 with kept: one scale).
struct MaskLayout {
  uint64_t m = 0, kept = 0, block = 0;
};
MaskLayout mask_layout(const Encoded& e);  // FormatError on bad params (kept <= m, kept <= count)
// The same, checked against the round's mask: FormatError unless ctx.mask holds
// exactly m positions (none when m = 0).
MaskLayout mask_layout_for(const Encoded& e, const Context& ctx);
// ctx.mask's positions after checking them (a contiguous 1-D int64 CPU tensor,
// ascending within [0, numel); sparrow::Error otherwise), nullptr without a mask.
const int64_t* mask_data(const Context& ctx, int64_t numel);
// The scale groups of a kMask update with kSign/kInt8 values: the `kept` mask
// values in blocks of `block` (one block when there is no block), then the own
// positions; value i takes scales[of(i)], and there are blocks + 1 scales.
struct MaskScaleGroups {
  uint64_t m = 0, block = 1, blocks = 1;
  uint64_t of(uint64_t i) const { return i < m ? i / block : blocks; }
};
MaskScaleGroups mask_scale_groups(const Encoded& e);
std::vector<int64_t> decode_mask_extras(const Encoded& e);
std::vector<int64_t> decode_masked_indices(const Encoded& e, const Context& ctx);
// The count values of a sparse e (kMask: the mask's blocks with their scales, the rest with the last).
void unpack_sparse_values(const Encoded& e, float* dst);
// Removes the indices whose value in src is exactly 0 (a top-k of fewer than k
// nonzero entries: sending them would cost bytes, or, as ±mean, change them).
void erase_zero_positions(std::vector<int64_t>& idx, const float* src);
// k distinct indices in [0, n), ascending, a pure function of (key, k, n).
std::vector<int64_t> seeded_indices(uint64_t key, uint64_t k, int64_t n);

// ---- stale state (clients that skip rounds) ---------------------------------
// What an error-feedback codec does with its memory when a client comes back
// after skipping rounds (spec keys decay=D, max_age=A): the memory is multiplied
// by D^skipped (D = 1, the default, keeps it, as STC does), and reset to zero
// when more than A rounds were skipped (A = 0, the default: never).
struct StalePolicy {
  double decay = 1.0;
  int64_t max_age = 0;
  bool active() const { return decay != 1.0 || max_age > 0; }
};
// ef: whether the codec keeps a residual (its spec's ef=); without one there is
// nothing to age, and decay/max_age are a ConfigError.
StalePolicy parse_stale_policy(Spec& spec, const char* method, bool ef = true);
// Applies `policy` to the named slots of `state` for the rounds skipped between
// state.last_round and ctx.round, then records ctx.round. A no-op for the slots
// when either round is unknown (-1); returns the rounds skipped (0 when unknown).
int64_t age_state(State& state, const Context& ctx, const StalePolicy& policy,
                  std::initializer_list<const char*> slots);

// The error-feedback residual (State slot "residual", zeros of x's shape when
// missing), made contiguous, as a raw pointer for fused kernels.
float* residual_data(State& state, const at::Tensor& x);

// Builds a kSparse Encoded from ascending indices and their values. kSign
// sends sign_magnitude as the magnitude; kInt8 computes its scale from vals.
Encoded make_sparse(const std::vector<int64_t>& shape, const int64_t* idx, const float* vals, uint64_t k, ValueType vt,
                    float sign_magnitude = 0.0f, IndexMode mode = IndexMode::kAuto);

}  // namespace sparrow::compression::detail
