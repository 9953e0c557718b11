#pragma once
// The LibTorch shell of the torch-free codec kernels (codec_kernel.h): a
// Compressor whose CPU encode runs the kernel on the input's data and on the
// State's tensors in place, so that the server, the simulator and the lite
// client share one implementation and no state tensor is copied per encode.
// Internal to compression/.

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>

#include "compression/codec_kernel.h"
#include "compression/compressor.h"

namespace sparrow::compression::detail {

class KernelCompressor : public Compressor {
 public:
  explicit KernelCompressor(std::unique_ptr<Kernel> kernel);
  std::string method() const override { return method_; }
  // CPU tensors (as_input's checks, then the kernel). Codecs with a CUDA path
  // override this and call it for CPU tensors.
  Encoded encode(const at::Tensor& x, State& state, const Context& ctx) const override;
  double mask_ratio() const override { return kernel_->mask_ratio(); }
  bool share_mean() const override { return kernel_->share_mean(); }

 private:
  std::unique_ptr<Kernel> kernel_;
  std::string method_;
};

// at::parallel_for as the kernels' parallel loop (set_parallel_for).
void use_aten_parallel_for();

}  // namespace sparrow::compression::detail
