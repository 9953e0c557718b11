#pragma once
// The LibTorch side of the lite runtime: converts a model Sparrow trains
// with LibTorch into a lite model (lite/model.h) and its file
// (lite/model_file.h). Lives apart from sparrow_lite because it needs
// LibTorch; the device never links it.

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "lite/model.h"

namespace torch::jit {
struct Module;
}

namespace sparrow::lite {

struct Exported {
  ModelSpec spec;
  std::vector<float> values;  // Model::get_values() order
};

// A built-in model ("mlp", "cnn", "logreg") holding `weights` (named as the
// LibTorch model's named_parameters(): "fc1.weight", ...). logreg's sizes
// come from its fc.weight. ConfigError for another name or weights that do
// not fit (a name missing, left over, or of the wrong shape).
Exported export_builtin(const std::string& name, const std::map<std::string, at::Tensor>& weights);

// A TorchScript module whose forward is a chain of supported layers
// (nn.Sequential-style; lite/layers.h lists them). The layers are read from
// forward's graph (inlined, constants folded), not from module or attribute
// names: each supported op (aten::linear, conv2d, relu, gelu, max_pool2d,
// avg_pool2d, flatten, dropout, layer_norm, embedding) becomes one layer,
// and its parameters are the module attributes it reads. A LoRA adapter on
// a Linear (docs/lite.md, "LoRA"), F.linear(x, W, b) + (x @ A.t() @ B.t()) * s
// or the same with F.linear(F.linear(x, A), B), becomes one lora_linear
// layer: W and b must be buffers (frozen: in the model file, not in the
// flat vector, as the LibTorch side keeps buffers out of its update), A and
// B parameters. Parameter names are Sparrow's for TorchScript models ('.'
// replaced by '_', core/models.h).
// `input_shape` is the per-sample input; empty: taken from the first layer
// when it is a Linear ([in_features]) or an Embedding. ConfigError with one
// line naming the layer for an unsupported op or setting (padding modes,
// dilation, groups, ceil_mode...), a LoRA variant it cannot keep in step
// with the LibTorch side (a frozen parameter instead of a buffer, dropout on
// the update), a buffer read as an ordinary layer's weight, control flow on
// the data, a parameter the chain does not use, or parameters used in
// another order than the module registers them (the flat vector's order
// would differ from the LibTorch client's).
Exported export_torchscript(const torch::jit::Module& module, Shape input_shape = {});
// The same for a saved module (torch.jit.save); ConfigError naming the file.
Exported export_torchscript_file(const std::string& path, Shape input_shape = {});

}  // namespace sparrow::lite
