#pragma once
// The LibTorch-free building blocks of the codecs (target sparrow_codec_core):
// the context and state the kernels see, input checks on raw buffers, value
// packing (fp32/fp16/bf16/sign bits/int8), index coding (delta varint, bitmap,
// Rice, seeded), the masked layout of TCS, and error-feedback ageing.
// codec_util.h adds the at::Tensor boundary (as_input, Context and State
// overloads). Internal to compression/: not part of the public interface.

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "compression/encoded.h"
#include "core/error.h"
#include "core/spec.h"

namespace sparrow::compression::detail {

// compression::Context (and flat::Context) as the kernels read it: no tensor,
// the mask a borrowed pointer, so that building it per encode copies nothing.
struct CodecView {
  std::string_view name;  // keys per-tensor random streams
  uint64_t seed = 0;
  int num_workers = 1;
  int64_t round = -1;
  // TCS: the server's mask (ascending positions), mask_size of them at `mask`.
  bool has_mask = false;
  // A LibTorch mask that is not a contiguous 1-D int64 CPU tensor: mask_data
  // refuses it where the kernel first reads it (as it always has).
  bool mask_malformed = false;
  const int64_t* mask = nullptr;
  int64_t mask_size = 0;
  bool share_mean = false;
  // ACP: the round's shared factor (row-major, shared_size floats at `shared`,
  // its shape shared_dims values at shared_shape; the kernel checks both).
  // has_shared false: none, derive the seeded initial one. A LibTorch factor
  // that is not float32 on the CPU: shared_malformed, refused by the kernel.
  bool has_shared = false;
  bool shared_malformed = false;
  const float* shared = nullptr;
  int64_t shared_size = 0;
  const int64_t* shared_shape = nullptr;
  size_t shared_dims = 0;
};

// A codec's per-tensor state as the kernels use it: named float32 buffers,
// read and written in place (the LibTorch State's tensors, or flat::State's
// vectors; neither is copied), plus the step and round counters.
class Slots {
 public:
  // The named slot's contiguous data, created as zeros of `shape` when missing
  // or when its shape differs (a changed model resets that slot).
  virtual float* slot(const char* name, const std::vector<int64_t>& shape) = 0;
  // The named slot's data and element count, or nullptr when there is none.
  virtual float* find(const char* name, int64_t* n) = 0;
  // Removes the named slot (a no-op when there is none).
  virtual void erase(const char* name) = 0;
  virtual uint64_t& step() = 0;
  virtual int64_t& last_round() = 0;

 protected:
  ~Slots() = default;
};

// The kernels' parallel loop: fn(b0, b1) over contiguous ranges that cover
// [begin, end). Serial, fn inlined, unless a hook is installed (the LibTorch
// shell installs at::parallel_for in register_builtins). Every kernel splits
// its work into fixed blocks and combines them in block order, so results
// never depend on the split. Kernels copy what their hot loops read into
// locals first: fn's captures escape into the hook, and a byte store could
// otherwise alias them and force a reload per element.
using ParallelFor = void (*)(int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>& fn);
void set_parallel_for(ParallelFor f);  // nullptr: serial
ParallelFor parallel_hook();
template <typename F>
void parallel_for(int64_t begin, int64_t end, const F& fn) {
  if (begin >= end) return;
  const ParallelFor hook = end - begin > 1 ? parallel_hook() : nullptr;
  if (hook)
    hook(begin, end, std::function<void(int64_t, int64_t)>(fn));
  else
    fn(begin, end);
}

// sparrow::Error "<method>: input contains NaN or infinity ..." when one of
// x[0, n) is not finite. One read of x (large inputs split over two threads).
void check_finite_input(const float* x, int64_t n, const char* method);
int64_t numel_of(const std::vector<int64_t>& shape);

// Key of the tensor's random stream: same on every party for the same
// (seed, name); `step` separates successive encodes.
uint64_t tensor_key(const CodecView& ctx);
uint64_t step_key(const CodecView& ctx, uint64_t step);

// ---- values -----------------------------------------------------------------
// IEEE half and bfloat16, rounded to nearest even (bit-identical to c10::Half
// and c10::BFloat16).
uint16_t fp16_from_float(float f);
float fp16_to_float(uint16_t h);
uint16_t bf16_from_float(float f);
float bf16_to_float(uint16_t h);

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

// ---- varints ----------------------------------------------------------------
// Unsigned LEB128 (7 bits a byte, low first, high bit = more follows): the
// delta-varint index coding and the wire's packed tensor lists.
size_t varint_len(uint64_t v);
// Writes v at p (varint_len(v) bytes) and returns the byte after it.
uint8_t* put_varint(uint8_t* p, uint64_t v);

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
// Decodes e's indices (any coding but kNone and kMask), checking ranges, order
// and count; throws FormatError when they are invalid.
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
// The same, checked against the round's mask: FormatError unless ctx's mask
// holds exactly m positions (none when m = 0). Without a mask in ctx, m =
// numel > 0 is accepted too: m ascending positions in [0, numel) can only be
// every position (tcs mask=all, which the server never broadcasts).
MaskLayout mask_layout_for(const Encoded& e, const CodecView& ctx);
// ctx's mask after checking it (ascending within [0, numel); sparrow::Error
// otherwise), nullptr without a mask.
const int64_t* mask_data(const CodecView& ctx, int64_t numel);
// The scale groups of a kMask update with kSign/kInt8 values: the `kept` mask
// values in blocks of `block` (one block when there is no block), then the own
// positions; value i takes scales[of(i)], and there are blocks + 1 scales.
struct MaskScaleGroups {
  uint64_t m = 0, block = 1, blocks = 1;
  uint64_t of(uint64_t i) const { return i < m ? i / block : blocks; }
};
MaskScaleGroups mask_scale_groups(const Encoded& e);
std::vector<int64_t> decode_mask_extras(const Encoded& e);
std::vector<int64_t> decode_masked_indices(const Encoded& e, const CodecView& ctx);
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
// The factor age_state applies for `skipped` rounds: 0 (reset) or decay^skipped
// (as float32: each value is multiplied by it in float32, as ATen's mul_ does).
double stale_factor(const StalePolicy& policy, int64_t skipped);
// Applies `policy` to the named slots for the rounds skipped between
// last_round and ctx.round, then records ctx.round. A no-op for the slots when
// either round is unknown (-1); returns the rounds skipped (0 when unknown).
int64_t age_state(Slots& slots, const CodecView& ctx, const StalePolicy& policy,
                  std::initializer_list<const char*> names);

// Builds a kSparse Encoded from ascending indices and their values. kSign
// sends sign_magnitude as the magnitude; kInt8 computes its scale from vals.
Encoded make_sparse(const std::vector<int64_t>& shape, const int64_t* idx, const float* vals, uint64_t k, ValueType vt,
                    float sign_magnitude = 0.0f, IndexMode mode = IndexMode::kAuto);

}  // namespace sparrow::compression::detail
