#include "tests/sparrow_test.h"

#include <torch/script.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>

#include "core/error.h"
#include "core/models.h"

using sparrow::ConfigError;
using sparrow::core::make_model;

namespace {

int64_t count_params(const sparrow::core::Model& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

std::vector<std::string> names(const sparrow::core::Model& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.key());
  return out;
}

bool same_params(const sparrow::core::Model& a, const sparrow::core::Model& b) {
  auto pa = a.parameters(), pb = b.parameters();
  if (pa.size() != pb.size()) return false;
  for (size_t i = 0; i < pa.size(); ++i)
    if (!at::equal(pa[i], pb[i])) return false;
  return true;
}

// A two-layer scripted model built from TorchScript source (no Python needed):
// parameters "fc.weight", "fc.bias" (in a submodule), then "scale"; buffer "offset".
void save_scripted(const std::string& path) {
  torch::jit::Module fc("Fc");
  fc.register_parameter("weight", torch::arange(12, torch::kFloat).reshape({3, 4}).requires_grad_(), false);
  fc.register_parameter("bias", torch::zeros({3}).requires_grad_(), false);
  fc.define(R"(
def forward(self, x):
    return torch.matmul(x, self.weight.t()) + self.bias
)");
  torch::jit::Module net("Net");
  net.register_module("fc", fc);
  net.register_parameter("scale", torch::ones({1}).requires_grad_(), false);
  net.register_buffer("offset", torch::full({1}, 0.5));
  net.define(R"(
def forward(self, x):
    return self.fc.forward(x) * self.scale + self.offset
)");
  net.save(path);
}

}  // namespace

TEST_CASE("models: parameter counts") {
  CHECK(count_params(*make_model("mlp", 0)) == 199210);
  // FedAvg CNN with padding 2: conv1 32*25+32, conv2 64*32*25+64, fc1 3136*512+512, fc2 512*10+10.
  CHECK(count_params(*make_model("cnn", 0)) == 832 + 51264 + 1606144 + 5130);
  CHECK(count_params(*make_model("cnn", 0)) == 1663370);
  // ResNet-8: stem, three blocks (two 3x3 convs + 2 BN, 1x1 shortcut + BN in stages 2 and 3), fc.
  auto resnet = [](int64_t in) {
    const int64_t stem = in * 16 * 9 + 2 * 16;
    const int64_t l1 = 2 * 16 * 16 * 9 + 2 * 2 * 16;
    const int64_t l2 = 16 * 32 * 9 + 32 * 32 * 9 + 2 * 2 * 32 + 16 * 32 + 2 * 32;
    const int64_t l3 = 32 * 64 * 9 + 64 * 64 * 9 + 2 * 2 * 64 + 32 * 64 + 2 * 64;
    return stem + l1 + l2 + l3 + 64 * 10 + 10;
  };
  CHECK(count_params(*make_model("resnet", 0)) == resnet(1));
  CHECK(count_params(*make_model("resnet:in_channels=3", 0)) == resnet(3));
}

TEST_CASE("models: forward shapes and input shapes") {
  for (const std::string& name : sparrow::core::model_names()) {
    CAPTURE(name);
    auto m = make_model(name, 1);
    std::vector<int64_t> shape = sparrow::core::model_input_shape(name);
    CHECK(shape == std::vector<int64_t>({1, 28, 28}));
    shape.insert(shape.begin(), 3);
    CHECK(m->forward(torch::randn(shape)).sizes() == at::IntArrayRef({3, 10}));
    CHECK(m->forward(torch::randn({2, 784})).sizes() == at::IntArrayRef({2, 10}));
  }
  CHECK(sparrow::core::model_input_shape("resnet:in_channels=3") == std::vector<int64_t>({3, 32, 32}));
  auto r3 = make_model("resnet:in_channels=3", 1);
  CHECK(r3->forward(torch::randn({2, 3, 32, 32})).sizes() == at::IntArrayRef({2, 10}));
  r3->eval();
  CHECK(r3->forward(torch::randn({1, 3, 32, 32})).sizes() == at::IntArrayRef({1, 10}));
}

TEST_CASE("models: deterministic init per seed and stable names") {
  for (const std::string& name : sparrow::core::model_names()) {
    CAPTURE(name);
    auto a = make_model(name, 5), b = make_model(name, 5), c = make_model(name, 6);
    CHECK(same_params(*a, *b));
    CHECK_FALSE(same_params(*a, *c));
    CHECK(names(*a) == names(*c));
  }
  CHECK(names(*make_model("cnn", 0)) ==
        std::vector<std::string>({"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias",
                                  "fc2.weight", "fc2.bias"}));
  const auto rn = names(*make_model("resnet", 0));
  CHECK(rn.front() == "conv1.weight");
  CHECK(std::find(rn.begin(), rn.end(), "layer2.downsample.0.weight") != rn.end());
  CHECK(std::find(rn.begin(), rn.end(), "layer1.downsample.0.weight") == rn.end());
  CHECK(rn.back() == "fc.bias");
  CHECK(make_model("resnet", 0)->named_buffers().contains("bn1.running_mean"));
}

TEST_CASE("models: unknown names and keys") {
  for (const char* name : {"vgg99", "", "cnn:width=2", "resnet:in_channels=2", "resnet:depth=8", "mlp:x=1"}) {
    CAPTURE(name);
    CHECK_THROWS_AS(make_model(name, 0), ConfigError);
  }
  CHECK_THROWS_AS(sparrow::core::model_input_shape("vgg99"), ConfigError);
  CHECK_THROWS_AS(sparrow::core::model_input_shape("torchscript:x.pt"), ConfigError);
}

TEST_CASE("models: torchscript round trip shares parameters") {
  const std::string path = "models_test_scripted.pt";
  save_scripted(path);
  auto m = make_model("torchscript:" + path, 0);
  std::remove(path.c_str());
  CHECK(names(*m) == std::vector<std::string>({"fc_weight", "fc_bias", "scale"}));  // registration order
  CHECK(m->named_buffers().contains("offset"));

  at::Tensor x = torch::ones({2, 4});
  at::Tensor y = m->forward(x);
  CHECK(y.sizes() == at::IntArrayRef({2, 3}));
  CHECK(y[0][1].item<float>() == doctest::Approx(4 + 5 + 6 + 7 + 0.5));

  // Writing through the Model's parameters changes what the scripted forward uses.
  {
    torch::NoGradGuard no_grad;
    m->named_parameters()["fc_bias"].fill_(1.0f);
    m->named_parameters()["scale"].fill_(2.0f);
  }
  CHECK(m->forward(x)[0][0].item<float>() == doctest::Approx((0 + 1 + 2 + 3 + 1) * 2 + 0.5));

  // Gradients of the scripted forward land on the Model's parameters.
  m->forward(x).sum().backward();
  at::Tensor g = m->named_parameters()["fc_weight"].grad();
  REQUIRE(g.defined());
  CHECK(at::allclose(g, torch::full({3, 4}, 4.0f)));  // 2 rows x scale 2

  m->eval();
  CHECK_FALSE(m->is_training());
}

TEST_CASE("models: torchscript errors name the file") {
  auto message = [](const std::string& name) -> std::string {
    try {
      make_model(name, 0);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  CHECK(message("torchscript:models_test_missing.pt").find("models_test_missing.pt") != std::string::npos);
  CHECK_THROWS_AS(make_model("torchscript:", 0), ConfigError);
  const std::string bad = "models_test_corrupt.pt";
  std::ofstream(bad, std::ios::binary) << "this is not a zip archive";
  CHECK(message("torchscript:" + bad).find(bad) != std::string::npos);
  std::remove(bad.c_str());
}
