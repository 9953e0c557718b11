#include "compression/codec_bits.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <future>
#include <numeric>

#include "compression/decoders.h"
#include "core/rng.h"

namespace sparrow::compression::detail {

namespace {

std::atomic<ParallelFor>& hook_slot() {
  static std::atomic<ParallelFor> hook{nullptr};
  return hook;
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

void set_parallel_for(ParallelFor f) { hook_slot().store(f); }
ParallelFor parallel_hook() { return hook_slot().load(std::memory_order_relaxed); }

void check_finite_input(const float* x, int64_t n, const char* method) {
  // Checked before any state is touched: a NaN or infinity would otherwise end
  // up in error-feedback residuals and momentum for good. One read of x, in
  // blocks the compiler vectorises (no early exit inside a block); large
  // tensors are split over two threads, since one core cannot saturate DRAM.
  const auto* bytes = reinterpret_cast<const uint8_t*>(x);
  auto first_bad = [bytes](int64_t begin, int64_t end) -> int64_t {
    constexpr int64_t kBlock = 4096;
    for (int64_t b = begin; b < end; b += kBlock)
      if (any_nonfinite_f32(bytes + 4 * b, static_cast<uint64_t>(std::min(end, b + kBlock) - b))) return b;
    return -1;
  };
  int64_t bad = -1;
  if (n >= (int64_t{1} << 22)) {
    const int64_t half = n / 2;
    auto upper = std::async(std::launch::async, first_bad, half, n);
    bad = first_bad(0, half);
    const int64_t bad_upper = upper.get();
    if (bad < 0) bad = bad_upper;
  } else {
    bad = first_bad(0, n);
  }
  SPARROW_CHECK(bad < 0, method << ": input contains NaN or infinity (first bad block at element " << bad << ")");
}

namespace {

// fp16 <-> fp32: the FP16 library's branch-free conversions, as c10::Half uses
// on the CPU (round to nearest even; NaN stays NaN).
uint16_t fp16_from_float_inline(float f) {
  const float scale_to_inf = bits_float(uint32_t{239} << 23);  // 0x1.0p+112f
  const float scale_to_zero = bits_float(uint32_t{17} << 23);  // 0x1.0p-110f
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

float fp16_to_float_inline(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = uint32_t{0xE0} << 23;
  const float exp_scale = bits_float(uint32_t{15} << 23);  // 0x1.0p-112f
  const float normalized_value = bits_float((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = uint32_t{126} << 23;
  const float denormalized_value = bits_float((two_w >> 17) | magic_mask) - 0.5f;
  const uint32_t denormalized_cutoff = uint32_t{1} << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? float_bits(denormalized_value) : float_bits(normalized_value));
  return bits_float(result);
}

uint16_t bf16_from_float_inline(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const uint32_t u = float_bits(f);
  const uint32_t rounding_bias = ((u >> 16) & 1) + 0x7FFFu;
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

float bf16_to_float_inline(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

}  // namespace

// The public names call these: a PIC build may not inline an exported
// function into pack_values/unpack_values (semantic interposition), and the
// per-value call would stop the loops from vectorising.
uint16_t fp16_from_float(float f) { return fp16_from_float_inline(f); }
float fp16_to_float(uint16_t h) { return fp16_to_float_inline(h); }
uint16_t bf16_from_float(float f) { return bf16_from_float_inline(f); }
float bf16_to_float(uint16_t h) { return bf16_to_float_inline(h); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t tensor_key(const CodecView& ctx) { return rng::derive(ctx.seed, rng::hash_name(ctx.name)); }
uint64_t step_key(const CodecView& ctx, uint64_t step) { return rng::derive(tensor_key(ctx), step); }

// ---- values -------------------------------------------------------------------

size_t value_bytes(ValueType vt, uint64_t n) {
  switch (vt) {
    case ValueType::kF32:
      return n * 4;
    case ValueType::kF16:
    case ValueType::kBF16:
      return n * 2;
    case ValueType::kSign:
      return (n + 7) / 8;
    case ValueType::kInt8:
      return n;
  }
  throw FormatError("unknown value type " + std::to_string(static_cast<int>(vt)));
}

float value_scale(const Encoded& e) {
  return (e.value_type == ValueType::kSign || e.value_type == ValueType::kInt8) ? e.scales.at(0) : 0.0f;
}

void saturate(float* a, uint64_t n, ValueType vt) {
  if (vt != ValueType::kF16 && vt != ValueType::kBF16) return;
  const float limit = vt == ValueType::kF16 ? 65504.0f : 3.3895313892515355e38f;  // largest finite of each
  for (uint64_t i = 0; i < n; ++i) a[i] = std::clamp(a[i], -limit, limit);
}

float int8_scale(const float* v, uint64_t n) {
  float m = 0.0f;
  for (uint64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(v[i]));
  return m / 127.0f;
}

void pack_values(const float* src, uint64_t n, ValueType vt, Bytes& out, float scale) {
  const size_t base = out.size();
  out.resize_uninitialized(base + value_bytes(vt, n));  // every new byte is written below
  uint8_t* dst = out.data() + base;
  if (n == 0) return;
  switch (vt) {
    case ValueType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case ValueType::kF16: {
      auto* h = reinterpret_cast<uint16_t*>(dst);
      for (uint64_t i = 0; i < n; ++i) h[i] = fp16_from_float_inline(src[i]);
      return;
    }
    case ValueType::kBF16: {
      auto* h = reinterpret_cast<uint16_t*>(dst);
      for (uint64_t i = 0; i < n; ++i) h[i] = bf16_from_float_inline(src[i]);
      return;
    }
    case ValueType::kSign: {
      std::memset(dst, 0, (n + 7) / 8);
      for (uint64_t i = 0; i < n; ++i) dst[i >> 3] |= static_cast<uint8_t>((src[i] < 0.0f) << (i & 7));
      return;
    }
    case ValueType::kInt8: {
      // Divide (not multiply by 1/scale): 1/scale overflows for a scale below 2^-128.
      for (uint64_t i = 0; i < n; ++i) {
        const float q = scale > 0.0f ? std::nearbyint(std::min(127.0f, std::max(-127.0f, src[i] / scale))) : 0.0f;
        dst[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
      return;
    }
  }
}

void unpack_values(const uint8_t* bytes, uint64_t n, ValueType vt, float magnitude, float* dst) {
  if (n == 0) return;
  switch (vt) {
    case ValueType::kF32:
      std::memcpy(dst, bytes, n * 4);
      return;
    case ValueType::kF16: {
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        dst[i] = fp16_to_float_inline(h);
      }
      return;
    }
    case ValueType::kBF16: {
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        dst[i] = bf16_to_float_inline(h);
      }
      return;
    }
    case ValueType::kSign:
      for (uint64_t i = 0; i < n; ++i) dst[i] = ((bytes[i >> 3] >> (i & 7)) & 1) ? -magnitude : magnitude;
      return;
    case ValueType::kInt8:
      for (uint64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(static_cast<int8_t>(bytes[i])) * magnitude;
      return;
  }
  throw FormatError("unknown value type " + std::to_string(static_cast<int>(vt)));
}

ValueType parse_value_type(const std::string& text) {
  if (text == "fp32") return ValueType::kF32;
  if (text == "fp16") return ValueType::kF16;
  if (text == "bf16") return ValueType::kBF16;
  if (text == "int8") return ValueType::kInt8;
  throw ConfigError("values='" + text + "' is not one of fp32, fp16, bf16, int8");
}

IndexMode parse_index_mode(const std::string& text) {
  if (text == "auto") return IndexMode::kAuto;
  if (text == "rice") return IndexMode::kRice;
  throw ConfigError("index='" + text + "' is not one of auto, rice");
}

// ---- indices ------------------------------------------------------------------

size_t varint_len(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

uint8_t* put_varint(uint8_t* p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  *p++ = static_cast<uint8_t>(v);
  return p;
}

size_t delta_varint_bytes(const int64_t* idx, uint64_t k) {
  size_t bytes = 0;
  int64_t prev = -1;
  for (uint64_t i = 0; i < k; ++i) {
    bytes += varint_len(static_cast<uint64_t>(idx[i] - prev - 1));
    prev = idx[i];
  }
  return bytes;
}

namespace {

// Largest Rice parameter a peer accepts: gaps are below 2^40 (kMaxNumel).
constexpr uint32_t kMaxRiceParameter = 40;

// Bit writer and reader, LSB first within each byte.
class BitWriter {
 public:
  explicit BitWriter(std::vector<uint8_t>& out) : out_(out) {}
  void bit(unsigned b) {
    if ((pos_ & 7) == 0) out_.push_back(0);
    out_.back() |= static_cast<uint8_t>(b << (pos_ & 7));
    ++pos_;
  }
  void ones(uint64_t n) {
    for (; n > 0 && (pos_ & 7) != 0; --n) bit(1);
    for (; n >= 8; n -= 8, pos_ += 8) out_.push_back(0xff);
    for (; n > 0; --n) bit(1);
  }
  void bits(uint64_t v, uint32_t n) {
    for (uint32_t i = 0; i < n; ++i) bit(static_cast<unsigned>((v >> i) & 1));
  }

 private:
  std::vector<uint8_t>& out_;
  uint64_t pos_ = 0;
};

void encode_rice(const int64_t* idx, uint64_t k, uint32_t b, std::vector<uint8_t>& out) {
  BitWriter w(out);
  int64_t prev = -1;
  for (uint64_t i = 0; i < k; ++i) {
    const auto gap = static_cast<uint64_t>(idx[i] - prev - 1);
    prev = idx[i];
    w.ones(gap >> b);
    w.bit(0);
    w.bits(gap, b);
  }
}

}  // namespace

std::vector<int64_t> decode_rice_positions(const std::vector<uint8_t>& indices, uint64_t k, uint32_t b, int64_t numel) {
  SPARROW_CHECK_T(FormatError, b <= kMaxRiceParameter,
                  "sparse: Rice parameter " << b << " above " << kMaxRiceParameter);
  const uint64_t total_bits = static_cast<uint64_t>(indices.size()) * 8;
  // Every index costs at least b + 1 bits: a count the stream cannot hold is refused before allocating.
  SPARROW_CHECK_T(FormatError, k <= static_cast<uint64_t>(numel) && k <= total_bits / (b + 1),
                  "sparse: count " << k << " exceeds what " << indices.size() << " Rice bytes can hold");
  std::vector<int64_t> idx(k);
  const uint8_t* p = indices.data();
  uint64_t pos = 0;
  int64_t prev = -1;
  const uint64_t room_limit = static_cast<uint64_t>(numel);
  for (uint64_t i = 0; i < k; ++i) {
    // Unary quotient: skip whole 0xff bytes at once when aligned.
    uint64_t q = 0;
    while (true) {
      SPARROW_CHECK_T(FormatError, pos < total_bits, "sparse: Rice stream truncated at index " << i);
      if ((pos & 7) == 0 && p[pos >> 3] == 0xff) {
        q += 8;
        pos += 8;
      } else {
        const unsigned bit = (p[pos >> 3] >> (pos & 7)) & 1;
        ++pos;
        if (!bit) break;
        ++q;
      }
      SPARROW_CHECK_T(FormatError, (q >> 40) == 0, "sparse: Rice quotient too long at index " << i);
    }
    SPARROW_CHECK_T(FormatError, pos + b <= total_bits, "sparse: Rice stream truncated at index " << i);
    uint64_t r = 0;
    for (uint32_t j = 0; j < b; ++j, ++pos) r |= static_cast<uint64_t>((p[pos >> 3] >> (pos & 7)) & 1) << j;
    const uint64_t room = room_limit - static_cast<uint64_t>(prev + 1);  // positions left after prev
    SPARROW_CHECK_T(FormatError, q < (uint64_t{1} << (62 - b)) && ((q << b) | r) < room,
                    "sparse: index out of range at position " << i << " (numel " << numel << ")");
    prev = prev + 1 + static_cast<int64_t>((q << b) | r);
    idx[i] = prev;
  }
  SPARROW_CHECK_T(FormatError, (pos + 7) / 8 == indices.size(), "sparse: trailing bytes after the Rice stream");
  for (uint64_t j = pos; j < total_bits; ++j)
    SPARROW_CHECK_T(FormatError, ((p[j >> 3] >> (j & 7)) & 1) == 0, "sparse: nonzero padding after the Rice stream");
  return idx;
}

namespace {

std::vector<int64_t> decode_rice(const Encoded& e, int64_t numel) {
  SPARROW_CHECK_T(FormatError, e.params.size() == 1, "sparse: Rice coding needs params {b}, got " << e.params.size());
  return decode_rice_positions(e.indices, e.count, e.params[0], numel);
}

}  // namespace

RiceChoice best_rice(const int64_t* idx, uint64_t k) {
  // Cost(b) = sum(gap >> b) + k·(b + 1) bits; it is convex in b, so try every b
  // up to where the quotient sum is zero and keep the smallest.
  std::vector<uint64_t> gaps(k);
  int64_t prev = -1;
  uint64_t max_gap = 0;
  for (uint64_t i = 0; i < k; ++i) {
    gaps[i] = static_cast<uint64_t>(idx[i] - prev - 1);
    prev = idx[i];
    max_gap = std::max(max_gap, gaps[i]);
  }
  RiceChoice best{0, SIZE_MAX};
  for (uint32_t b = 0; b <= kMaxRiceParameter; ++b) {
    uint64_t bits = k * (b + 1);
    for (uint64_t g : gaps) bits += g >> b;
    const size_t bytes = static_cast<size_t>((bits + 7) / 8);
    if (bytes < best.bytes) best = {b, bytes};
    if ((max_gap >> b) == 0) break;
  }
  return best;
}

void encode_indices_rice(const int64_t* idx, uint64_t k, uint32_t b, Encoded& e) {
  SPARROW_CHECK(b <= kMaxRiceParameter, "Rice parameter " << b << " above " << kMaxRiceParameter);
  e.count = k;
  e.index_coding = IndexCoding::kRice;
  e.params = {b};
  e.indices.clear();
  encode_rice(idx, k, b, e.indices);
}

void encode_indices(const int64_t* idx, uint64_t k, int64_t numel, Encoded& e, IndexMode mode) {
  e.count = k;
  e.indices.clear();
  e.params.clear();
  const size_t bitmap = static_cast<size_t>((numel + 7) / 8);
  const size_t delta = delta_varint_bytes(idx, k);
  if (mode == IndexMode::kRice) {
    const RiceChoice rice = best_rice(idx, k);
    // Rice (plus its parameter) unless varints or a bitmap are smaller: one Rice
    // parameter fits clustered positions (runs and long jumps) badly.
    if (rice.bytes + sizeof(uint32_t) < bitmap && rice.bytes + sizeof(uint32_t) < delta) {
      e.indices.reserve(rice.bytes);
      encode_indices_rice(idx, k, rice.b, e);
      return;
    }
  }
  if (bitmap < delta) {
    e.index_coding = IndexCoding::kBitmap;
    e.indices.assign(bitmap, 0);
    for (uint64_t i = 0; i < k; ++i) e.indices[idx[i] >> 3] |= static_cast<uint8_t>(1u << (idx[i] & 7));
    return;
  }
  // Gaps are stored minus one (indices are strictly ascending), so dense runs cost one byte each.
  e.index_coding = IndexCoding::kDeltaVarint;
  e.indices.resize(delta);
  uint8_t* p = e.indices.data();
  int64_t prev = -1;
  for (uint64_t i = 0; i < k; ++i) {
    p = put_varint(p, static_cast<uint64_t>(idx[i] - prev - 1));
    prev = idx[i];
  }
}

std::vector<int64_t> decode_indices(const Encoded& e) {
  const int64_t numel = e.numel();
  std::vector<int64_t> idx;
  switch (e.index_coding) {
    case IndexCoding::kDeltaVarint: {
      SPARROW_CHECK_T(FormatError, e.count <= static_cast<uint64_t>(numel) && e.count <= e.indices.size(),
                      "sparse: count " << e.count << " exceeds what " << e.indices.size() << " index bytes can hold");
      idx.resize(e.count);
      const uint8_t* p = e.indices.data();
      const uint8_t* end = p + e.indices.size();
      int64_t prev = -1;
      for (uint64_t i = 0; i < e.count; ++i) {
        uint64_t v = 0;
        int shift = 0;
        while (true) {
          SPARROW_CHECK_T(FormatError, p < end, "sparse: index stream truncated at index " << i);
          SPARROW_CHECK_T(FormatError, shift <= 56, "sparse: index varint too long at index " << i);
          const uint8_t b = *p++;
          v |= static_cast<uint64_t>(b & 0x7f) << shift;
          shift += 7;
          if (!(b & 0x80)) break;
        }
        SPARROW_CHECK_T(FormatError, v < static_cast<uint64_t>(numel) - static_cast<uint64_t>(prev + 1),
                        "sparse: index out of range at position " << i << " (numel " << numel << ")");
        prev = prev + 1 + static_cast<int64_t>(v);
        idx[i] = prev;
      }
      SPARROW_CHECK_T(FormatError, p == end, "sparse: " << (end - p) << " trailing bytes after the index stream");
      return idx;
    }
    case IndexCoding::kBitmap: {
      SPARROW_CHECK_T(
          FormatError, e.indices.size() == static_cast<size_t>((numel + 7) / 8),
          "sparse: bitmap has " << e.indices.size() << " bytes, numel " << numel << " needs " << (numel + 7) / 8);
      SPARROW_CHECK_T(FormatError, e.count <= static_cast<uint64_t>(numel), "sparse: count exceeds numel");
      idx.reserve(e.count);
      for (size_t byte = 0; byte < e.indices.size(); ++byte) {
        unsigned b = e.indices[byte];
        while (b) {
          const int bit = __builtin_ctz(b);
          b &= b - 1;
          const int64_t i = static_cast<int64_t>(byte) * 8 + bit;
          SPARROW_CHECK_T(FormatError, i < numel, "sparse: bitmap bit " << i << " beyond numel " << numel);
          SPARROW_CHECK_T(FormatError, idx.size() < e.count, "sparse: bitmap has more bits set than count " << e.count);
          idx.push_back(i);
        }
      }
      SPARROW_CHECK_T(FormatError, idx.size() == e.count,
                      "sparse: bitmap has " << idx.size() << " bits set, count says " << e.count);
      return idx;
    }
    case IndexCoding::kRice:
      return decode_rice(e, numel);
    case IndexCoding::kMask:
      throw FormatError("sparse: a masked update's positions need the server's mask (decode_masked_indices)");
    case IndexCoding::kSeeded:
      SPARROW_CHECK_T(FormatError, e.indices.empty(), "sparse: seeded indices carry no index bytes");
      SPARROW_CHECK_T(FormatError, e.count <= static_cast<uint64_t>(numel), "sparse: count exceeds numel");
      return seeded_indices(e.seed, e.count, numel);
    case IndexCoding::kNone:
      break;
  }
  throw FormatError("sparse: unknown index coding " + std::to_string(static_cast<int>(e.index_coding)));
}

void erase_zero_positions(std::vector<int64_t>& idx, const float* src) {
  idx.erase(std::remove_if(idx.begin(), idx.end(), [src](int64_t i) { return src[i] == 0.0f; }), idx.end());
}

std::vector<int64_t> seeded_indices(uint64_t key, uint64_t k, int64_t n) {
  SPARROW_CHECK(k <= static_cast<uint64_t>(n), "seeded_indices: k " << k << " > n " << n);
  std::vector<int64_t> idx;
  idx.reserve(k);
  const uint64_t un = static_cast<uint64_t>(n);
  if (k * 2 > un) {
    // Dense selection: a partial Fisher–Yates shuffle of 0..n-1 keeps it exact.
    std::vector<int64_t> perm(un);
    for (uint64_t i = 0; i < un; ++i) perm[i] = static_cast<int64_t>(i);
    rng::Stream s(key);
    for (uint64_t i = 0; i < k; ++i) std::swap(perm[i], perm[i + s.below(un - i)]);
    idx.assign(perm.begin(), perm.begin() + static_cast<int64_t>(k));
  } else {
    // Sparse selection: draw with rejection against a bitmap (expected draws < 2k).
    std::vector<uint64_t> seen((un + 63) / 64, 0);
    rng::Stream s(key);
    while (idx.size() < k) {
      const uint64_t i = s.below(un);
      uint64_t& w = seen[i >> 6];
      const uint64_t bit = 1ull << (i & 63);
      if (w & bit) continue;
      w |= bit;
      idx.push_back(static_cast<int64_t>(i));
    }
  }
  std::sort(idx.begin(), idx.end());
  return idx;
}

StalePolicy parse_stale_policy(Spec& spec, const char* method, bool ef) {
  StalePolicy p;
  p.decay = spec.get_double("decay", 1.0);
  SPARROW_CHECK_T(ConfigError, p.decay >= 0.0 && p.decay <= 1.0,
                  method << ": decay=" << p.decay << " must be in [0, 1]");
  p.max_age = spec.get_int("max_age", 0);
  SPARROW_CHECK_T(ConfigError, p.max_age >= 0,
                  method << ": max_age=" << p.max_age << " must be >= 0 (0 = never reset)");
  SPARROW_CHECK_T(ConfigError, ef || !p.active(), method << ": decay and max_age need ef=1 (they age its residual)");
  return p;
}

double stale_factor(const StalePolicy& policy, int64_t skipped) {
  const bool reset = policy.max_age > 0 && skipped > policy.max_age;
  return reset ? 0.0 : std::pow(policy.decay, static_cast<double>(skipped));
}

int64_t age_state(Slots& slots, const CodecView& ctx, const StalePolicy& policy,
                  std::initializer_list<const char*> names) {
  int64_t skipped = 0;
  int64_t& last = slots.last_round();
  if (ctx.round >= 0 && last >= 0 && ctx.round > last) skipped = ctx.round - last - 1;
  if (ctx.round >= 0) last = ctx.round;
  if (skipped <= 0 || !policy.active()) return skipped;
  const double factor = stale_factor(policy, skipped);
  // As ATen's zero_() and mul_(factor) on a float32 tensor: the factor is
  // rounded to float32 once, each product rounded once.
  const auto f = static_cast<float>(factor);
  for (const char* name : names) {
    int64_t n = 0;
    float* p = slots.find(name, &n);
    if (!p) continue;
    if (factor == 0.0) {
      std::fill(p, p + n, 0.0f);
    } else {
      for (int64_t i = 0; i < n; ++i) p[i] *= f;
    }
  }
  return skipped;
}

Encoded make_sparse(const std::vector<int64_t>& shape, const int64_t* idx, const float* vals, uint64_t k, ValueType vt,
                    float sign_magnitude, IndexMode mode) {
  Encoded e;
  e.format = Format::kSparse;
  e.shape = shape;
  e.value_type = vt;
  encode_indices(idx, k, numel_of(shape), e, mode);
  const float scale = vt == ValueType::kInt8 ? int8_scale(vals, k) : sign_magnitude;
  pack_values(vals, k, vt, e.values, scale);
  if (vt == ValueType::kSign || vt == ValueType::kInt8) e.scales = {scale};
  return e;
}

MaskLayout mask_layout(const Encoded& e) {
  SPARROW_CHECK_T(FormatError, e.params.size() >= 2 && e.params.size() <= 4,
                  "sparse: a masked update needs params {b, mask size[, block[, kept]]}, got " << e.params.size());
  MaskLayout l;
  l.m = e.params[1];
  l.kept = e.params.size() == 4 ? e.params[3] : l.m;
  l.block = e.params.size() >= 3 ? e.params[2] : 0;
  SPARROW_CHECK_T(FormatError, e.params.size() != 3 || l.block >= 1, "sparse: mask scale block must be >= 1");
  SPARROW_CHECK_T(FormatError, l.m <= static_cast<uint64_t>(e.numel()),
                  "sparse: mask size " << l.m << " exceeds numel " << e.numel());
  SPARROW_CHECK_T(FormatError, l.kept <= l.m, "sparse: " << l.kept << " kept mask values exceed the mask's " << l.m);
  SPARROW_CHECK_T(FormatError, l.kept <= e.count, "sparse: mask values " << l.kept << " exceed count " << e.count);
  return l;
}

MaskScaleGroups mask_scale_groups(const Encoded& e) {
  const MaskLayout l = mask_layout(e);
  MaskScaleGroups g;
  g.m = l.kept;
  g.block = l.block > 0 ? l.block : std::max<uint64_t>(g.m, 1);
  g.blocks = l.block > 0 ? (g.m + g.block - 1) / g.block : 1;
  return g;
}

const int64_t* mask_data(const CodecView& ctx, int64_t numel) {
  if (!ctx.has_mask) return nullptr;
  SPARROW_CHECK(!ctx.mask_malformed, "the mask of '" << ctx.name << "' must be a contiguous 1-D int64 CPU tensor");
  const int64_t* p = ctx.mask;
  for (int64_t i = 0, m = ctx.mask_size; i < m; ++i)
    SPARROW_CHECK(p[i] >= 0 && p[i] < numel && (i == 0 || p[i] > p[i - 1]),
                  "the mask of '" << ctx.name << "' is not ascending within [0, " << numel << ")");
  return p;
}

MaskLayout mask_layout_for(const Encoded& e, const CodecView& ctx) {
  const MaskLayout l = mask_layout(e);
  const uint64_t m = l.m;
  const uint64_t have = ctx.has_mask ? static_cast<uint64_t>(ctx.mask_size) : 0;
  if (!ctx.has_mask && m > 0 && m == static_cast<uint64_t>(e.numel())) return l;  // every position
  SPARROW_CHECK_T(FormatError, (ctx.has_mask || m == 0) && have == m,
                  "sparse: update '" << ctx.name << "' was made for a mask of " << m << " positions, this round's "
                                     << (ctx.has_mask ? "has " + std::to_string(have) : std::string("has none")));
  return l;
}

std::vector<int64_t> decode_mask_extras(const Encoded& e) {
  const uint64_t kept = mask_layout(e).kept;
  return decode_rice_positions(e.indices, e.count - kept, e.params[0], e.numel());
}

std::vector<int64_t> decode_masked_indices(const Encoded& e, const CodecView& ctx) {
  const MaskLayout l = mask_layout_for(e, ctx);
  const uint64_t m = l.m, kept = l.kept;
  std::vector<int64_t> idx(e.count);
  if (kept > 0) {
    // nullptr: the mask of every position (mask_layout_for), entry j is position j.
    const int64_t* mk = mask_data(ctx, e.numel());
    if (kept == m) {
      if (mk != nullptr)
        std::copy_n(mk, m, idx.begin());
      else
        std::iota(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(m), int64_t{0});
    } else {
      const std::vector<int64_t> pick = seeded_indices(e.seed, kept, static_cast<int64_t>(m));
      for (uint64_t j = 0; j < kept; ++j) idx[j] = mk != nullptr ? mk[pick[j]] : pick[j];
    }
  }
  const std::vector<int64_t> extra = decode_mask_extras(e);
  std::copy(extra.begin(), extra.end(), idx.begin() + static_cast<std::ptrdiff_t>(kept));
  return idx;
}

void unpack_sparse_values(const Encoded& e, float* dst) {
  if (e.index_coding != IndexCoding::kMask) {
    unpack_values(e.values.data(), e.count, e.value_type, value_scale(e), dst);
    return;
  }
  if (e.value_type != ValueType::kSign && e.value_type != ValueType::kInt8) {
    unpack_values(e.values.data(), e.count, e.value_type, 0.0f, dst);
    return;
  }
  // Unit values (±1, or the int8 codes), then each times its group's scale.
  unpack_values(e.values.data(), e.count, e.value_type, 1.0f, dst);
  const MaskScaleGroups g = mask_scale_groups(e);
  SPARROW_CHECK_T(FormatError, e.scales.size() == g.blocks + 1, "sparse: masked update has the wrong number of scales");
  for (uint64_t i = 0; i < e.count; ++i) dst[i] *= e.scales[g.of(i)];
}

void decode_sparse_add(const Encoded& e, float* out, float weight, const CodecView& ctx) {
  const std::vector<int64_t> idx =
      e.index_coding == IndexCoding::kMask ? decode_masked_indices(e, ctx) : decode_indices(e);
  std::vector<float> vals(e.count);
  unpack_sparse_values(e, vals.data());
  for (uint64_t i = 0; i < e.count; ++i) out[idx[i]] += weight * vals[i];
}

}  // namespace sparrow::compression::detail
