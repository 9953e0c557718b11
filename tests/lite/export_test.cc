// The exporter: built-in models and TorchScript modules made of supported
// layers become lite models computing what LibTorch computes; anything else
// is refused with one line naming the layer.
#include "tests/sparrow_test.h"
// sparrow_test.h first: it drops glog's CHECK macros before doctest's.
#include <torch/script.h>

#include <cstdio>

#include "core/export.h"
#include "core/models.h"
#include "lite/export/exporter.h"
#include "lite/model_file.h"
#include "tests/lite/lite_test_util.h"

namespace {

using namespace sparrow;
using lite::testing::rel_diff;
using lite::testing::to_vec;

// Lite forward of `e` on x (dropout off) against the reference logits.
void check_forward(const lite::Exported& e, const at::Tensor& x, const at::Tensor& ref) {
  lite::Model m(e.spec);
  m.set_values(e.values);
  lite::Tensor& in = m.input(x.size(0));
  in.data = to_vec(x);
  const lite::Tensor& out = m.forward(lite::ForwardContext{});
  CHECK(out.shape == ref.sizes().vec());
  CHECK(rel_diff(out.data, to_vec(ref)) <= 1e-5);
}

torch::jit::Module child(const std::string& kind, const std::string& forward,
                         const std::vector<std::pair<std::string, at::Tensor>>& params = {}) {
  torch::jit::Module m(kind);
  for (const auto& [name, value] : params) m.register_parameter(name, value, false);
  m.define(forward);
  return m;
}

}  // namespace

TEST_CASE("lite export of the built-in models computes LibTorch's logits") {
  torch::manual_seed(1);
  for (const char* name : {"mlp", "cnn"}) {
    INFO(name);
    auto model = core::make_model(name, 3);
    std::map<std::string, at::Tensor> w;
    for (const auto& p : model->named_parameters()) w[p.key()] = p.value().detach().clone();
    lite::Exported e = lite::export_builtin(name, w);
    at::Tensor x = at::rand({5, 1, 28, 28});
    torch::NoGradGuard g;
    check_forward(e, x, model->forward(x));
    w.erase("fc2.bias");
    CHECK_THROWS_WITH_AS(lite::export_builtin(name, w), doctest::Contains("fc2.bias"), ConfigError);
  }
  std::map<std::string, at::Tensor> lr{{"fc.weight", at::randn({3, 7})}, {"fc.bias", at::randn({3})}};
  lite::Exported e = lite::export_builtin("logreg", lr);
  at::Tensor x = at::randn({4, 7});
  check_forward(e, x, at::linear(x, lr["fc.weight"], lr["fc.bias"]));
  CHECK_THROWS_AS(lite::export_builtin("resnet", lr), ConfigError);
}

TEST_CASE("lite export reads a TorchScript chain of layers from its graph") {
  torch::manual_seed(2);
  // Children registered and called in order, named neither like torch's
  // classes nor like their layers: the exporter goes by the graph.
  torch::jit::Module net("UserNet");
  net.register_module("a", child("A", R"(
def forward(self, x):
    return torch.conv2d(x, self.weight, self.bias, [2, 1], [1, 2])
)",
                                 {{"weight", at::randn({4, 2, 3, 3}) * 0.3}, {"bias", at::randn({4})}}));
  net.register_module("b", child("B", R"(
def forward(self, x):
    return torch.max_pool2d(torch.relu(x), [2, 2], [2, 2], [1, 1])
)"));
  net.register_module("c", child("C", R"(
def forward(self, x):
    return torch.dropout(torch.flatten(x, 1), 0.1, False)
)"));
  net.register_module("d", child("D", R"(
def forward(self, x):
    return torch.layer_norm(x, [60], self.weight, self.bias, 1e-5)
)",
                                 {{"weight", at::rand({60}) + 0.5}, {"bias", at::randn({60})}}));
  net.register_module("e", child("E", R"(
def forward(self, x):
    return torch.linear(torch.gelu(x), self.weight, self.bias)
)",
                                 {{"weight", at::randn({5, 60}) * 0.1}, {"bias", at::randn({5})}}));
  net.define(R"(
def forward(self, x):
    return self.e.forward(self.d.forward(self.c.forward(self.b.forward(self.a.forward(x)))))
)");
  net.eval();
  lite::Exported e = lite::export_torchscript(net, {2, 9, 7});
  std::vector<std::string> kinds;
  for (const auto& l : e.spec.layers) kinds.push_back(lite::kind_name(l.kind));
  CHECK(kinds ==
        std::vector<std::string>{"conv2d", "relu", "max_pool2d", "flatten", "dropout", "layer_norm", "gelu", "linear"});
  CHECK(e.spec.layers[0].sh == 2);
  CHECK(e.spec.layers[0].pw == 2);
  CHECK(e.spec.layers[4].p == doctest::Approx(0.1));
  CHECK(lite::Model(e.spec).param_names() ==
        std::vector<std::string>{"a_weight", "a_bias", "d_weight", "d_bias", "e_weight", "e_bias"});
  at::Tensor x = at::randn({3, 2, 9, 7});
  torch::NoGradGuard g;
  check_forward(e, x, net.forward({x}).toTensor());

  SUBCASE("through a saved file and the model file") {
    const std::string ts = "lite_export_test_net.pt", out = "lite_export_test_net.lite";
    net.save(ts);
    lite::Exported f = lite::export_torchscript_file(ts, {2, 9, 7});
    lite::save_model_file(out, f.spec, f.values);
    auto m = lite::load_model(out);
    CHECK(m->get_values() == e.values);
    std::remove(ts.c_str());
    std::remove(out.c_str());
  }
  SUBCASE("a conv first needs the input shape") {
    CHECK_THROWS_WITH_AS(lite::export_torchscript(net), doctest::Contains("--input-shape"), ConfigError);
  }
}

TEST_CASE("lite export takes the built-in models' TorchScript form") {
  // core::save_torchscript's modules: input reshapes, functional relu and pools.
  torch::manual_seed(3);
  auto model = core::make_model("cnn", 5);
  std::map<std::string, at::Tensor> w;
  for (const auto& p : model->named_parameters()) w[p.key()] = p.value().detach().clone();
  const std::string ts = "lite_export_test_cnn.pt";
  core::save_torchscript("cnn", w, ts);
  lite::Exported e = lite::export_torchscript_file(ts);
  std::remove(ts.c_str());
  CHECK(e.spec.input_shape == lite::Shape{1, 28, 28});
  at::Tensor x = at::rand({2, 1, 28, 28});
  torch::NoGradGuard g;
  check_forward(e, x, model->forward(x));
}

TEST_CASE("lite export refuses an unsupported layer, naming it") {
  auto refuse = [](const std::string& body, const std::string& needle) {
    torch::jit::Module net("Net");
    net.register_module("0", child("L", "def forward(self, x):\n    return torch.linear(x, self.weight, self.bias)\n",
                                   {{"weight", at::randn({4, 3})}, {"bias", at::randn({4})}}));
    net.register_module("1", child("Odd", "def forward(self, x):\n    return " + body + "\n"));
    net.define("def forward(self, x):\n    return getattr(self, '1').forward(getattr(self, '0').forward(x))\n");
    INFO(body);
    CHECK_THROWS_WITH_AS(lite::export_torchscript(net), doctest::Contains(needle.c_str()), ConfigError);
  };
  refuse("torch.sigmoid(x)", "aten::sigmoid");
  refuse("torch.max_pool2d(x.reshape([x.size(0), 1, 2, 2]), [2, 2], [2, 2], [0, 0], [1, 1], True)", "reshape");
  refuse("x * 2.0", "aten::mul");
  refuse("torch.gelu(x) + x", "aten::add");
}
