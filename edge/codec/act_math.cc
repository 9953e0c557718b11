// The activation codecs' arithmetic (act_math.h). The products and the QR
// are Eigen's (act_math_eigen.h), in a baseline build here and an AVX2 + FMA
// build (act_math_avx2.cc) picked once per process on a CPU that has them;
// both run on the calling thread (no OpenMP), so the bits depend only on the
// build and that choice.
#define Eigen sparrow_act_eigen
#define SPARROW_ACT_MATH_NS baseline
#include "edge/codec/act_math_eigen.h"
#undef Eigen

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/rng.h"
#include "edge/codec/act_math.h"
#include "kernels/cpu.h"

namespace sparrow::edge::flat::detail {

#if defined(SPARROW_ACT_CODEC_AVX2)
namespace avx2 {
void matmul(const float* a, const float* b, int64_t n, int64_t k, int64_t m, float* out);
void matmul_tn(const float* a, const float* b, int64_t k, int64_t n, int64_t m, float* out);
void matmul_nt(const float* a, const float* b, int64_t n, int64_t k, int64_t m, float* out);
void orthonormalize(float* a, int64_t n, int64_t r);
}  // namespace avx2
#endif

namespace {

// SPARROW_KERNELS=reference (kernels/cpu.h), or SPARROW_ACT_CODEC_ISA=baseline,
// forces the baseline build (tests compare the two).
bool pick_avx2() {
#if defined(SPARROW_ACT_CODEC_AVX2)
  const char* isa = std::getenv("SPARROW_ACT_CODEC_ISA");
  if (isa != nullptr && std::strcmp(isa, "baseline") == 0) return false;
  return kernels::isa_enabled(kernels::Isa::kAvx2);
#else
  return false;
#endif
}

bool use_avx2() {
  static const bool yes = pick_avx2();
  return yes;
}

}  // namespace

const char* math_isa() { return use_avx2() ? "avx2" : "baseline"; }

void matmul(const float* a, const float* b, int64_t n, int64_t k, int64_t m, float* out) {
#if defined(SPARROW_ACT_CODEC_AVX2)
  if (use_avx2()) return avx2::matmul(a, b, n, k, m, out);
#endif
  baseline::matmul(a, b, n, k, m, out);
}

void matmul_tn(const float* a, const float* b, int64_t k, int64_t n, int64_t m, float* out) {
#if defined(SPARROW_ACT_CODEC_AVX2)
  if (use_avx2()) return avx2::matmul_tn(a, b, k, n, m, out);
#endif
  baseline::matmul_tn(a, b, k, n, m, out);
}

void matmul_nt(const float* a, const float* b, int64_t n, int64_t k, int64_t m, float* out) {
#if defined(SPARROW_ACT_CODEC_AVX2)
  if (use_avx2()) return avx2::matmul_nt(a, b, n, k, m, out);
#endif
  baseline::matmul_nt(a, b, n, k, m, out);
}

void orthonormalize(float* a, int64_t n, int64_t r) {
#if defined(SPARROW_ACT_CODEC_AVX2)
  if (use_avx2()) return avx2::orthonormalize(a, n, r);
#endif
  baseline::orthonormalize(a, n, r);
}

std::vector<float> gaussian(int64_t n, int64_t r, uint64_t key) {
  std::vector<float> out(static_cast<size_t>(n * r));
  for (size_t i = 0; i < out.size(); ++i) out[i] = rng::normal(key, i);
  return out;
}

void quantize_cols(const float* m, int64_t n, int64_t r, int bits, std::vector<float>& scales,
                   std::vector<uint8_t>& data) {
  const float levels = static_cast<float>((1 << bits) - 1);
  const size_t at = data.size();
  const uint64_t count = static_cast<uint64_t>(n * r);
  data.resize(at + code_bytes(count, static_cast<uint32_t>(bits)), 0);
  uint8_t* out = data.data() + at;
  for (int64_t j = 0; j < r; ++j) {
    float lo = m[j], hi = m[j];
    for (int64_t i = 1; i < n; ++i) {
      lo = std::min(lo, m[i * r + j]);
      hi = std::max(hi, m[i * r + j]);
    }
    const float step = (hi - lo) / levels;
    const float safe = step > 0 ? step : 1.0f;
    scales.push_back(lo);
    scales.push_back(step);
    for (int64_t i = 0; i < n; ++i) {
      float c = std::nearbyint((m[i * r + j] - lo) / safe);
      if (!(c >= 0)) c = 0;  // also NaN
      if (c > levels) c = levels;
      const uint64_t k = static_cast<uint64_t>(j * n + i);
      const auto code = static_cast<uint8_t>(c);
      if (bits == 8)
        out[k] = code;
      else
        out[k / 2] |= static_cast<uint8_t>(code << (4 * (k & 1)));
    }
  }
}

void dequantize_cols(const float* scales, const uint8_t* codes, int64_t n, int64_t r, uint32_t bits, float* out) {
  for (int64_t j = 0; j < r; ++j) {
    const float lo = scales[2 * j], step = scales[2 * j + 1];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t k = j * n + i;
      const uint32_t c = bits == 8 ? codes[k] : (codes[k / 2] >> (4 * (k & 1))) & 0xF;
      out[i * r + j] = lo + static_cast<float>(c) * step;
    }
  }
}

}  // namespace sparrow::edge::flat::detail
