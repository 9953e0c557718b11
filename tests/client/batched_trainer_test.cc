#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
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
using sparrow::client::parse_train_config;
using sparrow::client::TrainConfig;
using sparrow::client::TrainResult;
using sparrow::client::Weights;

namespace {

// Largest |a - b| relative to the largest |b| (so the tolerance means the
// same for small deltas and large ones).
double rel_diff(const Weights& a, const Weights& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, scale = 1e-12;
  for (const auto& [k, t] : b) {
    REQUIRE(a.count(k) == 1);
    REQUIRE(a.at(k).sizes() == t.sizes());
    const at::Tensor ta = a.at(k).to(at::kCPU), tb = t.to(at::kCPU);
    diff = std::max(diff, (ta - tb).abs().max().item<double>());
    scale = std::max(scale, tb.abs().max().item<double>());
  }
  return diff / scale;
}

Weights random_like(const Weights& w, uint64_t seed, double scale) {
  at::manual_seed(seed);
  Weights out;
  for (const auto& [k, t] : w) out[k] = at::randn_like(t) * scale;
  return out;
}

struct Client {
  at::Tensor x, y;
  uint64_t seed;
};

// Ragged clients: a short last minibatch, fewer samples than the batch, an
// exact multiple of the batch, and one sample.
std::vector<Client> make_clients(const std::vector<int64_t>& sizes, uint64_t seed,
                                 at::Device device = at::Device(at::kCPU)) {
  at::manual_seed(seed);
  std::vector<Client> out;
  for (size_t i = 0; i < sizes.size(); ++i)
    out.push_back(
        {at::randn({sizes[i], 1, 28, 28}).to(device), at::randint(0, 10, {sizes[i]}, at::kLong).to(device), 1000 + i});
  return out;
}

std::shared_ptr<sparrow::core::Model> model_on(const std::string& name, uint64_t seed, at::Device device) {
  auto m = sparrow::core::make_model(name, seed);
  m->to(device);
  return m;
}

// Trains every client with LocalTrainer and with one BatchedTrainer pass and
// checks each client's result is the same within float tolerance.
// On `device`: the CPU, or CUDA, where the data and both trainers' models
// live on the GPU. `tol` bounds each client's largest difference relative to
// its largest entry.
void check_equal(const std::string& model, const std::string& spec, const std::vector<int64_t>& sizes,
                 at::Device device = at::Device(at::kCPU), double tol = 2e-4) {
  CAPTURE(model);
  CAPTURE(spec);
  CAPTURE(device.str());
  const TrainConfig cfg = parse_train_config(spec);
  const bool scaffold = cfg.algorithm == "scaffold";
  const Weights global = get_weights(*sparrow::core::make_model(model, 3));
  const std::vector<Client> clients = make_clients(sizes, 11, device);
  const Weights server_c = scaffold ? random_like(global, 5, 0.01) : Weights{};
  std::vector<Weights> controls_seq(sizes.size()), controls_bat(sizes.size());
  if (scaffold) {
    // One new client (empty control = zeros), the others with their own c_i.
    for (size_t i = 1; i < sizes.size(); ++i) controls_seq[i] = controls_bat[i] = random_like(global, 20 + i, 0.01);
  }

  LocalTrainer seq(model_on(model, 7, device), cfg);
  std::vector<TrainResult> expected;
  for (size_t i = 0; i < clients.size(); ++i)
    expected.push_back(seq.train(global, clients[i].x, clients[i].y, clients[i].seed,
                                 scaffold ? &controls_seq[i] : nullptr, scaffold ? &server_c : nullptr));

  BatchedTrainer bat(model_on(model, 8, device), cfg);
  std::vector<ClientJob> jobs;
  for (size_t i = 0; i < clients.size(); ++i)
    jobs.push_back({clients[i].x, clients[i].y, clients[i].seed, scaffold ? &controls_bat[i] : nullptr});
  const std::vector<TrainResult> got = bat.train(global, jobs, scaffold ? &server_c : nullptr);

  REQUIRE(got.size() == expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].num_samples == expected[i].num_samples);
    CHECK(got[i].steps == expected[i].steps);
    CHECK(got[i].mean_loss == doctest::Approx(expected[i].mean_loss).epsilon(1e-4));
    CHECK(rel_diff(got[i].delta, expected[i].delta) < tol);
    if (scaffold) {
      CHECK(rel_diff(got[i].control_delta, expected[i].control_delta) < tol);
      CHECK(rel_diff(controls_bat[i], controls_seq[i]) < tol);
    } else {
      CHECK(got[i].control_delta.empty());
    }
  }
}

}  // namespace

TEST_CASE("batched clients equal sequential LocalTrainer, every algorithm, ragged sizes") {
  // batch 16: 37 = 2 full + 5, 9 < batch, 32 = 2 full, 1 sample, 50 = 3 + 2.
  const std::vector<int64_t> sizes{37, 9, 32, 1, 50};
  SUBCASE("mlp fedavg") { check_equal("mlp", "fedavg:lr=0.05,batch=16,epochs=2", sizes); }
  SUBCASE("mlp fedavg momentum + weight decay") {
    check_equal("mlp", "fedavg:lr=0.05,momentum=0.9,wd=0.001,batch=16,epochs=2", sizes);
  }
  SUBCASE("mlp fedprox") { check_equal("mlp", "fedprox:lr=0.05,mu=0.1,batch=16,epochs=2", sizes); }
  SUBCASE("mlp scaffold") { check_equal("mlp", "scaffold:lr=0.05,momentum=0.5,batch=16,epochs=2", sizes); }
  SUBCASE("cnn fedavg") { check_equal("cnn", "fedavg:lr=0.05,momentum=0.9,wd=0.0005,batch=16", {37, 9, 16}); }
  SUBCASE("cnn fedprox") { check_equal("cnn", "fedprox:lr=0.05,mu=0.01,batch=16", {20, 33}); }
  SUBCASE("cnn scaffold") { check_equal("cnn", "scaffold:lr=0.05,batch=16", {20, 7, 33}); }
  SUBCASE("one client") { check_equal("mlp", "fedavg:lr=0.1,batch=8", {19}); }
}

// The same code path on CUDA (grouped convolutions and autograd there):
// skipped, with a message, without a CUDA device or a CUDA-enabled LibTorch.
TEST_CASE("batched clients on CUDA equal sequential LocalTrainer on CUDA") {
  if (!at::hasCUDA()) {
    MESSAGE("skipped: no CUDA device");
    return;
  }
  const at::Device gpu(at::kCUDA);
  // cuDNN's TF32 convolutions (PyTorch's default) round inputs to 10-bit
  // mantissas, differently for a grouped and a plain convolution: compare in
  // full fp32. The simulator keeps PyTorch's default.
  const bool tf32 = at::globalContext().allowTF32CuDNN();
  at::globalContext().setAllowTF32CuDNN(false);
  struct Restore {
    bool v;
    ~Restore() { at::globalContext().setAllowTF32CuDNN(v); }
  } restore{tf32};
  const std::vector<int64_t> sizes{37, 9, 32, 1, 50};
  SUBCASE("mlp fedavg momentum + weight decay") {
    check_equal("mlp", "fedavg:lr=0.05,momentum=0.9,wd=0.001,batch=16,epochs=2", sizes, gpu);
  }
  SUBCASE("mlp fedprox") { check_equal("mlp", "fedprox:lr=0.05,mu=0.1,batch=16,epochs=2", sizes, gpu); }
  SUBCASE("mlp scaffold") { check_equal("mlp", "scaffold:lr=0.05,momentum=0.5,batch=16,epochs=2", sizes, gpu); }
  // cuDNN runs the grouped and the plain convolution with different fp32
  // algorithms (different summation orders): on the H200 the CNN's deltas
  // differ by up to 4e-4 of their largest entry (the MLP's stay under 2e-4).
  SUBCASE("cnn fedavg") {
    check_equal("cnn", "fedavg:lr=0.05,momentum=0.9,wd=0.0005,batch=16", {37, 9, 16}, gpu, 1e-3);
  }
  SUBCASE("cnn fedprox") { check_equal("cnn", "fedprox:lr=0.05,mu=0.01,batch=16", {20, 33}, gpu, 1e-3); }
  SUBCASE("cnn scaffold") { check_equal("cnn", "scaffold:lr=0.05,batch=16", {20, 7, 33}, gpu, 1e-3); }
}

TEST_CASE("batched clients: forward_clients equals forward per client") {
  for (const std::string name : {"mlp", "cnn"}) {
    CAPTURE(name);
    auto m = sparrow::core::make_model(name, 1);
    REQUIRE(m->can_forward_clients());
    std::vector<at::Tensor> stacked;
    std::vector<Weights> per_client;
    for (uint64_t k = 0; k < 3; ++k) per_client.push_back(get_weights(*sparrow::core::make_model(name, 10 + k)));
    for (const auto& p : m->named_parameters())
      stacked.push_back(at::stack({per_client[0].at(p.key()), per_client[1].at(p.key()), per_client[2].at(p.key())}));
    at::manual_seed(4);
    const at::Tensor x = at::randn({3, 5, 1, 28, 28});
    at::NoGradGuard g;
    const at::Tensor out = m->forward_clients(stacked, x);
    REQUIRE(out.sizes() == at::IntArrayRef{3, 5, 10});
    for (int64_t k = 0; k < 3; ++k) {
      for (auto& p : m->named_parameters()) p.value().copy_(per_client[k].at(p.key()));
      CHECK(at::allclose(out[k], m->forward(x[k]), 1e-4, 1e-5));
    }
  }
}

TEST_CASE("batched clients: unsupported models and bad input") {
  SUBCASE("resnet (BatchNorm buffers) is not batched") {
    auto m = sparrow::core::make_model("resnet", 1);
    CHECK_FALSE(BatchedTrainer::supports(*m));
    CHECK_THROWS_AS(BatchedTrainer(m, TrainConfig{}), sparrow::ConfigError);
  }
  TrainConfig cfg = parse_train_config("fedavg:lr=0.1,batch=8");
  BatchedTrainer bat(sparrow::core::make_model("mlp", 1), cfg);
  const Weights global = get_weights(*sparrow::core::make_model("mlp", 2));
  std::vector<Client> c = make_clients({10, 12}, 3);
  SUBCASE("no jobs") {
    std::vector<ClientJob> none;
    CHECK_THROWS_AS(bat.train(global, none), sparrow::Error);
  }
  SUBCASE("label out of range") {
    std::vector<ClientJob> jobs{{c[0].x, c[0].y, 1, nullptr}, {c[1].x, c[1].y.clone().fill_(10), 2, nullptr}};
    CHECK_THROWS_WITH_AS(bat.train(global, jobs), doctest::Contains("class label 10"), sparrow::Error);
  }
  SUBCASE("samples of different shapes") {
    std::vector<ClientJob> jobs{{c[0].x, c[0].y, 1, nullptr}, {c[1].x.reshape({12, 784}), c[1].y, 2, nullptr}};
    CHECK_THROWS_WITH_AS(bat.train(global, jobs), doctest::Contains("one shape"), sparrow::Error);
  }
  SUBCASE("controls given to fedavg") {
    Weights ctl;
    std::vector<ClientJob> jobs{{c[0].x, c[0].y, 1, &ctl}};
    CHECK_THROWS_AS(bat.train(global, jobs), sparrow::Error);
  }
  SUBCASE("a diverging client is named and controls stay") {
    TrainConfig s = parse_train_config("scaffold:lr=1e30,batch=8");
    BatchedTrainer sb(sparrow::core::make_model("mlp", 1), s);
    Weights ctl0, ctl1 = random_like(global, 9, 0.01);
    const Weights before = ctl1;
    const Weights server;
    std::vector<ClientJob> jobs{{c[0].x, c[0].y, 1, &ctl0}, {c[1].x, c[1].y, 2, &ctl1}};
    CHECK_THROWS_WITH_AS(sb.train(global, jobs, &server), doctest::Contains("diverged"), sparrow::Error);
    CHECK(ctl0.empty());
    CHECK(rel_diff(ctl1, before) == 0);
  }
}
