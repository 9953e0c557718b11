// What both split programs (cloud and device) share: reading config and
// weight files, the plain SGD of a split half, the bottom digest and label.
#include "edge/cloud.h"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "compression/state.h"
#include "core/error.h"
#include "core/flat_config.h"
#include "core/error_text.h"
#include "core/model_digest.h"
#include "core/spec.h"
#include "edge/split.h"

namespace sparrow::edge {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK_T(ConfigError, in, "cannot read file '" << path << "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

core::FlatConfig read_flat_config(const std::string& toml_text, const std::string& source,
                                  const std::vector<ConfigField>& fields, const std::vector<std::string>& overrides) {
  core::FlatConfig f(source);
  for (const ConfigField& field : fields) std::visit([&](auto* slot) { f.bind(field.key, slot); }, field.slot);
  f.read(toml_text, overrides);
  return f;
}

Sgd::Sgd(std::vector<at::Tensor> params, double lr, double momentum)
    : params_(std::move(params)), lr_(lr), momentum_(momentum) {
  SPARROW_CHECK_T(ConfigError, std::isfinite(lr) && lr > 0, "lr: must be > 0 (got " << lr << ")");
  SPARROW_CHECK_T(ConfigError, momentum >= 0 && momentum < 1, "momentum: must be in [0, 1) (got " << momentum << ")");
  for (const auto& p : params_) buffers_.push_back(torch::zeros_like(p));
}

void Sgd::zero_grad() {
  for (auto& p : params_)
    if (p.grad().defined()) p.mutable_grad() = at::Tensor();
}

void Sgd::step() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].grad();
    if (!g.defined()) continue;
    buffers_[i].mul_(momentum_).add_(g);
    params_[i].add_(buffers_[i], -lr_);
  }
}

void save_weights(const std::map<std::string, at::Tensor>& weights, const std::string& path) {
  compression::State s;
  for (const auto& [k, v] : weights) s.tensors[k] = v.detach().to(at::kCPU, at::kFloat).contiguous();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    SPARROW_CHECK_T(Error, out, "cannot write '" << tmp << "'");
    const std::string bytes = s.serialize();
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    SPARROW_CHECK_T(Error, out.good(), "cannot write '" << tmp << "'");
  }
  SPARROW_CHECK_T(Error, std::rename(tmp.c_str(), path.c_str()) == 0,
                  "cannot rename '" << tmp << "' to '" << path << "'");
}

void load_weights(core::Model& model, const std::string& path) {
  compression::State s;
  try {
    s = compression::State::deserialize(read_text_file(path));
  } catch (const FormatError& e) {
    throw FormatError("weights '" + path + "' is not a weights file (" + e.what() + ")");
  }
  auto params = model.named_parameters();
  for (const auto& [k, v] : s.tensors) {
    const at::Tensor* p = params.find(k);
    SPARROW_CHECK_T(FormatError, p, "weights '" << path << "': '" << k << "' is not a parameter of the model");
    SPARROW_CHECK_T(FormatError, p->sizes() == v.sizes(),
                    "weights '" << path << "': '" << k << "' has the wrong shape");
  }
  torch::NoGradGuard no_grad;
  for (const auto& [k, v] : s.tensors) params[k].copy_(v);
}

std::map<std::string, at::Tensor> copy_weights(const std::vector<std::string>& names,
                                               const std::vector<at::Tensor>& params) {
  std::map<std::string, at::Tensor> out;
  for (size_t i = 0; i < names.size(); ++i)
    out[names[i]] = params[i].detach().to(at::kCPU, at::kFloat).clone().contiguous();
  return out;
}

uint64_t bottom_digest(const std::vector<std::string>& names, const std::vector<at::Tensor>& params) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (size_t i = 0; i < names.size(); ++i) shapes[names[i]] = params[i].sizes().vec();
  return core::model_digest(shapes);
}

std::string split_model_label(const std::string& model, const std::string& cut) { return model + ";cut=" + cut; }

}  // namespace sparrow::edge
