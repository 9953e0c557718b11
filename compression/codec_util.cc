#include "compression/codec_util.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <future>

#include "core/rng.h"

namespace sparrow::compression::detail {

at::Tensor as_input(const at::Tensor& x, const char* method) {
  SPARROW_CHECK(x.defined(), method << ": input tensor is undefined");
  SPARROW_CHECK(x.scalar_type() == at::kFloat, method << ": input must be float32, got " << x.scalar_type());
  SPARROW_CHECK(x.device().is_cpu(), method << ": input must be on the CPU, got " << x.device());
  at::Tensor c = x.contiguous();
  // Checked before any state is touched: a NaN or infinity would otherwise end
  // up in error-feedback residuals and momentum for good. One read of x, in
  // blocks the compiler vectorises (no early exit inside a block); large
  // tensors are split over two threads, since one core cannot saturate DRAM.
  const auto* bits = reinterpret_cast<const uint32_t*>(c.data_ptr<float>());
  const int64_t n = c.numel();
  auto first_bad = [bits](int64_t begin, int64_t end) -> int64_t {
    constexpr int64_t kBlock = 4096;
    for (int64_t b = begin; b < end; b += kBlock) {
      const int64_t e = std::min(end, b + kBlock);
      uint32_t bad = 0;
      for (int64_t i = b; i < e; ++i) bad |= static_cast<uint32_t>((bits[i] & 0x7f800000u) == 0x7f800000u);
      if (bad) return b;
    }
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
  return c;
}

std::vector<int64_t> shape_of(const at::Tensor& x) { return std::vector<int64_t>(x.sizes().begin(), x.sizes().end()); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t tensor_key(const Context& ctx) { return rng::derive(ctx.seed, rng::hash_name(ctx.name)); }
uint64_t step_key(const Context& ctx, uint64_t step) { return rng::derive(tensor_key(ctx), step); }

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
  }
  throw FormatError("unknown value type " + std::to_string(static_cast<int>(vt)));
}

void pack_values(const float* src, uint64_t n, ValueType vt, Bytes& out) {
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
      for (uint64_t i = 0; i < n; ++i) h[i] = c10::Half(src[i]).x;
      return;
    }
    case ValueType::kBF16: {
      auto* h = reinterpret_cast<uint16_t*>(dst);
      for (uint64_t i = 0; i < n; ++i) h[i] = c10::BFloat16(src[i]).x;
      return;
    }
    case ValueType::kSign: {
      std::memset(dst, 0, (n + 7) / 8);
      for (uint64_t i = 0; i < n; ++i) dst[i >> 3] |= static_cast<uint8_t>((src[i] < 0.0f) << (i & 7));
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
        dst[i] = static_cast<float>(c10::Half(h, c10::Half::from_bits()));
      }
      return;
    }
    case ValueType::kBF16: {
      for (uint64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        dst[i] = static_cast<float>(c10::BFloat16(h, c10::BFloat16::from_bits()));
      }
      return;
    }
    case ValueType::kSign:
      for (uint64_t i = 0; i < n; ++i) dst[i] = ((bytes[i >> 3] >> (i & 7)) & 1) ? -magnitude : magnitude;
      return;
  }
  throw FormatError("unknown value type " + std::to_string(static_cast<int>(vt)));
}

ValueType parse_value_type(const std::string& text) {
  if (text == "fp32") return ValueType::kF32;
  if (text == "fp16") return ValueType::kF16;
  if (text == "bf16") return ValueType::kBF16;
  throw ConfigError("values='" + text + "' is not one of fp32, fp16, bf16");
}

// ---- indices ------------------------------------------------------------------

namespace {

inline size_t varint_len(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

}  // namespace

size_t delta_varint_bytes(const int64_t* idx, uint64_t k) {
  size_t bytes = 0;
  int64_t prev = -1;
  for (uint64_t i = 0; i < k; ++i) {
    bytes += varint_len(static_cast<uint64_t>(idx[i] - prev - 1));
    prev = idx[i];
  }
  return bytes;
}

void encode_indices(const int64_t* idx, uint64_t k, int64_t numel, Encoded& e) {
  e.count = k;
  e.indices.clear();
  const size_t delta = delta_varint_bytes(idx, k);
  const size_t bitmap = static_cast<size_t>((numel + 7) / 8);
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
    uint64_t v = static_cast<uint64_t>(idx[i] - prev - 1);
    prev = idx[i];
    while (v >= 0x80) {
      *p++ = static_cast<uint8_t>(v | 0x80);
      v >>= 7;
    }
    *p++ = static_cast<uint8_t>(v);
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
    case IndexCoding::kSeeded:
      SPARROW_CHECK_T(FormatError, e.indices.empty(), "sparse: seeded indices carry no index bytes");
      SPARROW_CHECK_T(FormatError, e.count <= static_cast<uint64_t>(numel), "sparse: count exceeds numel");
      return seeded_indices(e.seed, e.count, numel);
    case IndexCoding::kNone:
      break;
  }
  throw FormatError("sparse: unknown index coding " + std::to_string(static_cast<int>(e.index_coding)));
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

float* residual_data(State& state, const at::Tensor& x) {
  at::Tensor& slot = state.slot("residual", x);
  if (!slot.is_contiguous()) slot = slot.contiguous();
  return slot.data_ptr<float>();
}

Encoded make_sparse(const std::vector<int64_t>& shape, const int64_t* idx, const float* vals, uint64_t k, ValueType vt,
                    float sign_magnitude) {
  Encoded e;
  e.format = Format::kSparse;
  e.shape = shape;
  e.value_type = vt;
  encode_indices(idx, k, numel_of(shape), e);
  pack_values(vals, k, vt, e.values);
  if (vt == ValueType::kSign) e.scales = {sign_magnitude};
  return e;
}

void decode_sparse_add(const Encoded& e, float* out, float weight) {
  const std::vector<int64_t> idx = decode_indices(e);
  std::vector<float> vals(e.count);
  const float mag = e.value_type == ValueType::kSign ? e.scales.at(0) : 0.0f;
  unpack_values(e.values.data(), e.count, e.value_type, mag, vals.data());
  for (uint64_t i = 0; i < e.count; ++i) out[idx[i]] += weight * vals[i];
}

}  // namespace sparrow::compression::detail
