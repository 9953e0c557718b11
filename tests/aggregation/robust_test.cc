#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "aggregation/robust.h"
#include "compression/compressor.h"
#include "core/error.h"

using namespace sparrow;
using namespace sparrow::aggregation;

namespace {

const TensorShapes kShapes = {{"a", {3, 4}}, {"b", {5}}};  // 17 coordinates

// A dense update whose flattened values (model order "a" then "b") are `flat`.
EncodedUpdate dense_update(const at::Tensor& flat) {
  compression::register_builtins();
  auto none = compression::make_compressor("none");
  EncodedUpdate u;
  compression::State st;
  u.emplace_back("a", none->encode(flat.narrow(0, 0, 12).reshape({3, 4}).contiguous(), st, {}));
  u.emplace_back("b", none->encode(flat.narrow(0, 12, 5).contiguous(), st, {}));
  return u;
}

at::Tensor flatten(const std::map<std::string, at::Tensor>& m) {
  return at::cat({m.at("a").reshape({-1}), m.at("b").reshape({-1})});
}

// Runs `agg_spec`/`dp_spec` over the rows of X with the given weights.
at::Tensor aggregate(const std::string& agg_spec, const at::Tensor& X, const std::vector<double>& w = {},
                     const std::string& dp_spec = "none", AggregateStats* st = nullptr, int64_t expected = 0,
                     Aggregator* keep = nullptr) {
  std::optional<Aggregator> local;
  if (!keep) local.emplace(agg_spec, dp_spec, expected > 0 ? expected : X.size(0), 7);
  Aggregator& g = keep ? *keep : *local;
  Accumulator acc = g.make_accumulator(kShapes);
  acc.reset(g.clip());
  for (int64_t i = 0; i < X.size(0); ++i) acc.add(dense_update(X[i]), w.empty() ? 1.0 : w[static_cast<size_t>(i)]);
  return flatten(g.finish(acc, 0, st));
}

bool close(const at::Tensor& a, const at::Tensor& b, double tol = 1e-5) { return at::allclose(a, b, tol, tol); }

}  // namespace

TEST_CASE("robust: mean is the sample-weighted mean, streamed") {
  at::manual_seed(1);
  at::Tensor X = at::randn({4, 17});
  const std::vector<double> w = {1, 2, 3, 4};
  at::Tensor expect = (X * at::tensor({1.f, 2.f, 3.f, 4.f}).unsqueeze(1)).sum(0) / 10.0;
  CHECK(close(aggregate("mean", X, w), expect));
}

TEST_CASE("robust: coordinate-wise median, odd and even n, ignores weights") {
  at::manual_seed(2);
  at::Tensor X = at::randn({5, 17});
  CHECK(close(aggregate("median", X, {1, 100, 1, 1, 1}), std::get<0>(X.sort(0))[2]));
  at::Tensor Y = at::randn({4, 17});
  at::Tensor s = std::get<0>(Y.sort(0));
  CHECK(close(aggregate("median", Y), (s[1] + s[2]) / 2));
}

TEST_CASE("robust: trimmed mean drops floor(beta n) from each end per coordinate") {
  at::manual_seed(3);
  at::Tensor X = at::randn({10, 17});
  X[0].fill_(1000);  // an outlier in every coordinate
  at::Tensor s = std::get<0>(X.sort(0));
  CHECK(close(aggregate("trimmed_mean:beta=0.2", X), s.narrow(0, 2, 6).mean(0)));
  CHECK(close(aggregate("trimmed_mean:beta=0", X), X.mean(0)));
}

TEST_CASE("robust: krum, multikrum and bulyan ignore far-away updates") {
  at::manual_seed(4);
  at::Tensor honest = at::ones({9, 17}) + 0.01 * at::randn({9, 17});
  at::Tensor bad = at::full({2, 17}, -50.0);
  at::Tensor X = at::cat({bad.narrow(0, 0, 1), honest, bad.narrow(0, 1, 1)});  // n = 11, f = 2
  AggregateStats st;
  at::Tensor k = aggregate("krum:f=2", X, {}, "none", &st);
  CHECK(st.kept == 1);
  CHECK(st.f_used == 2);
  bool is_honest = false;
  for (int64_t i = 0; i < 9; ++i) is_honest = is_honest || at::equal(k, honest[i]);
  CHECK(is_honest);
  at::Tensor mk = aggregate("multikrum:f=2", X, {}, "none", &st);
  CHECK(st.kept == 9);
  CHECK(close(mk, honest.mean(0)));  // the 9 honest ones, equal weights
  at::Tensor bu = aggregate("bulyan:f=2", X, {}, "none", &st);
  CHECK(st.kept == 7);  // θ = n − 2f
  CHECK((bu - 1).abs().max().item<double>() < 0.05);
  // A plain mean is dragged far away.
  CHECK((aggregate("mean", X) - 1).abs().min().item<double>() > 5);
}

TEST_CASE("robust: krum's f is lowered to what a short round allows") {
  at::manual_seed(5);
  at::Tensor X = at::randn({5, 17});
  AggregateStats st;
  aggregate("krum:f=3", X, {}, "none", &st);
  CHECK(st.f_used == 1);  // n = 5 allows f <= (5 - 3) / 2
}

TEST_CASE("robust: normclip bounds each update's norm, fixed or by quantile") {
  at::Tensor X = at::zeros({3, 17});
  X[0][0] = 10;  // norm 10
  X[1][1] = 1;   // norm 1
  X[2][2] = 2;   // norm 2
  AggregateStats st;
  at::Tensor r = aggregate("normclip:c=2", X, {1, 1, 2}, "none", &st);
  CHECK(st.clipped == 1);
  CHECK(st.clip == doctest::Approx(2));
  at::Tensor expect = at::zeros({17});
  expect[0] = 2.0 / 4;
  expect[1] = 1.0 / 4;
  expect[2] = 4.0 / 4;
  CHECK(close(r, expect));
  r = aggregate("normclip:q=0.5", X, {}, "none", &st);  // median norm 2
  CHECK(st.clip == doctest::Approx(2));
  expect = at::zeros({17});
  expect[0] = 2.0 / 3;
  expect[1] = 1.0 / 3;
  expect[2] = 2.0 / 3;
  CHECK(close(r, expect));
}

TEST_CASE("robust: central DP clips, sums unweighted, adds N(0, (zC)^2), divides by m") {
  at::Tensor X = at::zeros({2, 17});
  X[0][0] = 30;  // clipped to 3
  X[1][1] = 1;
  at::Tensor r = aggregate("mean", X, {5, 1}, "central:clip=3,noise=0", nullptr, 4);
  at::Tensor expect = at::zeros({17});
  expect[0] = 3.0 / 4;
  expect[1] = 1.0 / 4;
  CHECK(close(r, expect));
  // The noise: a model of 17 coordinates is too small for statistics; use one of 200k.
  const TensorShapes big = {{"w", {200000}}};
  Aggregator g("mean", "central:clip=2,noise=1.5", 10, 11);
  Accumulator acc = g.make_accumulator(big);
  acc.reset(g.clip());
  compression::register_builtins();
  auto none = compression::make_compressor("none");
  compression::State st;
  acc.add({{"w", none->encode(at::zeros({200000}), st, {})}}, 1.0);
  at::Tensor noisy = g.finish(acc, 3).at("w");
  CHECK(std::abs(noisy.mean().item<double>()) < 0.01);
  CHECK(noisy.std().item<double>() == doctest::Approx(1.5 * 2 / 10).epsilon(0.01));
  // Deterministic in (seed, round), different across rounds.
  Accumulator acc2 = g.make_accumulator(big);
  acc2.reset(g.clip());
  acc2.add({{"w", none->encode(at::zeros({200000}), st, {})}}, 1.0);
  CHECK(at::equal(g.finish(acc2, 3).at("w"), noisy));
  CHECK(!at::equal(g.finish(acc2, 4).at("w"), noisy));
}

TEST_CASE("robust: adaptive clipping moves the clip towards the norms' quantile and checkpoints it") {
  at::Tensor X = at::zeros({4, 17});
  for (int i = 0; i < 4; ++i) X[i][i] = 0.1;  // every norm far below the clip
  Aggregator g("mean", "central:clip=1,noise=0,adaptive=1,quantile=0.5,clip_lr=0.2", 4, 1);
  CHECK(g.clip() == 1.0);
  aggregate("mean", X, {}, "", nullptr, 4, &g);
  CHECK(g.clip() == doctest::Approx(std::exp(-0.2 * (1.0 - 0.5))));
  const std::string saved = g.serialize_state();
  aggregate("mean", X, {}, "", nullptr, 4, &g);
  CHECK(g.clip() < std::exp(-0.2 * (1.0 - 0.5)));
  Aggregator h("mean", "central:clip=1,noise=0,adaptive=1,quantile=0.5,clip_lr=0.2", 4, 1);
  h.deserialize_state(saved);
  CHECK(h.clip() == doctest::Approx(std::exp(-0.2 * 0.5)));
  CHECK_THROWS_AS(h.deserialize_state("SPAG1xx"), FormatError);
  // Updates clipped at another clip cannot be finished.
  Accumulator acc = h.make_accumulator(kShapes);
  acc.reset(0.123);
  acc.add(dense_update(X[0]), 1.0);
  CHECK_THROWS_AS(h.finish(acc, 0), Error);
}

TEST_CASE("robust: compressed updates are decoded once, merge equals one share") {
  compression::register_builtins();
  auto topk = compression::make_compressor("topk:ratio=0.3");
  at::manual_seed(6);
  Aggregator g("median", "none", 5, 0);
  Accumulator one = g.make_accumulator(kShapes), p1 = g.make_accumulator(kShapes), p2 = g.make_accumulator(kShapes);
  for (auto* a : {&one, &p1, &p2}) a->reset(0);
  std::vector<at::Tensor> dec;
  for (int i = 0; i < 5; ++i) {
    EncodedUpdate u;
    at::Tensor flat = at::zeros({17});
    int64_t off = 0;
    for (const auto& [n, s] : kShapes) {
      compression::State st;
      compression::Encoded e = topk->encode(at::randn(s), st, {});
      at::Tensor d = compression::decode(e);
      flat.narrow(0, off, d.numel()).copy_(d.reshape({-1}));
      off += d.numel();
      u.emplace_back(n, std::move(e));
    }
    dec.push_back(flat);
    one.add(u, 1.0);
    (i < 2 ? p1 : p2).add(u, 1.0);
  }
  p1.merge(p2);
  CHECK(one.buffered_bytes() == 5 * 17 * 4);
  at::Tensor a = flatten(g.finish(one, 0));
  CHECK(close(a, std::get<0>(at::stack(dec).sort(0))[2]));
  CHECK(at::equal(a, flatten(g.finish(p1, 0))));
}

TEST_CASE("robust: a bad update is rejected and changes nothing") {
  Aggregator g("krum:f=0", "none", 3, 0);
  Accumulator acc = g.make_accumulator(kShapes);
  acc.reset(0);
  acc.add(dense_update(at::ones({17})), 1.0);
  // A dense payload holding a NaN (what a hostile peer can send; our encoder refuses to make one).
  EncodedUpdate nan = dense_update(at::ones({17}));
  const float q = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan[1].second.values.data() + 8, &q, sizeof(q));
  CHECK_THROWS_AS(acc.add(nan, 1.0), FormatError);
  EncodedUpdate missing = dense_update(at::ones({17}));
  missing.pop_back();
  CHECK_THROWS_AS(acc.add(missing, 1.0), FormatError);
  CHECK_THROWS_AS(acc.add(dense_update(at::ones({17})), 0.0), Error);
  CHECK(acc.count() == 1);
  CHECK(acc.buffered_bytes() == 17 * 4);
  Accumulator empty = g.make_accumulator(kShapes);
  CHECK_THROWS_AS(g.finish(empty, 0), Error);
}

TEST_CASE("robust: specs and combinations are strict") {
  CHECK_THROWS_AS(RobustSpec::parse("krum:g=2"), ConfigError);
  CHECK_THROWS_AS(RobustSpec::parse("krum:f=-1"), ConfigError);
  CHECK_THROWS_AS(RobustSpec::parse("trimmed_mean:beta=0.5"), ConfigError);
  CHECK_THROWS_AS(RobustSpec::parse("normclip"), ConfigError);
  CHECK_THROWS_AS(RobustSpec::parse("normclip:c=1,q=0.5"), ConfigError);
  CHECK_THROWS_AS(RobustSpec::parse("average"), ConfigError);
  CHECK(RobustSpec::parse("krum:f=2").min_updates() == 7);
  CHECK(RobustSpec::parse("bulyan:f=2").min_updates() == 11);
  CHECK(RobustSpec::parse("median").buffers());
  CHECK(!RobustSpec::parse("normclip:c=1").buffers());
  CHECK_THROWS_AS(DpSpec::parse("central:clip=1"), ConfigError);  // noise is required
  CHECK_THROWS_AS(DpSpec::parse("central:clip=0,noise=1"), ConfigError);
  CHECK_THROWS_AS(DpSpec::parse("local:clip=1,noise=1,adaptive=1"), ConfigError);
  CHECK_THROWS_AS(DpSpec::parse("global:clip=1,noise=1"), ConfigError);
  const auto r = RobustSpec::parse("median");
  const auto c = DpSpec::parse("central:clip=1,noise=1");
  CHECK_THROWS_AS(check_combination(r, c, "none", "fedavg"), ConfigError);
  CHECK_THROWS_AS(check_combination(r, DpSpec::parse("none"), "acp:rank=2", "fedavg"), ConfigError);
  // tcs share=mean averages per position, which only the plain mean does.
  CHECK_THROWS_AS(check_combination(r, DpSpec::parse("none"), "tcs:ratio=0.2,keep=0.5,share=mean", "fedavg"),
                  ConfigError);
  CHECK_THROWS_AS(check_combination(RobustSpec::parse("mean"), c, "tcs:ratio=0.2,keep=0.5,share=mean", "fedavg"),
                  ConfigError);
  CHECK_NOTHROW(check_combination(RobustSpec::parse("mean"), DpSpec::parse("none"), "tcs:ratio=0.2,keep=0.5,share=mean",
                                  "fedavg"));
  CHECK_NOTHROW(check_combination(r, DpSpec::parse("none"), "tcs:ratio=0.2,keep=0.5", "fedavg"));
  CHECK_THROWS_AS(check_combination(RobustSpec::parse("mean"), c, "none", "scaffold"), ConfigError);
  CHECK_NOTHROW(check_combination(RobustSpec::parse("mean"), c, "topk:ratio=0.1", "fedavg"));
  CHECK_NOTHROW(check_combination(RobustSpec::parse("mean"), DpSpec::parse("none"), "acp:rank=2", "scaffold"));
  // Adaptive clipping: the count's noise must leave room for the delta's.
  CHECK_THROWS_AS(Aggregator("mean", "central:clip=1,noise=1,adaptive=1,count_noise=0.4", 10, 0), ConfigError);
  CHECK_NOTHROW(Aggregator("mean", "central:clip=1,noise=1,adaptive=1,count_noise=2", 10, 0));
}

TEST_CASE("robust: local DP clips the whole update and adds seeded noise") {
  std::map<std::string, at::Tensor> u = {{"a", at::full({3, 4}, 3.0)}, {"b", at::full({5}, 4.0)}};
  const double before = std::sqrt(12 * 9.0 + 5 * 16.0);
  std::map<std::string, at::Tensor> v = u;
  CHECK(local_dp(v, 1.0, 0.0, 9) == doctest::Approx(before));
  double sq = 0;
  for (auto& [n, t] : v) sq += t.square().sum().item<double>();
  CHECK(std::sqrt(sq) == doctest::Approx(1.0));
  std::map<std::string, at::Tensor> n1 = u, n2 = u, n3 = u;
  local_dp(n1, 1.0, 0.5, 9);
  local_dp(n2, 1.0, 0.5, 9);
  local_dp(n3, 1.0, 0.5, 10);
  CHECK(at::equal(n1.at("a"), n2.at("a")));
  CHECK(!at::equal(n1.at("a"), n3.at("a")));
  CHECK(at::equal(u.at("a"), at::full({3, 4}, 3.0)));  // the input map's tensors are not modified
}

TEST_CASE("robust: epsilon grows with rounds and shrinks with noise, +inf without DP") {
  Aggregator none("mean", "none", 10, 0);
  CHECK(std::isinf(none.epsilon(10, 0.1, 1)));
  Aggregator a("mean", "central:clip=1,noise=1", 10, 0), b("mean", "central:clip=1,noise=2", 10, 0);
  CHECK(a.epsilon(10, 0.1, 0) < a.epsilon(20, 0.1, 0));
  CHECK(b.epsilon(20, 0.1, 0) < a.epsilon(20, 0.1, 0));
  Aggregator l("mean", "local:clip=1,noise=2", 10, 0);
  CHECK(l.epsilon(100, 0.1, 3) < l.epsilon(100, 0.1, 5));
}

TEST_CASE("robust: dense updates that view a received frame are decoded and released at once") {
  // The buffering path decodes each update through a scratch aggregator, which
  // holds a view instead of writing it: the row is taken from the view, and the
  // frame is not kept past add().
  auto none = compression::make_compressor("none");
  at::manual_seed(8);
  Aggregator g("median", "none", 3, 0);
  Accumulator viewed = g.make_accumulator(kShapes), owned = g.make_accumulator(kShapes);
  viewed.reset(0);
  owned.reset(0);
  for (int i = 0; i < 3; ++i) {
    EncodedUpdate u;
    for (const auto& [n, s] : kShapes) {
      compression::State st;
      u.emplace_back(n, none->encode(at::randn(s), st, {}));
    }
    auto frame = std::make_shared<std::vector<uint8_t>>();
    for (const auto& [n, e] : u) frame->insert(frame->end(), e.values.begin(), e.values.end());
    EncodedUpdate v = u;
    size_t off = 0;
    for (auto& [n, e] : v) {
      const size_t size = e.values.size();
      e.values = compression::Bytes::view(frame->data() + off, size, frame);
      off += size;
    }
    viewed.add(v, 1.0);
    owned.add(u, 1.0);
    v.clear();
    CHECK(frame.use_count() == 1);
  }
  CHECK(at::equal(flatten(g.finish(viewed, 0)), flatten(g.finish(owned, 0))));
}
