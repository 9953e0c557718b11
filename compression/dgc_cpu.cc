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
#include <cmath>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "compression/codec_bits.h"
#include "compression/codec_kernel.h"
#include "compression/dgc.h"
#include "core/rng.h"
#include "core/spec.h"

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
  parallel_for(0, blocks, [&](int64_t b0, int64_t b1) {
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

class DgcKernel final : public Kernel {
 public:
  explicit DgcKernel(const DgcOptions& o)
      : ratio_(o.ratio),
        momentum_(o.momentum),
        clip_(o.clip),
        warmup_(o.warmup),
        sample_(o.sample),
        dense1d_(o.dense1d),
        vt_(o.vt),
        index_(o.index),
        stale_(o.stale) {}
  std::string method() const override { return "dgc"; }

  Encoded encode(const float* x, const std::vector<int64_t>& shape, Slots& slots, const CodecView& ctx) const override {
    const uint64_t step = slots.step();
    const size_t dim = shape.size();
    const int64_t n = numel_of(shape);
    if (dim == 0 || (dim == 1 && dense1d_)) {
      Encoded e;
      e.format = Format::kDense;
      e.shape = shape;
      e.value_type = ValueType::kF32;
      pack_values(x, static_cast<uint64_t>(n), ValueType::kF32, e.values);
      ++slots.step();
      return e;
    }
    age_state(slots, ctx, stale_, {"u", "v"});
    float* u = slots.slot("u", shape);
    float* v = slots.slot("v", shape);
    const float* g = x;
    std::vector<int64_t> idx;
    if (n > 0) idx = select(g, u, v, n, step, ctx);

    std::vector<float> vals(idx.size());
    for (size_t j = 0; j < idx.size(); ++j) {
      const int64_t i = idx[j];
      vals[j] = v[i];
      u[i] = 0.0f;  // momentum factor masking
      v[i] = 0.0f;
    }
    Encoded e = make_sparse(shape, idx.data(), vals.data(), idx.size(), vt_, 0.0f, index_);
    ++slots.step();
    return e;
  }

 private:
  // Updates u and v in place and returns the ascending indices to send.
  std::vector<int64_t> select(const float* g, float* u, float* v, int64_t n, uint64_t step,
                              const CodecView& ctx) const {
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
  static void fused_update_collect(const float* g_in, float* u_in, float* v_in, int64_t n_in, float m_in, float coef_in,
                                   float thr_in, int64_t offset_in, int64_t stride_in, float* samples_in,
                                   Candidates& out) {
    const int64_t blocks = (n_in + kScanBlock - 1) / kScanBlock;
    std::vector<Candidates> parts(static_cast<size_t>(blocks));
    parallel_for(0, blocks, [&](int64_t b0, int64_t b1) {
      // Locals: the stores below (u, v, the candidates) could otherwise alias
      // the captures and force a reload per element.
      const float* const g = g_in;
      float* const u = u_in;
      float* const v = v_in;
      float* const samples = samples_in;
      const int64_t n = n_in, offset = offset_in, stride = stride_in;
      const float m = m_in, coef = coef_in, thr = thr_in;
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

  double ratio_, momentum_, clip_;
  int64_t warmup_;
  double sample_;
  bool dense1d_;
  ValueType vt_;
  IndexMode index_;
  StalePolicy stale_;
};

}  // namespace

DgcOptions parse_dgc_options(Spec& spec) {
  DgcOptions o;
  o.ratio = spec.get_double("ratio", 0.001);
  SPARROW_CHECK_T(ConfigError, o.ratio > 0.0 && o.ratio <= 1.0, "dgc: ratio=" << o.ratio << " must be in (0, 1]");
  o.momentum = spec.get_double("momentum", 0.0);  // off in FL: see the header comment
  SPARROW_CHECK_T(ConfigError, o.momentum >= 0.0 && o.momentum < 1.0,
                  "dgc: momentum=" << o.momentum << " must be in [0, 1)");
  o.clip = spec.get_double("clip", 0.0);
  SPARROW_CHECK_T(ConfigError, o.clip >= 0.0, "dgc: clip=" << o.clip << " must be >= 0 (0 = off)");
  o.warmup = spec.get_int("warmup", 0);
  SPARROW_CHECK_T(ConfigError, o.warmup >= 0, "dgc: warmup=" << o.warmup << " must be >= 0 steps");
  o.sample = spec.get_double("sample", 0.01);
  SPARROW_CHECK_T(ConfigError, o.sample > 0.0 && o.sample <= 1.0, "dgc: sample=" << o.sample << " must be in (0, 1]");
  o.dense1d = spec.get_bool("dense1d", true);
  o.vt = parse_value_type(spec.get_string("values", "fp32"));
  o.index = parse_index_mode(spec.get_string("index", "auto"));
  o.stale = parse_stale_policy(spec, "dgc");
  return o;
}

std::unique_ptr<Kernel> make_dgc_kernel(const DgcOptions& o) { return std::make_unique<DgcKernel>(o); }

}  // namespace sparrow::compression::detail
