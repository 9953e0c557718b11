// topk, randomk, threshold (compression/sparse.cc) and the selection kernels
// they share with dgc (compression/dgc.h).
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <set>

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

// The k best of |x| under a stable descending sort (ties: lower index first), ascending.
std::vector<int64_t> topk_reference(const at::Tensor& x, int64_t k) {
  at::Tensor order = std::get<1>(at::sort(x.reshape(-1).abs(), /*stable=*/true, /*dim=*/0, /*descending=*/true));
  return to_vec(std::get<0>(at::sort(order.slice(0, 0, k))));
}

int64_t k_of(double ratio, int64_t n) {
  return std::min<int64_t>(n, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(ratio * static_cast<double>(n)))));
}

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / b.norm().item<double>();
}

}  // namespace

TEST_CASE("topk: equals a stable-sort reference, ties included") {
  at::manual_seed(7);
  struct Case {
    const char* what;
    at::Tensor x;
  };
  const std::vector<Case> cases = {
      {"small randn", at::randn({50, 40})},
      {"small ties", at::round(at::randn({3000}) * 2)},
      {"large randn", at::randn({200, 600})},
      {"large ties", at::round(at::randn({300, 400}) * 3)},  // few distinct values, many zeros
      {"all equal", at::ones({20000})},
      {"sparse", at::randn({50000}) * (at::rand({50000}) < 0.01).to(at::kFloat)},
  };
  for (const auto& c : cases) {
    for (double ratio : {1e-4, 0.001, 0.01, 0.1, 0.5, 1.0}) {
      CAPTURE(c.what);
      CAPTURE(ratio);
      auto topk = make_compressor("topk:ratio=" + std::to_string(ratio));
      State s;
      const Encoded e = topk->encode(c.x, s, {});
      const int64_t k = k_of(ratio, c.x.numel());
      REQUIRE(e.count == static_cast<uint64_t>(k));
      const std::vector<int64_t> idx = cd::decode_indices(e);
      CHECK(idx == topk_reference(c.x, k));
      // Values are the input at those indices, exactly.
      const std::vector<float> vals = values_of(e);
      const float* xp = c.x.contiguous().data_ptr<float>();
      bool same = true;
      for (size_t j = 0; j < idx.size(); ++j) same = same && vals[j] == xp[idx[j]];
      CHECK(same);
      CHECK(s.step == 1);
      CHECK(s.tensors.empty());  // no state without ef
    }
  }
}

TEST_CASE("topk: the candidate rescan path when the sample misleads") {
  // The first 65536 elements (exactly the strided sample at n = 100000) are all
  // large, so the sampled threshold catches fewer than k and must be lowered.
  at::manual_seed(3);
  at::Tensor x = at::rand({100000});
  x.slice(0, 0, 65536).add_(10.0);
  for (int64_t k : {int64_t{70000}, int64_t{90000}, int64_t{99999}}) {
    CAPTURE(k);
    CHECK(cd::topk_abs_indices(x.data_ptr<float>(), x.numel(), k) == topk_reference(x, k));
  }
  // All-equal magnitudes with mixed signs: the lowest indices win.
  at::Tensor y = at::ones({40000});
  y.slice(0, 0, 40000, 3).neg_();
  std::vector<int64_t> first(123);
  for (int64_t i = 0; i < 123; ++i) first[static_cast<size_t>(i)] = i;
  CHECK(cd::topk_abs_indices(y.data_ptr<float>(), y.numel(), 123) == first);
}

TEST_CASE("topk: agrees with at::topk on a large tensor and is thread-count independent") {
  at::manual_seed(11);
  at::Tensor x = at::randn({2000000});
  const int64_t k = 2000;
  const std::vector<int64_t> got = cd::topk_abs_indices(x.data_ptr<float>(), x.numel(), k);
  std::vector<int64_t> want = to_vec(std::get<1>(at::topk(x.abs(), k)));
  std::sort(want.begin(), want.end());
  CHECK(got == want);
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  CHECK(cd::topk_abs_indices(x.data_ptr<float>(), x.numel(), k) == got);
  at::set_num_threads(threads);
}

TEST_CASE("topk: NaN input is an error, not undefined behaviour") {
  at::Tensor x = at::full({100}, NAN);
  x[3] = 1.0f;
  State s;
  CHECK_THROWS_AS(make_compressor("topk:ratio=0.1")->encode(x, s, {}), sparrow::Error);
}

TEST_CASE("topk: shapes round trip") {
  at::manual_seed(1);
  auto topk = make_compressor("topk:ratio=0.05");
  for (auto shape : {std::vector<int64_t>{1}, {37}, {12, 9}, {3, 4, 5, 6}, {0, 4}}) {
    CAPTURE(shape.size());
    at::Tensor x = at::randn(shape);
    State s;
    const Encoded e = topk->encode(x, s, {});
    CHECK(e.format == Format::kSparse);
    CHECK(e.shape == shape);
    const at::Tensor y = decode(e);
    REQUIRE(y.sizes() == x.sizes());
    if (x.numel() == 0) {
      CHECK(e.count == 0);
      continue;
    }
    CHECK(e.count == static_cast<uint64_t>(k_of(0.05, x.numel())));
    // Decoded = x on the kept entries, 0 elsewhere, and the kept ones are the largest.
    const at::Tensor kept = y != 0;
    CHECK(at::equal(y.masked_select(kept), x.masked_select(kept)));
    CHECK(kept.sum().item<int64_t>() == static_cast<int64_t>(e.count));
    if (kept.logical_not().any().item<bool>())
      CHECK(x.abs().masked_select(kept).min().item<float>() >=
            x.abs().masked_select(kept.logical_not()).max().item<float>());
  }
  // Non-contiguous input is accepted.
  at::Tensor x = at::randn({30, 20}).t();
  State s;
  const at::Tensor y = decode(topk->encode(x, s, {}));
  CHECK(at::equal(y.masked_select(y != 0), x.masked_select(y != 0)));
}

TEST_CASE("topk: fp16 values") {
  at::manual_seed(2);
  at::Tensor x = at::randn({100, 50});
  State s;
  const Encoded e = make_compressor("topk:ratio=0.02,values=fp16")->encode(x, s, {});
  CHECK(e.value_type == ValueType::kF16);
  CHECK(e.values.size() == 2 * e.count);
  const at::Tensor y = decode(e);
  const at::Tensor kept = y != 0;
  CHECK(kept.sum().item<int64_t>() == 100);
  const at::Tensor xs = x.masked_select(kept), ys = y.masked_select(kept);
  CHECK(((ys - xs).abs() - xs.abs() * 1e-3).max().item<float>() <= 0.0f);
  CHECK(at::equal(ys, xs.to(at::kHalf).to(at::kFloat)));
}

TEST_CASE("topk: error feedback makes the mean of decoded updates converge to the input") {
  at::manual_seed(4);
  const at::Tensor x = at::randn({2000});
  for (const char* spec : {"topk:ratio=0.02,ef=1", "topk:ratio=0.02,ef=1,values=fp16"}) {
    CAPTURE(spec);
    auto c = make_compressor(spec);
    State s;
    at::Tensor sum = at::zeros_like(x);
    std::vector<double> errs;
    for (int step = 1; step <= 1000; ++step) {
      const at::Tensor before = s.has("residual") ? s.tensors.at("residual").clone() : at::zeros_like(x);
      const Encoded e = c->encode(x, s, {});
      const at::Tensor d = decode(e);
      // residual = (x + previous residual) - decode, the error-feedback definition.
      CHECK(at::equal(s.tensors.at("residual"), (x + before) - d));
      sum += d;
      if (step == 25 || step == 200 || step == 1000) errs.push_back(rel_err(sum / step, x));
    }
    CHECK(errs[0] > errs[1]);
    CHECK(errs[1] > errs[2]);
    CHECK(errs[2] < 0.03);  // |mean - x| = |residual| / steps, and the residual stays bounded
  }
  // Without error feedback the mean stays the (biased) top-k of x.
  auto plain = make_compressor("topk:ratio=0.02");
  State s;
  at::Tensor sum = at::zeros_like(x);
  for (int step = 0; step < 50; ++step) sum += decode(plain->encode(x, s, {}));
  CHECK(rel_err(sum / 50, x) > 0.5);
}

TEST_CASE("topk: configuration errors") {
  CHECK_THROWS_AS(make_compressor("topk:ratio=0"), ConfigError);
  CHECK_THROWS_AS(make_compressor("topk:ratio=1.5"), ConfigError);
  CHECK_THROWS_AS(make_compressor("topk:ratio=-0.1"), ConfigError);
  CHECK_THROWS_AS(make_compressor("topk:ratio=0.1,foo=1"), ConfigError);
  CHECK_THROWS_AS(make_compressor("topk:ratio=0.1,values=int4"), ConfigError);
  CHECK_THROWS_AS(make_compressor("topk:ratio=0.1,values=sign"), ConfigError);  // sign values are stc's
  CHECK_THROWS_AS(make_compressor("topk:ratio=0.1,index=golomb"), ConfigError);
  CHECK_THROWS_AS(make_compressor("topk:ratio=0.1,ef=2"), ConfigError);
  CHECK_NOTHROW(make_compressor("topk"));  // ratio defaults to 0.01
  CHECK_NOTHROW(make_compressor("topk:ratio=1,ef=1,values=fp16"));
}

TEST_CASE("randomk: unbiased over seeds") {
  at::manual_seed(5);
  const at::Tensor x = at::randn({40});
  auto c = make_compressor("randomk:ratio=0.1");  // k = 4, scale 10
  const int seeds = 6000;
  at::Tensor sum = at::zeros_like(x);
  Context ctx;
  ctx.name = "layer.weight";
  for (int seed = 0; seed < seeds; ++seed) {
    ctx.seed = static_cast<uint64_t>(seed);
    State s;
    const Encoded e = c->encode(x, s, ctx);
    REQUIRE(e.count == 4);
    sum += decode(e);
  }
  const at::Tensor mean = sum / seeds;
  // Per element the estimate has standard deviation |x|·sqrt((n/k - 1)/seeds) ≈ 0.039|x|.
  const at::Tensor z = (mean - x).abs() / (x.abs() * std::sqrt(9.0 / seeds) + 1e-6);
  CHECK(z.max().item<float>() < 4.5f);
  CHECK(rel_err(mean, x) < 0.08);
}

TEST_CASE("randomk: the wire has no index bytes and the parties agree") {
  at::manual_seed(6);
  const at::Tensor x = at::randn({64, 32});
  auto c = make_compressor("randomk:ratio=0.05");
  Context a;
  a.seed = 42;
  a.name = "fc.weight";
  State sa, sb;
  const Encoded e1 = c->encode(x, sa, a);
  CHECK(e1.index_coding == IndexCoding::kSeeded);
  CHECK(e1.indices.empty());
  CHECK(e1.count == 103);  // ceil(0.05 · 2048)
  CHECK(e1.seed == cd::step_key(a, 0));
  CHECK(e1.payload_bytes() == 4 * e1.count);
  // Values are x at the drawn indices, scaled by n/k.
  const std::vector<int64_t> idx = cd::decode_indices(e1);
  CHECK(idx == cd::seeded_indices(cd::step_key(a, 0), 103, 2048));
  const std::vector<float> vals = values_of(e1);
  const float scale = static_cast<float>(2048.0 / 103.0);
  bool scaled = true;
  for (size_t j = 0; j < idx.size(); ++j) scaled = scaled && vals[j] == x.reshape(-1)[idx[j]].item<float>() * scale;
  CHECK(scaled);

  // Another party with the same (seed, name, step) draws the same indices, from
  // a different tensor; a different name or step draws different ones.
  const Encoded e2 = c->encode(at::randn({64, 32}), sb, a);
  CHECK(cd::decode_indices(e2) == idx);
  const Encoded next = c->encode(x, sa, a);
  CHECK(cd::decode_indices(next) != idx);
  Context other = a;
  other.name = "fc.bias";
  State sc;
  CHECK(cd::decode_indices(c->encode(x, sc, other)) != idx);
}

TEST_CASE("randomk: error feedback keeps x_c - decode") {
  at::manual_seed(8);
  const at::Tensor x = at::randn({500});
  auto c = make_compressor("randomk:ratio=0.1,ef=1");
  State s;
  Context ctx;
  ctx.name = "w";
  at::Tensor residual = at::zeros_like(x);
  for (int step = 0; step < 5; ++step) {
    const at::Tensor comp = x + residual;
    const Encoded e = c->encode(x, s, ctx);
    residual = comp - decode(e);
    CHECK(at::equal(s.tensors.at("residual"), residual));
  }
  // Error feedback converges (values unscaled, so the compressor is contractive):
  // the mean of the decodes approaches x and the residual stays bounded.
  State s2;
  at::Tensor sum = at::zeros_like(x);
  const int steps = 400;
  for (int step = 0; step < steps; ++step) sum += decode(c->encode(x, s2, ctx));
  CHECK(((sum / steps - x).norm() / x.norm()).item<double>() < 0.05);
  CHECK((s2.tensors.at("residual").norm() / x.norm()).item<double>() < 15.0);
  CHECK_THROWS_AS(make_compressor("randomk:ratio=2"), ConfigError);
  CHECK_THROWS_AS(make_compressor("randomk:ratio=0.1,values=fp16"), ConfigError);
}

TEST_CASE("threshold: sends ±tau where |residual| >= tau, residual bookkeeping exact") {
  at::manual_seed(9);
  const float tau = 0.75f;
  auto c = make_compressor("threshold:tau=0.75");  // ef defaults to 1
  State s;
  at::Tensor r = at::zeros({40, 25});
  for (int step = 0; step < 8; ++step) {
    const at::Tensor g = at::randn({40, 25}) * 0.6;
    const Encoded e = c->encode(g, s, {});
    CHECK(e.value_type == ValueType::kSign);
    CHECK(e.scales == std::vector<float>{tau});
    CHECK(e.values.size() == (e.count + 7) / 8);
    // Transcription of Strom (2015): r += g; send sign(r)·tau where |r| >= tau; r -= sent.
    r += g;
    const at::Tensor mask = r.abs() >= tau;
    const at::Tensor sent = at::where(mask, at::where(r < 0, -tau, tau), at::zeros_like(r));
    r -= sent;
    const at::Tensor d = decode(e);
    CHECK(at::equal(d, sent));
    CHECK(static_cast<int64_t>(e.count) == mask.sum().item<int64_t>());
    CHECK(at::equal(s.tensors.at("residual"), r));
    const at::Tensor nz = d.masked_select(d != 0).abs();
    CHECK(at::equal(nz, at::full_like(nz, tau)));
  }
  CHECK(s.step == 8);
}

TEST_CASE("threshold: EF mean converges, ef=0 is a stateless quantiser") {
  at::manual_seed(10);
  // |x| < tau everywhere, so the residual stays bounded and mean(decoded) -> x.
  const at::Tensor x = at::rand({1000}) * 2 - 1;
  auto c = make_compressor("threshold:tau=1.5");
  State s;
  at::Tensor sum = at::zeros_like(x);
  std::vector<double> errs;
  for (int step = 1; step <= 800; ++step) {
    sum += decode(c->encode(x, s, {}));
    if (step == 50 || step == 200 || step == 800) errs.push_back(rel_err(sum / step, x));
  }
  CHECK(errs[0] > errs[1]);
  CHECK(errs[1] > errs[2]);
  CHECK(errs[2] < 0.01);

  auto q = make_compressor("threshold:tau=0.5,ef=0");
  State s0;
  const at::Tensor y = at::randn({300});
  const at::Tensor d = decode(q->encode(y, s0, {}));
  CHECK(at::equal(d, at::where(y.abs() >= 0.5f, at::where(y < 0, -0.5f, 0.5f), at::zeros_like(y))));
  CHECK(s0.tensors.empty());
  // Nothing above tau: an empty update.
  State s1;
  CHECK(q->encode(at::zeros({10, 10}), s1, {}).count == 0);
}

TEST_CASE("threshold: configuration errors") {
  CHECK_THROWS_AS(make_compressor("threshold"), ConfigError);
  CHECK_THROWS_AS(make_compressor("threshold:tau=0"), ConfigError);
  CHECK_THROWS_AS(make_compressor("threshold:tau=-1"), ConfigError);
  CHECK_THROWS_AS(make_compressor("threshold:tau=1e-300"), ConfigError);  // 0 as float32
  CHECK_THROWS_AS(make_compressor("threshold:tau=1,ratio=0.1"), ConfigError);
}

TEST_CASE("sparse: selection kernels") {
  // kth_largest: the minimum of the top r, NaNs ignored, both selection strategies.
  std::vector<float> s = {3, 1, NAN, 7, 5, 5};
  CHECK(cd::kth_largest(s, 1) == 7.0f);
  s = {3, 1, NAN, 7, 5, 5};
  CHECK(cd::kth_largest(s, 3) == 5.0f);
  s = {3, 1, NAN, 7, 5, 5};
  CHECK(cd::kth_largest(s, 9) == 1.0f);
  std::vector<float> big(10000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>((i * 7919) % 10000);
  std::vector<float> copy = big;
  CHECK(cd::kth_largest(copy, 17) == 9983.0f);  // heap path
  copy = big;
  CHECK(cd::kth_largest(copy, 5000) == 5000.0f);  // nth_element path
  // collect_abs_ge across several scan blocks, ascending, NaN excluded.
  at::Tensor a = at::randn({3 * cd::kScanBlock + 17});
  a[5] = NAN;
  std::vector<int64_t> got;
  cd::collect_abs_ge(a.data_ptr<float>(), a.numel(), 1.5f, got);
  CHECK(got == to_vec(at::nonzero(a.abs() >= 1.5f).view(-1)));
  // keep_topk keeps the best k, ascending.
  std::vector<int64_t> cand = got;
  cd::keep_topk(a.data_ptr<float>(), cand, 10);
  CHECK(cand == topk_reference(at::nan_to_num(a, 0.0), 10));
}
