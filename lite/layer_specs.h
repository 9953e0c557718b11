#pragma once
// Builders of LayerSpec for the documented layers, with LibTorch's parameter
// names (`name.weight`, then `name.bias`): one place for what the built-in
// models (model.cc) and the tests write by hand. make_layer still checks
// every field against the parameters' shapes.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lite/layers.h"

namespace sparrow::lite::spec {

// A layer without parameters or geometry (ReLU, Flatten, Sigmoid, ...).
inline LayerSpec plain(LayerKind kind) {
  LayerSpec s;
  s.kind = kind;
  return s;
}

inline LayerSpec linear(const std::string& name, int64_t in, int64_t out, bool bias = true) {
  LayerSpec s = plain(LayerKind::kLinear);
  s.in = in;
  s.out = out;
  s.bias = bias;
  s.param_names = {name + ".weight"};
  s.param_shapes = {{out, in}};
  if (bias) {
    s.param_names.push_back(name + ".bias");
    s.param_shapes.push_back({out});
  }
  return s;
}

inline LayerSpec conv2d(const std::string& name, int64_t in, int64_t out, int64_t kh, int64_t kw, int64_t sh,
                        int64_t sw, int64_t ph, int64_t pw, bool bias = true) {
  LayerSpec s = plain(LayerKind::kConv2d);
  s.in = in;
  s.out = out;
  s.kh = kh;
  s.kw = kw;
  s.sh = sh;
  s.sw = sw;
  s.ph = ph;
  s.pw = pw;
  s.bias = bias;
  s.param_names = {name + ".weight"};
  s.param_shapes = {{out, in, kh, kw}};
  if (bias) {
    s.param_names.push_back(name + ".bias");
    s.param_shapes.push_back({out});
  }
  return s;
}

// MaxPool2d / AvgPool2d with a square kernel, stride and padding.
inline LayerSpec pool(LayerKind kind, int64_t k, int64_t stride, int64_t pad) {
  LayerSpec s = plain(kind);
  s.kh = s.kw = k;
  s.sh = s.sw = stride;
  s.ph = s.pw = pad;
  return s;
}

inline LayerSpec layer_norm(const std::string& name, int64_t n) {
  LayerSpec s = plain(LayerKind::kLayerNorm);
  s.in = n;
  s.param_names = {name + ".weight", name + ".bias"};
  s.param_shapes = {{n}, {n}};
  return s;
}

inline LayerSpec gelu(bool tanh_approx) {
  LayerSpec s = plain(LayerKind::kGelu);
  s.flag = tanh_approx ? 1 : 0;
  return s;
}

inline LayerSpec embedding(const std::string& name, int64_t num, int64_t dim) {
  LayerSpec s = plain(LayerKind::kEmbedding);
  s.in = num;
  s.out = dim;
  s.param_names = {name + ".weight"};
  s.param_shapes = {{num, dim}};
  return s;
}

inline FrozenTensor frozen(const std::string& name, Shape shape, std::vector<float> value) {
  return FrozenTensor{name, std::move(shape), std::make_shared<const std::vector<float>>(std::move(value))};
}

// LoRA on a frozen Linear: `weight` [out, in] and `bias` [out] (empty: no
// bias) frozen as `name.weight` / `name.bias`, parameters `name.lora_A`
// [r, in] and `name.lora_B` [out, r]; the update is scaled by alpha / r.
inline LayerSpec lora_linear(const std::string& name, int64_t in, int64_t out, int64_t r, float alpha,
                             std::vector<float> weight, std::vector<float> bias = {}) {
  LayerSpec s = plain(LayerKind::kLoraLinear);
  s.in = in;
  s.out = out;
  s.flag = r;
  s.p = alpha;
  s.bias = bias.empty() ? 0 : 1;
  s.frozen.push_back(frozen(name + ".weight", {out, in}, std::move(weight)));
  if (s.bias) s.frozen.push_back(frozen(name + ".bias", {out}, std::move(bias)));
  s.param_names = {name + ".lora_A", name + ".lora_B"};
  s.param_shapes = {{r, in}, {out, r}};
  return s;
}

}  // namespace sparrow::lite::spec
