#include "tests/sparrow_test.h"

#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <fstream>

#include "core/error.h"
#include "core/models.h"
#include "core/spec.h"
#include "core/threads.h"

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

// The built-in models (model_names() also lists any a test registered).
const std::vector<std::string> kBuiltins = {"cnn", "mlp", "resnet"};

// A model registered from outside the library: one Linear layer sized from the
// data (ModelArgs) with a `bias` key, as the simulator's "logreg" is.
class Toy final : public sparrow::core::Model {
 public:
  Toy(int64_t in, int64_t out, bool bias) {
    fc_ = register_module("fc", torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias)));
  }
  at::Tensor forward(const at::Tensor& x) override { return fc_->forward(x.reshape({x.size(0), -1})); }

 private:
  torch::nn::Linear fc_{nullptr};
};

void register_toy() {
  static const bool done = [] {
    sparrow::core::register_model(
        "toy",
        [](sparrow::Spec& s, const sparrow::core::ModelArgs& a) {
          const bool bias = s.get_bool("bias", true);
          SPARROW_CHECK_T(ConfigError, a.input_dim > 0, "model 'toy' needs the data's feature count");
          return std::make_shared<Toy>(a.input_dim, a.classes, bias);
        },
        "[bias=1] one linear layer sized from the data (a test model)",
        [](sparrow::Spec& s) {
          s.get_bool("bias", true);
          return std::vector<int64_t>{6};
        });
    return true;
  }();
  (void)done;
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
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
  for (const std::string& name : kBuiltins) {
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
  for (const std::string& name : kBuiltins) {
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
  CHECK_THROWS_AS(sparrow::core::model_input_shape("resnet:in_channels=2"), ConfigError);
  CHECK_THROWS_AS(sparrow::core::model_input_shape("mlp:x=1"), ConfigError);
  CHECK(message_of([] { make_model("vgg99", 0); }) ==
        "unknown model 'vgg99' (known: cnn, mlp, resnet, torchscript:FILE)");
}

TEST_CASE("models: the built-ins are registered with descriptions") {
  const std::vector<std::string> names = sparrow::core::model_names();
  for (const std::string& n : kBuiltins) {
    CAPTURE(n);
    CHECK(std::find(names.begin(), names.end(), n) != names.end());
    CHECK(sparrow::core::known_model(n));
    CHECK_FALSE(sparrow::core::model_description(n).empty());
  }
  CHECK_FALSE(sparrow::core::known_model("torchscript"));
  CHECK_FALSE(sparrow::core::known_model("resnet:in_channels=3"));  // a name, not a spec
}

TEST_CASE("models: a model registered from outside is made like a built-in") {
  register_toy();
  CHECK(sparrow::core::known_model("toy"));
  sparrow::core::ModelArgs args;
  args.seed = 3;
  args.input_dim = 6;
  args.classes = 4;
  auto a = make_model("toy", args), b = make_model("toy", args);
  CHECK(names(*a) == std::vector<std::string>({"fc.weight", "fc.bias"}));
  CHECK(a->forward(torch::ones({2, 6})).sizes() == at::IntArrayRef({2, 4}));
  CHECK(same_params(*a, *b));  // seeded under make_model's lock, like the built-ins
  args.seed = 4;
  CHECK_FALSE(same_params(*a, *make_model("toy", args)));
  CHECK(names(*make_model("toy:bias=0", args)) == std::vector<std::string>({"fc.weight"}));
  CHECK(sparrow::core::model_input_shape("toy:bias=0") == std::vector<int64_t>({6}));
  // Its keys are strict, its own checks apply, and it is listed.
  CHECK_THROWS_AS(make_model("toy:width=3", args), ConfigError);
  CHECK_THROWS_AS(make_model("toy", 0), ConfigError);  // no input_dim
  CHECK(message_of([] { make_model("vgg99", 0); }).find("toy") != std::string::npos);
  const std::vector<std::string> names = sparrow::core::model_names();
  CHECK(std::find(names.begin(), names.end(), "toy") != names.end());
  // A name is registered once; built-in names and "torchscript" are taken.
  const auto any = [](sparrow::Spec&, const sparrow::core::ModelArgs&) { return std::make_shared<Toy>(1, 1, true); };
  CHECK_THROWS_AS(sparrow::core::register_model("toy", any, ""), sparrow::Error);
  CHECK_THROWS_AS(sparrow::core::register_model("mlp", any, ""), sparrow::Error);
  CHECK_THROWS_AS(sparrow::core::register_model("torchscript", any, ""), sparrow::Error);
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
  // LibTorch's reason without its C++ backtrace: one line.
  CHECK(message("torchscript:" + bad).find("failed finding central directory") != std::string::npos);
  CHECK(message("torchscript:" + bad).find("Exception raised from") == std::string::npos);
  CHECK(message("torchscript:" + bad).find('\n') == std::string::npos);
  std::remove(bad.c_str());
}

TEST_CASE("models: hand-written backward of stacked clients equals autograd") {
  // Three clients with different weights, ragged per-sample loss weights (a
  // padded row of weight 0, rows of 1/len), every label present.
  // Contiguous stacks take the raw CPU path (core/linear_cpu.h); strided
  // ones the ATen formulation (the MLP's, which CUDA runs) or autograd.
  for (const bool strided : {false, true})
    for (const std::string name : {"mlp", "cnn"}) {
      CAPTURE(name);
      CAPTURE(strided);
      auto m = make_model(name, 5);
      const int64_t k = 3, b = 7;
      std::vector<at::Tensor> p, g_hand, g_auto;
      int c = 0;
      for (const auto& t : m->parameters()) {
        std::vector<int64_t> shape{k};
        shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
        torch::manual_seed(100 + c++);
        // Spread the clients apart so a mix-up between them cannot pass.
        at::Tensor v = t.detach().unsqueeze(0).expand(shape) + 0.05 * torch::randn(shape);
        if (strided) v = at::stack({v, v}, 1).select(1, 0);  // the same values, rows twice as far apart
        p.push_back(v);
        g_hand.push_back(torch::full(shape, 7.0f));  // overwritten, whatever it held
        g_auto.push_back(torch::empty(shape));
      }
      torch::manual_seed(9);
      const at::Tensor x = torch::rand({k, b, 1, 28, 28});
      const at::Tensor y = torch::randint(0, 10, {k * b}, torch::kLong);
      at::Tensor w = torch::full({k * b}, 1.0f / b);
      w.narrow(0, b, b).fill_(1.0f / (b - 1));
      w[2 * b - 1] = 0.0f;  // client 1's padded row
      const at::Tensor loss_hand = m->loss_backward_clients(p, x, y, w, g_hand);
      const at::Tensor loss_auto = m->sparrow::core::Model::loss_backward_clients(p, x, y, w, g_auto);
      CHECK(loss_hand.sizes() == at::IntArrayRef{k});
      CHECK(torch::allclose(loss_hand, loss_auto, 1e-5, 1e-6));
      for (size_t i = 0; i < p.size(); ++i) {
        CAPTURE(i);
        CHECK(torch::allclose(g_hand[i], g_auto[i], 1e-4, 1e-6));
        CHECK(g_auto[i].abs().sum().item<double>() > 0);
      }
      // The padded row contributes nothing: changing its input changes no gradient.
      at::Tensor x2 = x.clone();
      x2[1][b - 1].fill_(0.5);
      std::vector<at::Tensor> g2;
      for (const auto& t : g_hand) g2.push_back(torch::empty_like(t));
      m->loss_backward_clients(p, x2, y, w, g2);
      for (size_t i = 0; i < p.size(); ++i) CHECK(torch::allclose(g2[i], g_hand[i], 1e-5, 1e-7));
    }
}

TEST_CASE("models: the CPU fast paths give the same bits on one thread and on several") {
  // The clients (training) and the images (evaluation) are shared out over
  // the intra-op threads; nothing a client or an image gets may depend on that.
  const int saved = at::get_num_threads();
  for (const std::string name : {"mlp", "cnn"}) {
    CAPTURE(name);
    auto m = make_model(name, 6);
    const int64_t k = 5, b = 9;
    std::vector<at::Tensor> p;
    int c = 0;
    for (const auto& t : m->parameters()) {
      std::vector<int64_t> shape{k};
      shape.insert(shape.end(), t.sizes().begin(), t.sizes().end());
      torch::manual_seed(200 + c++);
      p.push_back(t.detach().unsqueeze(0).expand(shape) + 0.05 * torch::randn(shape));
    }
    torch::manual_seed(10);
    // 300 images: two blocks of 128 and a short one (core/models.cc's inference);
    // 100: one block, on one thread.
    const at::Tensor x = torch::rand({k, b, 1, 28, 28}), imgs = torch::rand({300, 784});
    const at::Tensor y = torch::randint(0, 10, {k * b}, torch::kLong), w = torch::full({k * b}, 1.0f / b);
    std::vector<at::Tensor> loss(2), logits(2), logits_one_block(2), loss_one(2);
    std::vector<std::vector<at::Tensor>> grads(2);
    for (const int threads : {1, 2}) {
      sparrow::core::configure_threads(1, threads);  // ATen's and the BLAS's, as the programs set them
      REQUIRE(at::get_num_threads() == threads);
      for (const auto& t : p) grads[threads - 1].push_back(torch::empty_like(t));
      loss[threads - 1] = m->loss_backward_clients(p, x, y, w, grads[threads - 1]);
      std::vector<at::Tensor> p1, g1;  // a pass of one client: one chunk
      for (const auto& t : p) {
        p1.push_back(t.narrow(0, 0, 1).contiguous());
        g1.push_back(torch::empty_like(p1.back()));
      }
      loss_one[threads - 1] = m->loss_backward_clients(p1, x.narrow(0, 0, 1), y.narrow(0, 0, b), w.narrow(0, 0, b), g1);
      at::NoGradGuard no_grad;
      logits[threads - 1] = m->forward(imgs);
      logits_one_block[threads - 1] = m->forward(imgs.narrow(0, 0, 100));
    }
    sparrow::core::configure_threads(1, saved);
    CHECK(torch::equal(loss[0], loss[1]));
    // The MLP's forward is ATen's, whose BLAS splits GEMMs by its thread count.
    if (name == "cnn") {
      CHECK(torch::equal(logits[0], logits[1]));
      CHECK(torch::equal(logits_one_block[0], logits_one_block[1]));
    }
    CHECK(torch::equal(loss_one[0], loss_one[1]));
    for (size_t i = 0; i < p.size(); ++i) CHECK(torch::equal(grads[0][i], grads[1][i]));
  }
}

TEST_CASE("models: hand-written backward checks its buffers") {
  auto m = make_model("mlp", 1);
  std::vector<at::Tensor> p, g;
  for (const auto& t : m->parameters()) {
    p.push_back(t.detach().unsqueeze(0));
    g.push_back(torch::empty_like(p.back()));
  }
  const at::Tensor x = torch::rand({1, 4, 784});
  const at::Tensor y = torch::zeros({4}, torch::kLong), w = torch::full({4}, 0.25f);
  g.pop_back();
  CHECK_THROWS_WITH(m->loss_backward_clients(p, x, y, w, g), doctest::Contains("gradient buffers"));
  g.push_back(torch::empty({1, 11}));
  CHECK_THROWS_WITH(m->loss_backward_clients(p, x, y, w, g), doctest::Contains("gradient buffer 5"));
}
