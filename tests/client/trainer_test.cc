#include "tests/sparrow_test.h"

#include <ATen/ATen.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "client/trainer.h"
#include "core/error.h"
#include "core/models.h"

using sparrow::client::epoch_order;
using sparrow::client::get_weights;
using sparrow::client::LocalTrainer;
using sparrow::client::TrainConfig;
using sparrow::client::TrainResult;
using sparrow::client::Weights;

namespace {

struct Data {
  at::Tensor x, y;
};

Data make_data(int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  return {at::randn({n, 784}), at::randint(0, 10, {n}, at::kLong)};
}

Weights global_weights(uint64_t seed) { return get_weights(*sparrow::core::make_model("mlp", seed)); }

LocalTrainer make_trainer(const TrainConfig& cfg, uint64_t seed = 99) {
  return LocalTrainer(sparrow::core::make_model("mlp", seed), cfg);
}

double max_diff(const Weights& a, const Weights& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (const auto& [k, t] : a) m = std::max(m, (t - b.at(k)).abs().max().item<double>());
  return m;
}

bool equal(const Weights& a, const Weights& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, t] : a) {
    if (!b.count(k) || !t.equal(b.at(k))) return false;
  }
  return true;
}

double norm(const Weights& w) {
  double s = 0;
  for (const auto& kv : w) s += kv.second.pow(2).sum().item<double>();
  return std::sqrt(s);
}

// The MLP's forward written out with ATen (784-200-200-10, ReLU) and its
// cross-entropy gradient by autograd: an independent reference for the trainer.
Weights hand_grad(const Weights& w, const at::Tensor& x, const at::Tensor& y) {
  Weights v;
  for (const auto& [k, t] : w) v[k] = t.detach().clone().requires_grad_(true);
  at::Tensor h = at::relu(at::linear(x, v["fc1.weight"], v["fc1.bias"]));
  h = at::relu(at::linear(h, v["fc2.weight"], v["fc2.bias"]));
  at::Tensor loss = at::cross_entropy_loss(at::linear(h, v["fc3.weight"], v["fc3.bias"]), y);
  loss.backward();
  Weights g;
  for (auto& [k, t] : v) g[k] = t.grad().detach().clone();
  return g;
}

// Minibatch b of epoch e, as the trainer draws it.
Data batch(const Data& d, uint64_t seed, int epoch, int64_t b, int64_t bs) {
  const int64_t n = d.x.size(0);
  std::vector<int64_t> order = epoch_order(n, seed, epoch);
  const int64_t len = std::min(bs, n - b * bs);
  at::Tensor idx = at::tensor(std::vector<int64_t>(order.begin() + b * bs, order.begin() + b * bs + len));
  return {d.x.index_select(0, idx), d.y.index_select(0, idx)};
}

Weights sub(const Weights& a, const Weights& b) {
  Weights out;
  for (const auto& [k, t] : a) out[k] = t - b.at(k);
  return out;
}

}  // namespace

TEST_CASE("trainer full batch equals hand-written SGD") {
  TrainConfig cfg;
  cfg.batch_size = 64;
  cfg.lr = 0.1;
  const Data d = make_data(40, 1);
  const Weights global = global_weights(7);
  LocalTrainer t = make_trainer(cfg);
  const TrainResult r = t.train(global, d.x, d.y, 5);
  CHECK(r.steps == 1);
  CHECK(r.num_samples == 40);
  const Data b = batch(d, 5, 0, 0, 40);
  const Weights g = hand_grad(global, b.x, b.y);
  Weights expected;
  for (const auto& [k, gk] : g) expected[k] = -cfg.lr * gk;
  CHECK(max_diff(r.delta, expected) < 1e-6);
  CHECK(norm(r.delta) > 1e-3);
  // The loss of the single step is the loss at the global weights.
  LocalTrainer e = make_trainer(cfg);
  CHECK(r.mean_loss == doctest::Approx(e.evaluate(global, d.x, d.y).first).epsilon(1e-5));
}

TEST_CASE("trainer minibatches with momentum and weight decay match torch optim SGD") {
  TrainConfig cfg;
  cfg.batch_size = 16;
  cfg.local_epochs = 2;
  cfg.lr = 0.05;
  cfg.momentum = 0.9;
  cfg.weight_decay = 1e-3;
  const Data d = make_data(40, 2);  // 3 batches per epoch, the last one short
  const Weights global = global_weights(8);
  const uint64_t seed = 11;
  LocalTrainer t = make_trainer(cfg);
  const TrainResult r = t.train(global, d.x, d.y, seed);
  CHECK(r.steps == 6);

  auto ref = sparrow::core::make_model("mlp", 123);
  {
    at::NoGradGuard ng;
    for (auto& p : ref->named_parameters()) p.value().copy_(global.at(p.key()));
  }
  torch::optim::SGD opt(ref->parameters(),
                        torch::optim::SGDOptions(cfg.lr).momentum(cfg.momentum).weight_decay(cfg.weight_decay));
  double loss_sum = 0;
  for (int e = 0; e < 2; ++e) {
    for (int64_t b = 0; b < 3; ++b) {
      const Data bd = batch(d, seed, e, b, 16);
      opt.zero_grad();
      at::Tensor loss = at::cross_entropy_loss(ref->forward(bd.x), bd.y);
      loss.backward();
      opt.step();
      loss_sum += loss.item<double>() * static_cast<double>(bd.x.size(0));
    }
  }
  CHECK(max_diff(r.delta, sub(get_weights(*ref), global)) < 1e-6);
  CHECK(r.mean_loss == doctest::Approx(loss_sum / 80).epsilon(1e-6));
}

TEST_CASE("fedprox with mu 0 equals fedavg and mu > 0 matches a hand proximal step") {
  const Data d = make_data(8, 3);
  const Weights global = global_weights(9);
  TrainConfig avg;
  avg.batch_size = 4;
  avg.lr = 0.5;
  TrainConfig prox = avg;
  prox.algorithm = "fedprox";
  LocalTrainer ta = make_trainer(avg), tp0 = make_trainer(prox);
  const TrainResult ra = ta.train(global, d.x, d.y, 4);
  CHECK(equal(ra.delta, tp0.train(global, d.x, d.y, 4).delta));

  prox.mu = 2.0;
  LocalTrainer tp = make_trainer(prox);
  const TrainResult rp = tp.train(global, d.x, d.y, 4);
  CHECK(rp.steps == 2);
  CHECK(norm(rp.delta) < norm(ra.delta));
  // Step 1: w1 = w0 - lr g(w0); step 2: w2 = w1 - lr (g(w1) + mu (w1 - w0)).
  const Data b0 = batch(d, 4, 0, 0, 4), b1 = batch(d, 4, 0, 1, 4);
  Weights w1, w2;
  const Weights g0 = hand_grad(global, b0.x, b0.y);
  for (const auto& [k, w] : global) w1[k] = w - prox.lr * g0.at(k);
  const Weights g1 = hand_grad(w1, b1.x, b1.y);
  for (const auto& [k, w] : w1) w2[k] = w - prox.lr * (g1.at(k) + prox.mu * (w - global.at(k)));
  CHECK(max_diff(rp.delta, sub(w2, global)) < 1e-6);
  CHECK(max_diff(ra.delta, rp.delta) > 1e-4);
}

TEST_CASE("scaffold with zero controls equals fedavg and follows option II") {
  const Data d = make_data(8, 4);
  const Weights global = global_weights(10);
  TrainConfig avg;
  avg.batch_size = 4;
  avg.lr = 0.3;
  TrainConfig sc = avg;
  sc.algorithm = "scaffold";
  LocalTrainer ta = make_trainer(avg), ts = make_trainer(sc);
  const TrainResult ra = ta.train(global, d.x, d.y, 6);

  SUBCASE("empty controls") {
    Weights ci, c;
    const TrainResult rs = ts.train(global, d.x, d.y, 6, &ci, &c);
    CHECK(equal(ra.delta, rs.delta));
    REQUIRE(ci.size() == global.size());
    for (const auto& [k, delta] : rs.delta) {
      const at::Tensor want = -delta / (2 * sc.lr);  // c_i+ = 0 - 0 + (x - y_i) / (K lr)
      CHECK((ci.at(k) - want).abs().max().item<double>() < 1e-6);
      CHECK(rs.control_delta.at(k).equal(ci.at(k)));
    }
  }
  SUBCASE("explicit zero controls") {
    Weights ci, c;
    for (const auto& [k, w] : global) ci[k] = at::zeros_like(w), c[k] = at::zeros_like(w);
    CHECK(equal(ra.delta, ts.train(global, d.x, d.y, 6, &ci, &c).delta));
  }
  SUBCASE("nonzero controls") {
    at::manual_seed(77);
    Weights ci, c;
    for (const auto& [k, w] : global) ci[k] = 0.05 * at::randn_like(w), c[k] = 0.05 * at::randn_like(w);
    const Weights ci_old = ci;
    const TrainResult rs = ts.train(global, d.x, d.y, 6, &ci, &c);
    // Hand: two steps with gradient g + c - c_i.
    const Data b0 = batch(d, 6, 0, 0, 4), b1 = batch(d, 6, 0, 1, 4);
    Weights w1, w2;
    const Weights g0 = hand_grad(global, b0.x, b0.y);
    for (const auto& [k, w] : global) w1[k] = w - sc.lr * (g0.at(k) + c.at(k) - ci_old.at(k));
    const Weights g1 = hand_grad(w1, b1.x, b1.y);
    for (const auto& [k, w] : w1) w2[k] = w - sc.lr * (g1.at(k) + c.at(k) - ci_old.at(k));
    CHECK(max_diff(rs.delta, sub(w2, global)) < 1e-6);
    // Option II: c_i+ = c_i - c + (x - y_i) / (K lr).
    for (const auto& [k, w] : global) {
      const at::Tensor want = ci_old.at(k) - c.at(k) + (w - w2.at(k)) / (2 * sc.lr);
      CHECK((ci.at(k) - want).abs().max().item<double>() < 1e-5);
      CHECK((rs.control_delta.at(k) - (want - ci_old.at(k))).abs().max().item<double>() < 1e-5);
    }
  }
}

TEST_CASE("training is deterministic in the seed") {
  const Data d = make_data(30, 5);
  const Weights global = global_weights(11);
  TrainConfig cfg;
  cfg.batch_size = 8;
  LocalTrainer t = make_trainer(cfg);
  const TrainResult a = t.train(global, d.x, d.y, 1);
  CHECK(equal(a.delta, t.train(global, d.x, d.y, 1).delta));
  CHECK(equal(a.delta, make_trainer(cfg, 5).train(global, d.x, d.y, 1).delta));
  CHECK(epoch_order(30, 1, 0) == epoch_order(30, 1, 0));
  CHECK(epoch_order(30, 1, 0) != epoch_order(30, 2, 0));
  CHECK(epoch_order(30, 1, 0) != epoch_order(30, 1, 1));
  std::vector<int64_t> sorted = epoch_order(30, 1, 0);
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 30; ++i) CHECK(sorted[static_cast<size_t>(i)] == i);
  CHECK(max_diff(a.delta, t.train(global, d.x, d.y, 2).delta) > 1e-6);
}

TEST_CASE("evaluate matches a direct computation") {
  const Data d = make_data(50, 6);
  const Weights global = global_weights(12);
  LocalTrainer t = make_trainer(TrainConfig{});
  const auto [loss, acc] = t.evaluate(global, d.x, d.y, 7);
  CHECK(acc >= 0.0);
  CHECK(acc <= 1.0);
  auto ref = sparrow::core::make_model("mlp", 12);
  at::NoGradGuard ng;
  at::Tensor logits = ref->forward(d.x);
  CHECK(loss == doctest::Approx(at::cross_entropy_loss(logits, d.y).item<double>()).epsilon(1e-5));
  CHECK(acc == doctest::Approx(logits.argmax(1).eq(d.y).to(at::kDouble).mean().item<double>()));
  // Labels equal to the model's prediction: accuracy 1.
  CHECK(t.evaluate(global, d.x, logits.argmax(1), 1000).second == 1.0);
}

TEST_CASE("evaluate at the model's batch size (0) equals any other, and refuses a negative one") {
  // The CNN on the CPU evaluates in batches of 256: 600 images are two full
  // batches and a short one.
  const Data d = make_data(600, 8);
  const Weights global = get_weights(*sparrow::core::make_model("cnn", 4));
  LocalTrainer t(sparrow::core::make_model("cnn", 5), TrainConfig{});
  CHECK(t.replica().eval_batch(at::Device(at::kCPU)) == 256);
  CHECK(sparrow::core::make_model("mlp", 1)->eval_batch(at::Device(at::kCPU)) == 64);
  const auto [loss, acc] = t.evaluate(global, d.x, d.y);
  const auto [loss1, acc1] = t.evaluate(global, d.x, d.y, 600);
  const auto [loss2, acc2] = t.evaluate(global, d.x, d.y, 7);
  CHECK(loss == doctest::Approx(loss1).epsilon(1e-6));
  CHECK(loss == doctest::Approx(loss2).epsilon(1e-6));
  CHECK(acc == acc1);
  CHECK(acc == acc2);
  CHECK_THROWS_WITH(t.evaluate(global, d.x, d.y, -1), doctest::Contains("batch_size"));
}

TEST_CASE("a reused replica leaks no state between clients") {
  TrainConfig cfg;
  cfg.batch_size = 8;
  cfg.local_epochs = 2;
  cfg.momentum = 0.9;
  cfg.weight_decay = 1e-4;
  const Data a = make_data(20, 7), b = make_data(13, 8);
  const Weights global = global_weights(13);
  LocalTrainer shared = make_trainer(cfg);
  const TrainResult ra = shared.train(global, a.x, a.y, 1);
  const TrainResult rb = shared.train(global, b.x, b.y, 2);
  CHECK(equal(ra.delta, make_trainer(cfg).train(global, a.x, a.y, 1).delta));
  CHECK(equal(rb.delta, make_trainer(cfg).train(global, b.x, b.y, 2).delta));
  CHECK(rb.mean_loss == make_trainer(cfg).train(global, b.x, b.y, 2).mean_loss);
  // evaluate() in between changes nothing either.
  shared.evaluate(ra.delta, a.x, a.y);
  CHECK(equal(ra.delta, shared.train(global, a.x, a.y, 1).delta));
}

TEST_CASE("a diverged client raises naming the step") {
  TrainConfig cfg;
  cfg.batch_size = 4;
  cfg.algorithm = "scaffold";
  Data d = make_data(12, 9);
  const Weights global = global_weights(14);
  LocalTrainer t = make_trainer(cfg);
  // The NaN sample lands in some batch; the error names that step.
  d.x[5][3] = NAN;
  std::vector<int64_t> order = epoch_order(12, 3, 0);
  const int64_t pos = std::find(order.begin(), order.end(), 5) - order.begin();
  Weights ci, c;
  std::string msg;
  try {
    t.train(global, d.x, d.y, 3, &ci, &c);
  } catch (const sparrow::Error& e) {
    msg = e.what();
  }
  CHECK(msg.find("diverged") != std::string::npos);
  CHECK(msg.find("at step " + std::to_string(pos / 4) + " ") != std::string::npos);
  CHECK(ci.empty());  // the caller's control is untouched
  // The trainer recovers: the next client is unaffected.
  const Data ok = make_data(12, 10);
  Weights ci2, c2, ci3, c3;
  CHECK(equal(t.train(global, ok.x, ok.y, 3, &ci2, &c2).delta,
              make_trainer(cfg).train(global, ok.x, ok.y, 3, &ci3, &c3).delta));
}

TEST_CASE("bad configs and bad inputs are rejected") {
  using sparrow::ConfigError;
  using sparrow::client::parse_train_config;
  using sparrow::client::validate;
  TrainConfig ok;
  CHECK_NOTHROW(validate(ok));
  auto bad = [](auto mutate) {
    TrainConfig c;
    mutate(c);
    return c;
  };
  CHECK_THROWS_AS(validate(bad([](TrainConfig& c) { c.lr = 0; })), ConfigError);
  CHECK_THROWS_AS(validate(bad([](TrainConfig& c) { c.lr = -1; })), ConfigError);
  CHECK_THROWS_AS(validate(bad([](TrainConfig& c) { c.lr = NAN; })), ConfigError);
  CHECK_THROWS_AS(validate(bad([](TrainConfig& c) { c.batch_size = 0; })), ConfigError);
  CHECK_THROWS_AS(validate(bad([](TrainConfig& c) { c.local_epochs = 0; })), ConfigError);
  CHECK_THROWS_AS(validate(bad([](TrainConfig& c) { c.algorithm = "fedsgd"; })), ConfigError);
  CHECK_THROWS_AS(validate(bad([](TrainConfig& c) { c.algorithm = "fedprox", c.mu = -0.1; })), ConfigError);
  CHECK_THROWS_AS(validate(bad([](TrainConfig& c) { c.mu = 0.1; })), ConfigError);  // mu without fedprox
  CHECK_THROWS_AS(validate(bad([](TrainConfig& c) { c.momentum = 1.0; })), ConfigError);
  CHECK_THROWS_AS(validate(bad([](TrainConfig& c) { c.weight_decay = -1; })), ConfigError);
  CHECK_THROWS_AS(make_trainer(bad([](TrainConfig& c) { c.lr = 0; })), ConfigError);

  const TrainConfig p = parse_train_config("fedprox:mu=0.01,lr=0.05,momentum=0.9,wd=1e-4,epochs=2,batch=64");
  CHECK(p.algorithm == "fedprox");
  CHECK(p.mu == 0.01);
  CHECK(p.lr == 0.05);
  CHECK(p.momentum == 0.9);
  CHECK(p.weight_decay == 1e-4);
  CHECK(p.local_epochs == 2);
  CHECK(p.batch_size == 64);
  CHECK(parse_train_config("scaffold").algorithm == "scaffold");
  CHECK_THROWS_AS(parse_train_config("fedavg:lr=0.1,beta=2"), ConfigError);
  CHECK_THROWS_AS(parse_train_config("fedavg:batch=0"), ConfigError);
  CHECK_THROWS_AS(parse_train_config("fedavg:lr=x"), ConfigError);
  CHECK_THROWS_AS(parse_train_config("nope"), ConfigError);

  const Data d = make_data(10, 11);
  const Weights global = global_weights(15);
  LocalTrainer t = make_trainer(ok);
  CHECK_THROWS_AS(t.train(global, d.x, d.y.narrow(0, 0, 9), 1), sparrow::Error);
  CHECK_THROWS_AS(t.train(global, d.x.narrow(0, 0, 0), d.y.narrow(0, 0, 0), 1), sparrow::Error);
  CHECK_THROWS_AS(t.train(global, d.x, d.y.to(at::kFloat), 1), sparrow::Error);
  CHECK_THROWS_AS(t.train(global, d.x, d.y + 10, 1), sparrow::Error);  // label >= classes
  CHECK_THROWS_AS(t.train(global, d.x, d.y - 10, 1), sparrow::Error);  // negative label
  CHECK_THROWS_AS(t.evaluate(global, d.x, d.y.narrow(0, 0, 9)), sparrow::Error);
  Weights missing = global;
  missing.erase("fc2.bias");
  CHECK_THROWS_AS(t.train(missing, d.x, d.y, 1), sparrow::Error);
  Weights extra = global;
  extra["fc4.weight"] = at::zeros({1});
  CHECK_THROWS_AS(t.train(extra, d.x, d.y, 1), sparrow::Error);
  Weights wrong = global;
  wrong["fc1.bias"] = at::zeros({3});
  CHECK_THROWS_AS(t.train(wrong, d.x, d.y, 1), sparrow::Error);
  Weights ci, c;
  CHECK_THROWS_AS(t.train(global, d.x, d.y, 1, &ci, &c), sparrow::Error);  // fedavg takes no controls
  TrainConfig sc;
  sc.algorithm = "scaffold";
  LocalTrainer ts = make_trainer(sc);
  CHECK_THROWS_AS(ts.train(global, d.x, d.y, 1), sparrow::Error);  // scaffold needs them
  Weights partial{{"fc1.bias", at::zeros({200})}};
  CHECK_THROWS_AS(ts.train(global, d.x, d.y, 1, &partial, &c), sparrow::Error);
  CHECK(partial.size() == 1);
  // int32 labels are accepted.
  CHECK_NOTHROW(t.train(global, d.x, d.y.to(at::kInt), 1));
}
