#include "compression/torch_codec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "compression/codec_util.h"
#include "compression/formats.h"
#include "core/spec.h"

namespace sparrow::compression::detail {
namespace {

// A State's tensors as the kernel's slots: each one made a contiguous float32
// CPU tensor once (as it almost always already is), then written in place.
class TorchSlots final : public Slots {
 public:
  TorchSlots(State& state, const std::string& method) : state_(state), method_(method) {}

  float* slot(const char* name, const std::vector<int64_t>& shape) override {
    auto it = state_.tensors.find(name);
    if (it == state_.tensors.end() || !it->second.sizes().equals(shape))
      it = state_.tensors.insert_or_assign(name, at::zeros(shape, at::TensorOptions().dtype(at::kFloat))).first;
    return data(name, it->second);
  }

  float* find(const char* name, int64_t* n) override {
    auto it = state_.tensors.find(name);
    if (it == state_.tensors.end()) return nullptr;
    *n = it->second.numel();
    return data(name, it->second);
  }

  void erase(const char* name) override { state_.tensors.erase(name); }

  uint64_t& step() override { return state_.step; }
  int64_t& last_round() override { return state_.last_round; }

 private:
  float* data(const char* name, at::Tensor& t) const {
    SPARROW_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.device().is_cpu(),
                  method_ << ": state slot '" << name << "' must be a float32 CPU tensor");
    if (!t.is_contiguous()) t = t.contiguous();
    return t.data_ptr<float>();
  }

  State& state_;
  const std::string& method_;
};

void aten_parallel_for(int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>& fn) {
  at::parallel_for(begin, end, 1, fn);
}

}  // namespace

KernelCompressor::KernelCompressor(std::unique_ptr<Kernel> kernel)
    : kernel_(std::move(kernel)), method_(kernel_->method()) {}

Encoded KernelCompressor::encode(const at::Tensor& x_in, State& state, const Context& ctx) const {
  const at::Tensor x = as_input(x_in, method_.c_str());
  TorchSlots slots(state, method_);
  return kernel_->encode(x.data_ptr<float>(), shape_of(x), slots, view_of(ctx));
}

void use_aten_parallel_for() { set_parallel_for(&aten_parallel_for); }

void register_kernel_codecs() {
  for (const std::string& method : kernel_methods()) {
    if (method == "dgc" || method == "sign") continue;  // their own files: they have CUDA paths
    if (method == "powersgd") continue;                 // powersgd.cc: its LibTorch codec
    if (method == "acp") continue;                      // acp.cc: its shared factor made contiguous
    register_compressor(method, [](Spec& spec) -> std::unique_ptr<Compressor> {
      return std::make_unique<KernelCompressor>(make_kernel(spec));
    });
  }
}

}  // namespace sparrow::compression::detail
