// Deep Gradient Compression (compression/dgc.cc). The central test runs the codec
// side by side with a transcription of the reference algorithm written here in
// plain ATen ops and requires identical indices, values and u/v state.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>
#include <cstring>

#include "compression/codec_util.h"
#include "compression/compressor.h"
#include "compression/dgc.h"
#include "core/error.h"
#include "tests/compression/sparse_util.h"

using namespace sparrow::compression;
using sparrow::ConfigError;
namespace cd = sparrow::compression::detail;
using sparrow::compression::test::to_vec;
using sparrow::compression::test::values_of;

namespace {

// The paper's warm-up, written out: density x1/4 per quarter of the warm-up.
double expected_density(uint64_t t, int64_t warmup, double ratio) {
  if (t >= static_cast<uint64_t>(warmup)) return ratio;
  const double quarter = static_cast<double>(warmup) / 4.0;
  const int phase = static_cast<int>(std::floor(static_cast<double>(t) / quarter));
  return std::max(std::pow(0.25, phase + 1), ratio);
}

// DGCCompressor.initialize, transcribed from the Python (math.ceil on doubles).
cd::DgcSamplePlan reference_plan(int64_t numel, double density, double sample_ratio) {
  cd::DgcSamplePlan p;
  const int64_t pct = static_cast<int64_t>(std::ceil(static_cast<double>(numel) * sample_ratio));
  const int64_t cpr = static_cast<int64_t>(std::ceil(2 / density));
  if (numel <= cpr) {
    p.stride = 1;
    p.num_samples = numel;
  } else {
    p.stride = static_cast<int64_t>(std::ceil(static_cast<double>(numel) / std::max(pct, cpr) / 32)) * 32 + 1;
    p.num_samples = numel / p.stride;
    while (p.num_samples < std::max(pct, cpr)) {
      p.stride = p.stride - 8;
      p.num_samples = numel / p.stride;
    }
  }
  p.top_k_samples = static_cast<int64_t>(std::ceil(p.num_samples * density));
  p.k = static_cast<int64_t>(std::ceil(numel * density));
  return p;
}

// One worker's DGC (DGCSGDMemory + DGCCompressor._sparsify + memory.update),
// written with ATen ops the way the reference code does it.
struct ReferenceDgc {
  double ratio = 0.001, momentum = 0.0, clip = 0.0, sample = 0.01;  // the codec's defaults
  int64_t warmup = 0;
  at::Tensor u, v;  // flat
  uint64_t step = 0;
  // How often each branch of the adaptation loop ran.
  int exact = 0, resampled = 0, lowered = 0, truncated = 0;

  // Returns (ascending indices, values).
  std::pair<std::vector<int64_t>, std::vector<float>> encode(const at::Tensor& grad, const Context& ctx) {
    at::Tensor g = grad.reshape(-1).clone();
    const int64_t n = g.numel();
    if (!u.defined()) {
      u = at::zeros({n});
      v = at::zeros({n});
    }
    const double density = expected_density(step, warmup, ratio);
    REQUIRE(cd::dgc_density(step, warmup, ratio) == density);
    const cd::DgcSamplePlan plan = reference_plan(n, density, sample);
    const cd::DgcSamplePlan mine = cd::dgc_sample_plan(n, density, sample);
    REQUIRE(mine.stride == plan.stride);
    REQUIRE(mine.num_samples == plan.num_samples);
    REQUIRE(mine.top_k_samples == plan.top_k_samples);
    REQUIRE(mine.k == plan.k);

    // Local gradient clipping (torch clip_grad_norm_ at C·N^-1/2).
    if (clip > 0) {
      const double norm = g.to(at::kDouble).norm().item<double>();
      const double coef = clip / std::sqrt(static_cast<double>(ctx.num_workers)) / (norm + 1e-6);
      if (coef < 1) g = g * static_cast<float>(coef);
    }
    // Momentum correction: mmt.mul_(m).add_(grad); vec.add_(mmt).
    u.mul_(momentum).add_(g);
    v.add_(u);

    const at::Tensor importance = v.abs();
    at::Tensor samples = importance;
    if (n != plan.num_samples) {
      const int64_t start = cd::dgc_sample_offset(cd::step_key(ctx, step), plan.stride);
      samples = importance.slice(0, start, n, plan.stride);
    }
    float threshold = std::get<0>(at::topk(samples, plan.top_k_samples)).min().item<float>();
    at::Tensor indices = at::nonzero(importance >= threshold).view(-1);
    const int64_t k = plan.k;
    if (n > plan.num_samples) {
      for (int it = 0; it < 10; ++it) {
        const int64_t count = indices.numel();
        if (count > k) {
          if (count > k * 1.3) {
            // torch.topk(importance[indices], k); ties go to the lower index.
            const at::Tensor order = std::get<1>(at::sort(importance.index_select(0, indices), true, 0, true));
            indices = std::get<0>(at::sort(indices.index_select(0, order.slice(0, 0, k))));
            ++resampled;
          } else {
            ++truncated;
          }
          break;
        } else if (count < 0.8 * k) {
          threshold = threshold * 0.8f;
          ++lowered;
        } else {
          break;
        }
        indices = at::nonzero(importance >= threshold).view(-1);
      }
    } else {
      ++exact;
    }
    indices = indices.slice(0, 0, k);
    const at::Tensor values = v.index_select(0, indices);
    u.index_fill_(0, indices, 0);  // momentum factor masking
    v.index_fill_(0, indices, 0);
    ++step;
    at::Tensor vc = values.contiguous();
    return {to_vec(indices), std::vector<float>(vc.data_ptr<float>(), vc.data_ptr<float>() + vc.numel())};
  }
};

void check_side_by_side(const std::string& spec, ReferenceDgc ref, std::vector<int64_t> shape, int steps, Context ctx,
                        ReferenceDgc* stats = nullptr) {
  auto dgc = make_compressor(spec);
  State state;
  for (int t = 0; t < steps; ++t) {
    CAPTURE(spec);
    CAPTURE(t);
    const at::Tensor g = at::randn(shape) * (1.0 + t % 3);
    const Encoded e = dgc->encode(g, state, ctx);
    const auto [idx, vals] = ref.encode(g, ctx);
    REQUIRE(e.format == Format::kSparse);
    CHECK(e.shape == shape);
    CHECK(cd::decode_indices(e) == idx);
    CHECK(values_of(e) == vals);
    CHECK(at::equal(state.tensors.at("u").reshape(-1), ref.u));
    CHECK(at::equal(state.tensors.at("v").reshape(-1), ref.v));
    CHECK(state.step == static_cast<uint64_t>(t + 1));
  }
  if (stats) {
    stats->exact += ref.exact;
    stats->resampled += ref.resampled;
    stats->lowered += ref.lowered;
    stats->truncated += ref.truncated;
  }
}

}  // namespace

TEST_CASE("dgc: warm-up densities") {
  const double want[] = {0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.00390625, 0.00390625, 0.001, 0.001};
  for (uint64_t t = 0; t < 10; ++t) CHECK(cd::dgc_density(t, 8, 0.001) == want[t]);
  CHECK(cd::dgc_density(0, 0, 0.001) == 0.001);  // no warm-up
  CHECK(cd::dgc_density(0, 8, 0.5) == 0.5);      // never sparser than the target
  CHECK(cd::dgc_density(399, 400, 0.001) == 0.00390625);
  CHECK(cd::dgc_density(100, 400, 0.001) == 0.0625);
  // The codec sends ceil(n·density) during warm-up: exactly that many when the
  // plan is exact, otherwise within the adaptation loop's bounds [0.8k, k].
  auto dgc = make_compressor("dgc:warmup=8");
  State s;
  const int64_t n = 400;  // 20 x 20
  for (int t = 0; t < 10; ++t) {
    CAPTURE(t);
    const Encoded e = dgc->encode(at::randn({20, 20}), s, {});
    const auto plan = cd::dgc_sample_plan(n, want[t], 0.01);
    CHECK(plan.k == static_cast<int64_t>(std::ceil(n * want[t])));
    CHECK(e.count <= static_cast<uint64_t>(plan.k));
    CHECK(e.count >= static_cast<uint64_t>(std::ceil(0.8 * static_cast<double>(plan.k))));
    if (plan.exact()) CHECK(e.count == static_cast<uint64_t>(plan.k));
  }
}

TEST_CASE("dgc: sampling plan matches the reference formula") {
  struct Row {
    int64_t n;
    double density;
    int64_t stride, num_samples, top_k_samples, k;
  };
  // Values computed with the reference's Python.
  const Row rows[] = {
      {25000000, 0.001, 97, 257731, 258, 25000}, {3200, 0.25, 97, 32, 8, 800},
      {3200, 0.015625, 25, 128, 2, 50},          {3200, 0.001, 1, 3200, 4, 4},
      {2100, 0.015625, 9, 233, 4, 33},           {2000000, 0.01, 97, 20618, 207, 20000},
      {100000, 0.001, 49, 2040, 3, 100},
  };
  for (const Row& r : rows) {
    CAPTURE(r.n);
    CAPTURE(r.density);
    const auto p = cd::dgc_sample_plan(r.n, r.density, 0.01);
    CHECK(p.stride == r.stride);
    CHECK(p.num_samples == r.num_samples);
    CHECK(p.top_k_samples == r.top_k_samples);
    CHECK(p.k == r.k);
  }
  for (int64_t stride : {1, 9, 97}) {
    const int64_t off = cd::dgc_sample_offset(12345, stride);
    CHECK(off >= 0);
    CHECK(off < stride);
  }
}

TEST_CASE("dgc: identical to a transcription of the reference algorithm") {
  at::manual_seed(2018);
  Context ctx;
  ctx.seed = 99;
  ctx.name = "conv.weight";
  ReferenceDgc stats;
  {
    ReferenceDgc ref;  // defaults, with warm-up
    ref.warmup = 8;
    check_side_by_side("dgc:warmup=8", ref, {64, 50}, 12, ctx, &stats);
    check_side_by_side("dgc:warmup=8", ref, {300, 7}, 12, ctx, &stats);
  }
  {
    ReferenceDgc ref;  // clipping, other momentum, ratio and sample ratio
    ref.ratio = 0.01;
    ref.momentum = 0.7;
    ref.clip = 2.0;
    ref.warmup = 8;
    ref.sample = 0.05;
    Context four = ctx;
    four.num_workers = 4;
    const std::string spec = "dgc:ratio=0.01,momentum=0.7,clip=2,warmup=8,sample=0.05";
    check_side_by_side(spec, ref, {64, 50}, 12, four, &stats);
    check_side_by_side(spec, ref, {300, 7}, 12, four, &stats);
    check_side_by_side(spec, ref, {2, 3, 10, 10}, 12, four, &stats);
  }
  {
    ReferenceDgc ref;  // a larger tensor: several scan blocks, steady state, the paper's momentum
    ref.ratio = 0.01;
    ref.warmup = 2;
    ref.momentum = 0.9;
    check_side_by_side("dgc:ratio=0.01,momentum=0.9,warmup=2", ref, {400, 500}, 6, ctx, &stats);
  }
  // Every branch of the reference's adaptation loop ran at least once.
  INFO("exact " << stats.exact << " resampled " << stats.resampled << " lowered " << stats.lowered << " truncated "
                << stats.truncated);
  CHECK(stats.exact > 0);
  CHECK(stats.resampled > 0);
  CHECK(stats.lowered > 0);
  CHECK(stats.truncated > 0);
}

TEST_CASE("dgc: adversarial samples: provisional-threshold rescan and the 10-iteration limit") {
  // n = 2e6 at density 0.01: 20618 samples at stride 97, so the codec's
  // provisional threshold comes from every 2nd sample. Making exactly those
  // samples huge (and distinct) puts it above the real threshold, which forces
  // the rescan path; the rest of the tensor is small, so the adaptation loop
  // lowers the threshold all 10 times and still sends fewer than 0.8k.
  Context ctx;
  ctx.seed = 5;
  ctx.name = "big";
  const int64_t n = 2000000;
  const auto plan = cd::dgc_sample_plan(n, 0.01, 0.01);
  REQUIRE(plan.stride == 97);
  const int64_t off = cd::dgc_sample_offset(cd::step_key(ctx, 0), plan.stride);
  at::manual_seed(17);
  at::Tensor g = at::randn({n}) * 0.01;
  float* gp = g.data_ptr<float>();
  for (int64_t j = 0; off + j * plan.stride < n; j += 2)
    gp[off + j * plan.stride] = 100.0f + 1e-3f * static_cast<float>(j);
  const at::Tensor g2 = g.reshape({2000, 1000});
  ReferenceDgc ref;
  ref.ratio = 0.01;
  auto dgc = make_compressor("dgc:ratio=0.01");
  State s;
  const Encoded e = dgc->encode(g2, s, ctx);
  const auto [idx, vals] = ref.encode(g2, ctx);
  CHECK(ref.lowered == 10);
  CHECK(cd::decode_indices(e) == idx);
  CHECK(values_of(e) == vals);
  CHECK(at::equal(s.tensors.at("v").reshape(-1), ref.v));
  CHECK(e.count < static_cast<uint64_t>(0.8 * static_cast<double>(plan.k)));
}

TEST_CASE("dgc: one step at default settings sends k = ceil(ratio*n)") {
  at::manual_seed(3);
  auto dgc = make_compressor("dgc");
  int exactly_k = 0;
  for (int trial = 0; trial < 8; ++trial) {
    const at::Tensor g = at::randn({1000, 100});  // k = 100, 2040 samples at stride 49
    State s;
    Context ctx;
    ctx.seed = static_cast<uint64_t>(trial);
    const Encoded e = dgc->encode(g, s, ctx);
    CHECK(e.count <= 100);
    CHECK(e.count >= 80);  // the adaptation loop's lower bound 0.8k
    exactly_k += e.count == 100;
    // What was sent is the largest |g| (u = g, v = g on the first step): every
    // unsent element is at most the smallest sent magnitude unless idx[:k] cut.
    const at::Tensor d = decode(e);
    CHECK(at::equal(d + s.tensors.at("v"), g));
    CHECK(at::equal(s.tensors.at("u"), at::where(d != 0, at::zeros_like(g), g)));
  }
  CHECK(exactly_k > 0);
  // Exactly k when at least k pass: with equal magnitudes everything passes,
  // the resample keeps k, ties going to the lowest indices.
  State s;
  const Encoded e = dgc->encode(at::ones({1000, 100}), s, {});
  CHECK(e.count == 100);
  const std::vector<int64_t> idx = cd::decode_indices(e);
  CHECK(idx.front() == 0);
  CHECK(idx.back() == 99);
}

TEST_CASE("dgc: 1-D tensors go dense and untouched") {
  auto dgc = make_compressor("dgc:clip=0.1,warmup=4,values=fp16");
  State s;
  const at::Tensor b = at::randn({17}) * 10;
  const Encoded e = dgc->encode(b, s, {});
  CHECK(e.format == Format::kDense);
  CHECK(e.value_type == ValueType::kF32);
  CHECK(at::equal(decode(e), b));
  CHECK(s.tensors.empty());
  CHECK(s.step == 1);
  const at::Tensor scalar = at::scalar_tensor(3.5);
  CHECK(at::equal(decode(dgc->encode(scalar, s, {})), scalar));
  // An empty 2-D tensor is an empty sparse update.
  State s2;
  const Encoded empty = dgc->encode(at::zeros({0, 5}), s2, {});
  CHECK(empty.format == Format::kSparse);
  CHECK(empty.count == 0);
}

TEST_CASE("dgc: dense1d=0 compresses 1-D tensors like the others") {
  at::manual_seed(2019);
  Context ctx;
  ctx.seed = 3;
  ctx.name = "fc1.bias";
  {
    ReferenceDgc ref;  // small 1-D tensors: the exact path (n <= ceil(2/density))
    ref.momentum = 0.5;
    check_side_by_side("dgc:momentum=0.5,dense1d=0", ref, {200}, 6, ctx);
  }
  {
    ReferenceDgc ref;  // a long 1-D tensor: sampled threshold and adaptation loop
    ref.ratio = 0.01;
    ref.warmup = 4;
    check_side_by_side("dgc:ratio=0.01,warmup=4,dense1d=0", ref, {50000}, 6, ctx);
  }
  // k = ceil(ratio·n) = 1 on a 10-element bias: the largest |g| is sent.
  auto dgc = make_compressor("dgc:momentum=0,dense1d=0");
  State s;
  const at::Tensor b = at::arange(10, at::kFloat) - 6.5f;  // |b| largest at index 0
  const Encoded e = dgc->encode(b, s, ctx);
  CHECK(e.format == Format::kSparse);
  CHECK(e.count == 1);
  CHECK(cd::decode_indices(e) == std::vector<int64_t>{0});
  CHECK(at::equal(decode(e) + s.tensors.at("v"), b));
  // A 0-d scalar still goes dense, and dense1d=1 is the default.
  const at::Tensor scalar = at::scalar_tensor(2.5);
  CHECK(dgc->encode(scalar, s, ctx).format == Format::kDense);
  State s2;
  CHECK(make_compressor("dgc")->encode(b, s2, ctx).format == Format::kDense);
  CHECK(make_compressor("dgc:dense1d=1")->encode(b, s2, ctx).format == Format::kDense);
}

TEST_CASE("dgc: local gradient clipping bounds the norm at clip / sqrt(N)") {
  at::manual_seed(4);
  // momentum 0: after one step decode + v == the clipped gradient.
  auto dgc = make_compressor("dgc:momentum=0,clip=1,ratio=0.01");
  for (int workers : {1, 4, 16}) {
    CAPTURE(workers);
    Context ctx;
    ctx.num_workers = workers;
    State s;
    const at::Tensor g = at::randn({50, 40}) * 3;
    const at::Tensor sent = decode(dgc->encode(g, s, ctx));
    const at::Tensor clipped = sent + s.tensors.at("v");
    const double bound = 1.0 / std::sqrt(static_cast<double>(workers));
    CHECK(clipped.norm().item<double>() <= bound * (1 + 1e-6));
    CHECK(clipped.norm().item<double>() >= bound * (1 - 1e-5));
    CHECK(at::allclose(clipped, g * (clipped.norm() / g.norm()), 1e-5, 1e-7));
  }
  // Below the bound nothing changes.
  State s;
  const at::Tensor small = at::randn({50, 40}) * 1e-3;
  const at::Tensor sent = decode(dgc->encode(small, s, {}));
  CHECK(at::equal(sent + s.tensors.at("v"), small));
}

TEST_CASE("dgc: state survives serialize/deserialize mid-stream") {
  at::manual_seed(5);
  auto dgc = make_compressor("dgc:ratio=0.01,warmup=6");
  Context ctx;
  ctx.name = "layer";
  State original;
  for (int t = 0; t < 4; ++t) dgc->encode(at::randn({120, 80}), original, ctx);
  State copy = State::deserialize(original.serialize());
  CHECK(copy.step == 4);
  for (int t = 0; t < 6; ++t) {
    CAPTURE(t);
    const at::Tensor g = at::randn({120, 80});
    const Encoded a = dgc->encode(g, original, ctx);
    const Encoded b = dgc->encode(g, copy, ctx);
    CHECK(a.indices == b.indices);
    CHECK(a.values == b.values);
    CHECK(a.count == b.count);
  }
  CHECK(at::equal(original.tensors.at("u"), copy.tensors.at("u")));
  CHECK(at::equal(original.tensors.at("v"), copy.tensors.at("v")));
}

TEST_CASE("dgc: results do not depend on the thread count") {
  at::manual_seed(6);
  const at::Tensor g = at::randn({300, 500});
  auto dgc = make_compressor("dgc:ratio=0.001,clip=5");
  const int threads = at::get_num_threads();
  Encoded e[2];
  State s[2];
  for (int i = 0; i < 2; ++i) {
    at::set_num_threads(i + 1);
    for (int t = 0; t < 3; ++t) e[i] = dgc->encode(g, s[i], {});
  }
  at::set_num_threads(threads);
  CHECK(e[0].indices == e[1].indices);
  CHECK(e[0].values == e[1].values);
  CHECK(at::equal(s[0].tensors.at("v"), s[1].tensors.at("v")));
}

TEST_CASE("dgc: fp16 values") {
  at::manual_seed(7);
  const at::Tensor g = at::randn({100, 100});
  State a, b;
  const Encoded e32 = make_compressor("dgc:ratio=0.01")->encode(g, a, {});
  const Encoded e16 = make_compressor("dgc:ratio=0.01,values=fp16")->encode(g, b, {});
  CHECK(e16.value_type == ValueType::kF16);
  CHECK(e16.indices == e32.indices);
  CHECK(at::equal(decode(e16), decode(e32).to(at::kHalf).to(at::kFloat)));
}

TEST_CASE("dgc: configuration errors") {
  CHECK_THROWS_AS(make_compressor("dgc:foo=1"), ConfigError);
  CHECK_THROWS_AS(make_compressor("dgc:ratio=0"), ConfigError);
  CHECK_THROWS_AS(make_compressor("dgc:ratio=1.5"), ConfigError);
  CHECK_THROWS_AS(make_compressor("dgc:ratio=-0.001"), ConfigError);
  CHECK_THROWS_AS(make_compressor("dgc:momentum=1"), ConfigError);
  CHECK_THROWS_AS(make_compressor("dgc:clip=-1"), ConfigError);
  CHECK_THROWS_AS(make_compressor("dgc:warmup=-2"), ConfigError);
  CHECK_THROWS_AS(make_compressor("dgc:warmup=1.5"), ConfigError);
  CHECK_THROWS_AS(make_compressor("dgc:sample=0"), ConfigError);
  CHECK_THROWS_AS(make_compressor("dgc:sample=2"), ConfigError);
  CHECK_THROWS_AS(make_compressor("dgc:values=int4"), ConfigError);
  CHECK_THROWS_AS(make_compressor("dgc:dense1d=2"), ConfigError);
  CHECK_THROWS_AS(make_compressor("dgc:dense1d=yes please"), ConfigError);
  CHECK_NOTHROW(make_compressor("dgc"));
  CHECK_NOTHROW(make_compressor("dgc:ratio=1,momentum=0,clip=0.5,warmup=10,sample=1,dense1d=0,values=fp16"));
}

TEST_SUITE("slow") {
  TEST_CASE("dgc: speed on 25M elements against topk and memcpy") {
    using clk = std::chrono::steady_clock;
    auto best_ms = [](int reps, auto&& f) {
      double best = 1e30;
      for (int r = 0; r < reps; ++r) {
        const auto t0 = clk::now();
        f();
        best = std::min(best, std::chrono::duration<double, std::milli>(clk::now() - t0).count());
      }
      return best;
    };
    at::manual_seed(8);
    const int64_t n = 25000000;
    const at::Tensor g = at::randn({5000, 5000});
    at::Tensor dst = at::empty({n});
    auto dgc = make_compressor("dgc");
    State s;
    Encoded e = dgc->encode(g, s, {});  // allocates u and v
    const double memcpy_ms =
        best_ms(5, [&] { std::memcpy(dst.data_ptr<float>(), g.data_ptr<float>(), static_cast<size_t>(n) * 4); });
    const double dgc_ms = best_ms(8, [&] { e = dgc->encode(g, s, {}); });
    const double topk_ms = best_ms(2, [&] { (void)at::topk(g.reshape(-1).abs(), 25000); });
    auto topk = make_compressor("topk:ratio=0.001");
    State st;
    const double topk_codec_ms = best_ms(3, [&] { (void)topk->encode(g, st, {}); });
    MESSAGE("25M fp32: memcpy " << memcpy_ms << " ms, dgc encode " << dgc_ms << " ms, topk codec " << topk_codec_ms
                                << " ms, at::topk(x.abs(), 25000) " << topk_ms << " ms; dgc is " << topk_ms / dgc_ms
                                << "x faster than at::topk and " << dgc_ms / memcpy_ms << "x a memcpy");
    CHECK(e.count <= 25000);
    CHECK(e.count >= 20000);
    // Loose bounds (the target is 20x and 10x); a shared machine is noisy.
    CHECK(dgc_ms * 8 < topk_ms);
    CHECK(dgc_ms < 15 * memcpy_ms);
    CHECK(topk_codec_ms * 8 < topk_ms);
  }
}

TEST_CASE("dgc: warm-up follows the global round when the context gives one") {
  at::manual_seed(21);
  const at::Tensor g = at::randn({100, 40});
  auto c = make_compressor("dgc:ratio=0.001,warmup=8,momentum=0");
  // A client first selected in round 7 is in the last warm-up phase (0.39%),
  // not the first (25%) as its own step count 0 would say; from round 8 on: ratio.
  for (int64_t round : {0, 2, 7, 8, 50}) {
    CAPTURE(round);
    State s;
    Context ctx;
    ctx.name = "w";
    ctx.round = round;
    const Encoded e = c->encode(g, s, ctx);
    const double density = cd::dgc_density(static_cast<uint64_t>(round), 8, 0.001);
    CHECK(e.count <= static_cast<uint64_t>(std::ceil(4000 * density)));
    CHECK(e.count >= static_cast<uint64_t>(std::floor(0.8 * std::ceil(4000 * density))));
  }
  // Without a round, the tensor's own steps drive it (the data-parallel case).
  State s;
  const uint64_t sent = c->encode(g, s, {}).count;  // step 0: 25% of 4000 (within the 0.8k..k bounds)
  CHECK(sent <= 1000);
  CHECK(sent >= 800);
}
