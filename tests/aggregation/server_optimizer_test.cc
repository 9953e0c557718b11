#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <map>
#include <string>
#include <vector>

#include "aggregation/server_optimizer.h"
#include "compression/state.h"
#include "core/error.h"
#include "core/spec.h"

using sparrow::aggregation::ServerOptimizer;

namespace {

using Weights = std::map<std::string, at::Tensor>;

Weights random_weights(uint64_t seed, double scale = 1.0) {
  at::manual_seed(seed);
  return {{"a", at::randn({5, 7}) * scale}, {"b", at::randn({11}) * scale}};
}

Weights clone(const Weights& w) {
  Weights out;
  for (const auto& [k, t] : w) out[k] = t.clone();
  return out;
}

// Direct transcription of Reddi et al. (ICLR 2021), Algorithm 2, per element in
// double; kind: "adagrad", "yogi", "adam".
struct Reference {
  std::string kind;
  double lr, b1, b2, tau;
  std::map<std::string, std::vector<double>> m, v;

  void step(std::map<std::string, std::vector<double>>& x, const std::map<std::string, std::vector<double>>& delta) {
    for (auto& [name, xs] : x) {
      const auto& d = delta.at(name);
      auto& mm = m[name];
      auto& vv = v[name];
      if (mm.empty()) mm.assign(xs.size(), 0.0);        // m_{-1} = 0
      if (vv.empty()) vv.assign(xs.size(), tau * tau);  // v_{-1} = tau^2
      for (size_t i = 0; i < xs.size(); ++i) {
        mm[i] = b1 * mm[i] + (1 - b1) * d[i];
        const double d2 = d[i] * d[i];
        if (kind == "adagrad") {
          vv[i] = vv[i] + d2;
        } else if (kind == "yogi") {
          const double s = vv[i] - d2;
          vv[i] = vv[i] - (1 - b2) * d2 * (s > 0 ? 1.0 : (s < 0 ? -1.0 : 0.0));
        } else {
          vv[i] = b2 * vv[i] + (1 - b2) * d2;
        }
        xs[i] = xs[i] + lr * mm[i] / (std::sqrt(vv[i]) + tau);
      }
    }
  }
};

std::map<std::string, std::vector<double>> to_vec(const Weights& w) {
  std::map<std::string, std::vector<double>> out;
  for (const auto& [k, t] : w) {
    at::Tensor d = t.to(at::kDouble).contiguous();
    out[k] = std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
  }
  return out;
}

void check_matches(const Weights& w, const std::map<std::string, std::vector<double>>& ref, double tol) {
  for (const auto& entry : w) {
    const auto& k = entry.first;  // INFO's lambda cannot capture a structured binding (C++17)
    const auto& t = entry.second;
    at::Tensor r = at::tensor(ref.at(k), at::kDouble).view(t.sizes());
    const double err = (t.to(at::kDouble) - r).abs().max().item<double>();
    INFO("tensor " << k << " max error " << err);
    CHECK(err <= tol);
  }
}

}  // namespace

TEST_CASE("server optimizer: fedavg with lr=1 equals plain averaging") {
  Weights x = random_weights(1);
  std::vector<Weights> clients = {random_weights(2), random_weights(3), random_weights(4)};
  const std::vector<double> cw = {1.0, 2.5, 0.5};
  Weights delta, avg;
  for (const auto& [k, t] : x) {
    at::Tensor d = at::zeros_like(t), a = at::zeros_like(t);
    for (size_t i = 0; i < clients.size(); ++i) {
      d += (clients[i].at(k) - t) * cw[i] / 4.0;
      a += clients[i].at(k) * cw[i] / 4.0;
    }
    delta[k] = d;
    avg[k] = a;
  }
  for (const char* spec : {"fedavg", "fedavg:lr=1"}) {
    ServerOptimizer opt(spec);
    Weights w = clone(x);
    opt.step(w, delta);
    for (const auto& [k, t] : w) CHECK(at::allclose(t, avg.at(k), 1e-5, 1e-6));
    CHECK(opt.steps() == 1);
  }
  ServerOptimizer half("fedavg:lr=0.5");
  Weights w = clone(x);
  half.step(w, delta);
  for (const auto& [k, t] : w) CHECK(at::allclose(t, x.at(k) + 0.5 * delta.at(k), 1e-6, 1e-6));
}

TEST_CASE("server optimizer: fedavgm is heavy-ball momentum on the pseudo-gradient") {
  ServerOptimizer opt("fedavgm:lr=0.7,momentum=0.8");
  Weights w = random_weights(5);
  auto ref = to_vec(w);
  std::map<std::string, std::vector<double>> m;
  for (int t = 0; t < 4; ++t) {
    Weights d = random_weights(100 + t, 0.1);
    auto dv = to_vec(d);
    opt.step(w, d);
    for (auto& [k, xs] : ref) {
      if (m[k].empty()) m[k].assign(xs.size(), 0.0);
      for (size_t i = 0; i < xs.size(); ++i) {
        m[k][i] = 0.8 * m[k][i] + dv[k][i];
        xs[i] += 0.7 * m[k][i];
      }
    }
  }
  check_matches(w, ref, 1e-5);
}

TEST_CASE("server optimizer: fedtopk applies the k largest of the error-compensated aggregate") {
  ServerOptimizer opt("fedtopk:ratio=0.5");
  Weights w{{"a", at::zeros({4})}};
  opt.step(w, {{"a", at::tensor({1.0f, -3.0f, 0.5f, 2.0f})}});
  CHECK(at::equal(w.at("a"), at::tensor({0.0f, -3.0f, 0.0f, 2.0f})));
  // The unsent 1 and 0.5 stay in the error and are sent once they are among the largest.
  opt.step(w, {{"a", at::tensor({1.0f, 0.0f, 0.0f, 0.0f})}});
  CHECK(at::equal(w.at("a"), at::tensor({2.0f, -3.0f, 0.5f, 2.0f})));
  CHECK(at::equal(opt.second_moment("a"), at::zeros({4})));
  // Over many steps the model moves by the sum of the deltas, less what is still in the error.
  ServerOptimizer big("fedtopk:ratio=0.1,lr=0.5");
  Weights x = random_weights(3);
  const Weights x0 = clone(x);
  Weights sum{{"a", at::zeros({5, 7})}, {"b", at::zeros({11})}};
  for (int t = 0; t < 30; ++t) {
    Weights d = random_weights(200 + t, 0.1);
    for (auto& [k, v] : sum) v += d.at(k);
    const Weights before = clone(x);
    big.step(x, d);
    // At most k = ceil(0.1 n) coordinates move per step: 4 of a's 35, 2 of b's 11.
    CHECK((x.at("a") != before.at("a")).sum().item<int64_t>() <= 4);
    CHECK((x.at("b") != before.at("b")).sum().item<int64_t>() <= 2);
  }
  for (const auto& [k, v] : x) CHECK(at::allclose(v - x0.at(k) + big.second_moment(k), sum.at(k) * 0.5, 1e-5, 1e-5));
  // With momentum the momentum is zeroed where the step went (FetchSGD's masking).
  ServerOptimizer mom("fedtopk:ratio=0.25,momentum=0.9");
  Weights y{{"a", at::zeros({4})}};
  mom.step(y, {{"a", at::tensor({4.0f, 1.0f, 1.0f, 1.0f})}});
  CHECK(at::equal(mom.first_moment("a"), at::tensor({0.0f, 1.0f, 1.0f, 1.0f})));
  ServerOptimizer back("fedtopk:ratio=0.25,momentum=0.9");
  back.deserialize_state(mom.serialize_state());
  CHECK(at::equal(back.first_moment("a"), mom.first_moment("a")));
  CHECK(at::equal(back.second_moment("a"), mom.second_moment("a")));
  CHECK_THROWS_AS(ServerOptimizer{"fedtopk:ratio=0"}, sparrow::ConfigError);
  CHECK_THROWS_AS(ServerOptimizer{"fedtopk:ratio=1.5"}, sparrow::ConfigError);
  CHECK_THROWS_AS(ServerOptimizer{"fedtopk:momentum=1"}, sparrow::ConfigError);
}

TEST_CASE("server optimizer: fedtopk values=sign steps by ±mu on the k largest and keeps the rest in the error") {
  ServerOptimizer opt("fedtopk:ratio=0.5,values=sign");
  Weights w{{"a", at::zeros({4})}};
  opt.step(w, {{"a", at::tensor({1.0f, -3.0f, 0.5f, 2.0f})}});
  // k = 2: positions 1 and 3, mu = (3 + 2) / 2 = 2.5, signs kept.
  CHECK(at::equal(w.at("a"), at::tensor({0.0f, -2.5f, 0.0f, 2.5f})));
  // The error keeps the unsent entries and the quantisation error of the sent ones.
  CHECK(at::allclose(opt.second_moment("a"), at::tensor({1.0f, -0.5f, 0.5f, -0.5f})));
  // mu's mantissa is rounded to 8 bits: (1 + 1/1024 + 1) / 2 is sent as 1, so
  // w ± mu stays exact and the broadcast can follow W bit for bit.
  ServerOptimizer r("fedtopk:ratio=0.5,values=sign");
  Weights q{{"a", at::full({4}, 0.1f)}};
  r.step(q, {{"a", at::tensor({1.0f + 1.0f / 1024, 0.0f, 0.0f, -1.0f})}});
  CHECK(at::equal(q.at("a"), at::tensor({1.1f, 0.1f, 0.1f, 0.1f - 1.0f})));
  // Exact zeros among the k largest are not sent (they would move by +mu).
  ServerOptimizer z("fedtopk:ratio=0.75,values=sign");
  Weights v{{"a", at::zeros({4})}};
  z.step(v, {{"a", at::tensor({0.0f, -4.0f, 0.0f, 2.0f})}});
  CHECK(at::equal(v.at("a"), at::tensor({0.0f, -3.0f, 0.0f, 3.0f})));
  // Over many steps the model plus the error is the sum of the steps, and each
  // step moves at most k positions by one magnitude.
  ServerOptimizer big("fedtopk:ratio=0.1,lr=0.5,values=sign");
  Weights x = random_weights(5);
  const Weights x0 = clone(x);
  Weights sum{{"a", at::zeros({5, 7})}, {"b", at::zeros({11})}};
  for (int t = 0; t < 20; ++t) {
    Weights d = random_weights(300 + t, 0.1);
    for (auto& [k, t2] : sum) t2 += d.at(k);
    const Weights before = clone(x);
    big.step(x, d);
    const at::Tensor moved = (x.at("a") - before.at("a")).abs();
    const at::Tensor nz = moved.masked_select(moved > 0);
    CHECK(nz.numel() <= 4);
    if (nz.numel() > 1) CHECK(at::allclose(nz, at::full_like(nz, nz[0].item<float>()), 1e-4, 1e-6));
  }
  for (const auto& [k, t2] : x) CHECK(at::allclose(t2 - x0.at(k) + big.second_moment(k), sum.at(k) * 0.5, 1e-4, 1e-5));
  CHECK_THROWS_AS(ServerOptimizer{"fedtopk:values=int8"}, sparrow::ConfigError);
}

TEST_CASE("server optimizer: fedtopk scope=model picks one k over the whole model") {
  // k = ceil(0.25 · 8) = 2 over both tensors: the two largest are both in a,
  // so b does not move (per tensor, b would get its own ceil(0.25 · 4) = 1).
  const Weights d{{"a", at::tensor({6.0f, -3.0f, 0.1f, 0.2f})}, {"b", at::tensor({2.0f, 0.5f, 0.0f, 0.0f})}};
  ServerOptimizer g("fedtopk:ratio=0.25,scope=model");
  Weights w{{"a", at::zeros({4})}, {"b", at::zeros({4})}};
  g.step(w, d);
  CHECK(at::equal(w.at("a"), at::tensor({6.0f, -3.0f, 0.0f, 0.0f})));
  CHECK(at::equal(w.at("b"), at::zeros({4})));
  CHECK(at::equal(g.second_moment("b"), d.at("b")));
  ServerOptimizer t("fedtopk:ratio=0.25");
  Weights x{{"a", at::zeros({4})}, {"b", at::zeros({4})}};
  t.step(x, d);
  CHECK(at::equal(x.at("b"), at::tensor({2.0f, 0.0f, 0.0f, 0.0f})));
  // Ternary, a magnitude per tensor: a moves by ±4.5 and keeps 1.5 at both
  // positions in its error; the next step sends b's 2 (the model's largest).
  ServerOptimizer gs("fedtopk:ratio=0.25,scope=model,values=sign");
  Weights y{{"a", at::zeros({4})}, {"b", at::zeros({4})}};
  gs.step(y, d);
  CHECK(at::equal(y.at("a"), at::tensor({4.5f, -4.5f, 0.0f, 0.0f})));
  CHECK(at::equal(y.at("b"), at::zeros({4})));
  gs.step(y, {{"a", at::zeros({4})}, {"b", at::zeros({4})}});
  CHECK(at::equal(y.at("b"), at::tensor({2.0f, 0.0f, 0.0f, 0.0f})));
  CHECK((y.at("a") != at::tensor({4.5f, -4.5f, 0.0f, 0.0f})).sum().item<int64_t>() == 1);
  CHECK_THROWS_AS(ServerOptimizer{"fedtopk:scope=layer"}, sparrow::ConfigError);
}

TEST_CASE("server optimizer: fedlowrank steps by a rank-R PowerSGD approximation with error feedback") {
  // A rank-1 delta is recovered exactly by one warm-started power step at rank 1.
  const at::Tensor u = at::tensor({1.0f, -2.0f, 0.5f, 3.0f, 1.5f, -1.0f}),
                   v = at::tensor({2.0f, 0.0f, -1.0f, 4.0f, 1.0f});
  const at::Tensor rank1 = at::outer(u, v);  // 6 x 5: rank 1 is compressible ((6+5)*1*2 < 30)
  ServerOptimizer opt("fedlowrank:rank=1");
  Weights w{{"m", at::zeros({6, 5})}, {"b", at::zeros({5})}};
  opt.step(w, {{"m", rank1}, {"b", at::tensor({1.0f, 2.0f, 3.0f, 4.0f, 5.0f})}});
  CHECK(at::allclose(w.at("m"), rank1, 1e-5, 1e-5));
  CHECK(at::allclose(opt.second_moment("m"), at::zeros({6, 5}), 1e-5, 1e-5));
  // A 1-D tensor is not compressed: it steps by the whole (error-compensated) delta.
  CHECK(at::equal(w.at("b"), at::tensor({1.0f, 2.0f, 3.0f, 4.0f, 5.0f})));
  // A full-rank delta: each step moves the matrix by a rank-1 matrix, and the
  // model plus the error always equals the sum of the deltas (nothing is lost).
  ServerOptimizer ef("fedlowrank:rank=1,lr=0.5,momentum=0.5");
  Weights x = random_weights(3);
  const Weights x0 = clone(x);
  Weights sum{{"a", at::zeros({5, 7})}, {"b", at::zeros({11})}};
  Weights m_sum{{"a", at::zeros({5, 7})}, {"b", at::zeros({11})}};
  Weights m{{"a", at::zeros({5, 7})}, {"b", at::zeros({11})}};
  for (int t = 0; t < 20; ++t) {
    Weights d = random_weights(300 + t, 0.1);
    for (auto& [k, mk] : m) {
      mk = mk * 0.5 + d.at(k);  // the momentum as the optimizer keeps it
      m_sum.at(k) += mk;
    }
    const Weights before = clone(x);
    ef.step(x, d);
    const at::Tensor moved = x.at("a") - before.at("a");
    CHECK(at::linalg_matrix_rank(moved).item<int64_t>() <= 1);
  }
  for (const auto& [k, xv] : x) CHECK(at::allclose(xv - x0.at(k) + ef.second_moment(k), m_sum.at(k) * 0.5, 1e-4, 1e-4));
  // The state (momentum, error, the warm-start factor) survives a checkpoint:
  // the next step is bit for bit the same.
  ServerOptimizer back("fedlowrank:rank=1,lr=0.5,momentum=0.5");
  back.deserialize_state(ef.serialize_state());
  Weights x1 = clone(x), x2 = clone(x);
  const Weights d = random_weights(999, 0.1);
  ef.step(x1, d);
  back.step(x2, d);
  for (const auto& [k, xv] : x1) CHECK(at::equal(xv, x2.at(k)));
  ServerOptimizer other_rank("fedlowrank:rank=2,lr=0.5,momentum=0.5");
  CHECK_THROWS_AS(other_rank.deserialize_state(ef.serialize_state()), sparrow::FormatError);
  CHECK_THROWS_AS(ServerOptimizer{"fedlowrank:rank=0"}, sparrow::ConfigError);
  CHECK_THROWS_AS(ServerOptimizer{"fedlowrank:rank=4,ratio=0.1"}, sparrow::ConfigError);
}

TEST_CASE("server optimizer: fedadam, fedyogi, fedadagrad match Algorithm 2") {
  struct Case {
    const char* spec;
    Reference ref;
  };
  const std::vector<Case> cases = {
      {"fedadam", {"adam", 0.01, 0.9, 0.99, 1e-3, {}, {}}},
      {"fedadam:lr=0.05,beta1=0.5,beta2=0.9,tau=0.01", {"adam", 0.05, 0.5, 0.9, 0.01, {}, {}}},
      {"fedyogi", {"yogi", 0.01, 0.9, 0.99, 1e-3, {}, {}}},
      {"fedyogi:lr=0.1,beta1=0,beta2=0.5,tau=0.1", {"yogi", 0.1, 0.0, 0.5, 0.1, {}, {}}},
      {"fedadagrad", {"adagrad", 0.01, 0.0, 0.0, 1e-3, {}, {}}},
      {"fedadagrad:lr=0.2,tau=0.05,beta1=0.9", {"adagrad", 0.2, 0.9, 0.0, 0.05, {}, {}}},
  };
  for (const auto& c : cases) {
    INFO("spec " << c.spec);
    ServerOptimizer opt(c.spec);
    Reference ref = c.ref;
    Weights w = random_weights(7);
    auto xr = to_vec(w);
    for (int t = 0; t < 5; ++t) {
      // Deltas of varying size, so Yogi's sign flips both ways.
      Weights d = random_weights(200 + t, t % 2 ? 0.5 : 0.01);
      opt.step(w, d);
      ref.step(xr, to_vec(d));
    }
    CHECK(opt.steps() == 5);
    check_matches(w, xr, 2e-5);
    for (const auto& [k, vs] : ref.v) {
      at::Tensor v = opt.second_moment(k);
      REQUIRE(v.defined());
      const double err = (v.to(at::kDouble).flatten() - at::tensor(vs, at::kDouble)).abs().max().item<double>();
      CHECK(err <= 1e-6 * (1 + at::tensor(vs).abs().max().item<double>()));
    }
  }
}

TEST_CASE("server optimizer: state round-trips through serialize/deserialize") {
  for (const char* spec : {"fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"}) {
    INFO("spec " << spec);
    ServerOptimizer a(spec);
    Weights wa = random_weights(8);
    for (int t = 0; t < 3; ++t) a.step(wa, random_weights(300 + t, 0.1));
    const std::string bytes = a.serialize_state();
    ServerOptimizer b(spec);
    b.deserialize_state(bytes);
    CHECK(b.steps() == 3);
    Weights wb = clone(wa);
    const Weights d = random_weights(400, 0.1);
    a.step(wa, d);
    b.step(wb, d);
    for (const auto& [k, t] : wa) CHECK(at::equal(t, wb.at(k)));
    CHECK(b.serialize_state() == a.serialize_state());

    // Malformed bytes and a state from another method are FormatErrors.
    CHECK_THROWS_AS(b.deserialize_state(bytes.substr(0, bytes.size() - 1)), sparrow::FormatError);
    CHECK_THROWS_AS(b.deserialize_state("junk"), sparrow::FormatError);
    ServerOptimizer other(std::string(spec) == "fedadam" ? "fedyogi" : "fedadam");
    CHECK_THROWS_AS(other.deserialize_state(bytes), sparrow::FormatError);
  }
  // A foreign slot name is rejected.
  ServerOptimizer adam("fedadam");
  std::string bytes = adam.serialize_state();
  sparrow::compression::State st;
  st.tensors["x/a"] = at::zeros({2});
  const size_t header = 12 + std::string("fedadam").size();
  bytes = bytes.substr(0, header) + st.serialize();
  CHECK_THROWS_AS(adam.deserialize_state(bytes), sparrow::FormatError);
}

TEST_CASE("server optimizer: unknown methods, keys and bad values are ConfigErrors") {
  for (const char* spec : {"sgd", "fedavg:momentum=0.9", "fedadam:foo=1", "fedavgm:beta1=0.9", "fedadagrad:beta2=0.9",
                           "fedavg:lr=0", "fedavg:lr=-1", "fedavgm:momentum=1", "fedadam:beta1=1.5",
                           "fedyogi:beta2=-0.1", "fedadam:tau=0", "fedadam:lr=abc", "fedadam:lr"}) {
    INFO("spec " << spec);
    CHECK_THROWS_AS(ServerOptimizer{spec}, sparrow::ConfigError);
  }
  CHECK_NOTHROW(ServerOptimizer{"fedavgm:lr=1,momentum=0.9"});
  CHECK_NOTHROW(ServerOptimizer{"fedadagrad:lr=0.01,tau=1e-3"});
}

TEST_CASE("server optimizer: bad steps are errors and change nothing") {
  ServerOptimizer opt("fedadam");
  Weights w = random_weights(9);
  opt.step(w, random_weights(10, 0.1));
  const Weights before = clone(w);
  const std::string state = opt.serialize_state();

  Weights d = random_weights(11, 0.1);
  d["a"][0][0] = std::nanf("");
  CHECK_THROWS_AS(opt.step(w, d), sparrow::Error);
  Weights missing = random_weights(11, 0.1);
  missing.erase("b");
  CHECK_THROWS_AS(opt.step(w, missing), sparrow::Error);
  Weights shape = random_weights(11, 0.1);
  shape["b"] = at::zeros({12});
  CHECK_THROWS_AS(opt.step(w, shape), sparrow::Error);
  // The state's tensor set is fixed by the first step.
  Weights w2 = {{"a", w["a"].clone()}, {"c", at::zeros({11})}};
  Weights d2 = {{"a", at::zeros({5, 7})}, {"c", at::zeros({11})}};
  CHECK_THROWS_AS(opt.step(w2, d2), sparrow::Error);
  Weights wd = {{"a", w["a"].to(at::kDouble)}, {"b", w["b"].clone()}};
  CHECK_THROWS_AS(opt.step(wd, random_weights(11, 0.1)), sparrow::Error);

  for (const auto& [k, t] : w) CHECK(at::equal(t, before.at(k)));
  CHECK(opt.serialize_state() == state);
  CHECK(opt.steps() == 1);
  opt.reset_state();
  CHECK(opt.steps() == 0);
  CHECK_FALSE(opt.second_moment("a").defined());
}

namespace {

// A server optimiser registered from outside the library: an exponential
// moving average of the updates, m = (1 − beta)·m + beta·Δ;  x += lr·m.
class Ema final : public sparrow::aggregation::OptimizerMethod {
 public:
  Ema(double lr, double beta) : lr_(lr), beta_(beta) {}
  std::vector<std::string> moments() const override { return {"m"}; }
  void step(const std::string&, at::Tensor& w, const at::Tensor& d, sparrow::aggregation::Slots& s) const override {
    at::Tensor& m = s["m"];
    if (!m.defined()) m = at::zeros(w.sizes());
    m.mul_(static_cast<float>(1 - beta_)).add_(d, static_cast<float>(beta_));
    w.add_(m, static_cast<float>(lr_));
  }

 private:
  double lr_, beta_;
};

void register_ema() {
  static const bool done = [] {
    sparrow::aggregation::register_server_optimizer(
        "fedema",
        [](sparrow::Spec& s) {
          const double beta = s.get_double("beta", 0.5);
          SPARROW_CHECK_T(sparrow::ConfigError, beta > 0 && beta <= 1, "fedema: beta must be in (0, 1]");
          return std::make_shared<Ema>(s.get_double("lr", 1.0), beta);
        },
        "[lr=1,beta=0.5] moving average of the updates (a test optimiser)");
    return true;
  }();
  (void)done;
}

}  // namespace

TEST_CASE("server optimizer: the built-ins are registered, an unknown name lists them") {
  const std::vector<std::string> names = sparrow::aggregation::server_optimizer_names();
  for (const char* n : {"fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedtopk", "fedlowrank"}) {
    CAPTURE(n);
    CHECK(std::find(names.begin(), names.end(), n) != names.end());
    CHECK(sparrow::aggregation::known_server_optimizer(n));
    CHECK_FALSE(sparrow::aggregation::server_optimizer_description(n).empty());
  }
  CHECK_FALSE(sparrow::aggregation::known_server_optimizer("sgd"));
  std::string msg;
  try {
    ServerOptimizer{"sgd"};
  } catch (const sparrow::ConfigError& e) {
    msg = e.what();
  }
  CHECK(msg.find("unknown server optimizer 'sgd' (known: ") == 0);
  for (const std::string& n : names) CHECK(msg.find(n) != std::string::npos);
}

TEST_CASE("server optimizer: one registered from outside steps, checkpoints and refuses bad state") {
  register_ema();
  CHECK(sparrow::aggregation::known_server_optimizer("fedema"));
  CHECK_THROWS_AS(ServerOptimizer{"fedema:beta=0"}, sparrow::ConfigError);
  CHECK_THROWS_AS(ServerOptimizer{"fedema:momentum=0.9"}, sparrow::ConfigError);  // unread key
  CHECK_THROWS_AS(sparrow::aggregation::register_server_optimizer(
                      "fedavg", [](sparrow::Spec&) { return std::make_shared<Ema>(1, 1); }, ""),
                  sparrow::Error);

  ServerOptimizer opt("fedema:lr=2,beta=0.5");
  CHECK(opt.method() == "fedema");
  Weights w = random_weights(1);
  const Weights w0 = clone(w);
  const Weights d1 = random_weights(2, 0.1), d2 = random_weights(3, 0.1);
  opt.step(w, d1);
  opt.step(w, d2);
  for (const auto& kv : w0) {
    const std::string& name = kv.first;
    const at::Tensor& t = kv.second;
    CAPTURE(name);
    const at::Tensor m1 = 0.5 * d1.at(name);
    const at::Tensor m2 = 0.5 * m1 + 0.5 * d2.at(name);
    CHECK(at::allclose(w.at(name), t + 2 * m1 + 2 * m2, 1e-5, 1e-6));
    CHECK(at::allclose(opt.first_moment(name), m2, 1e-5, 1e-6));
    CHECK_FALSE(opt.second_moment(name).defined());
  }

  // Its slots go into the checkpoint and come back.
  ServerOptimizer resumed("fedema:lr=2,beta=0.5");
  resumed.deserialize_state(opt.serialize_state());
  CHECK(resumed.steps() == 2);
  Weights wr = clone(w);
  const Weights d3 = random_weights(4, 0.1);
  opt.step(w, d3);
  resumed.step(wr, d3);
  for (const auto& [name, t] : w) CHECK(at::equal(t, wr.at(name)));

  // A slot it does not keep, and a tensor set that changed, are refused.
  sparrow::compression::State st;
  st.tensors["v/a"] = at::zeros({5, 7});
  std::string bytes = resumed.serialize_state();
  bytes = bytes.substr(0, 12 + std::string("fedema").size()) + st.serialize();
  CHECK_THROWS_AS(resumed.deserialize_state(bytes), sparrow::FormatError);
  Weights other = clone(w);
  other["b"] = at::zeros({12});
  Weights other_d = random_weights(5, 0.1);
  other_d["b"] = at::zeros({12});
  CHECK_THROWS_AS(resumed.step(other, other_d), sparrow::Error);
}
