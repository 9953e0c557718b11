// FedDyn's local step (Acar et al. 2021) in LocalTrainer and BatchedTrainer:
// g - h_i + alpha (w - w_global), and the state update h_i <- h_i - alpha Δ.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "client/batched_trainer.h"
#include "client/trainer.h"
#include "core/error.h"
#include "core/models.h"

using sparrow::client::BatchedTrainer;
using sparrow::client::ClientJob;
using sparrow::client::get_weights;
using sparrow::client::LocalTrainer;
using sparrow::client::TrainConfig;
using sparrow::client::TrainResult;
using sparrow::client::Weights;

namespace {

TrainConfig config(const std::string& algorithm, double mu, int batch) {
  TrainConfig c;
  c.algorithm = algorithm;
  c.mu = mu;
  c.lr = 0.1;
  c.batch_size = batch;
  return c;
}

double max_diff(const Weights& a, const Weights& b) {
  double m = 0;
  for (const auto& [n, v] : a) m = std::max(m, (v - b.at(n)).abs().max().item<double>());
  return m;
}

}  // namespace

TEST_CASE("feddyn: with h_i = 0 it is fedprox with mu = alpha, and the state becomes -alpha delta") {
  at::manual_seed(11);
  const at::Tensor x = at::randn({40, 784});
  const at::Tensor y = at::randint(0, 10, {40}, at::kLong);
  const Weights global = get_weights(*sparrow::core::make_model("mlp", 5));
  LocalTrainer prox(sparrow::core::make_model("mlp", 5), config("fedprox", 0.5, 16));
  LocalTrainer dyn(sparrow::core::make_model("mlp", 5), config("feddyn", 0.5, 16));
  const TrainResult want = prox.train(global, x, y, 7);
  Weights h;  // a new client
  const TrainResult got = dyn.train(global, x, y, 7, &h);
  CHECK(max_diff(got.delta, want.delta) == 0.0);  // 3 steps: the proximal term acts from step 2
  CHECK(got.control_delta.empty());               // nothing of h_i is sent
  REQUIRE(h.size() == got.delta.size());
  for (const auto& [n, v] : h) CHECK(at::allclose(v, got.delta.at(n) * -0.5));
}

TEST_CASE("feddyn: one step moves by lr h_i more than fedavg, and h_i -= alpha delta") {
  at::manual_seed(12);
  const at::Tensor x = at::randn({16, 784});
  const at::Tensor y = at::randint(0, 10, {16}, at::kLong);
  const Weights global = get_weights(*sparrow::core::make_model("mlp", 6));
  Weights h;
  for (const auto& [n, v] : global) h[n] = at::randn_like(v);
  const Weights h0 = [&] {
    Weights c;
    for (const auto& [n, v] : h) c[n] = v.clone();
    return c;
  }();
  LocalTrainer avg(sparrow::core::make_model("mlp", 6), config("fedavg", 0, 16));
  LocalTrainer dyn(sparrow::core::make_model("mlp", 6), config("feddyn", 0.2, 16));
  const TrainResult base = avg.train(global, x, y, 3);
  const TrainResult got = dyn.train(global, x, y, 3, &h);
  REQUIRE(got.steps == 1);
  // One step from w_global: g - h_i + alpha (w_global - w_global) = g - h_i.
  for (const auto& [n, d] : got.delta) {
    CHECK(at::allclose(d, base.delta.at(n) + h0.at(n) * 0.1, 1e-5, 1e-6));
    CHECK(at::allclose(h.at(n), h0.at(n) - d * 0.2, 1e-5, 1e-6));
  }

  SUBCASE("the batched trainer takes the same step") {
    BatchedTrainer batched(sparrow::core::make_model("mlp", 6), config("feddyn", 0.2, 16));
    Weights hb = h0;
    for (auto& [n, v] : hb) v = v.clone();
    std::vector<ClientJob> jobs{{x, y, 3, &hb}};
    const std::vector<TrainResult> out = batched.train(global, jobs, nullptr);
    REQUIRE(out.size() == 1);
    CHECK(max_diff(out[0].delta, got.delta) < 1e-5);
    CHECK(max_diff(hb, h) < 1e-5);
  }
}

TEST_CASE("feddyn and fednova: the trainer's checks") {
  CHECK_THROWS_AS(sparrow::client::validate(config("feddyn", 0, 16)), sparrow::ConfigError);  // alpha > 0
  CHECK_NOTHROW(sparrow::client::validate(config("fednova", 0, 16)));
  CHECK_THROWS_AS(sparrow::client::validate(config("fednova", 0.1, 16)), sparrow::ConfigError);  // no proximal term
  LocalTrainer dyn(sparrow::core::make_model("mlp", 5), config("feddyn", 0.1, 16));
  const Weights global = get_weights(*sparrow::core::make_model("mlp", 5));
  const at::Tensor x = at::randn({4, 784});
  const at::Tensor y = at::zeros({4}, at::kLong);
  CHECK_THROWS(dyn.train(global, x, y, 1));  // h_i is needed
  Weights h, c;
  CHECK_THROWS(dyn.train(global, x, y, 1, &h, &c));  // no server control
}
