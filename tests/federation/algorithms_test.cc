// federation/algorithms.h: FedNova's normalised averaging and FedDyn's server
// step, against hand computations, and the combinations their keys refuse.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "aggregation/aggregator.h"
#include "aggregation/robust.h"
#include "compression/compressor.h"
#include "core/error.h"
#include "federation/algorithms.h"
#include "federation/global_model.h"
#include "federation/run_config.h"

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

aggregation::EncodedUpdate update(const at::Tensor& a, const at::Tensor& b) {
  return {{"a", dense(a)}, {"b", dense(b)}};
}

// One global step of `gc` over client updates (delta_a, delta_b, num_samples),
// folded as a driver folds them (fold_terms with `rc`).
Weights one_step(const GlobalConfig& gc, const federation::RunConfig& rc,
                 const std::vector<std::tuple<at::Tensor, at::Tensor, uint64_t>>& clients) {
  GlobalModel gm(gc, zeros(), {"a", "b"});
  aggregation::Aggregator aggr("mean", "none", static_cast<int>(clients.size()), 1);
  aggregation::Accumulator acc = aggr.make_accumulator(kShapes);
  acc.reset(aggr.clip());
  Weights control_sum;
  for (const auto& [a, b, n] : clients) {
    federation::Arrival arr;
    federation::fold_terms(rc, n, arr);
    acc.add(update(a, b), arr.weight);
    for (const auto& [k, v] : arr.control_delta) {
      if (control_sum.count(k))
        control_sum[k] = control_sum[k] + v;
      else
        control_sum[k] = v.clone();
    }
  }
  const federation::StepResult r = gm.step(aggr, acc, control_sum, 1, 1.0);
  REQUIRE(r.applied);
  return gm.weights();
}

}  // namespace

TEST_CASE("fednova: local steps and the momentum normaliser a_i") {
  CHECK(federation::fednova_steps(100, 2, 32) == 8);  // 2 epochs x ceil(100 / 32)
  CHECK(federation::fednova_steps(10, 1, 32) == 1);   // a batch larger than the data: one step an epoch
  CHECK(federation::fednova_norm(5, 0.0) == 5.0);
  // a = Σ_{t=1..tau} (1 - rho^t) / (1 - rho): 1 + 1.5 + 1.75 for tau 3, rho 0.5.
  CHECK(federation::fednova_norm(3, 0.5) == doctest::Approx(4.25));
}

TEST_CASE("fednova: unequal local steps against a hand computation") {
  federation::RunConfig rc;
  rc.algorithm = "fednova";
  rc.local_epochs = 1;
  rc.batch_size = 32;
  GlobalConfig gc;
  gc.algorithm = "fednova";
  // Client 1: 32 samples, tau 1, delta 1. Client 2: 96 samples, tau 3, delta 6.
  // p = (1/4, 3/4); d = (1/1, 6/3) = (1, 2); Σ p d = 1.75; tau_eff = 1/4 + 9/4 =
  // 2.5; the update is 4.375 (FedAvg's would be 1/4 + 18/4 = 4.75).
  const Weights w = one_step(
      gc, rc, {{at::full({2, 3}, 1.f), at::full({3}, 1.f), 32}, {at::full({2, 3}, 6.f), at::full({3}, 6.f), 96}});
  CHECK(at::allclose(w.at("a"), at::full({2, 3}, 4.375f)));
  CHECK(at::allclose(w.at("b"), at::full({3}, 4.375f)));

  federation::Arrival arr;
  federation::fold_terms(rc, 96, arr);
  CHECK(arr.weight == doctest::Approx(32.0));  // n / a = 96 / 3
  CHECK(arr.control_delta.size() == 3);
  for (const auto& kv : arr.control_delta) CHECK(federation::is_fednova_key(kv.first));
}

TEST_CASE("fednova with equal local steps is fedavg") {
  at::manual_seed(3);
  std::vector<std::tuple<at::Tensor, at::Tensor, uint64_t>> clients;
  // batch 64: 40, 64 and 50 samples are one step each; with momentum a_i are equal too.
  for (uint64_t n : {40, 64, 50}) clients.emplace_back(at::randn({2, 3}), at::randn({3}), n);
  for (double momentum : {0.0, 0.9}) {
    federation::RunConfig rc;
    rc.local_epochs = 2;
    rc.batch_size = 64;
    rc.momentum = momentum;
    GlobalConfig avg;
    const Weights want = one_step(avg, rc, clients);
    rc.algorithm = "fednova";
    GlobalConfig nova;
    nova.algorithm = "fednova";
    const Weights got = one_step(nova, rc, clients);
    CHECK(at::allclose(got.at("a"), want.at("a"), 1e-6, 1e-6));
    CHECK(at::allclose(got.at("b"), want.at("b"), 1e-6, 1e-6));
  }
}

TEST_CASE("feddyn: the server's h and step against a hand computation, over two rounds") {
  GlobalConfig gc;
  gc.algorithm = "feddyn";
  gc.alpha = 0.1;
  GlobalModel gm(gc, zeros(), {"a", "b"});
  aggregation::Aggregator aggr("mean", "none", 2, 1);
  for (int r = 1; r <= 2; ++r) {
    aggregation::Accumulator acc = aggr.make_accumulator(kShapes);
    acc.reset(aggr.clip());
    acc.add(update(at::full({2, 3}, 1.f), at::full({3}, 1.f)), 1.0);
    acc.add(update(at::full({2, 3}, 3.f), at::full({3}, 3.f)), 1.0);
    const federation::StepResult s = gm.step(aggr, acc, {}, static_cast<uint64_t>(r), 4.0);
    REQUIRE(s.applied);
  }
  // Round 1: mean 2, h = 0 - 0.1 (2 / 4) 2 = -0.1, W = 0 + 2 - h / 0.1 = 3.
  // Round 2: h = -0.1 - 0.1 = -0.2, W = 3 + 2 + 2 = 7.
  CHECK(at::allclose(gm.control().at("a"), at::full({2, 3}, -0.2f)));
  CHECK(at::allclose(gm.control().at("b"), at::full({3}, -0.2f)));
  CHECK(at::allclose(gm.weights().at("a"), at::full({2, 3}, 7.f)));
  CHECK(at::allclose(gm.weights().at("b"), at::full({3}, 7.f)));
}

TEST_CASE("fednova and feddyn: keys refused where they have no effect or cannot hold") {
  auto refused = [](federation::RunConfig c, const std::string& key) {
    try {
      federation::validate(c);
    } catch (const ConfigError& e) {
      return std::string(e.what()).find("'" + key + "'") != std::string::npos;
    }
    return false;
  };
  federation::RunConfig ok;
  ok.algorithm = "feddyn";
  ok.feddyn_alpha = 0.01;
  CHECK_NOTHROW(federation::validate(ok));
  ok.algorithm = "fednova";
  ok.feddyn_alpha = 0;
  CHECK_NOTHROW(federation::validate(ok));

  federation::RunConfig c;
  c.feddyn_alpha = 0.1;  // fedavg
  CHECK(refused(c, "feddyn_alpha"));
  c.algorithm = "feddyn";
  c.feddyn_alpha = 0;
  CHECK(refused(c, "feddyn_alpha"));
  c.feddyn_alpha = 1000;
  CHECK(refused(c, "feddyn_alpha"));
  c.feddyn_alpha = 0.01;
  c.mode = "async";
  CHECK(refused(c, "mode"));
  c.mode = "sync";
  c.secagg = "secagg+";
  CHECK(refused(c, "secagg"));
  federation::RunConfig n;
  n.algorithm = "fednova";
  n.aggregator = "median";
  CHECK(refused(n, "aggregator"));
  n.aggregator = "mean";
  n.dp = "central:clip=1,noise=0.5";
  CHECK(refused(n, "dp"));
  n.dp = "none";
  n.mode = "async";
  CHECK(refused(n, "mode"));
}
