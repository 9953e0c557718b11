#include "tests/sparrow_test.h"

#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.h"
#include "core/export.h"
#include "core/models.h"
#include "core/npy.h"

namespace fs = std::filesystem;
using sparrow::ConfigError;
using sparrow::core::export_model;
using sparrow::core::make_model;

namespace {

std::map<std::string, at::Tensor> weights_of(sparrow::core::Model& m) {
  std::map<std::string, at::Tensor> w;
  for (const auto& p : m.named_parameters(true)) w[p.key()] = p.value().detach().clone();
  return w;
}

}  // namespace

TEST_CASE("export: mlp and cnn as TorchScript compute what Sparrow computes, and .npy per parameter") {
  for (const std::string name : {"mlp", "cnn"}) {
    CAPTURE(name);
    const std::string dir = "export_test_" + name;
    fs::remove_all(dir);
    auto m = make_model(name, 3);
    const auto w = weights_of(*m);
    const auto r = export_model(name, w, dir);
    REQUIRE(fs::exists(r.torchscript));
    CHECK(r.npy.size() == w.size());
    torch::jit::Module loaded = torch::jit::load(r.torchscript);
    at::manual_seed(1);
    const at::Tensor x = at::randn({5, 1, 28, 28});
    m->eval();
    c10::NoGradGuard g;
    const at::Tensor want = m->forward(x);
    const at::Tensor got = loaded.forward({x}).toTensor();
    CHECK(at::allclose(got, want, 1e-4, 1e-5));
    // Trainable as `torchscript:FILE`: every parameter takes gradients.
    for (const auto& p : loaded.named_parameters(true)) CHECK_MESSAGE(p.value.requires_grad(), p.name);
    // The .npy files hold the same numbers.
    const auto a = sparrow::npy::read(dir + "/weights/fc1.weight.npy");
    CHECK(a.shape == w.at("fc1.weight").sizes().vec());
    CHECK(at::equal(at::from_blob(const_cast<float*>(a.data.data()), a.shape, at::kFloat), w.at("fc1.weight")));
    fs::remove_all(dir);
  }
}

TEST_CASE("export: refuses weights of another model, resnet normalises with batch statistics") {
  auto mlp = make_model("mlp", 1);
  CHECK_THROWS_AS(export_model("cnn", weights_of(*mlp), "export_test_bad"), ConfigError);
  for (const std::string name : {"resnet", "resnet:in_channels=3"}) {
    CAPTURE(name);
    auto rn = make_model(name, 1);
    const auto r = export_model(name, weights_of(*rn), "export_test_resnet");
    REQUIRE_FALSE(r.torchscript.empty());
    CHECK(r.note.find("BatchNorm") != std::string::npos);
    CHECK(r.npy.size() == weights_of(*rn).size());
    torch::jit::Module loaded = torch::jit::load(r.torchscript);
    const int64_t ch = name == "resnet" ? 1 : 3;
    at::manual_seed(2);
    const at::Tensor x = at::randn({6, ch, 28, 28});
    rn->train();  // batch statistics, as the export
    c10::NoGradGuard g;
    CHECK(at::allclose(loaded.forward({x}).toTensor(), rn->forward(x), 1e-4, 1e-5));
    fs::remove_all("export_test_resnet");
  }
  fs::remove_all("export_test_bad");
}

TEST_CASE("export: a TorchScript model gets the trained weights") {
  torch::jit::Module net("Net");
  torch::jit::Module fc("Fc");
  fc.register_parameter("weight", torch::zeros({3, 4}), false);
  fc.register_parameter("bias", torch::zeros({3}), false);
  fc.define("def forward(self, x):\n    return torch.linear(x, self.weight, self.bias)\n");
  net.register_module("fc", fc);
  net.define("def forward(self, x):\n    return self.fc.forward(x)\n");
  net.save("export_test_user.pt");
  std::map<std::string, at::Tensor> w = {{"fc_weight", at::randn({3, 4})}, {"fc_bias", at::randn({3})}};
  const auto r = export_model("torchscript:export_test_user.pt", w, "export_test_user");
  torch::jit::Module loaded = torch::jit::load(r.torchscript);
  const at::Tensor x = at::randn({2, 4});
  CHECK(at::allclose(loaded.forward({x}).toTensor(), at::linear(x, w["fc_weight"], w["fc_bias"])));
  // The files name the parameters as the module does, not as Sparrow holds them.
  CHECK(fs::exists("export_test_user/weights/fc.weight.npy"));
  CHECK(fs::exists("export_test_user/weights/fc.bias.npy"));
  CHECK_FALSE(fs::exists("export_test_user/weights/fc_weight.npy"));
  w.erase("fc_bias");
  CHECK_THROWS_AS(export_model("torchscript:export_test_user.pt", w, "export_test_user"), ConfigError);
  fs::remove_all("export_test_user");
  std::remove("export_test_user.pt");
}

namespace {

std::map<std::string, at::Tensor> read_state_dict(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::map<std::string, at::Tensor> out;
  for (const auto& kv : torch::pickle_load(bytes).toGenericDict()) out[kv.key().toStringRef()] = kv.value().toTensor();
  return out;
}

}  // namespace

TEST_CASE("export: model.pt, state_dict.pt and the .npy files agree key for key") {
  for (const std::string name : {"mlp", "cnn", "resnet", "resnet:in_channels=3"}) {
    CAPTURE(name);
    std::string dir = "export_test_keys_" + name;
    std::replace(dir.begin(), dir.end(), ':', '_');
    std::replace(dir.begin(), dir.end(), '=', '_');
    fs::remove_all(dir);
    auto m = make_model(name, 4);
    const auto w = weights_of(*m);
    const auto r = export_model(name, w, dir);
    // model.pt's parameter names are Sparrow's (resnet's downsample.0/.1 too).
    std::set<std::string> module_names;
    for (const auto& p : torch::jit::load(r.torchscript).named_parameters(true)) module_names.insert(p.name);
    std::set<std::string> want;
    for (const auto& [k, v] : w) want.insert(k);
    CHECK(module_names == want);
    std::set<std::string> npy_names;
    for (const auto& e : fs::directory_iterator(dir + "/weights")) npy_names.insert(e.path().stem().string());
    CHECK(npy_names == want);
    const auto sd = read_state_dict(r.state_dict);
    REQUIRE(sd.size() == w.size());
    for (const auto& kv : w) {
      const std::string& key = kv.first;
      CAPTURE(key);
      REQUIRE(sd.count(key) == 1);
      CHECK(at::equal(sd.at(key), kv.second));
    }
    fs::remove_all(dir);
  }
}

TEST_CASE("export: a TorchScript model's state_dict.pt holds its buffers and dotted names") {
  torch::jit::Module net("Net");
  torch::jit::Module block("Block");
  block.register_parameter("weight", torch::zeros({2, 3}), false);
  block.register_buffer("running_mean", torch::full({2}, 7.0));
  block.define("def forward(self, x):\n    return torch.linear(x, self.weight) - self.running_mean\n");
  net.register_module("enc_1", block);
  net.define("def forward(self, x):\n    return self.enc_1.forward(x)\n");
  net.save("export_test_buffers.pt");
  const std::map<std::string, at::Tensor> w = {{"enc_1_weight", at::randn({2, 3})}};
  const auto r = export_model("torchscript:export_test_buffers.pt", w, "export_test_buffers");
  const auto sd = read_state_dict(r.state_dict);
  CHECK(sd.size() == 2);
  REQUIRE(sd.count("enc_1.weight") == 1);
  CHECK(at::equal(sd.at("enc_1.weight"), w.at("enc_1_weight")));
  REQUIRE(sd.count("enc_1.running_mean") == 1);
  CHECK(at::equal(sd.at("enc_1.running_mean"), torch::full({2}, 7.0)));
  CHECK(fs::exists("export_test_buffers/weights/enc_1.weight.npy"));
  // Weights that do not fit write nothing.
  fs::remove_all("export_test_buffers");
  CHECK_THROWS_AS(
      export_model("torchscript:export_test_buffers.pt", {{"enc_1_weight", at::randn({3, 3})}}, "export_test_buffers"),
      ConfigError);
  CHECK_FALSE(fs::exists("export_test_buffers"));
  std::remove("export_test_buffers.pt");
}
