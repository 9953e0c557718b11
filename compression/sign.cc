// sign: EF-signSGD (the algorithm and its CPU kernel: sign_cpu.cc) as a
// LibTorch compressor. CPU tensors run the torch-free kernel on the state's
// tensors in place (torch_codec.h); with SPARROW_WITH_CUDA, CUDA tensors run
// the same two passes on the device (compression/cuda/kernels.h).
#include <ATen/ATen.h>

#include <cmath>
#include <cstring>

#include "compression/codec_kernel.h"
#include "compression/codec_util.h"
#include "compression/formats.h"
#include "compression/torch_codec.h"
#include "core/spec.h"

#if SPARROW_WITH_CUDA
#include "compression/cuda/kernels.h"
#include "compression/cuda/torch_glue.h"
#endif

namespace sparrow::compression::detail {
namespace {

#if SPARROW_WITH_CUDA
constexpr const char* kResidual = "residual";
#endif

class SignCompressor final : public KernelCompressor {
 public:
  explicit SignCompressor(bool ef) : KernelCompressor(make_sign_kernel(ef)), ef_(ef) {}

  Encoded encode(const at::Tensor& x_in, State& state, const Context& ctx) const override {
#if SPARROW_WITH_CUDA
    if (x_in.defined() && x_in.is_cuda()) return encode_cuda(x_in, state);
#endif
    return KernelCompressor::encode(x_in, state, ctx);
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

  [[maybe_unused]] bool ef_;  // the CUDA path's (the kernel has its own)
};

}  // namespace

void register_sign() {
  register_compressor("sign", [](Spec& spec) -> std::unique_ptr<Compressor> {
    return std::make_unique<SignCompressor>(spec.get_bool("ef", true));
  });
}

}  // namespace sparrow::compression::detail
