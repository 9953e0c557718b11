// federation::AsyncEngine and its staleness rules: buffered asynchronous
// aggregation equals synchronous FedAvg when nothing is stale and nothing is
// discounted, staleness discounts match a hand computation, and the
// combinations that need a round barrier are refused by name.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>

#include "aggregation/robust.h"
#include "core/error.h"
#include "federation/async_engine.h"
#include "federation/round_engine.h"
#include "federation/run_config.h"

using namespace sparrow;
using federation::Arrival;
using federation::AsyncEngine;
using federation::RoundEngine;
using federation::Weights;

namespace {

const aggregation::TensorShapes kShapes = {{"a", {2, 3}}, {"b", {3}}};

Weights start() {
  at::manual_seed(7);
  return {{"a", at::randn({2, 3})}, {"b", at::randn({3})}};
}

using compression::dense_encoded;

// Client i's update of round r: random values, its own sample count, a
// SCAFFOLD control delta.
Arrival update_of(int r, int i) {
  at::manual_seed(static_cast<uint64_t>(100 * r + i));
  Arrival x;
  x.update = {{"a", dense_encoded(at::randn({2, 3}))}, {"b", dense_encoded(at::randn({3}))}};
  x.weight = 3.0 + 7.0 * i;  // samples
  x.control_delta = {{"a", at::randn({2, 3})}, {"b", at::randn({3})}};
  x.metrics["train_loss"] = 0.5 + i;
  return x;
}

Arrival flat(float a, float b, double w) {
  Arrival x;
  x.update = {{"a", dense_encoded(at::full({2, 3}, a))}, {"b", dense_encoded(at::full({3}, b))}};
  x.weight = w;
  return x;
}

bool same_bits(const Weights& x, const Weights& y) {
  if (x.size() != y.size()) return false;
  for (const auto& [k, v] : x)
    if (!y.count(k) || !at::equal(v, y.at(k))) return false;
  return true;
}

federation::RunConfig async_config() {
  federation::RunConfig c;
  c.mode = "async";
  c.clients = 20;
  return c;
}

std::string refusal(const federation::RunConfig& c) {
  try {
    federation::validate(c);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("staleness rules: the built-ins against a hand computation") {
  auto w = [](const std::string& spec, uint64_t s) { return federation::make_staleness(spec)(s); };
  CHECK(w("const", 0) == 1.0);
  CHECK(w("const", 1000) == 1.0);
  // poly: (1 + s)^-a
  CHECK(w("poly:a=0.5", 0) == 1.0);
  CHECK(w("poly:a=0.5", 3) == doctest::Approx(0.5));        // 4^-1/2
  CHECK(w("poly:a=0.5", 8) == doctest::Approx(1.0 / 3.0));  // 9^-1/2
  CHECK(w("poly:a=1", 4) == doctest::Approx(0.2));
  CHECK(w("poly", 3) == doctest::Approx(0.5));  // a = 0.5 by default
  CHECK(w("poly:a=0", 50) == 1.0);
  // hinge: 1 up to b, then 1 / (a (s - b) + 1)
  CHECK(w("hinge:a=10,b=4", 4) == 1.0);
  CHECK(w("hinge:a=10,b=4", 5) == doctest::Approx(1.0 / 11.0));
  CHECK(w("hinge:a=10,b=4", 7) == doctest::Approx(1.0 / 31.0));
  CHECK(w("hinge:a=0.5,b=0", 2) == doctest::Approx(0.5));
  SUBCASE("bad specs are ConfigErrors naming the rule") {
    CHECK_THROWS_WITH_AS(federation::make_staleness("exp:a=1"), doctest::Contains("exp"), ConfigError);
    CHECK_THROWS_AS(federation::make_staleness("poly:a=0.5,b=1"), ConfigError);  // unused key
    CHECK_THROWS_AS(federation::make_staleness("poly:a=-1"), ConfigError);
    CHECK_THROWS_AS(federation::make_staleness("hinge:a=nan"), ConfigError);
  }
  SUBCASE("a user's rule is registered by name and held to the contract") {
    federation::register_staleness(
        "test_half", [](Spec&) -> federation::StalenessFn { return [](uint64_t s) { return s == 0 ? 1.0 : 0.5; }; },
        "halves every stale update");
    CHECK(w("test_half", 3) == 0.5);
    federation::register_staleness(
        "test_grows", [](Spec&) -> federation::StalenessFn { return [](uint64_t s) { return 1.0 + s; }; },
        "breaks the contract");
    CHECK_THROWS_WITH_AS(federation::make_staleness("test_grows"), doctest::Contains("(0, 1]"), ConfigError);
    const auto names = federation::staleness_names();
    CHECK(std::find(names.begin(), names.end(), "hinge") != names.end());
  }
}

TEST_CASE("async engine: buffer = concurrency = clients and const staleness equal synchronous FedAvg bit for bit") {
  // Three clients, every one of them each round: the synchronous rounds and
  // the asynchronous steps see the same updates (arriving in client-id order,
  // the synchronous fold's order), with a stateful server optimiser and
  // SCAFFOLD's control, so any difference in weight, order, round number or
  // divisor shows in the bits.
  federation::GlobalConfig g;
  g.algorithm = "scaffold";
  g.server_optimizer = "fedavgm:lr=0.7,momentum=0.9";
  federation::GlobalModel sync_gm(g, start(), {"a", "b"});
  federation::GlobalModel async_gm(g, start(), {"a", "b"});
  aggregation::Aggregator sync_aggr("mean", "none", 3, 1), async_aggr("mean", "none", 3, 1);
  RoundEngine sync(sync_gm, sync_aggr, kShapes, 1, int64_t{1} << 20);
  AsyncEngine async(async_gm, async_aggr, kShapes, /*buffer=*/3, "const");
  const std::vector<std::string> ids = {"0", "1", "2"};
  for (int r = 1; r <= 4; ++r) {
    const auto& sctx = sync.open(static_cast<uint64_t>(r), ids);
    CHECK(async.version() == static_cast<uint64_t>(r - 1));
    CHECK(async.contexts().at("a").round == sctx.at("a").round);
    CHECK(async.contexts().at("a").num_workers == sctx.at("a").num_workers);
    for (int i : {2, 0, 1}) sync.add(0, ids[static_cast<size_t>(i)], update_of(r, i));  // any arrival order
    sync.close();
    for (int i = 0; i < 3; ++i) {
      const AsyncEngine::Folded f = async.add(ids[static_cast<size_t>(i)], async.version(), update_of(r, i));
      CHECK(f.staleness == 0);
      CHECK(f.discount == 1.0);
      CHECK(f.buffered == static_cast<size_t>(i + 1));
    }
    REQUIRE(async.due());
    CHECK(async.metric_sum().at("train_loss") == sync.metric_sum().at("train_loss"));
    REQUIRE(sync.step(3).applied);
    REQUIRE(async.step(3).applied);
    CHECK(async.buffered() == 0);
    CHECK(same_bits(sync_gm.weights(), async_gm.weights()));
    CHECK(same_bits(sync_gm.control(), async_gm.control()));
  }
  CHECK(sync_gm.optimizer().serialize_state() == async_gm.optimizer().serialize_state());
  // And the test can tell: a discount moves the bits.
  federation::GlobalModel other_gm(g, start(), {"a", "b"});
  aggregation::Aggregator other_aggr("mean", "none", 3, 1);
  AsyncEngine other(other_gm, other_aggr, kShapes, 3, "poly:a=0.5");
  for (int i = 0; i < 3; ++i) other.add(ids[static_cast<size_t>(i)], 0, update_of(1, i));
  REQUIRE(other.step(3).applied);
  other.add("0", 0, update_of(2, 0));  // stale by one: discounted
  for (int i = 1; i < 3; ++i) other.add(ids[static_cast<size_t>(i)], 1, update_of(2, i));
  REQUIRE(other.step(3).applied);
  federation::GlobalModel ref_gm(g, start(), {"a", "b"});
  aggregation::Aggregator ref_aggr("mean", "none", 3, 1);
  AsyncEngine ref(ref_gm, ref_aggr, kShapes, 3, "const");
  for (int r = 1; r <= 2; ++r) {
    for (int i = 0; i < 3; ++i) ref.add(ids[static_cast<size_t>(i)], ref.version(), update_of(r, i));
    REQUIRE(ref.step(3).applied);
  }
  CHECK_FALSE(same_bits(other_gm.weights(), ref_gm.weights()));
}

TEST_CASE("async engine: a step is the staleness-weighted mean of the buffer, by hand") {
  federation::GlobalModel gm({}, {{"a", at::zeros({2, 3})}, {"b", at::zeros({3})}}, {"a", "b"});
  aggregation::Aggregator aggr("mean", "none", 2, 1);
  AsyncEngine engine(gm, aggr, kShapes, /*buffer=*/2, "poly:a=0.5");
  // Version 0 -> 1: two fresh updates, 1 and 3 with 1 and 3 samples: mean 2.5.
  CHECK(engine.add("a", 0, flat(1, 1, 1)).buffered == 1);
  CHECK_FALSE(engine.due());
  engine.add("b", 0, flat(3, 3, 3));
  REQUIRE(engine.due());
  REQUIRE(engine.step(2).applied);
  CHECK(engine.version() == 1);
  CHECK(engine.contexts().at("a").round == 2);
  CHECK(at::allclose(gm.weights().at("a"), at::full({2, 3}, 2.5f)));
  // Version 1 -> 2: client c trained from version 0 (staleness 1, w = 2^-1/2)
  // sends 4 with 2 samples; d, fresh, sends 1 with 1 sample.
  const AsyncEngine::Folded fc = engine.add("c", 0, flat(4, -4, 2));
  CHECK(fc.staleness == 1);
  CHECK(fc.discount == doctest::Approx(1.0 / std::sqrt(2.0)));
  const AsyncEngine::Folded fd = engine.add("d", 1, flat(1, 1, 1));
  CHECK(fd.staleness == 0);
  CHECK(engine.max_staleness() == 1);
  CHECK(engine.mean_staleness() == doctest::Approx(0.5));
  const double wc = 2 / std::sqrt(2.0), wd = 1;
  CHECK(engine.sum().total_weight() == doctest::Approx(wc + wd));
  const double mean_a = (wc * 4 + wd * 1) / (wc + wd), mean_b = (wc * -4 + wd * 1) / (wc + wd);
  REQUIRE(engine.step(2).applied);
  CHECK(at::allclose(gm.weights().at("a"), at::full({2, 3}, static_cast<float>(2.5 + mean_a))));
  CHECK(at::allclose(gm.weights().at("b"), at::full({3}, static_cast<float>(2.5 + mean_b))));
  CHECK(engine.version() == 2);
}

TEST_CASE("async engine: refused updates change nothing") {
  federation::GlobalModel gm({}, {{"a", at::zeros({2, 3})}, {"b", at::zeros({3})}}, {"a", "b"});
  aggregation::Aggregator aggr("mean", "none", 2, 1);
  AsyncEngine engine(gm, aggr, kShapes, 2, "const", /*version=*/5);
  CHECK(engine.version() == 5);
  CHECK(engine.contexts().at("a").round == 6);  // a resumed run's next step
  CHECK_THROWS_WITH_AS(engine.add("x", 6, flat(1, 1, 1)), doctest::Contains("version 6"), FormatError);
  CHECK_THROWS_AS(engine.add("x", 5, flat(NAN, 1, 1)), FormatError);
  CHECK(engine.buffered() == 0);
  CHECK(engine.sum().total_weight() == 0);
  CHECK_THROWS_AS(engine.step(2), Error);  // empty buffer
  engine.add("x", 5, flat(2, 2, 1));
  REQUIRE(engine.step(2).applied);
  CHECK(at::allclose(gm.weights().at("a"), at::full({2, 3}, 2.f)));
}

TEST_CASE("async engine: a robust rule combines the buffer's rows") {
  federation::GlobalModel gm({}, {{"a", at::zeros({2, 3})}, {"b", at::zeros({3})}}, {"a", "b"});
  aggregation::Aggregator aggr("median", "none", 3, 1);
  AsyncEngine engine(gm, aggr, kShapes, 3, "poly:a=0.5");
  engine.add("a", 0, flat(1, 1, 1));
  engine.add("b", 0, flat(2, 2, 1));
  engine.add("c", 0, flat(100, 100, 1));  // an outlier the median ignores
  REQUIRE(engine.step(3).applied);
  CHECK(at::allclose(gm.weights().at("a"), at::full({2, 3}, 2.f)));
}

TEST_CASE("async config: defaults, and what cannot work without a round barrier is refused by key") {
  federation::RunConfig c = async_config();
  c.clients_per_round = 8;
  CHECK(refusal(c).empty());
  const federation::AsyncSettings s = federation::async_settings(c);
  CHECK(s.enabled);
  CHECK(s.buffer == 8);           // 0 = clients_per_round
  CHECK(s.max_concurrency == 8);  // 0 = buffer
  CHECK(s.staleness == "poly:a=0.5");
  c.buffer = 4;
  c.max_concurrency = 16;
  CHECK(federation::async_settings(c).buffer == 4);
  CHECK(federation::async_settings(c).max_concurrency == 16);
  CHECK(refusal(c).empty());
  c.max_concurrency = 21;  // more than the clients
  CHECK(refusal(c).find("'max_concurrency'") != std::string::npos);
  c.max_concurrency = 0;
  c.buffer = 21;  // never fills: a client trains a version once
  CHECK(refusal(c).find("'buffer' must be at most clients = 20") != std::string::npos);

  SUBCASE("mode") {
    federation::RunConfig x = async_config();
    x.mode = "asynchronous";
    CHECK(refusal(x).find("'mode'") != std::string::npos);
  }
  SUBCASE("the async keys are refused in sync mode, where they mean nothing") {
    federation::RunConfig x;
    x.buffer = 4;
    CHECK(refusal(x).find("'buffer' has no effect unless mode = \"async\"") != std::string::npos);
    x = federation::RunConfig{};
    x.max_concurrency = 4;
    CHECK(refusal(x).find("'max_concurrency'") != std::string::npos);
    x = federation::RunConfig{};
    x.staleness = "const";
    CHECK(refusal(x).find("'staleness'") != std::string::npos);
  }
  SUBCASE("staleness") {
    federation::RunConfig x = async_config();
    x.staleness = "poly:alpha=1";
    CHECK(refusal(x).find("'staleness'") != std::string::npos);
  }
  SUBCASE("SecAgg+") {
    federation::RunConfig x = async_config();
    x.secagg = "secagg+";
    CHECK(refusal(x).find("'secagg'") != std::string::npos);
    x.mode = "sync";
    CHECK(refusal(x).empty());
  }
  SUBCASE("central DP; local DP runs") {
    federation::RunConfig x = async_config();
    x.dp = "central:clip=1,noise=1";
    CHECK(refusal(x).find("'dp'") != std::string::npos);
    x.dp = "local:clip=1,noise=1";
    CHECK(refusal(x).empty());
  }
  SUBCASE("codecs that decode with the round's shared state; the others run") {
    federation::RunConfig x = async_config();
    x.compression = "acp:rank=2";
    CHECK(refusal(x).find("'compression'") != std::string::npos);
    x.compression = "tcs:ratio=0.1";
    CHECK(refusal(x).find("'compression'") != std::string::npos);
    x.compression = "topk:ratio=0.1";
    CHECK(refusal(x).empty());
    x.compression = "dgc:ratio=0.01";
    x.downlink = "topk:ratio=0.5";
    CHECK(refusal(x).empty());
  }
  SUBCASE("a robust rule needs enough updates in the buffer") {
    federation::RunConfig x = async_config();
    x.aggregator = "krum:f=2";
    x.buffer = 4;
    CHECK(refusal(x).find("'buffer'") != std::string::npos);
    x.buffer = 10;
    CHECK(refusal(x).empty());
  }
}
