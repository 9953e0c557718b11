#include "core/model_digest.h"

#include <torch/nn/module.h>

namespace sparrow::core {
namespace {

constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull, kFnvPrime = 0x100000001b3ull;

void mix(uint64_t& h, const std::string& s) {
  for (unsigned char c : s) {
    h ^= c;
    h *= kFnvPrime;
  }
}

}  // namespace

uint64_t model_digest(const std::map<std::string, std::vector<int64_t>>& shapes) {
  uint64_t h = kFnvOffset;
  for (const auto& [name, shape] : shapes) {
    std::string s = name + ":";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? "x" : "") + std::to_string(shape[i]);
    mix(h, s + ";");
  }
  return h;
}

uint64_t model_digest(const std::map<std::string, at::Tensor>& weights) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, t] : weights) shapes[name] = t.sizes().vec();
  return model_digest(shapes);
}

uint64_t model_digest(const torch::nn::Module& model) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model.named_parameters()) shapes[p.key()] = p.value().sizes().vec();
  return model_digest(shapes);
}

}  // namespace sparrow::core
