// Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, ICLR 2018), as in the
// paper and its reference code (synxlin/deep-gradient-compression: DGCCompressor
// and DGCSGDMemory):
//   dgc:ratio=0.001,momentum=0,clip=0,warmup=0,sample=0.01,dense1d=1[,values=fp32|fp16|bf16|int8]
//       [,index=auto|rice][,decay=D,max_age=A]
// momentum defaults to 0 (the paper's 0.9 is momentum=0.9): in federated learning
// with partial participation a client's momentum is many rounds stale when it is
// next selected, and measured it costs accuracy (docs/compression.md). decay and
// max_age age u and v over the rounds a client skipped (StalePolicy).
// Per step on a tensor with dim() > 1, or dim() == 1 when dense1d=0 (state slots
// "u" = momentum, "v" = velocity):
//   g *= min(1, C·N^-1/2 / (||g||2 + 1e-6))      local gradient clipping, clip = C > 0
//   u = m·u + g;  v += u                          momentum correction
//   thr from a strided sample of |v|, the reference's 1.3/0.8 adaptation loop
//   send (idx, v[idx]) for the first k indices;  u[idx] = v[idx] = 0 (momentum factor masking)
// with the density warmed up over the first `warmup` steps (dgc_density): global
// rounds when Context::round >= 0, else the tensor's own State::step.
// Tensors with dim() <= 1 (biases, norms) go dense fp32, untouched, as in the reference
// (dense1d=1, the default). With dense1d=0 the 1-D tensors are compressed like the
// others: on a small model their dense bytes dominate the message (on the 199,210-
// parameter MLP the 410 bias floats cost more than the 199 sparse values), which
// caps the compression ratio. 0-d scalars always go dense.
//
// Parameters: ratio in (0, 1] (density after warm-up), momentum in [0, 1),
// clip >= 0 (0 = off; the bound is clip·ctx.num_workers^-1/2 per tensor),
// dense1d 0|1 (1 = 1-D tensors dense, the default),
// warmup >= 0 steps of State::step, sample in (0, 1] (the reference clamps it to
// >= 0.01; here any value is honoured, the plan still takes >= ceil(2/density)
// samples). Wire: kSparse, ascending indices (delta varint or bitmap), fp32 values
// unless values= says otherwise. Fewer than k values are sent when the adaptation
// loop ends below k, as in the reference; never more.
//
// Speed (the cost is the memory traffic of one read of g, u, v and one write of
// u, v): a provisional threshold comes from a sub-sample of the new velocity,
// evaluated in place before anything is written, set a few standard deviations
// low. One fused pass then updates u and v, collects the candidates with
// |v| >= provisional and records |v| at every sample position. The reference's
// threshold from those samples is nearly always above the provisional one, so
// the indices it selects are filtered out of the candidates; otherwise v is
// rescanned. Only when the count misses [0.8k, 1.3k] is there a correction (exact
// top-k among the candidates, or a rescan with the threshold lowered by 0.8).
// No n-sized temporaries are allocated. The results are bit-identical to the
// reference's order of float operations as long as the compiler does not
// contract m·u + g into an FMA (the default x86-64 flags have no FMA); the
// codec stays self-consistent either way, because it selects on the stored v.
#include <ATen/ATen.h>

#include <cmath>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "compression/codec_util.h"
#include "compression/dgc.h"
#include "compression/formats.h"
#include "core/rng.h"
#include "core/spec.h"

#if SPARROW_WITH_CUDA
#include "compression/cuda/device_codec.h"
#include "compression/cuda/kernels.h"
#include "compression/cuda/torch_glue.h"
#endif

namespace sparrow::compression::detail {

double dgc_density(uint64_t step, int64_t warmup, double ratio) {
  if (warmup <= 0 || step >= static_cast<uint64_t>(warmup)) return ratio;
  const auto phase = static_cast<uint64_t>(static_cast<unsigned __int128>(step) * 4 / static_cast<uint64_t>(warmup));
  return std::max(std::pow(0.25, static_cast<double>(phase + 1)), ratio);
}

DgcSamplePlan dgc_sample_plan(int64_t n, double density, double sample_ratio) {
  DgcSamplePlan p;
  const double dn = static_cast<double>(n);
  const auto pct = static_cast<int64_t>(std::ceil(dn * sample_ratio));
  const auto cpr = static_cast<int64_t>(std::ceil(2.0 / density));
  if (n <= cpr) {
    p.stride = 1;
    p.num_samples = n;
  } else {
    const int64_t want = std::max(pct, cpr);
    p.stride = static_cast<int64_t>(std::ceil(dn / static_cast<double>(want) / 32.0)) * 32 + 1;
    p.num_samples = n / p.stride;
    // Terminates: stride starts >= 33 and 33 - 4·8 = 1, where num_samples = n >= want.
    while (p.num_samples < want) {
      p.stride -= 8;
      p.num_samples = n / p.stride;
    }
  }
  p.top_k_samples = static_cast<int64_t>(std::ceil(static_cast<double>(p.num_samples) * density));
  p.k = static_cast<int64_t>(std::ceil(dn * density));
  return p;
}

int64_t dgc_sample_offset(uint64_t key, int64_t stride) {
  return static_cast<int64_t>(rng::below(key, 0, static_cast<uint64_t>(stride)));
}

namespace {

constexpr double kUpperBound = 1.3;   // reference: compress_upper_bound
constexpr double kLowerBound = 0.8;   // reference: compress_lower_bound
constexpr float kLowerBoundF = 0.8f;  // thr *= 0.8 happens on a float32 tensor there
constexpr int kMaxAdaptationIters = 10;
constexpr int64_t kProvisionalSamples = 8192;  // every (count / this)-th sample sets the provisional threshold

// One element of the momentum-corrected update, in the reference's order of
// float operations (mmt.mul_(m).add_(grad); vec.add_(mmt)); the SSE path of the
// fused pass performs the same operations lane by lane.
inline float dgc_step(float& u, float v, float g, float m, float coef) {
  u = m * u + g * coef;
  return v + u;
}

// ||g||2 in double, summed per scan block and then in block order, so the
// result does not depend on the thread count.
double l2_norm(const float* g, int64_t n) {
  const int64_t blocks = (n + kScanBlock - 1) / kScanBlock;
  std::vector<double> part(static_cast<size_t>(blocks), 0.0);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      double acc[4] = {0, 0, 0, 0};
      const int64_t end = std::min(n, (b + 1) * kScanBlock);
      int64_t i = b * kScanBlock;
      for (; i + 4 <= end; i += 4)
        for (int j = 0; j < 4; ++j) acc[j] += static_cast<double>(g[i + j]) * g[i + j];
      for (; i < end; ++i) acc[0] += static_cast<double>(g[i]) * g[i];
      part[static_cast<size_t>(b)] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
  });
  double s = 0.0;
  for (double p : part) s += p;
  return std::sqrt(s);
}

at::Tensor& state_slot(State& state, const char* name, const at::Tensor& like) {
  at::Tensor& t = state.slot(name, like);
  SPARROW_CHECK(t.scalar_type() == at::kFloat, "dgc: state slot '" << name << "' must be float32");
  if (!t.is_contiguous()) t = t.contiguous();
  return t;
}

class DgcCompressor final : public Compressor {
 public:
  DgcCompressor(double ratio, double momentum, double clip, int64_t warmup, double sample, bool dense1d, ValueType vt,
                IndexMode index, StalePolicy stale)
      : ratio_(ratio),
        momentum_(momentum),
        clip_(clip),
        warmup_(warmup),
        sample_(sample),
        dense1d_(dense1d),
        vt_(vt),
        index_(index),
        stale_(stale) {}
  std::string method() const override { return "dgc"; }

  Encoded encode(const at::Tensor& x_in, State& state, const Context& ctx) const override {
#if SPARROW_WITH_CUDA
    if (x_in.defined() && x_in.is_cuda()) return encode_cuda(x_in, state, ctx);
#endif
    const at::Tensor x = as_input(x_in, "dgc");
    const uint64_t step = state.step;
    if (x.dim() == 0 || (x.dim() == 1 && dense1d_)) {
      Encoded e;
      e.format = Format::kDense;
      e.shape = shape_of(x);
      e.value_type = ValueType::kF32;
      pack_values(x.data_ptr<float>(), static_cast<uint64_t>(x.numel()), ValueType::kF32, e.values);
      ++state.step;
      return e;
    }
    const int64_t n = x.numel();
    age_state(state, ctx, stale_, {"u", "v"});
    float* u = state_slot(state, "u", x).data_ptr<float>();
    float* v = state_slot(state, "v", x).data_ptr<float>();
    const float* g = x.data_ptr<float>();
    std::vector<int64_t> idx;
    if (n > 0) idx = select(g, u, v, n, step, ctx);

    std::vector<float> vals(idx.size());
    for (size_t j = 0; j < idx.size(); ++j) {
      const int64_t i = idx[j];
      vals[j] = v[i];
      u[i] = 0.0f;  // momentum factor masking
      v[i] = 0.0f;
    }
    Encoded e = make_sparse(shape_of(x), idx.data(), vals.data(), idx.size(), vt_, 0.0f, index_);
    ++state.step;
    return e;
  }

 private:
  // Updates u and v in place and returns the ascending indices to send.
  std::vector<int64_t> select(const float* g, float* u, float* v, int64_t n, uint64_t step, const Context& ctx) const {
    // Warm-up follows the global round when the caller gives one: in federated
    // learning a client encodes only in the rounds it is selected, so its own
    // step count would keep it in warm-up long after the paper's first epochs.
    const double density = dgc_density(ctx.round >= 0 ? static_cast<uint64_t>(ctx.round) : step, warmup_, ratio_);
    const DgcSamplePlan plan = dgc_sample_plan(n, density, sample_);
    const float m = static_cast<float>(momentum_);
    float coef = 1.0f;  // g·1 == g exactly, so the unclipped path needs no branch
    if (clip_ > 0.0) {
      SPARROW_CHECK(ctx.num_workers >= 1, "dgc: Context::num_workers must be >= 1, got " << ctx.num_workers);
      const double max_norm = clip_ / std::sqrt(static_cast<double>(ctx.num_workers));
      const double c = max_norm / (l2_norm(g, n) + 1e-6);  // torch.nn.utils.clip_grad_norm_
      if (c < 1.0) coef = static_cast<float>(c);
    }

    std::vector<int64_t> idx;
    std::vector<float> samples;
    if (plan.exact()) {
      // Every element is a sample (a small tensor, or sample=1): the threshold is
      // exact and the reference skips the adaptation loop.
      for (int64_t i = 0; i < n; ++i) v[i] = dgc_step(u[i], v[i], g[i], m, coef);
      samples.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) samples[static_cast<size_t>(i)] = std::fabs(v[i]);
      collect_abs_ge(v, n, kth_largest(samples, plan.top_k_samples), idx);
    } else {
      const int64_t offset = dgc_sample_offset(step_key(ctx, step), plan.stride);
      const int64_t count = (n - offset - 1) / plan.stride + 1;  // samples at offset + j·stride < n
      // A provisional threshold from every q-th sample's new |v| (evaluated in
      // place before the pass writes anything), a few standard deviations lower
      // than the estimate of the real one, so that it is lower w.h.p.
      const int64_t q = std::max<int64_t>(1, count / kProvisionalSamples);
      for (int64_t j = 0; j < count; j += q) {
        const int64_t i = offset + j * plan.stride;
        float uu = u[i];
        samples.push_back(std::fabs(dgc_step(uu, v[i], g[i], m, coef)));
      }
      const double expect =
          static_cast<double>(samples.size()) * static_cast<double>(plan.top_k_samples) / static_cast<double>(count);
      const auto rank = static_cast<int64_t>(std::ceil(expect + 4.0 * std::sqrt(expect) + 4.0));
      const float provisional = rank >= static_cast<int64_t>(samples.size()) ? 0.0f : kth_largest(samples, rank);

      // The pass: update, collect |v| >= provisional, record every sample's |v|.
      samples.assign(static_cast<size_t>(count), 0.0f);
      Candidates cand;
      fused_update_collect(g, u, v, n, m, coef, provisional, offset, plan.stride, samples.data(), cand);
      float thr = kth_largest(samples, plan.top_k_samples);
      if (thr >= provisional) {
        // {|v| >= thr} is a subset of the candidates: filter them (their |v| were
        // recorded, so this reads no more of v).
        idx.reserve(cand.idx.size());
        for (size_t j = 0; j < cand.idx.size(); ++j)
          if (cand.mag[j] >= thr) idx.push_back(cand.idx[j]);
      } else {
        idx.clear();  // the provisional threshold was too high (rare): rescan
        collect_abs_ge(v, n, thr, idx);
      }

      // The reference's adaptation loop, verbatim in effect.
      const double k = static_cast<double>(plan.k);
      for (int it = 0; it < kMaxAdaptationIters; ++it) {
        const double found = static_cast<double>(idx.size());
        if (found > k) {
          if (found > k * kUpperBound) keep_topk(v, idx, static_cast<uint64_t>(plan.k));  // resample
          break;
        }
        if (!(found < kLowerBound * k)) break;
        thr = thr * kLowerBoundF;
        idx.clear();
        collect_abs_ge(v, n, thr, idx);
      }
    }
    if (static_cast<int64_t>(idx.size()) > plan.k) idx.resize(static_cast<size_t>(plan.k));  // idx[:k]
    return idx;
  }

  // Selected indices (ascending) and their |v|.
  struct Candidates {
    std::vector<int64_t> idx;
    std::vector<float> mag;
  };

  // u = m·u + coef·g; v += u; collects the i with |v| >= thr (and their |v|) and
  // stores |v| at offset + j·stride into samples[j]. One read of g, u, v and one
  // write of u, v: the memory traffic is the whole cost, so selecting must not
  // add a pass. Blocks as in scan_blocks: the result is thread-count independent.
  static void fused_update_collect(const float* g, float* u, float* v, int64_t n, float m, float coef, float thr,
                                   int64_t offset, int64_t stride, float* samples, Candidates& out) {
    const int64_t blocks = (n + kScanBlock - 1) / kScanBlock;
    std::vector<Candidates> parts(static_cast<size_t>(blocks));
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      Candidates& part = parts[static_cast<size_t>(b0)];
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t b = blk * kScanBlock, e = std::min(n, b + kScanBlock);
        int64_t i = b;
#if defined(__SSE2__)
        // 16 elements per iteration, four lanes at a time; the lane masks of the
        // comparisons find the (rare) selected elements with one branch per 16.
        // Same IEEE operations in the same order as dgc_step, lane by lane.
        const __m128 vm = _mm_set1_ps(m), vc = _mm_set1_ps(coef), vt = _mm_set1_ps(thr);
        const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
        for (; i + 16 <= e; i += 16) {
          unsigned mask = 0;
          for (int l = 0; l < 16; l += 4) {
            const __m128 uu =
                _mm_add_ps(_mm_mul_ps(vm, _mm_loadu_ps(u + i + l)), _mm_mul_ps(_mm_loadu_ps(g + i + l), vc));
            _mm_storeu_ps(u + i + l, uu);
            const __m128 vv = _mm_add_ps(_mm_loadu_ps(v + i + l), uu);
            _mm_storeu_ps(v + i + l, vv);
            mask |= static_cast<unsigned>(_mm_movemask_ps(_mm_cmpge_ps(_mm_and_ps(vv, abs_mask), vt))) << l;
          }
          while (mask) {
            const int64_t j = i + __builtin_ctz(mask);
            part.idx.push_back(j);
            part.mag.push_back(std::fabs(v[j]));
            mask &= mask - 1;
          }
        }
#endif
        for (; i < e; ++i) {
          v[i] = dgc_step(u[i], v[i], g[i], m, coef);
          if (std::fabs(v[i]) >= thr) {
            part.idx.push_back(i);
            part.mag.push_back(std::fabs(v[i]));
          }
        }
        int64_t j = b <= offset ? 0 : (b - offset + stride - 1) / stride;
        for (int64_t p = offset + j * stride; p < e; p += stride, ++j) samples[j] = std::fabs(v[p]);
      }
    });
    size_t total = 0;
    for (const auto& p : parts) total += p.idx.size();
    out.idx.reserve(total);
    out.mag.reserve(total);
    for (const auto& p : parts) {
      out.idx.insert(out.idx.end(), p.idx.begin(), p.idx.end());
      out.mag.insert(out.mag.end(), p.mag.begin(), p.mag.end());
    }
  }

#if SPARROW_WITH_CUDA
 public:
  // CUDA tensors: the whole step on the device (compression/cuda/dgc_device.cu),
  // then one synchronisation that brings the count, the status and the
  // (capacity-sized) index and value buffers to pinned host memory.
  Encoded encode_cuda(const at::Tensor& x_in, State& state, const Context& ctx) const {
    const at::Tensor x = cuda::as_cuda_tensor(x_in, "dgc");
    if (x.dim() == 0 || (x.dim() == 1 && dense1d_)) {
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
    return make_sparse(d.shape, hi.data_ptr<int64_t>(), hv.data_ptr<float>(), static_cast<uint64_t>(count), vt_, 0.0f,
                       index_);
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
    if (x.dim() == 0 || (x.dim() == 1 && dense1d_)) {
      d.dense = true;
      d.values = x.reshape({-1});
      d.capacity = x.numel();
      ++state.step;
      return d;
    }
    const uint64_t step = state.step;
    const int64_t n = x.numel();
    age_state(state, ctx, stale_, {"u", "v"});
    at::Tensor& ut = cuda::device_slot(state, "u", x, "dgc");
    at::Tensor& vt = cuda::device_slot(state, "v", x, "dgc");
    const double density = dgc_density(ctx.round >= 0 ? static_cast<uint64_t>(ctx.round) : step, warmup_, ratio_);
    const DgcSamplePlan plan = n > 0 ? dgc_sample_plan(n, density, sample_) : DgcSamplePlan{};
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
    s.momentum = static_cast<float>(momentum_);
    at::Tensor coef;  // clip > 0: min(1, max_norm / (||g||2 + 1e-6)) as float32, computed on the device
    if (clip_ > 0.0) {
      SPARROW_CHECK(ctx.num_workers >= 1, "dgc: Context::num_workers must be >= 1, got " << ctx.num_workers);
      const double max_norm = clip_ / std::sqrt(static_cast<double>(ctx.num_workers));
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

 private:
#endif

  double ratio_, momentum_, clip_;
  int64_t warmup_;
  double sample_;
  bool dense1d_;
  ValueType vt_;
  IndexMode index_;
  StalePolicy stale_;
};

}  // namespace

void register_dgc() {
  register_compressor("dgc", [](Spec& spec) {
    const double ratio = spec.get_double("ratio", 0.001);
    SPARROW_CHECK_T(ConfigError, ratio > 0.0 && ratio <= 1.0, "dgc: ratio=" << ratio << " must be in (0, 1]");
    const double momentum = spec.get_double("momentum", 0.0);  // off in FL: see the header comment
    SPARROW_CHECK_T(ConfigError, momentum >= 0.0 && momentum < 1.0,
                    "dgc: momentum=" << momentum << " must be in [0, 1)");
    const double clip = spec.get_double("clip", 0.0);
    SPARROW_CHECK_T(ConfigError, clip >= 0.0, "dgc: clip=" << clip << " must be >= 0 (0 = off)");
    const int64_t warmup = spec.get_int("warmup", 0);
    SPARROW_CHECK_T(ConfigError, warmup >= 0, "dgc: warmup=" << warmup << " must be >= 0 steps");
    const double sample = spec.get_double("sample", 0.01);
    SPARROW_CHECK_T(ConfigError, sample > 0.0 && sample <= 1.0, "dgc: sample=" << sample << " must be in (0, 1]");
    const bool dense1d = spec.get_bool("dense1d", true);
    const ValueType vt = parse_value_type(spec.get_string("values", "fp32"));
    const IndexMode index = parse_index_mode(spec.get_string("index", "auto"));
    const StalePolicy stale = parse_stale_policy(spec, "dgc");
    return std::make_unique<DgcCompressor>(ratio, momentum, clip, warmup, sample, dense1d, vt, index, stale);
  });
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
