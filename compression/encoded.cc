#include "compression/encoded.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "compression/codec_bits.h"
#include "compression/decoders.h"
#include "core/error.h"
#include "kernels/simd.h"

namespace sparrow::compression {
namespace {

constexpr int kMaxDims = 8;
constexpr int64_t kMaxNumel = int64_t{1} << 40;

// Non-finite values are found a block at a time: the block's test is a
// branch-free OR over its exponent bits (vectorised), and only a block that
// fails is searched for the first bad index. mask: the exponent bits of the
// format (all set = inf or nan). done(begin, end) is called for each block
// found finite, before the next is read.
template <typename Bits, typename Done>
void check_finite_bits(const uint8_t* bytes, uint64_t n, Bits mask, const char* what, Done&& done) {
  constexpr uint64_t kBlock = 1024;
  for (uint64_t b = 0; b < n; b += kBlock) {
    const uint64_t e = std::min(n, b + kBlock);
    const uint8_t* at = bytes + sizeof(Bits) * b;
    const bool bad = sizeof(Bits) == 4 ? detail::any_nonfinite_f32(at, e - b)
                                       : detail::any_nonfinite_16(at, e - b, static_cast<uint16_t>(mask));
    if (!bad) {
      done(b, e);
      continue;
    }
    for (uint64_t i = b; i < e; ++i) {
      Bits u;
      std::memcpy(&u, bytes + sizeof(Bits) * i, sizeof(Bits));
      SPARROW_CHECK_T(NonFiniteError, (u & mask) != mask, what << ": value " << i << " is not finite");
    }
  }
}

constexpr auto kNoBlockAction = [](uint64_t, uint64_t) {};

void check_finite_f32(const uint8_t* bytes, uint64_t n, const char* what) {
  check_finite_bits<uint32_t>(bytes, n, 0x7f800000u, what, kNoBlockAction);
}

void check_finite_16(const uint8_t* bytes, uint64_t n, ValueType vt, const char* what) {
  // fp16: exponent bits 0x7c00 all set = inf/nan; bf16: 0x7f80.
  check_finite_bits<uint16_t>(bytes, n, vt == ValueType::kF16 ? 0x7c00 : 0x7f80, what, kNoBlockAction);
}

uint64_t values_tag(const Encoded& e, uint64_t n) { return (n << 3) | (static_cast<uint64_t>(e.value_type) + 1); }

void check_values(const Encoded& e, uint64_t n, const char* what, bool scan = true) {
  const size_t want = detail::value_bytes(e.value_type, n);
  SPARROW_CHECK_T(FormatError, e.values.size() == want,
                  what << ": " << e.values.size() << " value bytes, expected " << want);
  // Scanned once per update: the parser's verdict holds until the bytes change.
  const uint64_t tag = values_tag(e, n);
  if (!scan || e.values.checked(tag)) return;
  if (e.value_type == ValueType::kF32) check_finite_f32(e.values.data(), n, what);
  if (e.value_type == ValueType::kF16 || e.value_type == ValueType::kBF16)
    check_finite_16(e.values.data(), n, e.value_type, what);
  e.values.set_checked(tag);
}

void check_scales(const Encoded& e, size_t want, const char* what) {
  SPARROW_CHECK_T(FormatError, e.scales.size() == want,
                  what << ": " << e.scales.size() << " scales, expected " << want);
  for (size_t i = 0; i < e.scales.size(); ++i)
    SPARROW_CHECK_T(FormatError, std::isfinite(e.scales[i]), what << ": scale " << i << " is not finite");
}

// int8 values (sparse, low-rank factors): q · scale must stay finite for every
// q in [-127, 127], and -128 is not a code. Scale count and value size checked before.
void check_int8(const Encoded& e, uint64_t n, const char* what) {
  for (const float s : e.scales)
    SPARROW_CHECK_T(FormatError, s >= 0.0f && s <= std::numeric_limits<float>::max() / 127.0f,
                    what << ": int8 scale " << s << " outside [0, FLT_MAX/127]");
  const uint8_t* q = e.values.data();
  for (uint64_t i = 0; i < n; ++i)
    SPARROW_CHECK_T(FormatError, q[i] != 0x80, what << ": int8 code -128 at value " << i << " (codes are -127..127)");
}

void check_no_indices(const Encoded& e, const char* what) {
  SPARROW_CHECK_T(FormatError, e.index_coding == IndexCoding::kNone && e.indices.empty(),
                  what << ": unexpected index data");
}

}  // namespace

int64_t Encoded::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t Encoded::payload_bytes() const {
  return values.size() + indices.size() + scales.size() * sizeof(float) + params.size() * sizeof(uint32_t);
}

const char* format_name(Format f) {
  switch (f) {
    case Format::kDense:
      return "dense";
    case Format::kSparse:
      return "sparse";
    case Format::kQuantized:
      return "quantized";
    case Format::kTernary:
      return "ternary";
    case Format::kSign:
      return "sign";
    case Format::kLowRank:
      return "lowrank";
    case Format::kLowRankFactor:
      return "lowrank_factor";
    case Format::kLowRankSparse:
      return "lowrank_sparse";
  }
  return "unknown";
}

namespace detail {
SPARROW_SIMD_CLONES
bool any_nonfinite_f32(const uint8_t* bytes, uint64_t n) {
  uint32_t bad = 0;
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, bytes + 4 * i, 4);
    bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
  }
  return bad != 0;
}
SPARROW_SIMD_CLONES
bool any_nonfinite_16(const uint8_t* bytes, uint64_t n, uint16_t mask) {
  uint16_t bad = 0;
  for (uint64_t i = 0; i < n; ++i) {
    uint16_t u;
    std::memcpy(&u, bytes + 2 * i, 2);
    bad |= static_cast<uint16_t>((u & mask) == mask);
  }
  return bad != 0;
}
void scan_finite_f32(const uint8_t* bytes, uint64_t n, const char* what,
                     const std::function<void(uint64_t, uint64_t)>& done) {
  check_finite_bits<uint32_t>(bytes, n, 0x7f800000u, what, done);
}
bool values_known_finite(const Encoded& e, uint64_t n) { return e.values.checked(values_tag(e, n)); }
void mark_values_finite(const Encoded& e, uint64_t n) { e.values.set_checked(values_tag(e, n)); }
}  // namespace detail

void validate(const Encoded& e, ValueCheck check) {
  SPARROW_CHECK_T(FormatError, e.shape.size() <= kMaxDims,
                  "tensor has " << e.shape.size() << " dimensions (max " << kMaxDims << ")");
  int64_t numel = 1;
  for (int64_t d : e.shape) {
    SPARROW_CHECK_T(FormatError, d >= 0 && d <= kMaxNumel, "bad dimension " << d);
    SPARROW_CHECK_T(FormatError, d == 0 || numel <= kMaxNumel / d, "tensor too large");
    numel *= d;
  }
  const uint64_t n = static_cast<uint64_t>(numel);
  switch (e.format) {
    case Format::kDense:
      SPARROW_CHECK_T(
          FormatError, e.value_type != ValueType::kSign && e.value_type != ValueType::kInt8,
          "dense: " << (e.value_type == ValueType::kSign ? "sign" : "int8") << " value type is not allowed");
      check_no_indices(e, "dense");
      check_values(e, n, "dense", check == ValueCheck::kScan || e.value_type != ValueType::kF32);
      return;
    case Format::kSparse:
      SPARROW_CHECK_T(FormatError, e.count <= n, "sparse: count " << e.count << " exceeds numel " << n);
      SPARROW_CHECK_T(FormatError, e.index_coding != IndexCoding::kNone, "sparse: no index coding");
      check_values(e, e.count, "sparse");
      {
        const bool scaled = e.value_type == ValueType::kSign || e.value_type == ValueType::kInt8;
        const bool masked = e.index_coding == IndexCoding::kMask;
        check_scales(e, scaled ? (masked ? detail::mask_scale_groups(e).blocks + 1 : 1) : 0, "sparse");
      }
      if (e.value_type == ValueType::kInt8) check_int8(e, e.count, "sparse");
      if (e.index_coding == IndexCoding::kMask) {
        // The mask's own positions are checked against the round's mask when decoding.
        (void)detail::decode_mask_extras(e);
        return;
      }
      SPARROW_CHECK_T(FormatError, e.index_coding == IndexCoding::kRice || e.params.empty(),
                      "sparse: unexpected params for this index coding");
      (void)detail::decode_indices(e);  // range, order and count checks
      return;
    case Format::kQuantized: {
      check_no_indices(e, "qsgd");
      SPARROW_CHECK_T(FormatError, e.params.size() == 2, "qsgd: expected params {levels, bucket}");
      const uint32_t levels = e.params[0], bucket = e.params[1];
      SPARROW_CHECK_T(FormatError, levels >= 1 && levels <= (1u << 24), "qsgd: bad levels " << levels);
      SPARROW_CHECK_T(FormatError, bucket >= 1, "qsgd: bad bucket " << bucket);
      check_scales(e, static_cast<size_t>((n + bucket - 1) / bucket), "qsgd");
      for (float s : e.scales) SPARROW_CHECK_T(FormatError, s >= 0.0f, "qsgd: negative bucket norm");
      // Every element costs at least one bit; the decoder checks the rest of the stream.
      SPARROW_CHECK_T(FormatError, e.values.size() >= (n + 7) / 8, "qsgd: bit stream shorter than numel bits");
      SPARROW_CHECK_T(FormatError, e.values.size() <= n * 8 + 8, "qsgd: bit stream too long");
      return;
    }
    case Format::kTernary:
      check_no_indices(e, "terngrad");
      check_scales(e, 1, "terngrad");
      SPARROW_CHECK_T(FormatError, e.scales[0] >= 0.0f, "terngrad: negative scale");
      SPARROW_CHECK_T(FormatError, e.values.size() == (2 * n + 7) / 8,
                      "terngrad: " << e.values.size() << " bytes, expected " << (2 * n + 7) / 8);
      return;
    case Format::kSign:
      check_no_indices(e, "sign");
      check_scales(e, 1, "sign");
      SPARROW_CHECK_T(FormatError, e.values.size() == (n + 7) / 8,
                      "sign: " << e.values.size() << " bytes, expected " << (n + 7) / 8);
      return;
    case Format::kLowRank:
    case Format::kLowRankFactor:
    case Format::kLowRankSparse: {
      const bool factor = e.format == Format::kLowRankFactor;
      const bool sparse = e.format == Format::kLowRankSparse;
      const char* what = factor ? "acp" : "powersgd";
      if (!sparse) check_no_indices(e, what);
      SPARROW_CHECK_T(FormatError, e.params.size() == (factor || sparse ? 4u : 3u), what << ": wrong number of params");
      const uint64_t rows = e.params[0], cols = e.params[1], rank = e.params[2];
      SPARROW_CHECK_T(FormatError, rows * cols == n,
                      what << ": " << rows << "x" << cols << " does not match numel " << n);
      SPARROW_CHECK_T(FormatError, rank >= 1 && rank <= rows && rank <= cols, what << ": bad rank " << rank);
      // fp32 since 1.0; fp16, bf16 and int8 (one scale per factor column) since 1.4.
      SPARROW_CHECK_T(FormatError,
                      e.value_type == ValueType::kF32 || e.value_type == ValueType::kF16 ||
                          e.value_type == ValueType::kBF16 || e.value_type == ValueType::kInt8,
                      what << ": factors must be fp32, fp16, bf16 or int8");
      uint64_t floats = (rows + cols) * rank;
      if (factor) {
        SPARROW_CHECK_T(FormatError, e.params[3] <= 1, what << ": factor selector must be 0 (P) or 1 (Q)");
        floats = (e.params[3] == 0 ? rows : cols) * rank;
      }
      if (sparse) {
        SPARROW_CHECK_T(FormatError, e.index_coding == IndexCoding::kRice,
                        what << ": the sparse correction's positions must be Rice coded");
        SPARROW_CHECK_T(FormatError, e.count <= n, what << ": count " << e.count << " exceeds numel " << n);
        floats += e.count;  // the sparse values follow the factors
      }
      check_scales(e, e.value_type == ValueType::kInt8 ? (factor ? 1 : 2) * rank + (sparse ? 1 : 0) : 0, what);
      check_values(e, floats, what);
      if (e.value_type == ValueType::kInt8) check_int8(e, floats, what);
      // Range, order and count of the positions, once the values' bytes bound
      // `count` (a short message cannot make the receiver expand many positions).
      if (sparse) (void)detail::decode_rice_positions(e.indices, e.count, e.params[3], static_cast<int64_t>(n));
      return;
    }
  }
  throw FormatError("unknown tensor format " + std::to_string(static_cast<int>(e.format)));
}

}  // namespace sparrow::compression
