#include "state/encoding.h"

#include <cstring>

#include "core/error.h"

namespace sparrow::state {
namespace {

constexpr uint32_t kExpMask = 0x7f800000u;

// The bf16 bits of one float32, or false for a value bf16 cannot hold: NaN,
// +-inf, or a finite value that rounds past bf16's largest (3.39e38).
inline bool narrow_one(float f, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & kExpMask) == kExpMask) return false;
  // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit.
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  if ((rounded & kExpMask) == kExpMask) return false;
  *out = static_cast<uint16_t>(rounded >> 16);
  return true;
}

inline float widen_one(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

bool valid_encoding(const std::string& value) { return value == "fp32" || value == "bf16"; }

Encoding parse_encoding(const std::string& value, const std::string& key) {
  if (value == "fp32") return Encoding::kFp32;
  if (value == "bf16") return Encoding::kBf16;
  throw ConfigError(key + ": unknown value '" + value + "' (expected \"fp32\" or \"bf16\")");
}

const char* encoding_name(Encoding e) { return e == Encoding::kBf16 ? "bf16" : "fp32"; }

bool narrowable_slot(const std::string& slot) { return slot == "residual" || slot == "u" || slot == "v"; }

bool to_bf16(const float* in, uint16_t* out, size_t n, size_t* first_bad) {
  for (size_t i = 0; i < n; ++i) {
    if (!narrow_one(in[i], &out[i])) {
      if (first_bad) *first_bad = i;
      return false;
    }
  }
  return true;
}

bool fits_bf16(const float* v, size_t n, size_t* first_bad) {
  uint16_t b = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!narrow_one(v[i], &b)) {
      if (first_bad) *first_bad = i;
      return false;
    }
  }
  return true;
}

bool round_to_bf16(float* v, size_t n, size_t* first_bad) {
  if (!fits_bf16(v, n, first_bad)) return false;
  uint16_t b = 0;
  for (size_t i = 0; i < n; ++i) {
    narrow_one(v[i], &b);
    v[i] = widen_one(b);
  }
  return true;
}

void from_bf16(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = widen_one(in[i]);
}

}  // namespace sparrow::state
