// sign: 1-bit sign compression with a scale and error feedback, as EF-signSGD
// (Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
// Compression Schemes", ICML 2019).
//
// Spec: sign[:ef=0|1], default ef=1.
//
// p = g + e (e = the residual in State slot "residual"; with ef=0, p = g and no
// state is kept); delta = (||p||_1 / d)·sign(p), sign(0) = +1; e ← p − delta.
// The learning rate γ of the paper is the caller's business (compress the
// gradient or the update, consistently). The residual is updated with exactly the
// values a decoder produces, so Σ_t decode_t + e_T = Σ_t g_t up to fp32 rounding.
// The ||p||_1 sum is taken in double over fixed blocks, so it is the same for any
// thread count.
//
// Wire (Format::kSign): scales[0] = ||p||_1 / d; values = one bit per element,
// LSB first (1 = negative); padding bits must be zero. 32x below fp32 (minus
// the 4-byte scale).
#include <cmath>
#include <cstring>

#include "compression/codec_bits.h"
#include "compression/codec_kernel.h"
#include "compression/decoders.h"
#include "compression/quantizers.h"

namespace sparrow::compression::detail {
namespace {

constexpr const char* kResidual = "residual";

class SignKernel final : public Kernel {
 public:
  explicit SignKernel(bool ef) : ef_(ef) {}
  std::string method() const override { return "sign"; }

  Encoded encode(const float* x, const std::vector<int64_t>& shape, Slots& slots, const CodecView&) const override {
    const int64_t n = numel_of(shape);
    float* const res = ef_ ? slots.slot(kResidual, shape) : nullptr;
    // Pass 1: ||p||_1. The state is not touched until the scale is known to be finite.
    const std::vector<double> parts = per_block<double>(n, [&](int64_t lo, int64_t hi) {
      const float* const g = x;
      const float* const r = res;
      double s = 0.0;
      if (r) {
        for (int64_t i = lo; i < hi; ++i) s += std::fabs(g[i] + r[i]);
      } else {
        for (int64_t i = lo; i < hi; ++i) s += std::fabs(g[i]);
      }
      return s;
    });
    double l1 = 0.0;
    for (double p : parts) l1 += p;
    const float scale = n ? static_cast<float>(l1 / static_cast<double>(n)) : 0.0f;
    SPARROW_CHECK(std::isfinite(scale), "sign: input" << (ef_ ? " plus residual" : "") << " is not finite");

    Encoded e;
    e.format = Format::kSign;
    e.shape = shape;
    e.scales = {scale};
    e.values.assign(static_cast<size_t>((n + 7) / 8), 0);
    uint8_t* const out = e.values.data();
    // Pass 2: sign bits and the new residual. kBlock is a multiple of 8, so blocks never share a byte.
    for_blocks(n, [&](int64_t lo, int64_t hi) {
      const float* const g = x;
      float* const r = res;
      uint8_t* const bits = out;
      const float scale_l = scale;
      for (int64_t i = lo; i < hi; ++i) {
        const float p = r ? g[i] + r[i] : g[i];
        const bool neg = p < 0.0f;
        bits[i >> 3] |= static_cast<uint8_t>(static_cast<unsigned>(neg) << (i & 7));
        if (r) r[i] = p - (neg ? -scale_l : scale_l);
      }
    });
    ++slots.step();
    return e;
  }

 private:
  bool ef_;
};

}  // namespace

void decode_sign_add(const Encoded& e, float* out, float weight) {
  const int64_t n = e.numel();
  const size_t nbytes = static_cast<size_t>((n + 7) / 8);
  SPARROW_CHECK_T(FormatError, e.scales.size() == 1 && e.values.size() == nbytes, "sign: wrong payload size");
  const uint8_t* bits = e.values.data();
  if (n % 8) {
    SPARROW_CHECK_T(FormatError, (bits[nbytes - 1] >> (n % 8)) == 0, "sign: nonzero padding bits");
  }
  // Branch-free: a set bit flips the float sign bit of m (random signs would
  // defeat a branch predictor).
  const float m = weight * e.scales[0];
  uint32_t mbits;
  std::memcpy(&mbits, &m, 4);
  for_blocks(n, [bits, mbits, out](int64_t lo, int64_t hi) {
    const uint8_t* const in = bits;  // locals: the float stores below cannot alias them
    float* const o = out;
    const uint32_t mb = mbits;
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t b = mb ^ (static_cast<uint32_t>((in[i >> 3] >> (i & 7)) & 1) << 31);
      float v;
      std::memcpy(&v, &b, 4);
      o[i] += v;
    }
  });
}

std::unique_ptr<Kernel> make_sign_kernel(bool ef) { return std::make_unique<SignKernel>(ef); }

}  // namespace sparrow::compression::detail
