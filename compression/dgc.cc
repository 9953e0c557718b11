// dgc: Deep Gradient Compression (the algorithm and its CPU kernel: dgc_cpu.cc)
// as a LibTorch compressor. CPU tensors run the torch-free kernel on the
// state's tensors in place (torch_codec.h); with SPARROW_WITH_CUDA, CUDA
// tensors run the whole step on the device (compression/cuda/dgc_device.cu).
#include <ATen/ATen.h>

#include <cmath>

#include "compression/codec_kernel.h"
#include "compression/codec_util.h"
#include "compression/dgc.h"
#include "compression/formats.h"
#include "compression/torch_codec.h"
#include "core/spec.h"

#if SPARROW_WITH_CUDA
#include "compression/cuda/device_codec.h"
#include "compression/cuda/kernels.h"
#include "compression/cuda/torch_glue.h"
#endif

namespace sparrow::compression::detail {
namespace {

class DgcCompressor final : public KernelCompressor {
 public:
  explicit DgcCompressor(const DgcOptions& o) : KernelCompressor(make_dgc_kernel(o)), o_(o) {}

  Encoded encode(const at::Tensor& x_in, State& state, const Context& ctx) const override {
#if SPARROW_WITH_CUDA
    if (x_in.defined() && x_in.is_cuda()) return encode_cuda(x_in, state, ctx);
#endif
    return KernelCompressor::encode(x_in, state, ctx);
  }

#if SPARROW_WITH_CUDA
  // CUDA tensors: the whole step on the device (compression/cuda/dgc_device.cu),
  // then one synchronisation that brings the count, the status and the
  // (capacity-sized) index and value buffers to pinned host memory.
  Encoded encode_cuda(const at::Tensor& x_in, State& state, const Context& ctx) const {
    const at::Tensor x = cuda::as_cuda_tensor(x_in, "dgc");
    if (x.dim() == 0 || (x.dim() == 1 && o_.dense1d)) {
      const at::Tensor h = as_input(x.cpu(), "dgc");
      Encoded e;
      e.format = Format::kDense;
      e.shape = shape_of(h);
      e.value_type = ValueType::kF32;
      pack_values(h.data_ptr<float>(), static_cast<uint64_t>(h.numel()), ValueType::kF32, e.values);
      ++state.step;
      return e;
    }
    const cuda::DeviceEncoded d = encode_device(x, state, ctx);
    const int64_t cap = d.capacity;
    const at::TensorOptions pinned = at::TensorOptions().pinned_memory(true);
    at::Tensor hc = at::empty({2}, pinned.dtype(at::kLong));
    at::Tensor hi = at::empty({cap}, pinned.dtype(at::kLong));
    at::Tensor hv = at::empty({cap}, pinned.dtype(at::kFloat));
    hc.zero_();
    void* stream = cuda::current_stream();
    cuda::copy_to_host_async(hc.data_ptr<int64_t>(), d.count.data_ptr<int64_t>(), sizeof(int64_t), stream);
    cuda::copy_to_host_async(hc.data_ptr<int64_t>() + 1, d.status.data_ptr<int32_t>(), sizeof(int32_t), stream);
    cuda::copy_to_host_async(hi.data_ptr<int64_t>(), d.indices.data_ptr<int64_t>(),
                             static_cast<size_t>(cap) * sizeof(int64_t), stream);
    cuda::copy_to_host_async(hv.data_ptr<float>(), d.values.data_ptr<float>(), static_cast<size_t>(cap) * sizeof(float),
                             stream);
    cuda::stream_synchronize(stream);  // the one wait of the call
    const int64_t count = hc.data_ptr<int64_t>()[0];
    if (static_cast<int32_t>(hc.data_ptr<int64_t>()[1]) != 0) {
      --state.step;  // as on the CPU, a rejected input is not a step (u and v were not written)
      SPARROW_CHECK(false, "dgc: input contains NaN or infinity");
    }
    SPARROW_CHECK(count >= 0 && count <= cap, "dgc: device selection returned " << count << " of at most " << cap);
    return make_sparse(d.shape, hi.data_ptr<int64_t>(), hv.data_ptr<float>(), static_cast<uint64_t>(count), o_.vt, 0.0f,
                       o_.index);
  }

  // The step of select() on the device, decided there (select_rule.h): no host
  // copy and no synchronisation. The selected set, the values and u, v equal
  // the CPU path's for the same inputs and state, except with clip > 0, where
  // ||g||2 is an ATen device reduction whose last bits may differ from l2_norm.
  cuda::DeviceEncoded encode_device(const at::Tensor& x_in, State& state, const Context& ctx, bool check_finite = true,
                                    bool fused = false) const {
    const at::Tensor x = cuda::as_cuda_tensor(x_in, "dgc");
    cuda::DeviceEncoded d;
    d.shape = shape_of(x);
    if (x.dim() == 0 || (x.dim() == 1 && o_.dense1d)) {
      d.dense = true;
      d.values = x.reshape({-1});
      d.capacity = x.numel();
      ++state.step;
      return d;
    }
    const uint64_t step = state.step;
    const int64_t n = x.numel();
    age_state(state, ctx, o_.stale, {"u", "v"});
    at::Tensor& ut = cuda::device_slot(state, "u", x, "dgc");
    at::Tensor& vt = cuda::device_slot(state, "v", x, "dgc");
    const double density = dgc_density(ctx.round >= 0 ? static_cast<uint64_t>(ctx.round) : step, o_.warmup, o_.ratio);
    const DgcSamplePlan plan = n > 0 ? dgc_sample_plan(n, density, o_.sample) : DgcSamplePlan{};
    d.capacity = n > 0 ? plan.k : 0;
    d.indices = at::empty({d.capacity}, x.options().dtype(at::kLong));
    d.values = at::empty({d.capacity}, x.options());
    if (n == 0 || d.capacity == 0) {
      d.count = at::zeros({1}, x.options().dtype(at::kLong));
      d.status = at::zeros({1}, x.options().dtype(at::kInt));
      ++state.step;
      return d;
    }
    d.count = at::empty({1}, x.options().dtype(at::kLong));  // written by the step's last scan, always
    d.status = at::empty({1}, x.options().dtype(at::kInt));
    cuda::DgcDeviceStep s;
    s.n = n;
    s.momentum = static_cast<float>(o_.momentum);
    at::Tensor coef;  // clip > 0: min(1, max_norm / (||g||2 + 1e-6)) as float32, computed on the device
    if (o_.clip > 0.0) {
      SPARROW_CHECK(ctx.num_workers >= 1, "dgc: Context::num_workers must be >= 1, got " << ctx.num_workers);
      const double max_norm = o_.clip / std::sqrt(static_cast<double>(ctx.num_workers));
      const at::Tensor denom = x.to(at::kDouble).norm() + 1e-6;  // torch.nn.utils.clip_grad_norm_
      coef = at::scalar_tensor(max_norm, denom.options()).div(denom).clamp_max(1.0).to(at::kFloat).contiguous();
      s.coef_device = coef.data_ptr<float>();
    }
    if (plan.exact()) {
      s.sample_offset = 0;
      s.sample_stride = 1;
      s.sample_count = n;
      s.exact = true;
    } else {
      s.sample_offset = dgc_sample_offset(step_key(ctx, step), plan.stride);
      s.sample_stride = plan.stride;
      s.sample_count = (n - s.sample_offset - 1) / plan.stride + 1;
    }
    // kth_largest clamps its rank to [1, size] (rank <= 0 means the maximum).
    s.sample_rank = std::min(std::max<int64_t>(plan.top_k_samples, 1), s.sample_count);
    s.k = plan.k;
    s.check_finite = check_finite;
    // Fused: the new state goes to a second pair of buffers, which become the
    // slots (a rejected input leaves copies of the old values there).
    at::Tensor u_next, v_next;
    if (fused) {
      u_next = at::empty_like(ut);
      v_next = at::empty_like(vt);
      s.u_out = u_next.data_ptr<float>();
      s.v_out = v_next.data_ptr<float>();
    }
    at::Tensor ws = cuda::scratch_bytes(cuda::dgc_device_workspace_bytes(s), x);
    cuda::dgc_encode_device(x.data_ptr<float>(), ut.data_ptr<float>(), vt.data_ptr<float>(), s, ws.data_ptr(),
                            d.indices.data_ptr<int64_t>(), d.values.data_ptr<float>(), d.count.data_ptr<int64_t>(),
                            d.status.data_ptr<int32_t>(), cuda::current_stream());
    if (fused) {
      cuda::retire_on_current_stream(ut);  // still read by the queued kernels
      cuda::retire_on_current_stream(vt);
      ut = u_next;
      vt = v_next;
    }
    ++state.step;
    return d;
  }

#endif

 private:
  [[maybe_unused]] DgcOptions o_;  // the CUDA path's (the kernel has its own)
};

}  // namespace

void register_dgc() {
  register_compressor("dgc", [](Spec& spec) { return std::make_unique<DgcCompressor>(parse_dgc_options(spec)); });
}

}  // namespace sparrow::compression::detail

#if SPARROW_WITH_CUDA
namespace sparrow::compression::cuda {

DeviceEncoded encode_device(const Compressor& codec, const at::Tensor& x, State& state, const Context& ctx,
                            bool check_finite, bool fused) {
  const auto* dgc = dynamic_cast<const detail::DgcCompressor*>(&codec);
  SPARROW_CHECK(dgc != nullptr, "encode_device: only the dgc codec encodes on the device, got " << codec.method());
  return dgc->encode_device(x, state, ctx, check_finite, fused);
}

void fold_device(const DeviceEncoded& e, float weight, at::Tensor& dense) {
  SPARROW_CHECK(dense.is_cuda() && dense.scalar_type() == at::kFloat && dense.is_contiguous(),
                "fold_device: the accumulator must be a contiguous float32 CUDA tensor");
  SPARROW_CHECK(dense.numel() == detail::numel_of(e.shape), "fold_device: accumulator has "
                                                                << dense.numel() << " elements, the update "
                                                                << detail::numel_of(e.shape));
  if (e.dense) {
    dense.view({-1}).add_(e.values, weight);
    return;
  }
  fold_sparse(e.indices.data_ptr<int64_t>(), e.values.data_ptr<float>(), e.count.data_ptr<int64_t>(), e.capacity,
              weight, dense.data_ptr<float>(), current_stream());
}

}  // namespace sparrow::compression::cuda
#endif
