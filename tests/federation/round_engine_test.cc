// federation::RoundEngine: the round's phases both drivers go through, in
// turn only; abandon changes nothing; SecAgg+'s unmasked sum is folded as
// the survivors' weighted mean.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include "aggregation/robust.h"
#include "core/error.h"
#include "federation/round_engine.h"
#include "secagg/secagg.h"

using namespace sparrow;
using federation::Arrival;
using federation::RoundEngine;
using federation::Weights;

namespace {

const aggregation::TensorShapes kShapes = {{"a", {2, 3}}, {"b", {3}}};

Weights zeros() { return {{"a", at::zeros({2, 3})}, {"b", at::zeros({3})}}; }

using compression::dense_encoded;

Arrival update(float a, float b, double w = 1) {
  Arrival x;
  x.update = {{"a", dense_encoded(at::full({2, 3}, a))}, {"b", dense_encoded(at::full({3}, b))}};
  x.weight = w;
  x.metrics["train_loss"] = a;
  return x;
}

}  // namespace

TEST_CASE("round engine: open, add in any order, close and step move the model by the mean") {
  federation::GlobalModel gm({}, zeros(), {"a", "b"});
  aggregation::Aggregator aggr("mean", "none", 2, 1);
  RoundEngine engine(gm, aggr, kShapes, 1, int64_t{1} << 20);
  CHECK(engine.phase() == RoundEngine::Phase::kIdle);
  CHECK_THROWS_AS(engine.close(), Error);  // out of turn
  const auto& ctx = engine.open(1, {"10", "2"});
  CHECK(ctx.at("a").round == 1);
  CHECK(ctx.at("a").num_workers == 2);
  CHECK_THROWS_AS(engine.open(2, {"1"}), Error);
  CHECK_THROWS_AS(engine.step(2), Error);
  engine.add(0, "10", update(3, 4));  // early: "2" comes first in the order
  engine.add(0, "2", update(1, 2));
  engine.close();
  CHECK(engine.sum().count() == 2);
  CHECK(engine.metric_sum().at("train_loss") == doctest::Approx(4.0));
  const federation::StepResult r = engine.step(2);
  REQUIRE(r.applied);
  CHECK(engine.phase() == RoundEngine::Phase::kIdle);
  CHECK(at::allclose(gm.weights().at("a"), at::full({2, 3}, 2.f)));
  CHECK(at::allclose(gm.weights().at("b"), at::full({3}, 3.f)));
  CHECK(engine.sum().count() == 0);  // released after the step
}

TEST_CASE("round engine: an abandoned round changes nothing, and the next one starts clean") {
  federation::GlobalModel gm({}, zeros(), {"a", "b"});
  aggregation::Aggregator aggr("mean", "none", 2, 1);
  RoundEngine engine(gm, aggr, kShapes, 1, int64_t{1} << 20);
  engine.open(1, {"0", "1"});
  engine.add(0, "1", update(5, 5));  // held
  engine.abandon();
  CHECK(engine.phase() == RoundEngine::Phase::kIdle);
  CHECK(at::equal(gm.weights().at("a"), at::zeros({2, 3})));
  engine.open(1, {"0", "1"});
  engine.add(0, "0", update(1, 1));
  engine.close();
  CHECK(engine.sum().count() == 1);  // not the abandoned round's
  REQUIRE(engine.step(2).applied);
  CHECK(at::allclose(gm.weights().at("a"), at::full({2, 3}, 1.f)));
}

TEST_CASE("round engine: SecAgg+'s unmasked ring sum is folded as the survivors' weighted mean") {
  federation::GlobalModel gm({}, zeros(), {"a", "b"});
  aggregation::Aggregator aggr("mean", "none", 2, 1);
  RoundEngine engine(gm, aggr, kShapes, 1, int64_t{1} << 20);
  engine.open(1, {"0", "1"});
  // Two clients quantised w_i * x_i with w = (1, 3), x = (2, 6): Σ = 20, / Σw = 5.
  const double scale = secagg::ring_scale(2, 100.0);
  std::vector<uint32_t> sum(9);
  for (auto& v : sum) v = static_cast<uint32_t>(std::llround(20.0 * scale));
  engine.add_secagg_sum(sum, scale, 4.0, 40.0, {{10.0, {{"train_loss", 1.0}}}, {30.0, {{"train_loss", 2.0}}}});
  engine.close();
  CHECK(engine.sum().total_weight() == doctest::Approx(40.0));
  CHECK(engine.metric_sum().at("train_loss") / engine.metric_weight().at("train_loss") == doctest::Approx(1.75));
  CHECK_THROWS_AS(engine.add_secagg_sum(std::vector<uint32_t>(3), scale, 4.0, 40.0), Error);  // closed
  REQUIRE(engine.step(2).applied);
  CHECK(at::allclose(gm.weights().at("a"), at::full({2, 3}, 5.f), 1e-3));
}
