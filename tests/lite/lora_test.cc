// LoRA in the lite runtime: the layer against LibTorch's forward and
// autograd, its model file, the exporter's graph pattern, and one training
// step of an exported model against the LibTorch client's LocalTrainer on the
// same TorchScript file (same flat vector: the frozen base in neither).
#include "tests/sparrow_test.h"
// sparrow_test.h first: it drops glog's CHECK macros before doctest's.
#include <torch/script.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "client/trainer.h"
#include "core/models.h"
#include "lite/export/exporter.h"
#include "lite/layer_specs.h"
#include "lite/model_file.h"
#include "lite/trainer.h"
#include "tests/lite/lite_test_util.h"

namespace {

using namespace sparrow;
using lite::testing::from_torch;
using lite::testing::rel_diff;
using lite::testing::to_vec;

constexpr double kTol = 1e-5;

// The lite layer and LibTorch's F.linear(x, W, b) + (x @ A.t() @ B.t()) * (alpha / r)
// on the same random x, W, b, A, B and upstream gradient.
void check_lora(int64_t in, int64_t out, int64_t r, float alpha, bool bias, const lite::Shape& x_shape, uint64_t seed) {
  INFO("in " << in << ", out " << out << ", r " << r << ", bias " << bias << ", x " << lite::shape_str(x_shape));
  torch::manual_seed(seed);
  const at::Tensor w = at::randn({out, in}), b = at::randn({out}), a = at::randn({r, in}), bb = at::randn({out, r});
  auto layer = lite::make_layer(
      lite::spec::lora_linear("fc", in, out, r, alpha, to_vec(w), bias ? to_vec(b) : std::vector<float>{}));
  REQUIRE(layer->params().size() == 2);  // A and B only: the base is frozen
  CHECK(layer->params()[0].name == "fc.lora_A");
  CHECK(layer->params()[1].name == "fc.lora_B");
  layer->params()[0].value = to_vec(a);
  layer->params()[1].value = to_vec(bb);

  const at::Tensor xt = at::randn(x_shape);
  lite::Tensor x = from_torch(xt), y, dx;
  lite::ForwardContext ctx;
  ctx.train = true;
  layer->forward(x, y, ctx);

  at::Tensor xr = xt.clone().requires_grad_(true), ar = a.clone().requires_grad_(true),
             br = bb.clone().requires_grad_(true);
  const double scale = static_cast<double>(alpha) / static_cast<double>(r);
  at::Tensor yr = at::linear(xr, w, bias ? b : at::Tensor()) + at::matmul(at::matmul(xr, ar.t()), br.t()) * scale;
  REQUIRE(yr.sizes().vec() == y.shape);
  const at::Tensor dyt = at::randn(yr.sizes());
  (yr * dyt).sum().backward();
  layer->backward(x, y, from_torch(dyt), &dx);

  CHECK(rel_diff(y.data, to_vec(yr)) <= kTol);
  CHECK(rel_diff(dx.data, to_vec(xr.grad())) <= kTol);
  CHECK(rel_diff(layer->params()[0].grad, to_vec(ar.grad())) <= kTol);
  CHECK(rel_diff(layer->params()[1].grad, to_vec(br.grad())) <= kTol);
  CHECK(*layer->spec().frozen[0].value == to_vec(w));  // the base is read, never written
}

// A TorchScript LoRA layer: weight and bias buffers, lora_A and lora_B
// parameters (requires_grad, as nn.Parameter), `scaling` a float attribute.
torch::jit::Module lora_child(const at::Tensor& w, const at::Tensor& b, const at::Tensor& a, const at::Tensor& bb,
                              double scaling, const std::string& forward, bool frozen_as_buffers = true) {
  torch::jit::Module m("LoRALinear");
  if (frozen_as_buffers) {
    m.register_buffer("weight", w.clone());
    if (b.defined()) m.register_buffer("bias", b.clone());
  } else {  // parameters with requires_grad=False: refused (see the exporter)
    m.register_parameter("weight", w.clone(), false);
    if (b.defined()) m.register_parameter("bias", b.clone(), false);
  }
  m.register_parameter("lora_A", a.clone().requires_grad_(true), false);
  m.register_parameter("lora_B", bb.clone().requires_grad_(true), false);
  m.register_attribute("scaling", c10::FloatType::get(), scaling);
  m.define(forward);
  return m;
}

torch::jit::Module linear_child(int64_t in, int64_t out) {
  torch::jit::Module m("Fc");
  m.register_parameter("weight", (at::randn({out, in}) * 0.2).requires_grad_(true), false);
  m.register_parameter("bias", (at::randn({out}) * 0.1).requires_grad_(true), false);
  m.define("def forward(self, x):\n    return torch.linear(x, self.weight, self.bias)\n");
  return m;
}

const char* kMatmulForm = R"(
def forward(self, x):
    return torch.linear(x, self.weight, self.bias) + torch.matmul(torch.matmul(x, self.lora_A.t()), self.lora_B.t()) * self.scaling
)";
const char* kLinearForm = R"(
def forward(self, x):
    return self.scaling * torch.linear(torch.linear(x, self.lora_A), self.lora_B) + torch.linear(x, self.weight, self.bias)
)";

// fc1 (trainable) -> relu -> fc2 (LoRA on a frozen base): the MLP-with-an-
// adapter shape of examples/lora_mlp.py.
torch::jit::Module lora_net(const std::string& lora_forward, bool frozen_as_buffers = true, bool bias = true) {
  torch::jit::Module net("LoraNet");
  net.register_module("fc1", linear_child(12, 16));
  // B not zero (as after some training): A's gradient is then not zero either.
  net.register_module(
      "fc2", lora_child(at::randn({5, 16}) * 0.3, bias ? at::randn({5}) : at::Tensor(), at::randn({3, 16}) * 0.3,
                        at::randn({5, 3}) * 0.3, 2.0 / 3.0, lora_forward, frozen_as_buffers));
  net.define("def forward(self, x):\n    return self.fc2.forward(torch.relu(self.fc1.forward(x)))\n");
  return net;
}

// Lite forward of `e` on x against the module's own.
void check_forward(const lite::Exported& e, torch::jit::Module& net, const at::Tensor& x) {
  lite::Model m(e.spec);
  m.set_values(e.values);
  m.input(x.size(0)).data = to_vec(x);
  const lite::Tensor& out = m.forward(lite::ForwardContext{});
  torch::NoGradGuard g;
  const at::Tensor ref = net.forward({x}).toTensor();
  CHECK(out.shape == ref.sizes().vec());
  CHECK(rel_diff(out.data, to_vec(ref)) <= kTol);
}

std::vector<float> flatten(const client::Weights& w, const std::vector<std::string>& names) {
  std::vector<float> out;
  for (const auto& n : names) {
    const auto v = to_vec(w.at(n));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// The TorchScript file as the LibTorch client loads it (torchscript:FILE) and
// as sparrow-lite-export converts it: the same parameters in the same order,
// and the same update from the same global weights, data and seed.
void check_training(const std::string& ts_path, const lite::Shape& x_shape, const std::string& cfg_text, double tol) {
  INFO("model " << ts_path << ", config " << cfg_text);
  auto torch_model = core::make_model("torchscript:" + ts_path, 1);
  std::vector<std::string> names;
  for (const auto& p : torch_model->named_parameters()) names.push_back(p.key());
  const client::Weights global = client::get_weights(*torch_model);

  lite::Exported e = lite::export_torchscript_file(ts_path);
  const std::string lite_path = ts_path + ".lite";
  lite::save_model_file(lite_path, e.spec, e.values);
  std::shared_ptr<lite::Model> lite_model = lite::load_model(lite_path);
  std::remove(lite_path.c_str());
  CHECK(lite_model->param_names() == names);  // the frozen base is in neither
  const std::vector<float> flat_global = flatten(global, names);
  REQUIRE(lite_model->get_values() == flat_global);

  torch::manual_seed(21);
  const int64_t n = 24;
  lite::Shape shape{n};
  shape.insert(shape.end(), x_shape.begin(), x_shape.end());
  const at::Tensor x = at::randn(shape);
  const at::Tensor y = at::randint(0, lite_model->classes(), {n}, at::kLong);
  const std::vector<int64_t> yv(y.data_ptr<int64_t>(), y.data_ptr<int64_t>() + n);

  const client::TrainConfig tc = client::parse_train_config(cfg_text);
  lite::TrainConfig lc;
  lc.algorithm = tc.algorithm;
  lc.local_epochs = tc.local_epochs;
  lc.batch_size = tc.batch_size;
  lc.lr = tc.lr;
  lc.momentum = tc.momentum;
  lc.weight_decay = tc.weight_decay;
  client::LocalTrainer torch_trainer(torch_model, tc);
  lite::Trainer lite_trainer(lite_model, lc);
  const client::TrainResult tr = torch_trainer.train(global, x, y, 5);
  const lite::TrainResult lr = lite_trainer.train(flat_global, to_vec(x), yv, 5);
  CHECK(lr.steps == tr.steps);
  CHECK(std::fabs(lr.mean_loss - tr.mean_loss) <= 1e-5 * std::fabs(tr.mean_loss));
  const std::vector<float> td = flatten(tr.delta, names);
  const double d = rel_diff(lr.delta, td);
  MESSAGE(ts_path << " " << cfg_text << ": the lite update differs by " << d << " of its largest element");
  CHECK(d <= tol);
  // Every parameter moved, A and B included.
  size_t off = 0;
  for (const auto& p : lite_model->params()) {
    double mx = 0;
    for (size_t i = 0; i < p->value.size(); ++i) mx = std::max(mx, std::fabs(static_cast<double>(td[off + i])));
    CHECK_MESSAGE(mx > 0, p->name << " did not train");
    off += p->value.size();
  }
}

}  // namespace

TEST_CASE("lite LoRA linear matches LibTorch's forward and autograd") {
  check_lora(7, 5, 2, 4.0f, true, {3, 7}, 1);
  check_lora(16, 10, 4, 8.0f, true, {9, 16}, 2);
  check_lora(16, 10, 4, 8.0f, false, {9, 16}, 3);
  check_lora(32, 24, 8, 16.0f, true, {2, 6, 32}, 4);  // sequence input: [B, L, in]
  check_lora(5, 40, 1, 1.0f, true, {4, 5}, 5);        // rank 1
  check_lora(9, 4, 12, 3.0f, true, {5, 9}, 6);        // rank above min(in, out) is allowed, as in PyTorch
}

TEST_CASE("lite LoRA linear checks its spec") {
  auto spec = lite::spec::lora_linear("fc", 4, 3, 2, 4.0f, std::vector<float>(12, 0.5f), std::vector<float>(3, 0.0f));
  CHECK(lite::make_layer(spec)->params().size() == 2);
  lite::ModelSpec m{{4}, {spec}};
  CHECK(lite::Model(m).num_values() == 2 * 4 + 3 * 2);  // A and B, not the frozen 12 + 3
  auto bad = spec;
  bad.flag = 0;
  CHECK_THROWS_WITH_AS(lite::make_layer(bad), doctest::Contains("rank"), Error);
  bad = spec;
  bad.frozen.pop_back();  // bias = 1 without the bias
  CHECK_THROWS_WITH_AS(lite::make_layer(bad), doctest::Contains("2 frozen tensors"), Error);
  bad = spec;
  bad.frozen[0].value = std::make_shared<const std::vector<float>>(11, 0.0f);
  CHECK_THROWS_WITH_AS(lite::make_layer(bad), doctest::Contains("holds 11 values"), Error);
  bad = lite::spec::linear("fc", 4, 3);
  bad.frozen = spec.frozen;  // only LoRA layers hold frozen tensors
  CHECK_THROWS_WITH_AS(lite::make_layer(bad), doctest::Contains("0 frozen tensors"), Error);
}

TEST_CASE("lite model file carries a LoRA layer's frozen base outside the flat vector") {
  torch::manual_seed(7);
  lite::ModelSpec m;
  m.input_shape = {6};
  m.layers = {lite::spec::linear("fc1", 6, 8), lite::spec::plain(lite::LayerKind::kRelu),
              lite::spec::lora_linear("fc2", 8, 4, 2, 8.0f, to_vec(at::randn({4, 8})), to_vec(at::randn({4})))};
  lite::Model ref(m);
  const std::vector<float> values = to_vec(at::randn({ref.num_values()}));
  ref.set_values(values);
  const auto bytes = lite::encode_model_file(m, values);
  lite::ModelFile f = lite::decode_model_file(bytes.data(), bytes.size(), "mem");
  CHECK(f.values == values);
  const lite::LayerSpec &a = f.spec.layers[2], &b = m.layers[2];
  CHECK(a.kind == lite::LayerKind::kLoraLinear);
  CHECK(a.flag == 2);
  CHECK(a.p == 8.0f);
  CHECK(a.param_names == b.param_names);
  REQUIRE(a.frozen.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CHECK(a.frozen[i].name == b.frozen[i].name);
    CHECK(a.frozen[i].shape == b.frozen[i].shape);
    CHECK(*a.frozen[i].value == *b.frozen[i].value);
  }
  CHECK(lite::encode_model_file(f.spec, f.values) == bytes);
  // Same logits from the loaded model.
  lite::Model back(f.spec);
  back.set_values(f.values);
  const std::vector<float> x = to_vec(at::randn({3, 6}));
  ref.input(3).data = x;
  back.input(3).data = x;
  CHECK(ref.forward({}).data == back.forward({}).data);

  SUBCASE("a file whose LoRA layer lists its tensors wrongly is refused, naming the file") {
    // Clear the LoRA layer's bias flag: its bias is then read as a parameter.
    auto bad = bytes;
    const size_t layer0 = 8 + 4 + 4 + 4 + 8 + 4;
    size_t at = layer0 + 4 + 10 * 8 + 8;  // past layer 0's kind, fields, p, eps
    at += 4;                              // its tensor count (2: fc1.weight, fc1.bias)
    for (const char* name : {"fc1.weight", "fc1.bias"}) at += 4 + std::strlen(name) + 4 + 8 * (name[4] == 'w' ? 2 : 1);
    at += 4 + 10 * 8 + 8 + 4;               // the relu, no tensors
    const size_t bias_at = at + 4 + 8 * 8;  // past kind, in, out, kh, kw, sh, sw, ph, pw
    REQUIRE(bad[at] == 11);
    REQUIRE(bad[bias_at] == 1);
    bad[bias_at] = 0;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i + 8 < bad.size(); ++i) h = (h ^ bad[i]) * 0x100000001b3ull;
    std::memcpy(bad.data() + bad.size() - 8, &h, 8);
    CHECK_THROWS_WITH_AS(lite::decode_model_file(bad.data(), bad.size(), "lora_bad.lite"),
                         doctest::Contains("lora_bad.lite"), FormatError);
  }
}

TEST_CASE("lite model files without LoRA keep the version 1 layout") {
  // logreg 2 -> 2 written by hand as docs/lite.md lays out version 1: what
  // every file without a LoRA layer still is, byte for byte.
  std::vector<uint8_t> want;
  auto put = [&](const void* p, size_t n) {
    want.insert(want.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  };
  auto u32 = [&](uint32_t v) { put(&v, 4); };
  auto i64 = [&](int64_t v) { put(&v, 8); };
  auto f32 = [&](float v) { put(&v, 4); };
  put("SPRWLITE", 8);
  u32(1);
  u32(0);
  u32(1);
  i64(2);
  u32(1);
  u32(1);  // linear
  for (int64_t v : {2, 2, 1, 1, 1, 1, 0, 0, 1, 0}) i64(v);
  f32(0.0f);
  f32(1e-5f);
  u32(2);
  u32(9);
  put("fc.weight", 9);
  u32(2);
  i64(2);
  i64(2);
  u32(7);
  put("fc.bias", 7);
  u32(1);
  i64(2);
  const std::vector<float> values{1, 2, 3, 4, 5, 6};
  uint64_t count = 6;
  put(&count, 8);
  put(values.data(), 24);
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint8_t c : want) h = (h ^ c) * 0x100000001b3ull;
  put(&h, 8);
  CHECK(lite::encode_model_file(lite::builtin_spec("logreg", 2, 2), values) == want);
  CHECK(lite::decode_model_file(want.data(), want.size(), "v1.lite").values == values);
}

TEST_CASE("lite export recognises LoRA from the graph and matches LibTorch") {
  for (const char* form : {kMatmulForm, kLinearForm}) {
    for (bool bias : {true, false}) {
      INFO((form == kMatmulForm ? "x @ A.t() @ B.t()" : "linear(linear(x, A), B)") << ", bias " << bias);
      torch::manual_seed(9);
      std::string fwd = form;
      if (!bias) {
        const size_t at = fwd.find("self.weight, self.bias");
        fwd.replace(at, 22, "self.weight, None");
      }
      torch::jit::Module net = lora_net(fwd, true, bias);
      lite::Exported e = lite::export_torchscript(net);
      REQUIRE(e.spec.layers.size() == 3);
      const lite::LayerSpec& l = e.spec.layers[2];
      CHECK(l.kind == lite::LayerKind::kLoraLinear);
      CHECK(l.flag == 3);
      CHECK(l.p == doctest::Approx(2.0));  // alpha = scaling * r
      CHECK(l.bias == (bias ? 1 : 0));
      CHECK(l.frozen.size() == (bias ? 2u : 1u));
      CHECK(l.frozen[0].name == "fc2_weight");
      CHECK(e.spec.input_shape == lite::Shape{12});
      CHECK(lite::Model(e.spec).param_names() ==
            std::vector<std::string>{"fc1_weight", "fc1_bias", "fc2_lora_A", "fc2_lora_B"});
      check_forward(e, net, at::randn({4, 12}));
    }
  }
  SUBCASE("a constant scale") {
    std::string fwd = kMatmulForm;
    fwd.replace(fwd.find("self.scaling"), 12, "0.5");
    torch::jit::Module net = lora_net(fwd);
    lite::Exported e = lite::export_torchscript(net);
    CHECK(e.spec.layers[2].p == 1.5f);  // alpha = 0.5 * r
    check_forward(e, net, at::randn({4, 12}));
  }
}

TEST_CASE("lite LoRA training step equals the LibTorch client's on the same TorchScript file") {
  torch::manual_seed(11);
  const std::string ts = "lite_lora_test_net.pt";
  lora_net(kMatmulForm).save(ts);
  check_training(ts, {12}, "fedavg:lr=0.1,batch=24", kTol);  // one step on the whole batch
  check_training(ts, {12}, "fedavg:lr=0.05,momentum=0.9,wd=1e-3,batch=8,epochs=2", 1e-4);
  std::remove(ts.c_str());
}

TEST_CASE("lite export of examples/lora_mlp.py trains as the LibTorch client does") {
  // The example itself, scripted by PyTorch; skipped without python3-torch.
  const std::string python = std::ifstream("/usr/bin/python3").good() ? "/usr/bin/python3" : "python3";
  if (std::system((python + " -c 'import torch' > /dev/null 2>&1").c_str()) != 0) {
    MESSAGE("skipped: no python3 with torch");
    return;
  }
  const std::string ts = "lite_lora_test_example.pt";
  const std::string cmd =
      python + " " + SPARROW_SOURCE_DIR + "/examples/lora_mlp.py " + ts + " --rank 4 --alpha 8 > /dev/null";
  REQUIRE(std::system(cmd.c_str()) == 0);
  // The example's B starts at zero (standard LoRA init), so A's first
  // gradient is zero: two steps, so that both have moved.
  check_training(ts, {784}, "fedavg:lr=0.1,batch=12", 1e-4);
  std::remove(ts.c_str());
}

TEST_CASE("lite export refuses LoRA variants it cannot keep in step, naming why") {
  auto refused = [](torch::jit::Module net, const std::string& needle) {
    INFO(needle);
    CHECK_THROWS_WITH_AS(lite::export_torchscript(net), doctest::Contains(needle.c_str()), ConfigError);
  };
  torch::manual_seed(13);
  // A frozen base held as parameters (requires_grad=False): the LibTorch side
  // would send them, the lite client would not.
  refused(lora_net(kMatmulForm, false), "must be a buffer");
  refused(lora_net(R"(
def forward(self, x):
    return torch.linear(x, self.weight, self.bias) + torch.matmul(torch.matmul(torch.dropout(x, 0.1, False), self.lora_A.t()), self.lora_B.t()) * self.scaling
)"),
          "dropout");
  refused(lora_net(R"(
def forward(self, x):
    return torch.linear(x, self.weight, self.bias) + torch.matmul(torch.matmul(x, self.lora_A.t()), self.lora_B.t()) * self.weight[0, 0]
)"),
          "scaled by a float");
  refused(lora_net(R"(
def forward(self, x):
    return torch.linear(x, self.weight, self.bias) + torch.matmul(torch.matmul(x, self.lora_A), self.lora_B.t()) * self.scaling
)"),
          "aten::add");
  refused(lora_net(R"(
def forward(self, x):
    return torch.linear(x, self.weight, self.bias) + torch.matmul(torch.matmul(torch.relu(x), self.lora_A.t()), self.lora_B.t()) * self.scaling
)"),
          "LoRA");
  refused(lora_net(R"(
def forward(self, x):
    y = torch.linear(x, self.weight, self.bias)
    return y + torch.matmul(torch.matmul(x, self.lora_A.t()), self.lora_B.t()) * self.scaling + y
)"),
          "used elsewhere");
  // Every message is one line naming the op.
  try {
    lite::export_torchscript(lora_net(kMatmulForm, false));
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    CHECK(what.find('\n') == std::string::npos);
    CHECK(what.find("aten::add") != std::string::npos);
  }
  // A plain layer on a buffer: frozen weights exist only in LoRA layers.
  torch::jit::Module net("Net");
  torch::jit::Module fc("Fc");
  fc.register_buffer("weight", at::randn({3, 4}));
  fc.define("def forward(self, x):\n    return torch.linear(x, self.weight)\n");
  net.register_module("fc", fc);
  net.define("def forward(self, x):\n    return self.fc.forward(x)\n");
  refused(net, "is a buffer");
}
