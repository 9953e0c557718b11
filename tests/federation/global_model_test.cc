// federation::GlobalModel: the global step both sparrow-server and sparrow-sim
// run (tests/integration check the two programs end to end).
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <limits>

#include "aggregation/aggregator.h"
#include "aggregation/robust.h"
#include "compression/compressor.h"
#include "federation/global_model.h"

using namespace sparrow;
using federation::GlobalConfig;
using federation::GlobalModel;
using federation::Weights;

namespace {

const aggregation::TensorShapes kShapes = {{"a", {2, 3}}, {"b", {3}}};

Weights zeros() { return {{"a", at::zeros({2, 3})}, {"b", at::zeros({3})}}; }

compression::Encoded dense(const at::Tensor& t) {
  compression::Encoded e;
  e.format = compression::Format::kDense;
  e.shape = t.sizes().vec();
  e.value_type = compression::ValueType::kF32;
  const at::Tensor c = t.contiguous();
  e.values.resize(static_cast<size_t>(c.numel()) * 4);
  std::memcpy(e.values.data(), c.data_ptr<float>(), e.values.size());
  return e;
}

aggregation::EncodedUpdate update(float a, float b) {
  return {{"a", dense(at::full({2, 3}, a))}, {"b", dense(at::full({3}, b))}};
}

}  // namespace

TEST_CASE("global step: the mean delta moves W, and SCAFFOLD's c averages over the population") {
  GlobalConfig gc;
  gc.algorithm = "scaffold";
  GlobalModel gm(gc, zeros(), {"a", "b"});
  aggregation::Aggregator aggr("mean", "none", 2, 1);
  aggregation::Accumulator acc = aggr.make_accumulator(kShapes);
  acc.reset(aggr.clip());
  acc.add(update(1, 2), 1.0);
  acc.add(update(3, 4), 1.0);
  const Weights control_sum = {{"a", at::full({2, 3}, 8.f)}, {"b", at::full({3}, 4.f)}};
  const federation::StepResult r = gm.step(aggr, acc, control_sum, 1, 4.0);
  REQUIRE(r.applied);
  CHECK(at::allclose(gm.weights().at("a"), at::full({2, 3}, 2.f)));
  CHECK(at::allclose(gm.weights().at("b"), at::full({3}, 3.f)));
  CHECK(at::allclose(gm.control().at("a"), at::full({2, 3}, 2.f)));  // 8 / population 4
  CHECK(at::allclose(gm.control().at("b"), at::full({3}, 1.f)));
}

TEST_CASE("global step: a non-finite aggregate abandons the round and changes nothing") {
  GlobalModel gm(GlobalConfig{}, zeros(), {"a", "b"});
  // Adaptive clipping keeps state that a failed round must not advance.
  aggregation::Aggregator aggr("mean", "central:clip=1e39,noise=0,adaptive=1", 2, 1);
  const std::string state = aggr.serialize_state();
  aggregation::Accumulator acc = aggr.make_accumulator(kShapes);
  acc.reset(aggr.clip());
  // Each update is admitted (one entry of FLT_MAX / 2); their sum overflows.
  at::Tensor a = at::zeros({2, 3});
  a[0][0] = std::numeric_limits<float>::max() / 2;
  for (int i = 0; i < 3; ++i) acc.add({{"a", dense(a)}, {"b", dense(at::zeros({3}))}}, 1.0);
  const federation::StepResult r = gm.step(aggr, acc, {}, 1, 1.0);
  CHECK_FALSE(r.applied);
  CHECK_FALSE(r.error.empty());
  CHECK(at::equal(gm.weights().at("a"), at::zeros({2, 3})));
  CHECK(aggr.serialize_state() == state);
  CHECK(gm.optimizer().steps() == 0);
}

TEST_CASE("codec contexts: rounds are 1-based, and ACP's shared factor is the seeded one until a step") {
  GlobalConfig gc;
  gc.seed = 7;
  gc.compression = "acp:rank=1";
  GlobalModel gm(gc, {{"a", at::zeros({4, 5})}, {"b", at::zeros({5})}}, {"a", "b"});
  CHECK_THROWS(gm.contexts(0, 2));
  const aggregation::ContextMap c1 = gm.contexts(1, 2);
  CHECK(c1.at("a").round == 1);
  CHECK(c1.at("a").seed == 7);
  CHECK(c1.at("a").num_workers == 2);
  REQUIRE(c1.at("a").shared_factor.defined());
  CHECK_FALSE(c1.at("b").shared_factor.defined());  // a vector is never factored
  // Held: the same factor again for the same round.
  CHECK(at::equal(gm.contexts(1, 2).at("a").shared_factor, c1.at("a").shared_factor));
}

TEST_CASE("downlink: B moves by the decoded C_r, and B equals W for a lossless codec") {
  GlobalConfig gc;
  gc.downlink = "topk:ratio=0.5";
  GlobalModel gm(gc, zeros(), {"a", "b"});
  aggregation::Aggregator aggr("mean", "none", 1, 1);
  aggregation::Accumulator acc = aggr.make_accumulator(kShapes);
  acc.reset(aggr.clip());
  acc.add({{"a", dense(at::arange(6, at::kFloat).reshape({2, 3}))}, {"b", dense(at::ones({3}))}}, 1.0);
  const federation::StepResult r = gm.step(aggr, acc, {}, 1, 1.0);
  REQUIRE(r.applied);
  REQUIRE(r.downlink.size() == 2);
  CHECK(r.downlink[0].first == "a");  // model order
  Weights b = zeros();
  for (const auto& [n, e] : r.downlink) compression::decode_add(e, b.at(n), 1.0f);
  for (const auto& [n, v] : b) CHECK(at::equal(v, gm.broadcast().at(n)));
  CHECK_FALSE(at::equal(gm.broadcast().at("a"), gm.weights().at("a")));  // top half only
}

TEST_CASE("downlink: a ternary fedtopk step with stc at its ratio keeps B at W") {
  // The server's step is ±mu on k positions: stc at the same ratio encodes
  // it without loss, so clients train from the model itself (no lag); with
  // fp32 values the same downlink lags W.
  for (const bool sign : {true, false}) {
    CAPTURE(sign);
    GlobalConfig gc;
    gc.server_optimizer = std::string("fedtopk:ratio=0.34,momentum=0.5") + (sign ? ",values=sign" : "");
    gc.downlink = "stc:ratio=0.34";
    GlobalModel gm(gc, zeros(), {"a", "b"});
    aggregation::Aggregator aggr("mean", "none", 1, 1);
    aggregation::Accumulator acc = aggr.make_accumulator(kShapes);
    at::manual_seed(7);
    float gap = 0;
    for (uint64_t r = 1; r <= 6; ++r) {
      acc.reset(aggr.clip());
      acc.add({{"a", dense(at::randn({2, 3}))}, {"b", dense(at::randn({3}))}}, 1.0);
      const federation::StepResult res = gm.step(aggr, acc, {}, r, 1.0);
      REQUIRE(res.applied);
      for (const auto& n : gm.names())
        gap = std::max(gap, (gm.weights().at(n) - gm.broadcast().at(n)).abs().max().item<float>());
      // Each step moves at most k = 3 of a's 6 and 2 of b's 3 positions.
      CHECK(res.downlink[0].second.count <= 3);
    }
    if (sign)
      CHECK(gap <= 1e-6f);
    else
      CHECK(gap > 1e-3f);
  }
}

TEST_CASE("downlink: a tensor the step leaves unchanged is not sent, one tensor always is") {
  // scope=model with k = 1 of 9 positions: only a's largest moves, so C_r
  // names a alone; B still equals W.
  GlobalConfig gc;
  gc.server_optimizer = "fedtopk:ratio=0.1,scope=model,values=sign";
  gc.downlink = "stc:ratio=1";
  GlobalModel gm(gc, zeros(), {"a", "b"});
  aggregation::Aggregator aggr("mean", "none", 1, 1);
  aggregation::Accumulator acc = aggr.make_accumulator(kShapes);
  acc.reset(aggr.clip());
  acc.add({{"a", dense(at::tensor({0.0f, 0.0f, 3.0f, 0.0f, 0.0f, 0.0f}).reshape({2, 3}))},
           {"b", dense(at::tensor({0.5f, 0.0f, 0.0f}))}},
          1.0);
  federation::StepResult r = gm.step(aggr, acc, {}, 1, 1.0);
  REQUIRE(r.applied);
  REQUIRE(r.downlink.size() == 1);
  CHECK(r.downlink[0].first == "a");
  for (const auto& n : gm.names()) CHECK(at::equal(gm.weights().at(n), gm.broadcast().at(n)));
  // A step that moves nothing (a zero aggregate) still sends one tensor.
  GlobalConfig gz;
  gz.downlink = "stc:ratio=0.5";
  GlobalModel gm2(gz, zeros(), {"a", "b"});
  acc.reset(aggr.clip());
  acc.add(update(0.0f, 0.0f), 1.0);
  r = gm2.step(aggr, acc, {}, 1, 1.0);
  REQUIRE(r.applied);
  CHECK(r.downlink.size() == 1);
}
