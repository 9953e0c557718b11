// terngrad: TernGrad (Wen et al., "TernGrad: Ternary Gradients to Reduce
// Communication in Distributed Deep Learning", NeurIPS 2017).
//
// Spec: terngrad[:clip=C]. C >= 0, default 0 = no clipping; the paper uses 2.5.
//
// Per tensor: with clipping on, g is first clamped to [−Cσ, Cσ], σ the
// population standard deviation of g (about its mean). s = max|g|;
// b_i ~ Bernoulli(|g_i|/s) (drawn as rng::uniform01(step_key(ctx, step), i)·s < |g_i|);
// g̃_i = s·sign(g_i)·b_i. Without clipping E[g̃] = g (unbiased, per-element
// variance s|g_i| − g_i² <= s²/4); clipping trades that bias for a smaller s.
// s == 0 (an all-zero tensor, or σ == 0 with clipping on) sends all zeros.
// The paper shares s across workers (max); here each encode has its own s, so
// no extra round trip is needed.
//
// Wire (Format::kTernary): scales[0] = s; values = 2 bits per element, LSB
// first, element i in bits 2(i mod 4).. of byte i/4: 0 = zero, 1 = +s, 2 = −s.
// Code 3 and nonzero padding bits are rejected (FormatError).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "compression/codec_bits.h"
#include "compression/codec_kernel.h"
#include "compression/decoders.h"
#include "compression/quantizers.h"
#include "core/rng.h"
#include "core/spec.h"

namespace sparrow::compression::detail {
namespace {

struct Moments {
  double sum = 0.0;
  double sumsq = 0.0;
  float max_abs = 0.0f;
  bool finite = true;
};

class TernGradKernel final : public Kernel {
 public:
  explicit TernGradKernel(double clip) : clip_(clip) {}
  std::string method() const override { return "terngrad"; }

  Encoded encode(const float* x, const std::vector<int64_t>& shape, Slots& slots, const CodecView& ctx) const override {
    const int64_t n = numel_of(shape);
    const bool clip = clip_ > 0.0;

    const std::vector<Moments> parts = per_block<Moments>(n, [&](int64_t lo, int64_t hi) {
      const float* const g = x;
      Moments m;
      for (int64_t i = lo; i < hi; ++i) {
        const float a = std::fabs(g[i]);
        m.finite &= std::isfinite(a);
        m.max_abs = std::max(m.max_abs, a);
        if (clip) {
          m.sum += g[i];
          m.sumsq += static_cast<double>(g[i]) * g[i];
        }
      }
      return m;
    });
    Moments all;
    for (const Moments& m : parts) {
      all.sum += m.sum;
      all.sumsq += m.sumsq;
      all.max_abs = std::max(all.max_abs, m.max_abs);
      all.finite &= m.finite;
    }
    SPARROW_CHECK(all.finite, "terngrad: input contains inf or nan");

    // The clipping bound Cσ; +inf means no clipping.
    float bound = std::numeric_limits<float>::infinity();
    if (clip && n > 0) {
      const double mean = all.sum / static_cast<double>(n);
      const double var = std::max(0.0, all.sumsq / static_cast<double>(n) - mean * mean);
      bound = static_cast<float>(clip_ * std::sqrt(var));
    }
    const float s = std::min(all.max_abs, bound);
    const uint64_t key = step_key(ctx, slots.step());

    Encoded e;
    e.format = Format::kTernary;
    e.shape = shape;
    e.scales = {s};
    e.values.assign(static_cast<size_t>((2 * n + 7) / 8), 0);
    if (s > 0.0f) {
      uint8_t* const codes = e.values.data();
      // kBlock is a multiple of 4, so blocks never share a byte.
      for_blocks(n, [&](int64_t lo, int64_t hi) {
        // Locals: the byte stores below may alias anything in memory.
        const float* const g = x;
        uint8_t* const out = codes;
        const float bound_l = bound, s_l = s;
        const uint64_t key_l = key;
        for (int64_t i = lo; i < hi; ++i) {
          const float a = std::min(std::fabs(g[i]), bound_l);
          if (a == 0.0f) continue;
          if (rng::uniform01(key_l, static_cast<uint64_t>(i)) * s_l < a) {
            const unsigned code = g[i] < 0.0f ? 2u : 1u;
            out[i >> 2] |= static_cast<uint8_t>(code << (2 * (i & 3)));
          }
        }
      });
    }
    ++slots.step();
    return e;
  }

 private:
  double clip_;
};

}  // namespace

void decode_ternary_add(const Encoded& e, float* out, float weight) {
  const int64_t n = e.numel();
  const size_t nbytes = static_cast<size_t>((2 * n + 7) / 8);
  SPARROW_CHECK_T(FormatError, e.scales.size() == 1 && e.values.size() == nbytes, "terngrad: wrong payload size");
  const uint8_t* bytes = e.values.data();

  // Check every code first (code 3 is invalid; padding must be zero), 8 bytes at a time.
  constexpr uint64_t kLow = 0x5555555555555555ull;
  size_t k = 0;
  for (; k + 8 <= nbytes; k += 8) {
    uint64_t w;
    std::memcpy(&w, bytes + k, 8);
    SPARROW_CHECK_T(FormatError, (w & (w >> 1) & kLow) == 0, "terngrad: invalid 2-bit code 3 near element " << 4 * k);
  }
  for (; k < nbytes; ++k) {
    const unsigned b = bytes[k];
    SPARROW_CHECK_T(FormatError, (b & (b >> 1) & 0x55u) == 0, "terngrad: invalid 2-bit code 3 near element " << 4 * k);
  }
  if (n % 4) {
    const unsigned pad = static_cast<unsigned>(bytes[nbytes - 1]) >> (2 * (n % 4));
    SPARROW_CHECK_T(FormatError, pad == 0, "terngrad: nonzero padding bits");
  }

  const float m = weight * e.scales[0];
  const float table[4] = {0.0f, m, -m, 0.0f};
  for_blocks(n, [&](int64_t lo, int64_t hi) {
    // Locals: the float stores below could otherwise alias the table.
    const float t[4] = {table[0], table[1], table[2], table[3]};
    const uint8_t* const in = bytes;
    float* const o = out;
    for (int64_t i = lo; i < hi; ++i) o[i] += t[(in[i >> 2] >> (2 * (i & 3))) & 3];
  });
}

std::unique_ptr<Kernel> make_terngrad_kernel(Spec& spec) {
  const double clip = spec.get_double("clip", 0.0);
  SPARROW_CHECK_T(
      ConfigError, clip >= 0.0,
      "spec '" << spec.text() << "': terngrad clip must be >= 0 (0 = off; the paper uses 2.5), got " << clip);
  return std::make_unique<TernGradKernel>(clip);
}

}  // namespace sparrow::compression::detail
