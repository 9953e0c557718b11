#include "batched/script_graph.h"

#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/csrc/jit/passes/peephole.h>

#include <algorithm>
#include <map>

namespace sparrow::batched {

using torch::jit::Node;
using torch::jit::Value;

std::string flat_name(std::string dotted) {
  std::replace(dotted.begin(), dotted.end(), '.', '_');
  return dotted;
}

namespace {

const std::map<std::string, OpKind>& kinds() {
  static const std::map<std::string, OpKind> k = {
      {"aten::linear", OpKind::kLinear},
      {"aten::conv2d", OpKind::kConv2d},
      {"aten::_convolution", OpKind::kConv2d},
      {"aten::relu", OpKind::kRelu},
      {"aten::relu_", OpKind::kRelu},
      {"aten::gelu", OpKind::kGelu},
      {"aten::gelu_", OpKind::kGelu},
      {"aten::tanh", OpKind::kTanh},
      {"aten::tanh_", OpKind::kTanh},
      {"aten::sigmoid", OpKind::kSigmoid},
      {"aten::sigmoid_", OpKind::kSigmoid},
      {"aten::max_pool2d", OpKind::kMaxPool2d},
      {"aten::avg_pool2d", OpKind::kAvgPool2d},
      {"aten::adaptive_avg_pool2d", OpKind::kAdaptiveAvgPool2d},
      {"aten::flatten", OpKind::kFlatten},
      {"aten::reshape", OpKind::kReshape},
      {"aten::view", OpKind::kReshape},
      {"aten::dropout", OpKind::kDropout},
      {"aten::dropout_", OpKind::kDropout},
      {"aten::feature_dropout", OpKind::kDropout},
      {"aten::batch_norm", OpKind::kBatchNorm},
      {"aten::layer_norm", OpKind::kLayerNorm},
      {"aten::embedding", OpKind::kEmbedding},
      {"aten::add", OpKind::kAdd},
      {"aten::add_", OpKind::kAdd},
      {"aten::to", OpKind::kIdentity},
      {"aten::long", OpKind::kIdentity},
      {"aten::contiguous", OpKind::kIdentity},
      {"aten::clone", OpKind::kIdentity},
  };
  return k;
}

}  // namespace

ScriptGraph::ScriptGraph(const torch::jit::Module& module, bool training) : module_(module) {
  try {
    graph_ = module_.get_method("forward").graph()->copy();
  } catch (const c10::Error&) {
    throw ConfigError("the TorchScript module has no forward method");
  }
  torch::jit::Inline(*graph_);
  if (training) {
    std::vector<Node*> reads;
    for (Node* n : graph_->nodes())
      if (n->kind() == c10::prim::GetAttr && n->s(c10::attr::name) == "training") reads.push_back(n);
    for (Node* n : reads) {
      torch::jit::WithInsertPoint at(n);
      n->output()->replaceAllUsesWith(graph_->insertConstant(true));
    }
    torch::jit::PeepholeOptimize(graph_);
  }
  torch::jit::ConstantPropagation(graph_);
  torch::jit::EliminateDeadCode(graph_);
  for (const auto& p : module_.named_parameters(/*recurse=*/true)) parameters_.push_back(p.name);
  for (const auto& b : module_.named_buffers(/*recurse=*/true)) buffers_.insert(b.name);
}

std::optional<OpKind> ScriptGraph::kind_of(const Node* n) {
  auto it = kinds().find(n->kind().toQualString());
  if (it == kinds().end()) return std::nullopt;
  return it->second;
}

std::string ScriptGraph::where(const Node* n) {
  if (auto cs = n->callstack()) {
    if (auto mi = (*cs)->module_instance()) return " (in module '" + mi->instance_name() + "')";
  }
  return "";
}

bool ScriptGraph::is_none(const Value* v) {
  if (v->type()->kind() == c10::TypeKind::NoneType) return true;
  auto c = torch::jit::toIValue(v);
  return c && c->isNone();
}

void ScriptGraph::refuse(const Node* n, const std::string& why) const {
  throw Unsupported(n->kind().toQualString(), where(n), why);
}

std::string ScriptGraph::attr_path_of(const Value* v) const {
  std::vector<std::string> parts;
  while (v->node()->kind() == c10::prim::GetAttr) {
    parts.push_back(v->node()->s(c10::attr::name));
    v = v->node()->input(0);
  }
  if (v != graph_->inputs()[0] || parts.empty()) return "";
  std::string s;
  for (size_t i = parts.size(); i-- > 0;) s += parts[i] + (i ? "." : "");
  return s;
}

c10::IValue ScriptGraph::attr_at(const std::string& dotted) const {
  torch::jit::Module m = module_;
  size_t start = 0;
  for (size_t dot; (dot = dotted.find('.', start)) != std::string::npos; start = dot + 1)
    m = m.attr(dotted.substr(start, dot - start)).toModule();
  return m.attr(dotted.substr(start));
}

c10::IValue ScriptGraph::constant(const Node* n, size_t i, const char* what) const {
  if (i >= n->inputs().size()) refuse(n, std::string(what) + " is missing");
  auto v = torch::jit::toIValue(n->input(i));
  if (!v) refuse(n, std::string(what) + " is not a constant");
  return *v;
}

std::array<int64_t, 2> ScriptGraph::pair(const Node* n, size_t i, const char* what, int64_t if_empty) const {
  c10::IValue v = constant(n, i, what);
  if (v.isInt()) return {v.toInt(), v.toInt()};
  if (v.isIntList()) {
    auto l = v.toIntVector();
    if (l.empty() && if_empty >= 0) return {if_empty, if_empty};
    if (l.size() == 1) return {l[0], l[0]};
    if (l.size() == 2) return {l[0], l[1]};
  }
  refuse(n, std::string(what) + " must be an int or a pair");
}

std::string ScriptGraph::tensor(const Node* n, size_t i) const {
  if (i >= n->inputs().size() || is_none(n->input(i))) return "";
  std::string s = attr_path_of(n->input(i));
  if (s.empty()) refuse(n, "a weight that is no parameter of the module");
  return s;
}

ScriptOp ScriptGraph::decode(const Node* n) const {
  const std::string k = n->kind().toQualString();
  auto it = kinds().find(k);
  if (it == kinds().end()) refuse(n, "not supported");
  ScriptOp op;
  op.kind = it->second;
  op.node = n;
  switch (op.kind) {
    case OpKind::kLinear:
      op.tensors = {tensor(n, 1), tensor(n, 2)};
      break;
    case OpKind::kConv2d:
      op.tensors = {tensor(n, 1), tensor(n, 2)};
      op.stride = pair(n, 3, "stride");
      if (constant(n, 4, "padding").isString()) {
        op.padding_string = true;
      } else {
        op.padding = pair(n, 4, "padding");
      }
      op.dilation = pair(n, 5, "dilation");
      if (k == "aten::_convolution") {
        op.transposed = constant(n, 6, "transposed").toBool();
        op.groups = constant(n, 8, "groups").toInt();
      } else {
        op.groups = constant(n, 6, "groups").toInt();
      }
      break;
    case OpKind::kGelu:
      if (n->inputs().size() > 1) {
        const std::string a = constant(n, 1, "approximate").toStringRef();
        if (a != "none" && a != "tanh") refuse(n, "approximate='" + a + "'");
        op.flag = a == "tanh";
      }
      break;
    case OpKind::kMaxPool2d:
      op.kernel = pair(n, 1, "kernel_size");
      op.stride = pair(n, 2, "stride", 0);
      if (op.stride[0] == 0) op.stride = op.kernel;
      op.padding = pair(n, 3, "padding");
      op.dilation = pair(n, 4, "dilation");
      op.ceil_mode = constant(n, 5, "ceil_mode").toBool();
      break;
    case OpKind::kAvgPool2d:
      op.kernel = pair(n, 1, "kernel_size");
      op.stride = pair(n, 2, "stride", 0);
      if (op.stride[0] == 0) op.stride = op.kernel;
      op.padding = pair(n, 3, "padding");
      op.ceil_mode = constant(n, 4, "ceil_mode").toBool();
      op.count_include_pad = constant(n, 5, "count_include_pad").toBool();
      op.divisor_override = !constant(n, 6, "divisor_override").isNone();
      break;
    case OpKind::kAdaptiveAvgPool2d: {
      const auto s = pair(n, 1, "output_size");
      op.shape = {s[0], s[1]};
      break;
    }
    case OpKind::kFlatten:
      op.start_dim = constant(n, 1, "start_dim").toInt();
      op.end_dim = constant(n, 2, "end_dim").toInt();
      break;
    case OpKind::kReshape: {
      // The dims after the batch's: x.reshape([x.size(0), ...]).
      const Node* list = n->input(1)->node();
      if (list->kind() != c10::prim::ListConstruct || list->inputs().size() < 2) refuse(n, "a reshape to a shape");
      for (size_t i = 1; i < list->inputs().size(); ++i) {
        auto v = torch::jit::toIValue(list->input(i));
        if (!v || !v->isInt()) refuse(n, "a reshape to a shape that is not constant");
        op.shape.push_back(v->toInt());
      }
      break;
    }
    case OpKind::kDropout:
      op.p = constant(n, 1, "p").toDouble();
      op.training = constant(n, 2, "train").toBool();
      op.feature = k == "aten::feature_dropout";
      break;
    case OpKind::kBatchNorm:
      op.tensors = {tensor(n, 1), tensor(n, 2), tensor(n, 3), tensor(n, 4)};
      op.training = constant(n, 5, "training").toBool();
      op.momentum = constant(n, 6, "momentum (None, a cumulative average, is not supported)").toDouble();
      op.eps = constant(n, 7, "eps").toDouble();
      break;
    case OpKind::kLayerNorm:
      op.shape = constant(n, 1, "normalized_shape").toIntVector();
      op.tensors = {tensor(n, 2), tensor(n, 3)};
      op.eps = constant(n, 4, "eps").toDouble();
      break;
    case OpKind::kEmbedding:
      op.tensors = {tensor(n, 0)};
      op.padding_idx = constant(n, 2, "padding_idx").toInt();
      op.flag = constant(n, 3, "scale_grad_by_freq").toBool();
      break;
    case OpKind::kAdd: {
      if (n->inputs().size() != 3) refuse(n, "not a tensor + tensor");
      const c10::IValue a = constant(n, 2, "alpha");
      if (!a.isInt() && !a.isDouble()) refuse(n, "alpha is not a number");
      op.alpha = a.isInt() ? static_cast<double>(a.toInt()) : a.toDouble();
      break;
    }
    default:
      break;
  }
  return op;
}

}  // namespace sparrow::batched
