#include "tests/sparrow_test.h"
// PowerSGD and ACP-SGD: codec round trips, convergence of the power iteration,
// zero-column guards, error feedback, the ACP aggregator API.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "compression/codec_util.h"
#include "compression/compressor.h"
#include "compression/lowrank.h"
#include "core/error.h"

using namespace sparrow::compression;

namespace {

Context named(const std::string& name, uint64_t seed = 7) {
  Context ctx;
  ctx.name = name;
  ctx.seed = seed;
  return ctx;
}

// n × m with singular values decay^i (i = 0, 1, ...) and random singular vectors.
at::Tensor decaying_matrix(int64_t n, int64_t m, double decay, uint64_t seed) {
  at::manual_seed(seed);
  const int64_t k = std::min(n, m);
  at::Tensor u = std::get<0>(at::linalg_qr(at::randn({n, k})));
  at::Tensor v = std::get<0>(at::linalg_qr(at::randn({m, k})));
  at::Tensor s = at::pow(at::full({k}, decay), at::arange(k, at::kFloat));
  return at::mm(u * s, v.t()).contiguous();
}

double best_rank_error(const at::Tensor& m, int64_t r) {
  at::Tensor s = at::linalg_svdvals(m.to(at::kDouble));
  return std::sqrt(s.slice(0, r).pow(2).sum().item<double>());
}

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-30);
}

// The orthonormality defect of the non-zero columns of f.
double orth_defect(const at::Tensor& f) {
  at::Tensor g = at::mm(f.t(), f);
  at::Tensor d = g.diagonal();
  at::Tensor want = at::diag((d > 0.5).to(at::kFloat));
  return (g - want).abs().max().item<double>();
}

}  // namespace

TEST_CASE("powersgd: shapes and dtypes round trip") {
  at::manual_seed(1);
  for (const char* spec : {"powersgd:rank=2", "acp:rank=2"}) {
    auto c = make_compressor(spec);
    CHECK(c->method() == std::string(spec).substr(0, std::string(spec).find(':')));
    for (auto shape : std::vector<std::vector<int64_t>>{{64, 32}, {16, 8, 3, 3}, {40, 1, 5}, {7}, {3, 5}, {0, 4}, {}}) {
      at::Tensor x = shape.empty() ? at::randn({}) : at::randn(shape);
      State s;
      const Context ctx = named("w");
      Encoded e = c->encode(x, s, ctx);
      CHECK(e.shape == shape);
      CHECK(s.step == 1);
      const bool lowrank = lowrank_compressible(shape, 2);
      CHECK(e.format ==
            (lowrank ? (std::string(spec)[0] == 'p' ? Format::kLowRank : Format::kLowRankFactor) : Format::kDense));
      at::Tensor y = c->decode(e, ctx);
      CHECK(y.sizes().equals(x.sizes()));
      CHECK((y.scalar_type() == at::kFloat));
      CHECK(all_finite(y));
      if (!lowrank) CHECK(at::equal(y, x));
    }
  }
}

TEST_CASE("powersgd: compressibility rule and matrix view") {
  CHECK_FALSE(lowrank_compressible({100}, 1));
  CHECK_FALSE(lowrank_compressible({1, 100}, 1));  // (1 + 100)·1·2 > 100
  CHECK_FALSE(lowrank_compressible({3, 5}, 1));    // (3 + 5)·2 = 16 > 15
  CHECK(lowrank_compressible({6, 6}, 1));          // 24 < 36
  CHECK_FALSE(lowrank_compressible({6, 6}, 2));    // 48 > 36
  CHECK(lowrank_compressible({64, 3, 7, 7}, 4));   // 64 × 147
  CHECK_FALSE(lowrank_compressible({0, 7}, 1));
  CHECK_FALSE(lowrank_compressible({}, 1));
  const LowRankDims d = lowrank_dims({64, 3, 7, 7}, 100);
  CHECK(d.rows == 64);
  CHECK(d.cols == 147);
  CHECK(d.rank == 64);
  CHECK(lowrank_dims({8, 2}, 4).rank == 2);
}

TEST_CASE("powersgd: 1-D and incompressible tensors go dense, with and without ef") {
  for (const char* spec : {"powersgd:rank=4", "powersgd:rank=4,ef=0,warm_start=0", "acp:rank=4", "acp:rank=4,ef=0"}) {
    auto c = make_compressor(spec);
    for (auto shape : std::vector<std::vector<int64_t>>{{1000}, {10, 10}, {2, 500}, {500, 2, 1}}) {
      at::Tensor x = at::randn(shape);
      State s;
      for (int step = 0; step < 3; ++step) {
        Encoded e = c->encode(x, s, named("b"));
        CHECK(e.format == Format::kDense);
        CHECK(e.value_type == ValueType::kF32);
        CHECK(at::equal(decode(e), x));
      }
      CHECK(s.step == 3);
    }
  }
}

TEST_CASE("powersgd: skinny kernels match ATen and ignore the thread count") {
  at::manual_seed(23);
  const int threads = at::get_num_threads();
  for (auto dims :
       std::vector<std::vector<int64_t>>{{1, 5, 1}, {37, 19, 3}, {300, 2500, 4}, {2, 5000, 2}, {70, 70, 8}}) {
    const int64_t n = dims[0], m = dims[1], r = dims[2];
    CAPTURE(n);
    CAPTURE(m);
    const at::Tensor a = at::randn({n, m}), x = at::randn({n, m});
    const at::Tensor b = at::randn({m, r}), p = at::randn({n, r});
    std::vector<at::Tensor> runs;
    for (int t : {1, 3}) {
      at::set_num_threads(t);
      at::Tensor pa = at::empty({n, r}), qa = at::empty({m, r}), sum = at::empty({n, m});
      sparrow::compression::detail::skinny_mm(a.data_ptr<float>(), nullptr, nullptr, n, m, b.data_ptr<float>(), r,
                                              pa.data_ptr<float>());
      sparrow::compression::detail::skinny_mm_t(a.data_ptr<float>(), nullptr, nullptr, n, m, p.data_ptr<float>(), r,
                                                qa.data_ptr<float>());
      CHECK(rel_err(pa, at::mm(a, b)) < 1e-5);
      CHECK(rel_err(qa, at::mm(a.t(), p)) < 1e-5);
      // Fused A + x, stored in sum; and without storing.
      at::Tensor pf = at::empty({n, r}), qf = at::empty({m, r}), qg = at::empty({m, r});
      sparrow::compression::detail::skinny_mm(a.data_ptr<float>(), x.data_ptr<float>(), sum.data_ptr<float>(), n, m,
                                              b.data_ptr<float>(), r, pf.data_ptr<float>());
      CHECK(at::equal(sum, a + x));
      CHECK(rel_err(pf, at::mm(a + x, b)) < 1e-5);
      sparrow::compression::detail::skinny_mm_t(a.data_ptr<float>(), x.data_ptr<float>(), nullptr, n, m,
                                                p.data_ptr<float>(), r, qf.data_ptr<float>());
      CHECK(rel_err(qf, at::mm((a + x).t(), p)) < 1e-5);
      at::Tensor in_place = a.clone();
      sparrow::compression::detail::skinny_mm_t(in_place.data_ptr<float>(), x.data_ptr<float>(),
                                                in_place.data_ptr<float>(), n, m, p.data_ptr<float>(), r,
                                                qg.data_ptr<float>());
      CHECK(at::equal(qg, qf));
      CHECK(at::equal(in_place, a + x));
      at::Tensor u = a.clone();
      sparrow::compression::detail::rank_update(u.data_ptr<float>(), n, m, p.data_ptr<float>(), b.data_ptr<float>(), r,
                                                -0.5f);
      CHECK(rel_err(u, a - 0.5 * at::mm(p, b.t())) < 1e-5);
      for (const at::Tensor& t : {pa, qa, pf, qf, u}) runs.push_back(t);
    }
    at::set_num_threads(threads);
    for (size_t i = 0; i < runs.size() / 2; ++i) CHECK(at::equal(runs[i], runs[i + runs.size() / 2]));
  }
}

TEST_CASE("powersgd: warm start converges to the best rank-r approximation") {
  const int64_t n = 200, m = 120, r = 4;
  at::Tensor x = decaying_matrix(n, m, 0.75, 3);
  const double best = best_rank_error(x, r);
  auto c = make_compressor("powersgd:rank=4,ef=0");
  State s;
  double err = 0.0, first = 0.0;
  for (int step = 0; step < 30; ++step) {
    Encoded e = c->encode(x, s, named("conv"));
    REQUIRE(e.format == Format::kLowRank);
    err = (decode(e) - x).norm().item<double>();
    if (step == 0) first = err;
  }
  CHECK(first > 1.01 * best);  // the first step alone is not optimal: the iteration does the work
  CHECK(err <= 1.01 * best);
  CHECK(err >= 0.999 * best);  // and nothing beats the SVD
  // Without warm start every step starts afresh from the same seeded Q: no progress.
  auto cold = make_compressor("powersgd:rank=4,ef=0,warm_start=0");
  State s2;
  double e1 = 0.0, e2 = 0.0;
  for (int step = 0; step < 5; ++step) {
    const double e = (decode(cold->encode(x, s2, named("conv"))) - x).norm().item<double>();
    (step == 0 ? e1 : e2) = e;
  }
  CHECK(e1 == doctest::Approx(e2).epsilon(1e-6));
  CHECK_FALSE(s2.has("q"));
}

TEST_CASE("powersgd: orthonormalize_columns guards zero and dependent columns") {
  SUBCASE("zero matrix") {
    at::Tensor z = at::zeros({10, 3});
    orthonormalize_columns(z);
    CHECK(at::equal(z, at::zeros({10, 3})));
  }
  SUBCASE("a zero and a duplicated column") {
    at::manual_seed(5);
    at::Tensor a = at::randn({50, 4});
    a.select(1, 1).zero_();
    a.select(1, 3).copy_(a.select(1, 0) * 2.0);
    orthonormalize_columns(a);
    CHECK(all_finite(a));
    CHECK(at::equal(a.select(1, 1), at::zeros({50})));
    CHECK(orth_defect(a) < 1e-5);
    // column 0 normalised, column 2 orthonormal to it
    CHECK(a.select(1, 0).norm().item<double>() == doctest::Approx(1.0).epsilon(1e-6));
    CHECK(a.select(1, 2).norm().item<double>() == doctest::Approx(1.0).epsilon(1e-6));
  }
  SUBCASE("tiny but non-zero scale stays scale-invariant") {
    at::manual_seed(6);
    at::Tensor a = at::randn({30, 3});
    at::Tensor b = a * 1e-30f;
    orthonormalize_columns(a);
    orthonormalize_columns(b);
    CHECK(all_finite(b));
    CHECK((a - b).abs().max().item<float>() < 1e-5f);
    CHECK(orth_defect(b) < 1e-5);
  }
  SUBCASE("non-contiguous input") {
    at::manual_seed(7);
    at::Tensor a = at::randn({3, 40}).t();
    orthonormalize_columns(a);
    CHECK(orth_defect(a) < 1e-5);
  }
}

TEST_CASE("powersgd: zero matrices and zero columns give no NaN") {
  for (const char* spec : {"powersgd:rank=4", "powersgd:rank=4,ef=0", "acp:rank=4", "acp:rank=4,ef=0"}) {
    const std::string spec_text = spec;
    CAPTURE(spec_text);
    const bool acp = spec[0] == 'a';
    auto c = make_compressor(spec);
    const std::vector<int64_t> shape{64, 48};
    const LowRankDims d = lowrank_dims(shape, 4);
    // One party; for ACP it also plays the aggregator (shared = orth(own factor)).
    State s;
    Context ctx = named("z");
    at::Tensor shared = acp_initial_shared(ctx, d, 0);
    int64_t round = 0;
    auto step = [&](const at::Tensor& x) {
      ctx.round = round;
      if (acp) ctx.shared_factor = shared;
      Encoded e = c->encode(x, s, ctx);
      at::Tensor y = decode(e, ctx);
      if (acp) shared = acp_next_shared(acp_factor(e));
      ++round;
      return y;
    };
    // All-zero input for a few steps: decodes to exactly zero.
    for (int i = 0; i < 3; ++i) {
      at::Tensor y = step(at::zeros(shape));
      CHECK(all_finite(y));
      CHECK(y.abs().max().item<float>() == 0.0f);
      if (acp) CHECK(orth_defect(shared) < 1e-5);
    }
    // Then a real matrix: the factor that collapsed to 0 (warm-start Q, or the
    // next shared factor) is refilled, so the codec still finds the signal.
    at::Tensor x = decaying_matrix(64, 48, 0.5, 9);
    double err = 0.0;
    for (int i = 0; i < 8; ++i) err = rel_err(step(x), x);
    CHECK(err < 0.3);
    // Zero columns, a single non-zero entry, a rank-1 matrix at rank 4.
    at::Tensor zc = at::randn(shape);
    zc.slice(1, 0, 40).zero_();
    at::Tensor one = at::zeros(shape);
    one[3][5] = 2.0f;
    at::Tensor r1 = at::mm(at::randn({64, 1}), at::randn({1, 48}));
    for (const at::Tensor& t : {zc, one, r1}) {
      s = State();
      for (int i = 0; i < 4; ++i) {
        at::Tensor y = step(t);
        REQUIRE(all_finite(y));
        for (const auto& kv : s.tensors) CHECK(all_finite(kv.second));
        if (acp) REQUIRE(all_finite(shared));
      }
      if (t.data_ptr() != zc.data_ptr() && !acp) CHECK(rel_err(step(t), t) < 1e-5);  // rank 1: exact
    }
  }
}

TEST_CASE("powersgd: with error feedback the mean of decodes converges to the input") {
  const int64_t n = 96, m = 64;
  at::manual_seed(11);
  at::Tensor x = at::randn({n, m});  // flat spectrum: one rank-2 step captures little
  auto c = make_compressor("powersgd:rank=2");
  State s;
  at::Tensor sum = at::zeros({n, m});
  const int steps = 200;
  double err10 = 0.0, err100 = 0.0, e100 = 0.0;
  for (int step = 1; step <= steps; ++step) {
    sum += decode(c->encode(x, s, named("ef")));
    if (step == 10) err10 = rel_err(sum / 10.0, x);
    if (step == 100) {
      err100 = rel_err(sum / 100.0, x);
      e100 = s.tensors.at("residual").norm().item<double>();
    }
  }
  const double err = rel_err(sum / steps, x);
  MESSAGE("ef mean rel error after 10 steps " << err10 << ", after " << steps << " " << err);
  // The residual stays bounded (about 19|x| here: a flat spectrum, rank 2 of
  // 64), so the error of the mean falls like 1/N.
  CHECK(s.tensors.at("residual").norm().item<double>() < 1.25 * e100);
  CHECK(err < 0.6 * err100);
  CHECK(err < 0.12);
  // Telescoping: Σ decode = N·x − E_N exactly (up to rounding).
  CHECK(rel_err(sum + s.tensors.at("residual"), x * steps) < 1e-4);
}

TEST_CASE("powersgd: parties derive bit-identical initial factors") {
  const Context a = named("layer1.conv", 42);
  const Context b = named("layer1.conv", 42);
  for (int which : {0, 1}) {
    at::Tensor fa = acp_initial_factor(a, 300, 200, 4, which);
    at::Tensor fb = acp_initial_factor(b, 300, 200, 4, which);
    CHECK(fa.sizes().equals({which == 0 ? 300 : 200, 4}));
    CHECK(at::equal(fa, fb));
    CHECK(orth_defect(fa) < 1e-5);
    CHECK_FALSE(at::equal(fa, acp_initial_factor(named("layer2.conv", 42), 300, 200, 4, which)));
    CHECK_FALSE(at::equal(fa, acp_initial_factor(named("layer1.conv", 43), 300, 200, 4, which)));
  }
  CHECK(acp_initial_factor(a, 3, 200, 8, 1).size(1) == 3);  // rank clamped
  // Independent of intra-op threads.
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  at::Tensor f1 = acp_initial_factor(a, 500, 64, 4, 1);
  at::set_num_threads(std::max(2, threads));
  at::Tensor f2 = acp_initial_factor(a, 500, 64, 4, 1);
  at::set_num_threads(threads);
  CHECK(at::equal(f1, f2));
  // Two clients encoding the same input from fresh state send the same bytes.
  at::Tensor x = at::randn({128, 64});
  for (const char* spec : {"powersgd:rank=3", "acp:rank=3"}) {
    auto c = make_compressor(spec);
    State s1, s2;
    CHECK(c->encode(x, s1, a).values == c->encode(x, s2, b).values);
  }
}

TEST_CASE("powersgd: rank 4 on 2048x512 is >= 100x smaller than dense") {
  at::Tensor x = at::randn({2048, 512});
  State s;
  Encoded e = make_compressor("powersgd:rank=4")->encode(x, s, named("big"));
  REQUIRE(e.format == Format::kLowRank);
  CHECK(e.values.size() == (2048 + 512) * 4 * 4);
  const double ratio = 2048.0 * 512 * 4 / static_cast<double>(e.payload_bytes());
  MESSAGE("powersgd rank 4, 2048x512: " << ratio << "x below dense");
  CHECK(ratio >= 100.0);
  State s2;
  Encoded f = make_compressor("acp:rank=4")->encode(x, s2, named("big"));
  CHECK(f.values.size() == 2048 * 4 * 4);  // even round: P only
}

TEST_CASE("powersgd: decode_add accumulates with a weight") {
  at::Tensor x = decaying_matrix(40, 30, 0.5, 13);
  State s;
  Encoded e = make_compressor("powersgd:rank=3")->encode(x, s, named("w"));
  at::Tensor d = decode(e);
  at::Tensor out = at::ones({40, 30});
  decode_add(e, out, 0.5f);
  CHECK(rel_err(out, at::ones({40, 30}) + 0.5 * d) < 1e-6);
  at::Tensor flat = at::zeros({1200});
  decode_add(e, flat, 1.0f);
  CHECK(at::equal(flat.view({40, 30}), d));
}

TEST_CASE("powersgd: state survives serialize/deserialize mid-stream") {
  for (const char* spec : {"powersgd:rank=3", "acp:rank=3"}) {
    CAPTURE(spec);
    auto c = make_compressor(spec);
    at::manual_seed(17);
    std::vector<at::Tensor> inputs;
    for (int i = 0; i < 8; ++i) inputs.push_back(at::randn({50, 6, 2}));
    State live;
    const Context ctx = named("s");
    for (int i = 0; i < 4; ++i) c->encode(inputs[i], live, ctx);
    State restored = State::deserialize(live.serialize());
    CHECK(restored.step == 4);
    CHECK(restored.has("residual"));
    if (spec[0] == 'p') CHECK(restored.has("q"));
    for (int i = 4; i < 8; ++i) {
      Encoded a = c->encode(inputs[i], live, ctx);
      Encoded b = c->encode(inputs[i], restored, ctx);
      CHECK(a.params == b.params);
      CHECK(a.values == b.values);
    }
  }
}

TEST_CASE("powersgd: config errors") {
  for (const char* bad :
       {"powersgd", "powersgd:rank=0", "powersgd:rank=-2", "powersgd:rank=4,foo=1", "powersgd:rank=4,ef=maybe",
        "powersgd:rank=x", "acp", "acp:rank=0", "acp:rank=4,warm_start=1", "acp:rank=2,bar=3"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(make_compressor(bad), sparrow::ConfigError);
  }
  CHECK_NOTHROW(make_compressor("powersgd:rank=1,warm_start=0,ef=0"));
  CHECK_NOTHROW(make_compressor("acp:rank=8,ef=0"));
}

TEST_CASE("powersgd: malformed payloads are FormatErrors") {
  at::Tensor x = at::randn({32, 16});
  State s;
  Encoded e = make_compressor("powersgd:rank=2")->encode(x, s, named("m"));
  Encoded bad = e;
  bad.values.resize(bad.values.size() - 4);
  CHECK_THROWS_AS(decode(bad), sparrow::FormatError);
  bad = e;
  bad.params[2] = 40;
  CHECK_THROWS_AS(decode(bad), sparrow::FormatError);
  bad = e;
  bad.params = {16, 32, 2};  // swapped: same numel, consistent sizes: decodes, no crash
  CHECK_NOTHROW(decode(bad));
  bad = e;
  const float nan = std::nanf("");
  std::memcpy(bad.values.data(), &nan, 4);
  CHECK_THROWS_AS(decode(bad), sparrow::FormatError);
}

TEST_CASE("acp: rounds alternate between P and Q") {
  auto c = make_compressor("acp:rank=2");
  at::Tensor x = at::randn({40, 24});
  SUBCASE("from State::step") {
    State s;
    for (int t = 0; t < 4; ++t) {
      Encoded e = c->encode(x, s, named("a"));
      REQUIRE(e.format == Format::kLowRankFactor);
      CHECK(e.params[3] == static_cast<uint32_t>(t % 2));
      CHECK(e.values.size() == static_cast<size_t>((t % 2 ? 24 : 40) * 2 * 4));
    }
  }
  SUBCASE("from Context::round") {
    State s;
    Context ctx = named("a");
    ctx.round = 7;
    CHECK(c->encode(x, s, ctx).params[3] == 1u);
    ctx.round = 10;
    CHECK(c->encode(x, s, ctx).params[3] == 0u);
  }
  CHECK(acp_sent_factor(0) == 0);
  CHECK(acp_sent_factor(3) == 1);
  const LowRankDims d = lowrank_dims({40, 24}, 2);
  CHECK(acp_sent_shape(d, 0) == std::vector<int64_t>{40, 2});
  CHECK(acp_shared_shape(d, 0) == std::vector<int64_t>{24, 2});
  CHECK(acp_sent_shape(d, 1) == std::vector<int64_t>{24, 2});
  CHECK(acp_shared_shape(d, 1) == std::vector<int64_t>{40, 2});
}

TEST_CASE("acp/powersgd: decay ages the residual of a client that skipped rounds") {
  for (const std::string method : {"acp", "powersgd"}) {
    CAPTURE(method);
    at::manual_seed(21);
    const at::Tensor x = at::randn({40, 24}), y = at::randn({40, 24});
    auto plain = make_compressor(method + ":rank=2");
    auto decayed = make_compressor(method + ":rank=2,decay=0.5");
    auto reset = make_compressor(method + ":rank=2,max_age=1");
    Context ctx = named("a");
    ctx.round = 0;
    State a, b, c;
    plain->encode(x, a, ctx);
    decayed->encode(x, b, ctx);
    reset->encode(x, c, ctx);
    REQUIRE(at::equal(a.tensors.at("residual"), b.tensors.at("residual")));
    REQUIRE(at::sum(at::abs(a.tensors.at("residual"))).item<double>() > 0);
    // Back in round 4 after skipping rounds 1 to 3 (for acp the same parity of
    // round): decay=0.5 multiplies the residual by 0.5^3 first, max_age=1 zeroes it.
    ctx.round = 4;
    State manual = State::deserialize(a.serialize());  // deep copies
    manual.tensors.at("residual").mul_(0.125);
    State zeroed = State::deserialize(a.serialize());
    zeroed.tensors.at("residual").zero_();
    State fresh = State::deserialize(zeroed.serialize());
    CHECK(decayed->encode(y, b, ctx).values == plain->encode(y, manual, ctx).values);
    CHECK(reset->encode(y, c, ctx).values == plain->encode(y, zeroed, ctx).values);
    CHECK_FALSE(plain->encode(y, a, ctx).values == plain->encode(y, fresh, ctx).values);
    CHECK_THROWS_AS(make_compressor(method + ":rank=2,ef=0,decay=0.5"), sparrow::ConfigError);
    CHECK_THROWS_AS(make_compressor(method + ":rank=2,decay=1.5"), sparrow::ConfigError);
  }
}

TEST_CASE("acp: a wrong shared factor throws on encode and decode") {
  auto c = make_compressor("acp:rank=2");
  at::Tensor x = at::randn({40, 24});
  Context ctx = named("a");
  ctx.round = 0;
  State s;
  Encoded e = c->encode(x, s, ctx);  // seeded Q̂
  Context wrong = ctx;
  wrong.shared_factor = at::randn({40, 2});  // P̂-shaped in a P round
  CHECK_THROWS_AS(decode(e, wrong), sparrow::FormatError);
  wrong.shared_factor = at::randn({24, 3});
  CHECK_THROWS_AS(decode(e, wrong), sparrow::FormatError);
  wrong.shared_factor = at::randn({24, 2}, at::kDouble);
  CHECK_THROWS_AS(decode(e, wrong), sparrow::FormatError);
  wrong.shared_factor = at::full({24, 2}, std::nanf(""));
  CHECK_THROWS_AS(decode(e, wrong), sparrow::FormatError);
  State before = s;
  const std::string bytes = s.serialize();
  wrong.shared_factor = at::randn({40, 2});
  CHECK_THROWS_AS(c->encode(x, s, wrong), sparrow::Error);
  CHECK(s.serialize() == bytes);  // the failed encode left the state alone
  // Undefined shared factor: decode uses the same seeded Q̂ as the encoder.
  at::Tensor q0 = acp_initial_factor(ctx, 40, 24, 2, 1);
  Context explicit_ctx = ctx;
  explicit_ctx.shared_factor = q0;
  CHECK(at::equal(decode(e, ctx), decode(e, explicit_ctx)));
  CHECK(rel_err(decode(e, ctx), at::mm(at::mm(x, q0), q0.t())) < 1e-5);
}

TEST_CASE("acp: aggregation is linear in the factors (fp32 and int8 factors)") {
  at::manual_seed(19);
  const std::vector<int64_t> shape{48, 4, 3};
  const LowRankDims d = lowrank_dims(shape, 3);
  const std::vector<std::pair<std::string, int64_t>> cases{
      {"acp:rank=3", 0}, {"acp:rank=3", 1}, {"acp:rank=3,values=int8", 0}, {"acp:rank=3,values=int8", 1}};
  for (const auto& sr : cases) {
    const std::string spec = sr.first;  // not a structured binding: CAPTURE's lambda captures it (C++17)
    const int64_t round = sr.second;
    CAPTURE(spec);
    CAPTURE(round);
    auto c = make_compressor(spec);
    Context ctx = named("lin");
    ctx.round = round;
    ctx.shared_factor = acp_next_shared(at::randn(acp_shared_shape(d, round)));
    const std::vector<float> w{0.5f, 1.5f, 2.0f};
    at::Tensor sum_dec = at::zeros(shape);
    at::Tensor sum_f = at::zeros(acp_sent_shape(d, round));
    for (size_t i = 0; i < w.size(); ++i) {
      State s;
      Encoded e = c->encode(at::randn(shape), s, ctx);
      decode_add(e, sum_dec, w[i], ctx);
      acp_add_factor(e, round, sum_f, w[i]);
    }
    CHECK(rel_err(acp_update(sum_f, ctx.shared_factor, round, shape), sum_dec) < 1e-5);
    CHECK(rel_err(decode(acp_factor_encoded(sum_f, shape, round), ctx), sum_dec) < 1e-5);
    // A factor of the other round is rejected.
    State s;
    Context other = ctx;
    other.round = round + 1;
    other.shared_factor = at::Tensor();
    Encoded e = c->encode(at::randn(shape), s, other);
    at::Tensor acc = at::zeros(acp_sent_shape(d, round));
    CHECK_THROWS_AS(acp_add_factor(e, round, acc, 1.0f), sparrow::FormatError);
  }
}

TEST_CASE("acp: multi-client simulation with the aggregator API tracks the mean matrix") {
  const std::vector<int64_t> shape{64, 40};
  const int64_t rank = 4;
  const int clients = 4, rounds = 40;
  REQUIRE(lowrank_compressible(shape, rank));
  const LowRankDims d = lowrank_dims(shape, rank);
  auto c = make_compressor("acp:rank=4");
  std::vector<at::Tensor> mats;
  std::vector<float> weights{1.0f, 2.0f, 3.0f, 4.0f};
  const at::Tensor common = decaying_matrix(64, 40, 0.8, 99);
  at::Tensor target = at::zeros(shape);
  float wtotal = 0.0f;
  for (int i = 0; i < clients; ++i) {
    // Clients agree on a common component and differ in their own (non-IID).
    mats.push_back(common + 0.5 * decaying_matrix(64, 40, 0.8, 100 + i));
    target += weights[i] * mats.back();
    wtotal += weights[i];
  }
  target /= wtotal;
  std::vector<State> states(clients);
  Context base = named("fc");
  at::Tensor shared = acp_initial_shared(base, d, 0);
  at::Tensor running = at::zeros(shape);
  double err_at_10 = 0.0;
  for (int64_t t = 0; t < rounds; ++t) {
    Context ctx = base;
    ctx.round = t;
    ctx.shared_factor = shared;
    at::Tensor sum = at::zeros(acp_sent_shape(d, t));
    at::Tensor mean_of_decodes = at::zeros(shape);
    for (int i = 0; i < clients; ++i) {
      Encoded e = c->encode(mats[i], states[i], ctx);
      acp_add_factor(e, t, sum, weights[i]);
      decode_add(e, mean_of_decodes, weights[i] / wtotal, ctx);
    }
    at::Tensor mean = sum / wtotal;
    at::Tensor update = acp_update(mean, shared, t, shape);
    // One round's aggregate equals the weighted mean of the clients' own decodes.
    CHECK(rel_err(update, mean_of_decodes) < 1e-5);
    shared = acp_next_shared(mean);
    CHECK(orth_defect(shared) < 1e-5);
    running += update;
    if (t + 1 == 10) err_at_10 = rel_err(running / 10.0, target);
  }
  const double err = rel_err(running / rounds, target);
  MESSAGE("acp running-mean rel error: after 10 rounds " << err_at_10 << ", after " << rounds << " " << err);
  // Σ_t update_t = T·target − Ē_T exactly (local EF telescopes through the
  // linear aggregate); Ē stays bounded (about 5|target| here), so the running
  // mean converges like 1/T.
  at::Tensor mean_residual = at::zeros(shape);
  for (int i = 0; i < clients; ++i) mean_residual += weights[i] / wtotal * states[i].tensors.at("residual");
  CHECK(rel_err(running + mean_residual, target * rounds) < 1e-4);
  CHECK(mean_residual.norm().item<double>() < 8.0 * target.norm().item<double>());
  CHECK(err < 0.2);
  CHECK(err < 0.5 * err_at_10);
}

TEST_CASE("acp: next shared factor refills vanished columns") {
  at::Tensor f = at::zeros({30, 3});
  at::Tensor s = acp_next_shared(f);
  CHECK(all_finite(s));
  CHECK(orth_defect(s) < 1e-5);
  CHECK(at::mm(s.t(), s).diagonal().min().item<float>() > 0.99f);  // full rank again
  CHECK(at::equal(f, at::zeros({30, 3})));                         // input untouched
  at::Tensor g = at::randn({30, 3});
  g.select(1, 2).zero_();
  at::Tensor sg = acp_next_shared(g);
  CHECK(orth_defect(sg) < 1e-5);
  CHECK(at::mm(sg.t(), sg).diagonal().min().item<float>() > 0.99f);
}

// ---- factors in 16 or 8 bits (protocol 1.4) -------------------------------------

TEST_CASE("powersgd/acp: values= sends the factors in fp16, bf16 or int8, the rounding kept in E") {
  at::manual_seed(23);
  const at::Tensor x = decaying_matrix(96, 40, 0.7, 23);
  struct Want {
    const char* values;
    ValueType vt;
    size_t bytes_per_value;
    double max_rel;  // of one factor's decode against the fp32 encode's
  };
  for (const Want w : {Want{"fp16", ValueType::kF16, 2, 2e-3}, Want{"bf16", ValueType::kBF16, 2, 1.5e-2},
                       Want{"int8", ValueType::kInt8, 1, 4e-2}}) {
    for (const char* method : {"powersgd", "acp"}) {
      CAPTURE(w.values);
      CAPTURE(method);
      const std::string base = std::string(method) + ":rank=3";
      auto c32 = make_compressor(base);
      auto c = make_compressor(base + ",values=" + w.values);
      State s32, s;
      const Context ctx = named("q");
      const Encoded e32 = c32->encode(x, s32, ctx);
      const Encoded e = c->encode(x, s, ctx);
      CHECK(e.format == e32.format);
      CHECK(e.value_type == w.vt);
      CHECK(e.params == e32.params);
      const uint64_t n = e32.values.size() / 4;
      CHECK(e.values.size() == n * w.bytes_per_value);
      // int8: one scale per column of each factor sent (P and Q: 2r; ACP: r).
      CHECK(e.scales.size() == (w.vt == ValueType::kInt8 ? (method[0] == 'p' ? 6u : 3u) : 0u));
      CHECK_NOTHROW(validate(e));
      const at::Tensor d = decode(e, ctx), d32 = decode(e32, ctx);
      CHECK(rel_err(d, d32) < w.max_rel);
      // Error feedback keeps exactly what the receiver did not get: x = decode + E.
      CHECK(rel_err(d + s.tensors.at("residual"), x) < 1e-5);
      // A later step starts from that residual; state round-trips as before.
      State restored = State::deserialize(s.serialize());
      const at::Tensor x2 = at::randn({96, 40});
      CHECK(c->encode(x2, s, ctx).values == c->encode(x2, restored, ctx).values);
    }
  }
}

TEST_CASE("powersgd/acp: fp16 factors saturate at 65504, the excess kept in E") {
  at::manual_seed(43);
  const at::Tensor x =
      at::randn({64, 32}) * 1e5f;  // Q = M'ᵀP has entries far above fp16's range  // The sparse correction's values are
                                   // the largest entries of E: above fp16's range here too.
  for (const char* spec :
       {"powersgd:rank=2,values=fp16", "acp:rank=2,values=fp16", "powersgd:rank=2,values=fp16,sparse=0.05"}) {
    CAPTURE(spec);
    Context ctx = named("big");
    ctx.round = 1;  // acp: the Q round (Q = M'ᵀP̂, entries ~ column norms of M')
    State s;
    const Encoded e = make_compressor(spec)->encode(x, s, ctx);
    CHECK_NOTHROW(validate(e));
    const at::Tensor d = decode(e, ctx);
    CHECK(all_finite(d));
    CHECK(all_finite(s.tensors.at("residual")));
    CHECK(rel_err(d + s.tensors.at("residual"), x) < 1e-5);
    // And the next encode of the same tensor still works from that residual.
    CHECK_NOTHROW(validate(make_compressor(spec)->encode(x, s, ctx)));
  }
}

TEST_CASE("powersgd/acp: a bf16 factor entry above bf16's largest finite value saturates") {
  // 3.4e38 is finite in fp32 but rounds to inf in bf16 (largest finite 3.3895e38).
  at::Tensor f = at::full({2, 1}, 3.4e38f);
  f[1][0] = -3.4e38f;
  Encoded e;
  sparrow::compression::detail::pack_factor(f, ValueType::kBF16, e);
  CHECK(all_finite(f));
  CHECK(f[0][0].item<float>() == 3.3895313892515355e38f);
  CHECK(f[1][0].item<float>() == -3.3895313892515355e38f);
}

TEST_CASE("powersgd/acp: int8 factors keep small columns (one scale per column)") {
  // Singular values 1 and 1e-3: with one scale per factor the second column of
  // Q would round to zero; with one per column it keeps 8 bits of its own.
  at::manual_seed(29);
  at::Tensor u = std::get<0>(at::linalg_qr(at::randn({64, 2})));
  at::Tensor v = std::get<0>(at::linalg_qr(at::randn({48, 2})));
  const at::Tensor x = at::mm(u * at::tensor({1.0f, 1e-3f}), v.t()).contiguous();
  State s;
  auto c = make_compressor("powersgd:rank=2,values=int8,warm_start=0");
  // x has rank 2, so one power step from the seeded Q finds both directions.
  const Encoded e = c->encode(x, s, named("cols"));
  REQUIRE(e.scales.size() == 4);
  const float q0 = e.scales[2], q1 = e.scales[3];  // Q's two column scales
  CHECK(q1 > 0.0f);
  CHECK(q1 < 1e-2f * q0);
  CHECK(rel_err(decode(e), x) < 0.05);
}

TEST_CASE("powersgd/acp: malformed 1.4 factors are FormatErrors") {
  at::manual_seed(31);
  const at::Tensor x = at::randn({32, 16});
  for (const char* spec : {"powersgd:rank=2,values=int8", "acp:rank=2,values=int8"}) {
    CAPTURE(spec);
    State s;
    const Encoded e = make_compressor(spec)->encode(x, s, named("m"));
    Encoded bad = e;
    bad.scales.pop_back();  // a column without its scale
    CHECK_THROWS_AS(validate(bad), sparrow::FormatError);
    bad = e;
    bad.scales[0] = -1.0f;
    CHECK_THROWS_AS(validate(bad), sparrow::FormatError);
    bad = e;
    bad.scales[0] = std::nanf("");
    CHECK_THROWS_AS(validate(bad), sparrow::FormatError);
    bad = e;
    bad.values.resize(bad.values.size() - 1);
    CHECK_THROWS_AS(validate(bad), sparrow::FormatError);
    bad = e;
    bad.value_type = ValueType::kSign;  // not a factor type
    CHECK_THROWS_AS(validate(bad), sparrow::FormatError);
    // q · scale must stay finite: scales up to FLT_MAX/127, codes -127..127.
    bad = e;
    bad.scales[0] = std::numeric_limits<float>::max();
    CHECK_THROWS_AS(validate(bad), sparrow::FormatError);
    bad = e;
    bad.values.data()[0] = 0x80;
    CHECK_THROWS_AS(validate(bad), sparrow::FormatError);
  }
  State s;
  Encoded h = make_compressor("powersgd:rank=2,values=fp16")->encode(x, s, named("m"));
  Encoded bad = h;
  bad.scales = {1.0f};  // fp16 factors carry no scales
  CHECK_THROWS_AS(validate(bad), sparrow::FormatError);
  bad = h;
  const uint16_t inf16 = 0x7c00;
  std::memcpy(bad.values.data(), &inf16, 2);
  CHECK_THROWS_AS(validate(bad), sparrow::FormatError);
  for (const char* cfg : {"powersgd:rank=2,values=sign", "acp:rank=2,values=fp8", "powersgd:rank=2,values="}) {
    CAPTURE(cfg);
    CHECK_THROWS_AS(make_compressor(cfg), sparrow::ConfigError);
  }
}

TEST_CASE("powersgd: iters=N runs N power steps per encode, closer to the best rank-r approximation") {
  const at::Tensor x = decaying_matrix(120, 80, 0.6, 41);
  const double best = best_rank_error(x, 3) / x.norm().item<double>();
  double prev = 1e9;
  for (int iters : {1, 2, 8}) {
    CAPTURE(iters);
    State s;
    const Encoded e =
        make_compressor("powersgd:rank=3,warm_start=0,iters=" + std::to_string(iters))->encode(x, s, named("it"));
    CHECK(e.values.size() == (120 + 80) * 3 * 4);  // the wire is the same
    const double err = rel_err(decode(e), x);
    MESSAGE("iters " << iters << ": rel error " << err << " (best rank 3: " << best << ")");
    CHECK(err < prev);
    CHECK(rel_err(decode(e) + s.tensors.at("residual"), x) < 1e-5);
    prev = err;
  }
  CHECK(prev < 1.01 * best);
  for (const char* bad : {"powersgd:rank=2,iters=0", "powersgd:rank=2,iters=17", "acp:rank=2,iters=2"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(make_compressor(bad), sparrow::ConfigError);
  }
}

TEST_CASE("powersgd: min_rate sends a matrix dense unless its factors are that many times smaller") {
  // 10 x 200 at rank 4: (10 + 200)·4 = 840 values against 2,000, 2.4x.
  CHECK(lowrank_compressible({10, 200}, 4));
  CHECK_FALSE(lowrank_compressible({10, 200}, 4, 3.0));
  CHECK(lowrank_compressible({200, 200}, 4, 3.0));  // 25x
  const at::Tensor x = at::randn({10, 200});
  State s2, s3;
  const Encoded e2 = make_compressor("powersgd:rank=4")->encode(x, s2, named("out"));
  const Encoded e3 = make_compressor("powersgd:rank=4,min_rate=3")->encode(x, s3, named("out"));
  CHECK(e2.format == Format::kLowRank);
  CHECK(e3.format == Format::kDense);
  CHECK(at::equal(decode(e3), x));
  for (const char* bad : {"powersgd:rank=4,min_rate=0.5", "powersgd:rank=4,min_rate=nan", "acp:rank=4,min_rate=3"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(make_compressor(bad), sparrow::ConfigError);
  }
}

TEST_CASE("powersgd: sparse=S sends the largest entries of what the factors leave, kept out of E") {
  const at::Tensor x = decaying_matrix(96, 40, 0.8, 47);
  for (const char* values : {"fp32", "fp16", "bf16", "int8"}) {
    CAPTURE(values);
    const std::string spec = std::string("powersgd:rank=2,sparse=0.05,values=") + values;
    auto plain = make_compressor(std::string("powersgd:rank=2,values=") + values);
    auto c = make_compressor(spec);
    State s0, s;
    const Context ctx = named("w");
    const Encoded e0 = plain->encode(x, s0, ctx);
    const Encoded e = c->encode(x, s, ctx);
    REQUIRE(e.format == Format::kLowRankSparse);
    CHECK(e.index_coding == IndexCoding::kRice);
    CHECK(e.count == static_cast<uint64_t>(std::ceil(0.05 * (96 * 40))));
    REQUIRE(e.params.size() == 4);
    CHECK(std::vector<uint32_t>(e.params.begin(), e.params.begin() + 3) == e0.params);
    // The factors are the plain encode's; the sparse values follow them.
    CHECK(std::memcmp(e.values.data(), e0.values.data(), e0.values.size()) == 0);
    CHECK(e.scales.size() == (std::string(values) == "int8" ? 5u : 0u));
    CHECK_NOTHROW(validate(e));
    // The correction is the largest |E| of the plain encode, at exactly those positions.
    const at::Tensor before = s0.tensors.at("residual").flatten();
    std::vector<int64_t> pos =
        sparrow::compression::detail::decode_rice_positions(e.indices, e.count, e.params[3], 96 * 40);
    const at::Tensor sent = at::from_blob(pos.data(), {static_cast<int64_t>(pos.size())}, at::kLong).clone();
    // Elsewhere the decode is the factors' alone.
    at::Tensor diff = (decode(e, ctx) - decode(e0, ctx)).flatten();
    diff.index_fill_(0, sent, 0.0f);
    CHECK(diff.abs().max().item<float>() == 0.0f);
    const float smallest_sent = before.index_select(0, sent).abs().min().item<float>();
    at::Tensor unsent = before.abs().clone();
    unsent.index_fill_(0, sent, 0.0f);
    CHECK(unsent.max().item<float>() <= smallest_sent);
    // Error feedback: x = decode + E, and E is smaller than without the correction.
    const at::Tensor r = s.tensors.at("residual");
    CHECK(rel_err(decode(e, ctx) + r, x) < 1e-5);
    CHECK(r.norm().item<double>() < 0.9 * before.norm().item<double>());
    // decode_add with a weight adds the same.
    at::Tensor acc = at::ones_like(x);
    decode_add(e, acc, 0.5f, ctx);
    CHECK(at::allclose(acc, 1 + 0.5 * decode(e, ctx), 1e-5, 1e-6));
  }
  // 1-D tensors still go dense; the bias of a layer carries no correction.
  State s;
  CHECK(make_compressor("powersgd:rank=2,sparse=0.1")->encode(at::randn({50}), s, named("b")).format == Format::kDense);
  for (const char* bad : {"powersgd:rank=2,sparse=-0.1", "powersgd:rank=2,sparse=1.5", "powersgd:rank=2,sparse=nan",
                          "powersgd:rank=2,sparse=0.1,ef=0", "acp:rank=2,sparse=0.1"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(make_compressor(bad), sparrow::ConfigError);
  }
}

TEST_CASE("powersgd: a malformed sparse correction is a FormatError and leaves the sum unchanged") {
  at::manual_seed(53);
  const at::Tensor x = at::randn({40, 24});
  State s;
  const Encoded e = make_compressor("powersgd:rank=2,sparse=0.02,values=int8")->encode(x, s, named("m"));
  REQUIRE(e.format == Format::kLowRankSparse);
  REQUIRE(e.count >= 2);
  std::vector<Encoded> bad(11, e);
  bad[0].index_coding = IndexCoding::kDeltaVarint;  // only Rice positions
  bad[1].params.pop_back();                         // no Rice parameter
  bad[2].params[3] = 41;                            // above the largest Rice parameter
  bad[3].count += 1;                                // one position more than the stream holds
  bad[3].values.resize(bad[3].values.size() + 1);   // (its value present)
  bad[4].indices.pop_back();                        // truncated position stream
  bad[5].values.resize(bad[5].values.size() - 1);   // a value short
  bad[6].scales.pop_back();                         // the sparse values' scale missing
  bad[7].scales.back() = std::nanf("");
  bad[8].values.data()[bad[8].values.size() - 1] = 0x80;  // int8 code -128
  bad[9].indices.push_back(0);                            // a trailing byte after the stream
  bad[10].count -= 1;                                     // one position fewer: bits left over
  bad[10].values.resize(bad[10].values.size() - 1);
  for (size_t i = 0; i < bad.size(); ++i) {
    CAPTURE(i);
    CHECK_THROWS_AS(validate(bad[i]), sparrow::FormatError);
    at::Tensor acc = at::full({40, 24}, 2.0f);
    CHECK_THROWS_AS(decode_add(bad[i], acc, 1.0f), sparrow::FormatError);
    CHECK(at::equal(acc, at::full({40, 24}, 2.0f)));
  }
  // A position beyond numel: a valid stream for a larger tensor.
  Encoded wide = e;
  wide.indices.assign(121, 0xff);  // one unary gap of 975 >= numel 960, then its 0 bit
  wide.indices.push_back(0x7f);
  wide.count = 1;
  wide.params[3] = 0;
  wide.values.resize(wide.values.size() - (e.count - 1));
  CHECK_THROWS_AS(validate(wide), sparrow::FormatError);
  // fp32 values: a non-finite sparse value is refused.
  State s32;
  Encoded f = make_compressor("powersgd:rank=2,sparse=0.02")->encode(x, s32, named("m"));
  REQUIRE(f.format == Format::kLowRankSparse);
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(f.values.data() + f.values.size() - 4, &inf, 4);
  CHECK_THROWS_AS(validate(f), sparrow::FormatError);
}

TEST_CASE("powersgd: a huge sparse count with few value bytes is refused before its positions are expanded") {
  // 2^20 x 2^20, rank 1; 16 MiB of zero index bytes would be 2^27 valid gap-0
  // positions at b = 0 (1 GiB as int64), but the values hold the factors only.
  Encoded e;
  e.format = Format::kLowRankSparse;
  e.shape = {int64_t{1} << 20, int64_t{1} << 20};
  e.params = {1u << 20, 1u << 20, 1, 0};
  e.index_coding = IndexCoding::kRice;
  e.count = uint64_t{1} << 27;
  e.indices.assign(size_t{1} << 24, 0);
  e.indices.back() = 0xff;  // an unended last gap: expanding the positions first would fail there, after 1 GiB
  e.values = std::vector<uint8_t>(size_t{2} * (1u << 20) * 4, 0);
  CHECK_THROWS_WITH_AS(validate(e), doctest::Contains("value bytes"), sparrow::FormatError);
}

TEST_CASE("powersgd: sparse with warm start, two power steps and decay over skipped rounds, and no zeros sent") {
  at::manual_seed(61);
  auto c = make_compressor("powersgd:rank=2,values=int8,iters=2,sparse=0.03,decay=0.5");
  auto plain = make_compressor("powersgd:rank=2,values=int8,iters=2,decay=0.5");
  State s, s0;
  Context ctx = named("t");
  for (int64_t round : {0, 1, 2, 5, 6, 9}) {  // skipped rounds age the residual
    ctx.round = round;
    const at::Tensor x = at::randn({48, 20});
    const at::Tensor before = s.tensors.count("residual") ? s.tensors.at("residual").clone() : at::zeros({48, 20});
    const Encoded e = c->encode(x, s, ctx);
    const Encoded e0 = plain->encode(x, s0, ctx);
    REQUIRE(e.format == Format::kLowRankSparse);
    CHECK(e.count == static_cast<uint64_t>(std::ceil(0.03 * (48 * 20))));
    // The same ageing as without the correction, and what was kept is exactly what was not sent.
    const double age = round == 5 || round == 9 ? 0.25 : 1.0;  // two rounds skipped: 0.5^2
    CHECK(rel_err(decode(e, ctx) + s.tensors.at("residual"), x + age * before) < 1e-5);
    // The correction leaves a smaller residual than the factors alone.
    CHECK(s.tensors.at("residual").norm().item<double>() < s0.tensors.at("residual").norm().item<double>());
  }
  // An all-zero input leaves E = 0: exact zeros are not sent.
  State z;
  const Encoded e = make_compressor("powersgd:rank=2,sparse=0.5")->encode(at::zeros({48, 20}), z, named("z"));
  CHECK(e.format == Format::kLowRankSparse);
  CHECK(e.count == 0);
  CHECK_NOTHROW(validate(e));
  CHECK(at::equal(decode(e), at::zeros({48, 20})));
}
