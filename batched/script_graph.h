#pragma once
// One reader of a TorchScript module's forward graph, for the two programs
// that turn a user's scripted model into layers of their own: the lite
// exporter (lite/export/exporter.h, a chain of lite layers) and the batched
// layer program (batched/program.h, K clients in one pass). The reader
// prepares the graph (inlined, constants folded) and decodes each op into a
// ScriptOp: its kind, the tensors of the module it reads (by dotted attribute
// path) and its settings. What to make of an op, and what to refuse, is each
// consumer's: the lite runtime runs fewer ops than the batched program.
//
// Ops are recognised from the graph's ops, never from module or attribute
// names (an nn.Sequential, submodules called one after another, or functional
// calls read the same).

#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/api/module.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"

namespace sparrow::batched {

enum class OpKind {
  kLinear,
  kConv2d,
  kRelu,
  kGelu,
  kTanh,
  kSigmoid,
  kMaxPool2d,
  kAvgPool2d,
  kAdaptiveAvgPool2d,
  kFlatten,
  kReshape,  // reshape/view to a constant per-sample shape (shape: dims after the batch)
  kDropout,
  kBatchNorm,
  kLayerNorm,
  kEmbedding,
  kAdd,       // a + alpha * b of two data values
  kIdentity,  // dtype, layout or copy: aten::to, long, contiguous, clone
};

// One decoded op. Settings not used by a kind keep their defaults.
struct ScriptOp {
  OpKind kind = OpKind::kIdentity;
  const torch::jit::Node* node = nullptr;
  // The module tensors it reads, as dotted attribute paths ("" for None):
  // linear and conv2d {weight, bias}; layer_norm {weight, bias}; embedding
  // {weight}; batch_norm {weight, bias, running_mean, running_var}.
  std::vector<std::string> tensors;
  std::array<int64_t, 2> kernel{0, 0}, stride{1, 1}, padding{0, 0}, dilation{1, 1};
  int64_t groups = 1;
  bool transposed = false;
  bool ceil_mode = false;
  bool count_include_pad = true;
  bool divisor_override = false;
  bool padding_string = false;  // conv2d padding 'same'/'valid'
  int64_t start_dim = 1, end_dim = -1;
  double p = 0;           // dropout
  double eps = 0;         // layer_norm, batch_norm
  double momentum = 0;    // batch_norm
  double alpha = 1;       // add
  bool training = false;  // dropout, batch_norm: the constant training flag
  bool flag = false;      // gelu: tanh approximation; embedding: scale_grad_by_freq
  int64_t padding_idx = -1;
  bool feature = false;        // dropout: channel dropout (feature_dropout)
  std::vector<int64_t> shape;  // layer_norm normalized_shape, adaptive pool output, reshape dims
};

// Thrown by ScriptGraph::decode for an op it does not know or a setting that
// is not a constant; `op` is the op's name ("aten::lstm"), `why` the reason.
class Unsupported : public ConfigError {
 public:
  Unsupported(std::string op, std::string where, std::string why)
      : ConfigError(op + where + ": " + why), op_(std::move(op)), where_(std::move(where)), why_(std::move(why)) {}
  const std::string& op() const { return op_; }
  const std::string& where() const { return where_; }
  const std::string& why() const { return why_; }

 private:
  std::string op_, where_, why_;
};

class ScriptGraph {
 public:
  // The module's forward, inlined, constants propagated, dead code removed.
  // training = true also reads the module as in training mode: every
  // `self.training` becomes the constant True and the graph is simplified
  // again, so BatchNorm's and Dropout's training branches are what remains
  // (what the batched program trains with). ConfigError when there is no
  // forward method.
  ScriptGraph(const torch::jit::Module& module, bool training);

  const std::shared_ptr<torch::jit::Graph>& graph() const { return graph_; }
  const torch::jit::Module& module() const { return module_; }

  // The op's kind by its name alone (no settings read); empty when decode()
  // does not know it.
  static std::optional<OpKind> kind_of(const torch::jit::Node* n);
  // The op's kind, tensors and settings. Unsupported for an unknown op, a
  // setting that is not a constant, or a tensor read that is neither a module
  // attribute nor None.
  ScriptOp decode(const torch::jit::Node* n) const;

  // The dotted path of a prim::GetAttr chain from the module itself ("" when
  // v is not one).
  std::string attr_path_of(const torch::jit::Value* v) const;
  c10::IValue attr_at(const std::string& dotted) const;
  at::Tensor tensor_at(const std::string& dotted) const { return attr_at(dotted).toTensor(); }
  // The parameters (dotted, registration order) and the buffers.
  const std::vector<std::string>& parameters() const { return parameters_; }
  bool is_buffer(const std::string& dotted) const { return buffers_.count(dotted) > 0; }

  // Where in the module an op sits, for messages: " (in module 'fc1')" or "".
  static std::string where(const torch::jit::Node* n);
  static bool is_none(const torch::jit::Value* v);

 private:
  [[noreturn]] void refuse(const torch::jit::Node* n, const std::string& why) const;
  c10::IValue constant(const torch::jit::Node* n, size_t i, const char* what) const;
  std::array<int64_t, 2> pair(const torch::jit::Node* n, size_t i, const char* what, int64_t if_empty = -1) const;
  std::string tensor(const torch::jit::Node* n, size_t i) const;

  torch::jit::Module module_;
  std::shared_ptr<torch::jit::Graph> graph_;
  std::vector<std::string> parameters_;
  std::set<std::string> buffers_;
};

// Sparrow's name of a TorchScript model's tensor (core/models.h): '.' -> '_'.
std::string flat_name(std::string dotted);

}  // namespace sparrow::batched
