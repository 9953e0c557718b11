// The lite trainer against the LibTorch client's LocalTrainer: the same
// global weights, data, seed and config give the same update (within float
// rounding over a few local steps), for fedavg, fedprox and scaffold.
#include "tests/sparrow_test.h"
// sparrow_test.h first: it drops glog's CHECK macros before doctest's.
#include "client/trainer.h"
#include "core/models.h"
#include "lite/export/exporter.h"
#include "lite/trainer.h"
#include "tests/lite/lite_test_util.h"

namespace {

using namespace sparrow;
using lite::testing::rel_diff;
using lite::testing::to_vec;

// Relative to the largest change: a few SGD steps from the same weights and
// batches; differences are float rounding in differently ordered sums
// (measured: below 5e-6 for the MLP and the CNN).
constexpr double kUpdateTol = 1e-4;

std::vector<float> flatten(const client::Weights& w, const std::vector<std::string>& names) {
  std::vector<float> out;
  for (const auto& n : names) {
    const auto v = to_vec(w.at(n));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

client::Weights unflatten(const std::vector<float>& v, const client::Weights& like,
                          const std::vector<std::string>& names) {
  client::Weights out;
  size_t off = 0;
  for (const auto& n : names) {
    const at::Tensor& t = like.at(n);
    out[n] = at::from_blob(const_cast<float*>(v.data() + off), t.sizes(), at::kFloat).clone();
    off += static_cast<size_t>(t.numel());
  }
  return out;
}

struct Setup {
  std::shared_ptr<core::Model> torch_model;
  client::Weights global;
  std::vector<std::string> names;
  std::shared_ptr<lite::Model> lite_model;
  std::vector<float> flat_global;
  at::Tensor x, y;
  std::vector<float> xv;
  std::vector<int64_t> yv;
};

Setup make_setup(const std::string& model, int64_t n, const std::vector<int64_t>& x_shape) {
  Setup s;
  s.torch_model = core::make_model(model, 7);
  s.global = client::get_weights(*s.torch_model);
  for (const auto& p : s.torch_model->named_parameters()) s.names.push_back(p.key());
  lite::Exported e = lite::export_builtin(model, s.global);
  s.lite_model = std::make_shared<lite::Model>(e.spec);
  CHECK(s.lite_model->param_names() == s.names);
  s.flat_global = e.values;
  CHECK(s.flat_global == flatten(s.global, s.names));
  torch::manual_seed(11);
  std::vector<int64_t> shape{n};
  shape.insert(shape.end(), x_shape.begin(), x_shape.end());
  s.x = at::rand(shape);
  s.y = at::randint(0, 10, {n}, at::kLong);
  s.xv = to_vec(s.x);
  s.yv.assign(s.y.data_ptr<int64_t>(), s.y.data_ptr<int64_t>() + n);
  return s;
}

void compare(Setup& s, const std::string& cfg_text, uint64_t seed) {
  INFO("config " << cfg_text);
  client::TrainConfig tc = client::parse_train_config(cfg_text);
  lite::TrainConfig lc;
  lc.algorithm = tc.algorithm;
  lc.local_epochs = tc.local_epochs;
  lc.batch_size = tc.batch_size;
  lc.lr = tc.lr;
  lc.momentum = tc.momentum;
  lc.weight_decay = tc.weight_decay;
  lc.mu = tc.mu;
  client::LocalTrainer torch_trainer(s.torch_model, tc);
  lite::Trainer lite_trainer(s.lite_model, lc);
  const bool scaffold = tc.algorithm == "scaffold";
  client::Weights ci, c;
  std::vector<float> lci, lc_server;
  if (scaffold) {
    torch::manual_seed(13);
    for (const auto& n : s.names) {
      ci[n] = at::randn(s.global.at(n).sizes()) * 0.01;
      c[n] = at::randn(s.global.at(n).sizes()) * 0.01;
    }
    lci = flatten(ci, s.names);
    lc_server = flatten(c, s.names);
  }
  client::TrainResult tr =
      scaffold ? torch_trainer.train(s.global, s.x, s.y, seed, &ci, &c) : torch_trainer.train(s.global, s.x, s.y, seed);
  lite::TrainResult lr = scaffold ? lite_trainer.train(s.flat_global, s.xv, s.yv, seed, &lci, &lc_server)
                                  : lite_trainer.train(s.flat_global, s.xv, s.yv, seed);
  CHECK(lr.steps == tr.steps);
  CHECK(lr.num_samples == tr.num_samples);
  CHECK(std::fabs(lr.mean_loss - tr.mean_loss) <= 1e-5 * std::fabs(tr.mean_loss));
  const auto td = flatten(tr.delta, s.names);
  const double d = rel_diff(lr.delta, td);
  MESSAGE(cfg_text << ": update differs by " << d << " of its largest element");
  CHECK(d <= kUpdateTol);
  if (scaffold) {
    CHECK(rel_diff(lr.control_delta, flatten(tr.control_delta, s.names)) <= kUpdateTol);
    CHECK(rel_diff(lci, flatten(ci, s.names)) <= kUpdateTol);
  }
  // evaluate: the same loss and accuracy for the trained weights.
  std::vector<float> trained = s.flat_global;
  for (size_t i = 0; i < trained.size(); ++i) trained[i] += td[i];
  const auto t_eval = torch_trainer.evaluate(unflatten(trained, s.global, s.names), s.x, s.y, 16);
  const auto l_eval = lite_trainer.evaluate(trained, s.xv, s.yv, 16);
  const double tl = t_eval.first, ta = t_eval.second, ll = l_eval.first, la = l_eval.second;
  CHECK(std::fabs(ll - tl) <= 1e-5 * std::fabs(tl));
  CHECK(la == doctest::Approx(ta));
}

}  // namespace

TEST_CASE("lite trainer matches LocalTrainer on the built-in MLP") {
  Setup s = make_setup("mlp", 100, {784});
  compare(s, "fedavg:lr=0.05,batch=32,epochs=2", 3);
  compare(s, "fedavg:lr=0.05,momentum=0.9,wd=1e-3,batch=16", 4);
  compare(s, "fedprox:lr=0.05,mu=0.1,momentum=0.5,batch=32", 5);
  compare(s, "scaffold:lr=0.05,batch=25", 6);
}

TEST_CASE("lite trainer matches LocalTrainer on the built-in CNN") {
  Setup s = make_setup("cnn", 40, {1, 28, 28});
  compare(s, "fedavg:lr=0.05,momentum=0.9,wd=1e-4,batch=16", 3);
  compare(s, "scaffold:lr=0.02,batch=20", 4);
  SUBCASE("the same call trains the same update") {
    lite::Trainer t(s.lite_model, lite::TrainConfig{});
    auto a = t.train(s.flat_global, s.xv, s.yv, 1);
    auto b = t.train(s.flat_global, s.xv, s.yv, 1);
    CHECK(a.delta == b.delta);  // deterministic
  }
}

TEST_CASE("lite trainer refuses what LocalTrainer refuses") {
  Setup s = make_setup("mlp", 10, {784});
  lite::Trainer t(s.lite_model, lite::TrainConfig{});
  std::vector<float> short_global(s.flat_global.begin(), s.flat_global.end() - 1);
  CHECK_THROWS_AS(t.train(short_global, s.xv, s.yv, 1), sparrow::Error);
  auto bad_y = s.yv;
  bad_y[2] = 10;
  CHECK_THROWS_WITH_AS(t.train(s.flat_global, s.xv, bad_y, 1), doctest::Contains("class label 10"), sparrow::Error);
  std::vector<float> short_x(s.xv.begin(), s.xv.end() - 784);
  CHECK_THROWS_AS(t.train(s.flat_global, short_x, s.yv, 1), sparrow::Error);
  std::vector<float> ci, c;
  CHECK_THROWS_AS(t.train(s.flat_global, s.xv, s.yv, 1, &ci, &c), sparrow::Error);  // fedavg takes no controls
  lite::TrainConfig bad;
  bad.mu = 0.1;
  CHECK_THROWS_AS(lite::Trainer(s.lite_model, bad), sparrow::ConfigError);
  SUBCASE("a diverging run names the step and returns nothing") {
    lite::TrainConfig hot;
    hot.lr = 1e30;
    lite::Trainer h(s.lite_model, hot);
    auto xv = s.xv;
    for (auto& v : xv) v *= 1e20f;
    CHECK_THROWS_WITH_AS(h.train(s.flat_global, xv, s.yv, 1), doctest::Contains("diverged"), sparrow::Error);
  }
}

TEST_CASE("lite epoch order is the client's") {
  for (uint64_t seed : {0ull, 42ull}) {
    CHECK(lite::epoch_order(57, seed, 3) == client::epoch_order(57, seed, 3));
  }
}
