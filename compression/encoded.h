#pragma once
// Encoded: what one compressed tensor is on the wire, as a plain struct.
// Only wire/ turns it into FlatBuffers bytes; everything else sees this.
// The format is self-describing, so any party can decode an update without
// knowing the spec that produced it (ACP additionally needs the shared factor).

#include <cstdint>
#include <string>
#include <vector>

#include "compression/bytes.h"
#include "core/error.h"

namespace sparrow::compression {

// Layout of Encoded::values / indices / scales / params per format.
enum class Format : uint8_t {
  // values: numel values of value_type (kF32, kF16, kBF16).
  kDense = 0,
  // `count` values of value_type at the positions given by index_coding.
  // value_type kSign: one bit per value (1 = negative), magnitude scales[0];
  // kInt8: one signed byte q per value, value = q · scales[0].
  // index_coding kRice: params = {Rice parameter b}; kMask: {b, mask size m[, block B]};
  // otherwise params is empty.
  kSparse = 1,
  // QSGD. params = {levels s, bucket}; scales = one L2 norm per bucket;
  // values = per element Elias-gamma(level + 1) then, when level > 0, a sign bit
  // (bit stream, LSB first in 64-bit little-endian words).
  kQuantized = 2,
  // TernGrad. scales[0] = s (max |g|); values = 2 bits per element
  // (0 = zero, 1 = +s, 2 = -s), LSB first.
  kTernary = 3,
  // 1-bit sign. scales[0] = magnitude; values = 1 bit per element (1 = negative).
  kSign = 4,
  // PowerSGD. params = {rows n, cols m, rank r}; values = P (n×r) then Q (m×r),
  // row-major, of value_type kF32, or since protocol 1.4 kF16, kBF16 or kInt8
  // (kInt8: scales = one per column of P, then one per column of Q; value at
  // (i, j) = q · scale[j]). Decodes to P·Qᵀ reshaped to `shape`.
  kLowRank = 5,
  // ACP-SGD, one factor. params = {rows n, cols m, rank r, which (0 = P, 1 = Q)};
  // values = that factor, row-major, value types as kLowRank (kInt8: r scales).
  // Decoding needs the other factor, the aggregator's shared one, from
  // Context::shared_factor.
  kLowRankFactor = 6,
  // Protocol 1.5: PowerSGD factors plus a sparse correction (`powersgd:...,sparse=R`,
  // the largest entries of the residual the factors leave). params = {rows n,
  // cols m, rank r, Rice parameter b}; values = P (n×r), Q (m×r), then `count`
  // values, all of value_type (kF32, kF16, kBF16 or kInt8; kInt8: scales = one
  // per column of P, one per column of Q, then one for the sparse values);
  // index_coding kRice, `indices` = the sparse values' positions in the
  // flattened tensor (as kSparse's kRice). Decodes to P·Qᵀ + the sparse values.
  kLowRankSparse = 7,
};

// kInt8 (protocol 1.2): symmetric 8-bit codes q in [-127, 127], value = q · scale: sparse
// (scales[0]; kMask: see below) and, since 1.4, low-rank factors (one scale per column).
enum class ValueType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kSign = 3, kInt8 = 4 };

enum class IndexCoding : uint8_t {
  kNone = 0,         // dense formats
  kDeltaVarint = 1,  // ascending indices, gaps (first: index itself) as LEB128 varints
  kBitmap = 2,       // ceil(numel/8) bytes, bit i set = index i present (LSB first)
  kSeeded = 3,       // no index bytes: `count` distinct indices drawn from key `seed` (random-k)
  // Protocol 1.2: gaps minus one (as kDeltaVarint), each Golomb-Rice coded with
  // parameter b = params[0]: the quotient gap >> b in unary (that many 1 bits, then
  // a 0), then the low b bits, LSB first; a bit stream packed LSB first into bytes,
  // zero padded. About log2(mean gap) + 1.5 bits per index against 8-16 for varints.
  kRice = 4,
  // Protocol 1.3, time-correlated sparsification (`tcs`): the first params[1] values
  // sit at the positions of the server's shared mask (Context::mask, which the
  // server broadcasts with the round's task), so they cost no index bits; the
  // other count - params[1] at Rice-coded positions in `indices` (parameter
  // b = params[0], as kRice). kSign and kInt8 carry one scale for the mask's values
  // (with params[2] = B: one per B of them), then one for the others. Decoding
  // needs the same mask.
  kMask = 5,
};

struct Encoded {
  Format format = Format::kDense;
  std::vector<int64_t> shape;
  ValueType value_type = ValueType::kF32;
  IndexCoding index_coding = IndexCoding::kNone;
  uint64_t count = 0;  // kSparse: number of values sent
  uint64_t seed = 0;   // kSeeded: key of the index stream; kMask with 4 params: key of the kept mask entries
  std::vector<uint32_t> params;
  std::vector<float> scales;
  std::vector<uint8_t> indices;
  Bytes values;  // may view a received frame (wire::parse with an owner)

  int64_t numel() const;
  // Bytes of tensor payload (values + indices + scales + params); the wire adds
  // framing, which wire::encoded_size() reports.
  size_t payload_bytes() const;
};

const char* format_name(Format f);

// Structural checks on an Encoded that came from outside: shape sane, sizes of
// values/indices/scales/params consistent with the format, sparse index ranges
// and counts valid, float scales and fp32 values finite. Throws FormatError.
// decode() calls it; the wire parser calls it on every tensor.
//
// The finiteness scan runs once per update: its verdict is memoised on the
// value bytes (compression::Bytes), so later validate() calls skip it.
// ValueCheck::kDeferDenseF32 checks everything but the finiteness of a dense
// fp32 tensor's values (their size still) and leaves the scan to whoever reads
// them next: validate(), decode() and decode_add() scan then, and decode_fill()
// fuses the scan with its write, so a large dense update is read once, not
// twice, between the wire and the aggregate (sparrow-server's workers).
enum class ValueCheck { kScan, kDeferDenseF32 };
// What the finiteness scan throws (values holding NaN or ±Inf): a FormatError,
// which a receiver that defers the scan can still tell from the others (the
// server answers it with kMalformed, as when wire::parse finds it).
class NonFiniteError : public FormatError {
 public:
  using FormatError::FormatError;
};
void validate(const Encoded& e, ValueCheck check = ValueCheck::kScan);

namespace detail {
// validate()'s memo for e's values (dense: e.numel() values; sparse: e.count).
bool values_known_finite(const Encoded& e, uint64_t n);
void mark_values_finite(const Encoded& e, uint64_t n);
// True when one of the n values at `bytes` (fp32, or fp16/bf16 for the 16-bit
// form with its exponent mask 0x7c00/0x7f80) is an infinity or a NaN. A
// branch-free OR over the exponent bits, compiled for AVX-512, AVX2 and the
// baseline (kernels/simd.h); the block scans and the codecs' input checks use it.
bool any_nonfinite_f32(const uint8_t* bytes, uint64_t n);
bool any_nonfinite_16(const uint8_t* bytes, uint64_t n, uint16_t mask);
}  // namespace detail

}  // namespace sparrow::compression
