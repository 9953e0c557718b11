#include "core/export.h"

#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/error_text.h"
#include "core/npy.h"

namespace sparrow::core {
namespace fs = std::filesystem;
namespace {

using Weights = std::map<std::string, at::Tensor>;

const at::Tensor& need(const Weights& w, const std::string& name, const std::vector<int64_t>& shape) {
  auto it = w.find(name);
  SPARROW_CHECK_T(ConfigError, it != w.end(), "export: the weights lack '" << name << "'");
  SPARROW_CHECK_T(
      ConfigError, shape.empty() || it->second.sizes().vec() == shape,
      "export: '" << name << "' has shape " << it->second.sizes() << ", the model needs " << at::IntArrayRef(shape));
  return it->second;
}

// A trainable parameter, as nn.Module's are: the exported file is also a model
// users train further (`model = "torchscript:FILE"`), which needs gradients.
at::Tensor param(const at::Tensor& t) {
  return t.detach().to(at::kCPU, at::kFloat).contiguous().clone().requires_grad_(true);
}

// A submodule holding weight and bias with a forward of the given body.
torch::jit::Module layer(const std::string& kind, const at::Tensor& weight, const at::Tensor& bias,
                         const std::string& forward) {
  torch::jit::Module m(kind);
  m.register_parameter("weight", param(weight), false);
  m.register_parameter("bias", param(bias), false);
  m.define(forward);
  return m;
}

const char* kLinear = R"(
def forward(self, x):
    return torch.linear(x, self.weight, self.bias)
)";
const char* kConv5x5 = R"(
def forward(self, x):
    return torch.conv2d(x, self.weight, self.bias, [1, 1], [2, 2])
)";

torch::jit::Module linear(const Weights& w, const std::string& name, int64_t in, int64_t out) {
  return layer("Linear", need(w, name + ".weight", {out, in}), need(w, name + ".bias", {out}), kLinear);
}

torch::jit::Module builtin(const std::string& model, const Weights& w) {
  torch::jit::Module net(model == "cnn" ? "SparrowCnn" : model == "mlp" ? "SparrowMlp" : "SparrowLogReg");
  if (model == "mlp") {
    net.register_module("fc1", linear(w, "fc1", 784, 200));
    net.register_module("fc2", linear(w, "fc2", 200, 200));
    net.register_module("fc3", linear(w, "fc3", 200, 10));
    net.define(R"(
def forward(self, x):
    h = x.reshape([x.size(0), -1])
    h = torch.relu(self.fc1.forward(h))
    h = torch.relu(self.fc2.forward(h))
    return self.fc3.forward(h)
)");
  } else if (model == "cnn") {
    net.register_module("conv1",
                        layer("Conv2d", need(w, "conv1.weight", {32, 1, 5, 5}), need(w, "conv1.bias", {32}), kConv5x5));
    net.register_module(
        "conv2", layer("Conv2d", need(w, "conv2.weight", {64, 32, 5, 5}), need(w, "conv2.bias", {64}), kConv5x5));
    net.register_module("fc1", linear(w, "fc1", 7 * 7 * 64, 512));
    net.register_module("fc2", linear(w, "fc2", 512, 10));
    net.define(R"(
def forward(self, x):
    h = x.reshape([x.size(0), 1, 28, 28])
    h = torch.max_pool2d(torch.relu(self.conv1.forward(h)), [2, 2])
    h = torch.max_pool2d(torch.relu(self.conv2.forward(h)), [2, 2])
    h = torch.relu(self.fc1.forward(h.flatten(1)))
    return self.fc2.forward(h)
)");
  } else {  // logreg: one linear layer on the flattened input
    const at::Tensor& wt = need(w, "fc.weight", {});
    SPARROW_CHECK_T(ConfigError, wt.dim() == 2, "export: logreg's fc.weight must be 2-D");
    net.register_module("fc", linear(w, "fc", wt.size(1), wt.size(0)));
    net.define(R"(
def forward(self, x):
    return self.fc.forward(x.reshape([x.size(0), -1]))
)");
  }
  return net;
}

// ResNet-8 (core/models.cc). The global model holds no BatchNorm running
// statistics (they are buffers, never aggregated), so every BatchNorm
// normalises with the statistics of the batch it is given, as the model does
// in training mode: evaluate it on batches, not on single samples.
torch::jit::Module conv_nobias(const at::Tensor& w, int64_t stride, int64_t pad) {
  torch::jit::Module m("Conv2d");
  m.register_parameter("weight", param(w), false);
  m.define("def forward(self, x):\n    return torch.conv2d(x, self.weight, None, [" + std::to_string(stride) + ", " +
           std::to_string(stride) + "], [" + std::to_string(pad) + ", " + std::to_string(pad) + "])\n");
  return m;
}

torch::jit::Module batch_norm(const Weights& w, const std::string& name, int64_t channels) {
  return layer("BatchNorm2d", need(w, name + ".weight", {channels}), need(w, name + ".bias", {channels}), R"(
def forward(self, x):
    return torch.batch_norm(x, self.weight, self.bias, None, None, True, 0.0, 1e-5, False)
)");
}

torch::jit::Module basic_block(const Weights& w, const std::string& name, int64_t in, int64_t out, int64_t stride) {
  torch::jit::Module b("BasicBlock");
  b.register_module("conv1", conv_nobias(need(w, name + ".conv1.weight", {out, in, 3, 3}), stride, 1));
  b.register_module("bn1", batch_norm(w, name + ".bn1", out));
  b.register_module("conv2", conv_nobias(need(w, name + ".conv2.weight", {out, out, 3, 3}), 1, 1));
  b.register_module("bn2", batch_norm(w, name + ".bn2", out));
  if (stride != 1 || in != out) {
    // Named as Sparrow's model (and torchvision's) names it, downsample.0 and
    // downsample.1, so model.pt's state_dict keys are the .npy names.
    torch::jit::Module down("Downsample");
    down.register_module("0", conv_nobias(need(w, name + ".downsample.0.weight", {out, in, 1, 1}), stride, 0));
    down.register_module("1", batch_norm(w, name + ".downsample.1", out));
    down.define(R"(
def forward(self, x):
    return getattr(self, "1").forward(getattr(self, "0").forward(x))
)");
    b.register_module("downsample", down);
    b.define(R"(
def forward(self, x):
    h = torch.relu(self.bn1.forward(self.conv1.forward(x)))
    h = self.bn2.forward(self.conv2.forward(h))
    return torch.relu(h + self.downsample.forward(x))
)");
  } else {
    b.define(R"(
def forward(self, x):
    h = torch.relu(self.bn1.forward(self.conv1.forward(x)))
    h = self.bn2.forward(self.conv2.forward(h))
    return torch.relu(h + x)
)");
  }
  return b;
}

torch::jit::Module resnet8(const Weights& w) {
  const at::Tensor& stem = need(w, "conv1.weight", {});
  SPARROW_CHECK_T(ConfigError, stem.dim() == 4 && stem.size(0) == 16,
                  "export: resnet's conv1.weight is " << stem.sizes());
  const int64_t in = stem.size(1);
  torch::jit::Module net("SparrowResNet8");
  net.register_module("conv1", conv_nobias(need(w, "conv1.weight", {16, in, 3, 3}), 1, 1));
  net.register_module("bn1", batch_norm(w, "bn1", 16));
  net.register_module("layer1", basic_block(w, "layer1", 16, 16, 1));
  net.register_module("layer2", basic_block(w, "layer2", 16, 32, 2));
  net.register_module("layer3", basic_block(w, "layer3", 32, 64, 2));
  net.register_module("fc", linear(w, "fc", 64, 10));
  std::string image = in == 1 ? "    if x.dim() == 2:\n        x = x.reshape([x.size(0), 1, 28, 28])\n" : "";
  net.define("def forward(self, x):\n" + image + R"(    h = torch.relu(self.bn1.forward(self.conv1.forward(x)))
    h = self.layer3.forward(self.layer2.forward(self.layer1.forward(h)))
    return self.fc.forward(torch.adaptive_avg_pool2d(h, [1, 1]).flatten(1))
)");
  return net;
}

// The user's module with these weights (Sparrow names its parameters with '.'
// replaced by '_', core/models.h).
torch::jit::Module scripted(const std::string& file, const Weights& w) {
  torch::jit::Module m;
  try {
    m = torch::jit::load(file, torch::kCPU);
  } catch (const std::exception& e) {
    throw ConfigError("export: TorchScript model file '" + file + "' could not be loaded: " + error_text(e));
  }
  torch::NoGradGuard g;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) {
    std::string key = p.name;
    std::replace(key.begin(), key.end(), '.', '_');
    const at::Tensor& v = need(w, key, p.value.sizes().vec());
    p.value.copy_(v.to(at::kCPU, p.value.scalar_type()));
  }
  return m;
}

// The exported module: `model`'s structure holding `weights`.
torch::jit::Module build(const std::string& model, const Weights& weights) {
  torch::jit::Module m;
  if (model.rfind("torchscript:", 0) == 0)
    m = scripted(model.substr(12), weights);
  else if (model == "mlp" || model == "cnn" || model == "logreg")
    m = builtin(model, weights);
  else if (model.rfind("resnet", 0) == 0)
    m = resnet8(weights);
  else
    throw ConfigError("export: no TorchScript form for model '" + model + "'");
  // Every module above took each of its parameters from `weights` (need()):
  // the same count means none of the weights was left over.
  size_t n = 0;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) {
    (void)p;
    ++n;
  }
  SPARROW_CHECK_T(ConfigError, n == weights.size(),
                  "export: model '" << model << "' has " << n << " parameters, the weights " << weights.size());
  return m;
}

void write_file(const std::string& path, const std::vector<char>& bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    SPARROW_CHECK(f.good(), "export: cannot write '" << tmp << "'");
  }
  fs::rename(tmp, path);
}

}  // namespace

void save_torchscript(const std::string& model, const Weights& weights, const std::string& path) {
  torch::jit::Module m = build(model, weights);
  const std::string tmp = path + ".tmp";
  m.save(tmp);
  fs::rename(tmp, path);
}

ExportResult export_model(const std::string& model, const Weights& weights, const std::string& dir) {
  SPARROW_CHECK_T(ConfigError, !weights.empty(), "export: no weights");
  // Built first, so weights that do not fit the model write nothing.
  torch::jit::Module m = build(model, weights);
  fs::create_directories(fs::path(dir) / "weights");
  ExportResult r;
  // Every file names a parameter as the module does (`fc1.weight`, also for a
  // TorchScript model, whose parameters Sparrow holds as `fc1_weight`), so
  // PyTorch's load_state_dict takes them without renaming.
  c10::Dict<std::string, at::Tensor> state;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) {
    const at::Tensor v = p.value.detach().to(at::kCPU, at::kFloat).contiguous();
    const std::string path = (fs::path(dir) / "weights" / (p.name + ".npy")).string();
    npy::write(path, v.sizes().vec(), v.data_ptr<float>());
    r.npy.push_back(path);
    state.insert(p.name, p.value.detach());
  }
  // Buffers (a user's BatchNorm statistics) are never trained or aggregated:
  // they are the model file's own, included so a strict load finds every key.
  for (const auto& b : m.named_buffers(/*recurse=*/true)) state.insert(b.name, b.value.detach());
  r.state_dict = (fs::path(dir) / "state_dict.pt").string();
  write_file(r.state_dict, torch::pickle_save(c10::IValue(state)));
  if (model.rfind("resnet", 0) == 0)
    r.note =
        "resnet: the global model has no BatchNorm running statistics, so model.pt normalises each batch with "
        "its own statistics (evaluate on batches, not single samples)";
  r.torchscript = (fs::path(dir) / "model.pt").string();
  const std::string tmp = r.torchscript + ".tmp";
  m.save(tmp);
  fs::rename(tmp, r.torchscript);
  return r;
}

}  // namespace sparrow::core
