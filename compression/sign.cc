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
#include <ATen/ATen.h>

#include <cmath>
#include <cstring>

#include "compression/codec_util.h"
#include "compression/formats.h"
#include "compression/quantizers.h"
#include "core/spec.h"

#if SPARROW_WITH_CUDA
#include "compression/cuda/kernels.h"
#include "compression/cuda/torch_glue.h"
#endif

namespace sparrow::compression::detail {
namespace {

constexpr const char* kResidual = "residual";

class SignCompressor final : public Compressor {
 public:
  explicit SignCompressor(bool ef) : ef_(ef) {}
  std::string method() const override { return "sign"; }

  Encoded encode(const at::Tensor& x_in, State& state, const Context&) const override {
#if SPARROW_WITH_CUDA
    if (x_in.defined() && x_in.is_cuda()) return encode_cuda(x_in, state);
#endif
    const at::Tensor x = as_input(x_in, "sign");
    const float* g = x.data_ptr<float>();
    const int64_t n = x.numel();
    float* r = nullptr;
    if (ef_) {
      at::Tensor& res = state.slot(kResidual, x);
      SPARROW_CHECK(res.scalar_type() == at::kFloat && res.is_contiguous() && res.device().is_cpu(),
                    "sign: state slot 'residual' must be a contiguous float32 CPU tensor");
      r = res.data_ptr<float>();
    }

    // Pass 1: ||p||_1. The state is not touched until the scale is known to be finite.
    const std::vector<double> parts = per_block<double>(n, [&](int64_t lo, int64_t hi) {
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
    e.shape = shape_of(x);
    e.scales = {scale};
    e.values.assign(static_cast<size_t>((n + 7) / 8), 0);
    uint8_t* bits = e.values.data();
    // Pass 2: sign bits and the new residual. kBlock is a multiple of 8, so blocks never share a byte.
    for_blocks(n, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const float p = r ? g[i] + r[i] : g[i];
        const bool neg = p < 0.0f;
        bits[i >> 3] |= static_cast<uint8_t>(static_cast<unsigned>(neg) << (i & 7));
        if (r) r[i] = p - (neg ? -scale : scale);
      }
    });
    ++state.step;
    return e;
  }

 private:
#if SPARROW_WITH_CUDA
  // CUDA tensors (compression/cuda/kernels.h): the same two passes on the
  // device. The sign bits and the residual update are those of the CPU path for
  // the same scale; ||p||_1 is summed in a different (fixed) order, so the
  // scale may differ from the CPU's in its last bit.
  Encoded encode_cuda(const at::Tensor& x_in, State& state) const {
    const at::Tensor x = cuda::as_cuda_input(x_in, "sign");
    const int64_t n = x.numel();
    float* r = ef_ ? cuda::device_slot(state, kResidual, x, "sign").data_ptr<float>() : nullptr;
    const float* g = x.data_ptr<float>();
    void* stream = cuda::current_stream();
    at::Tensor ws = cuda::scratch_bytes(cuda::sum_abs_workspace_bytes(n), x);
    const double l1 = cuda::sum_abs(g, r, n, ws.data_ptr(), stream);
    const float scale = n ? static_cast<float>(l1 / static_cast<double>(n)) : 0.0f;
    SPARROW_CHECK(std::isfinite(scale), "sign: input" << (ef_ ? " plus residual" : "") << " is not finite");
    Encoded e;
    e.format = Format::kSign;
    e.shape = shape_of(x);
    e.scales = {scale};
    const int64_t nbytes = (n + 7) / 8;
    if (nbytes > 0) {
      at::Tensor bits = cuda::scratch_bytes(static_cast<size_t>(nbytes), x);
      cuda::sign_pack(g, r, n, scale, bits.data_ptr<uint8_t>(), stream);
      const at::Tensor h = bits.cpu();
      e.values.assign(h.data_ptr<uint8_t>(), h.data_ptr<uint8_t>() + nbytes);
    }
    ++state.step;
    return e;
  }
#endif

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
  for_blocks(n, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t b = mbits ^ (static_cast<uint32_t>((bits[i >> 3] >> (i & 7)) & 1) << 31);
      float v;
      std::memcpy(&v, &b, 4);
      out[i] += v;
    }
  });
}

void register_sign() {
  register_compressor("sign", [](Spec& spec) -> std::unique_ptr<Compressor> {
    return std::make_unique<SignCompressor>(spec.get_bool("ef", true));
  });
}

}  // namespace sparrow::compression::detail
