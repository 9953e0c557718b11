#include "lite/export/exporter.h"

#include <torch/csrc/jit/ir/constants.h>
#include <torch/script.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>

#include "batched/script_graph.h"
#include "core/error.h"

namespace sparrow::lite {
namespace {

using torch::jit::Node;
using torch::jit::Value;

std::vector<float> flat(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU, at::kFloat).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

Shape shape_of(const at::Tensor& t) { return t.sizes().vec(); }

using batched::flat_name;
using batched::OpKind;
using batched::ScriptGraph;
using batched::ScriptOp;

// A LoRA layer found in the graph: the value it reads, its trainable A and
// B (dotted paths) and its spec, frozen values included.
struct Lora {
  const Value* x = nullptr;
  std::string a_path, b_path;
  LayerSpec spec;
};

// The values of a spec's parameters, looked up by name in order.
Exported with_values(ModelSpec spec, const std::map<std::string, at::Tensor>& weights, const std::string& model) {
  Exported e;
  size_t used = 0;
  for (LayerSpec& l : spec.layers) {
    for (size_t i = 0; i < l.param_names.size(); ++i) {
      auto it = weights.find(l.param_names[i]);
      SPARROW_CHECK_T(ConfigError, it != weights.end(),
                      "lite export: the " << model << " weights lack '" << l.param_names[i] << "'");
      SPARROW_CHECK_T(ConfigError, shape_of(it->second) == l.param_shapes[i],
                      "lite export: '" << l.param_names[i] << "' has shape " << it->second.sizes() << ", " << model
                                       << " needs " << shape_str(l.param_shapes[i]));
      const std::vector<float> v = flat(it->second);
      e.values.insert(e.values.end(), v.begin(), v.end());
      ++used;
    }
  }
  SPARROW_CHECK_T(ConfigError, used == weights.size(),
                  "lite export: " << weights.size() - used << " of the weights are no parameter of " << model);
  e.spec = std::move(spec);
  Model check(e.spec);  // the shapes chain
  return e;
}

// What the graph walk knows about each op it meets.
class GraphReader {
 public:
  // What the LibTorch side sends and aggregates is every parameter,
  // requires_grad=False ones too (core/models.cc registers them all); only
  // buffers stay out of the flat vector, so only buffers may be frozen here.
  explicit GraphReader(const ScriptGraph& sg) : sg_(sg), graph_(sg.graph()), trainable_(sg.parameters()) {}

  Exported read(Shape input_shape) {
    const auto inputs = graph_->inputs();
    SPARROW_CHECK_T(ConfigError, inputs.size() == 2,
                    "lite export: forward must take one input, it takes " << inputs.size() - 1);
    current_ = inputs[1];
    for (Node* n : graph_->nodes()) find_lora(n);
    for (Node* n : graph_->nodes()) visit(n);
    const auto outs = graph_->outputs();
    SPARROW_CHECK_T(ConfigError, outs.size() == 1 && outs[0] == current_,
                    "lite export: forward must return the output of its last layer");
    SPARROW_CHECK_T(ConfigError, !spec_.layers.empty(), "lite export: forward has no layer");
    // The order of the flat vector must be the LibTorch model's.
    SPARROW_CHECK_T(ConfigError, trainable_ == used_,
                    "lite export: forward uses the parameters " << join(used_) << " but the module registers "
                                                                << join(trainable_)
                                                                << " (every parameter once, in registration order)");
    if (input_shape.empty()) input_shape = first_shape_;
    SPARROW_CHECK_T(ConfigError, !input_shape.empty(),
                    "lite export: the first layer is a " << kind_name(spec_.layers.front().kind)
                                                         << ": give the per-sample input shape (--input-shape)");
    spec_.input_shape = input_shape;
    Exported e;
    for (const std::string& name : used_) {
      const std::vector<float> v = flat(tensor_at(name));
      e.values.insert(e.values.end(), v.begin(), v.end());
    }
    e.spec = std::move(spec_);
    try {
      Model check(e.spec);
    } catch (const Error& err) {
      throw ConfigError(std::string("lite export: ") + err.what());
    }
    return e;
  }

 private:
  static std::string join(const std::vector<std::string>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
    return s + "]";
  }

  c10::IValue attr_at(const std::string& dotted) const { return sg_.attr_at(dotted); }
  at::Tensor tensor_at(const std::string& dotted) const { return sg_.tensor_at(dotted); }
  static std::string where(const Node* n) { return ScriptGraph::where(n); }

  [[noreturn]] void refuse(const Node* n, const std::string& why) const {
    throw ConfigError("lite export: unsupported layer " + std::string(n->kind().toQualString()) + where(n) + ": " +
                      why);
  }

  std::string attr_path_of(const Value* v) const { return sg_.attr_path_of(v); }
  static bool is_none(const Value* v) { return ScriptGraph::is_none(v); }
  bool is_trainable(const std::string& path) const {
    return std::find(trainable_.begin(), trainable_.end(), path) != trainable_.end();
  }

  // LoRA on a frozen Linear (lite/layers.h, kLoraLinear), recognised from the
  // ops, not from names:
  //   base + delta  or  delta + base, where
  //   base   = aten::linear(x, W, b)   W and b (or None) buffers of the module
  //   delta  = aten::mul(branch, s)    s a float: a constant or a module attribute
  //   branch = aten::matmul(aten::matmul(x, aten::t(A)), aten::t(B))
  //            or aten::linear(aten::linear(x, A, None), B, None)
  // A and B parameters, and every intermediate used once. An add of
  // a linear and a product that breaks one of these rules is refused here,
  // naming the rule; any other add is left to visit, which refuses it.
  void find_lora(Node* n) {
    if (n->kind() != c10::aten::add || n->inputs().size() != 3) return;
    Node* base = nullptr;
    Node* delta = nullptr;
    for (size_t i = 0; i < 2 && !base; ++i) {
      if (n->input(i)->node()->kind() == c10::aten::linear && n->input(1 - i)->node()->kind() == c10::aten::mul) {
        base = n->input(i)->node();
        delta = n->input(1 - i)->node();
      }
    }
    if (!base) return;
    auto why = [&](const std::string& text) { refuse(n, "LoRA: " + text); };
    const auto alpha = torch::jit::toIValue(n->input(2));
    if (!alpha || !((alpha->isInt() && alpha->toInt() == 1) || (alpha->isDouble() && alpha->toDouble() == 1.0)))
      why("an add with alpha other than 1");
    // The scale: the product's one non-tensor operand.
    const bool t0 = delta->input(0)->type()->cast<c10::TensorType>() != nullptr;
    const bool t1 = delta->input(1)->type()->cast<c10::TensorType>() != nullptr;
    if (t0 == t1) why("the update must be scaled by a float (a constant or a module attribute), not a tensor");
    const Value* sv = delta->input(t0 ? 1 : 0);
    c10::IValue sc;  // plain: assigning an IValue to a std::optional<IValue> held None (IValue converting ctors)
    if (auto c = torch::jit::toIValue(sv)) {
      sc = *c;
    } else {
      const std::string path = attr_path_of(sv);
      if (path.empty()) why("the scale is neither a constant nor a module attribute");
      sc = attr_at(path);
    }
    if (!sc.isDouble() && !sc.isInt()) why("the scale is not a number");
    const double scale = sc.isDouble() ? sc.toDouble() : static_cast<double>(sc.toInt());
    if (!std::isfinite(scale)) why("the scale is not finite");
    // The low-rank branch.
    Node* br = delta->input(t0 ? 0 : 1)->node();
    std::vector<const Node*> inner{base, delta, br};
    const Value* x = nullptr;
    const Value* va = nullptr;
    const Value* vb = nullptr;
    if (br->kind() == c10::aten::matmul) {
      Node* h = br->input(0)->node();
      Node* tb = br->input(1)->node();
      if (h->kind() == c10::aten::matmul && tb->kind() == c10::aten::t && h->input(1)->node()->kind() == c10::aten::t) {
        x = h->input(0);
        va = h->input(1)->node()->input(0);
        vb = tb->input(0);
        inner.insert(inner.end(), {h, tb, h->input(1)->node()});
      }
    } else if (br->kind() == c10::aten::linear) {
      Node* h = br->input(0)->node();
      if (h->kind() == c10::aten::linear && is_none(br->input(2)) && is_none(h->input(2))) {
        x = h->input(0);
        va = h->input(1);
        vb = br->input(1);
        inner.push_back(h);
      }
    }
    if (x && x != base->input(0)) {
      const std::string k = x->node()->kind().toQualString();
      if (k.find("dropout") != std::string::npos) why("dropout on the update's input is not supported (remove it)");
      why("the update and the frozen linear read different inputs");
    }
    if (!x) why("the update must be (x @ A.t() @ B.t()) * s or F.linear(F.linear(x, A), B) * s");
    for (const Node* m : inner) {  // the layer's result is the add's alone
      if (m->outputs().size() != 1 || m->output(0)->uses().size() != 1) why("an intermediate result is used elsewhere");
    }
    // Frozen base (buffers), trainable A and B, shapes that chain.
    auto frozen_path = [&](const Value* v, const char* what) {
      const std::string path = attr_path_of(v);
      if (path.empty()) why(std::string("the base ") + what + " is no buffer of the module");
      if (!sg_.is_buffer(path))
        why(std::string("the base ") + what + " '" + path +
            "' must be a buffer (register_buffer): Sparrow trains and sends every parameter of a TorchScript "
            "model, requires_grad=False ones too, so a frozen parameter would be in the LibTorch client's "
            "update and not in the lite client's");
      return path;
    };
    const std::string w_path = frozen_path(base->input(1), "weight");
    const std::string b_path = is_none(base->input(2)) ? std::string() : frozen_path(base->input(2), "bias");
    const std::string a_path = attr_path_of(va), b2_path = attr_path_of(vb);
    for (const std::string* p : {&a_path, &b2_path}) {
      if (p->empty() || !is_trainable(*p))
        why((p->empty() ? std::string("A and B") : "'" + *p + "'") + " must be a parameter of the module");
    }
    const at::Tensor w = tensor_at(w_path), a = tensor_at(a_path), b = tensor_at(b2_path);
    if (w.dim() != 2 || a.dim() != 2 || b.dim() != 2 || a.size(1) != w.size(1) || b.size(0) != w.size(0) ||
        b.size(1) != a.size(0))
      why("shapes weight " + shape_str(shape_of(w)) + ", A " + shape_str(shape_of(a)) + ", B " +
          shape_str(shape_of(b)) + " are not [out, in], [r, in], [out, r]");
    Lora lora;
    lora.x = x;
    lora.a_path = a_path;
    lora.b_path = b2_path;
    LayerSpec& l = lora.spec;
    l.kind = LayerKind::kLoraLinear;
    l.out = w.size(0);
    l.in = w.size(1);
    l.flag = a.size(0);
    l.p = static_cast<float>(scale * static_cast<double>(l.flag));  // alpha
    l.bias = b_path.empty() ? 0 : 1;
    l.frozen.push_back(frozen_tensor(w_path, w));
    if (l.bias) {
      const at::Tensor bias = tensor_at(b_path);
      if (shape_of(bias) != Shape{l.out}) why("the base bias is not [out]");
      l.frozen.push_back(frozen_tensor(b_path, bias));
    }
    l.param_names = {flat_name(a_path), flat_name(b2_path)};
    l.param_shapes = {shape_of(a), shape_of(b)};
    for (const Node* m : inner) lora_inner_.insert(m);
    lora_.emplace(n, std::move(lora));
  }

  static FrozenTensor frozen_tensor(const std::string& path, const at::Tensor& t) {
    return FrozenTensor{flat_name(path), shape_of(t), std::make_shared<const std::vector<float>>(flat(t))};
  }

  // Adds the parameter at `path` (a weight or bias the op reads); false
  // when it is None ("").
  bool param(const Node* n, const std::string& path, LayerSpec& l) {
    if (path.empty()) return false;
    if (sg_.is_buffer(path))
      refuse(n, "'" + path + "' is a buffer; the lite runtime keeps weights frozen only in LoRA layers");
    const at::Tensor t = tensor_at(path);
    l.param_names.push_back(flat_name(path));
    l.param_shapes.push_back(shape_of(t));
    used_.push_back(path);
    return true;
  }

  void add(const Node* n, LayerSpec l) {
    if (spec_.layers.empty()) {
      if (l.kind == LayerKind::kLinear || l.kind == LayerKind::kLoraLinear) first_shape_ = {l.in};
    }
    spec_.layers.push_back(std::move(l));
    current_ = n->output(0);
  }

  void visit(Node* n) {
    if (lora_inner_.count(n)) return;  // read by find_lora; its add becomes the layer
    if (auto it = lora_.find(n); it != lora_.end()) {
      if (it->second.x != current_) refuse(n, "LoRA: its input is not the previous layer's output");
      used_.push_back(it->second.a_path);
      used_.push_back(it->second.b_path);
      add(n, std::move(it->second.spec));
      return;
    }
    const std::string k = n->kind().toQualString();
    static const std::set<std::string> kInert = {"prim::Constant", "prim::GetAttr", "prim::ListConstruct", "aten::size",
                                                 "aten::Int",      "aten::dim",     "aten::__getitem__"};
    if (kInert.count(k)) return;
    const bool on_data = std::any_of(n->inputs().begin(), n->inputs().end(), [&](Value* v) { return v == current_; });
    if (!on_data) {
      if (k.rfind("aten::", 0) == 0 || k.rfind("prim::", 0) == 0) return;  // shape arithmetic
      refuse(n, "an op the lite runtime does not know");
    }
    // The ops the lite runtime runs (the batched program runs more).
    static const std::set<OpKind> kLite = {OpKind::kLinear,    OpKind::kConv2d,    OpKind::kRelu,
                                           OpKind::kGelu,      OpKind::kMaxPool2d, OpKind::kAvgPool2d,
                                           OpKind::kFlatten,   OpKind::kReshape,   OpKind::kDropout,
                                           OpKind::kLayerNorm, OpKind::kEmbedding, OpKind::kIdentity};
    const std::optional<OpKind> kind = ScriptGraph::kind_of(n);
    if (!kind || !kLite.count(*kind))
      refuse(n,
             "not one of linear, conv2d, relu, gelu, max_pool2d, avg_pool2d, flatten, dropout, layer_norm, "
             "embedding");
    if (*kind == OpKind::kIdentity) {
      current_ = n->output(0);  // a dtype or layout change: the runtime's data are floats throughout
      return;
    }
    ScriptOp op;
    try {
      op = sg_.decode(n);
    } catch (const batched::Unsupported& e) {
      refuse(n, e.why());
    }
    LayerSpec l;
    switch (op.kind) {
      case OpKind::kLinear:
        l.kind = LayerKind::kLinear;
        param(n, op.tensors[0], l);
        l.bias = param(n, op.tensors[1], l) ? 1 : 0;
        l.out = l.param_shapes[0][0];
        l.in = l.param_shapes[0][1];
        break;
      case OpKind::kConv2d: {
        l.kind = LayerKind::kConv2d;
        param(n, op.tensors[0], l);
        l.bias = param(n, op.tensors[1], l) ? 1 : 0;
        const Shape& w = l.param_shapes[0];
        if (w.size() != 4) refuse(n, "the weight is not 4-D");
        l.out = w[0];
        l.in = w[1];
        l.kh = w[2];
        l.kw = w[3];
        std::tie(l.sh, l.sw) = std::make_pair(op.stride[0], op.stride[1]);
        if (op.padding_string) refuse(n, "padding given as a string ('same'/'valid')");
        std::tie(l.ph, l.pw) = std::make_pair(op.padding[0], op.padding[1]);
        if (op.dilation != std::array<int64_t, 2>{1, 1}) refuse(n, "dilation other than 1");
        if (op.transposed) refuse(n, "transposed convolution");
        if (op.groups != 1) refuse(n, "groups other than 1");
        break;
      }
      case OpKind::kRelu:
        l.kind = LayerKind::kRelu;
        break;
      case OpKind::kGelu:
        l.kind = LayerKind::kGelu;
        l.flag = op.flag ? 1 : 0;
        break;
      case OpKind::kMaxPool2d:
      case OpKind::kAvgPool2d: {
        const bool max = op.kind == OpKind::kMaxPool2d;
        l.kind = max ? LayerKind::kMaxPool2d : LayerKind::kAvgPool2d;
        std::tie(l.kh, l.kw) = std::make_pair(op.kernel[0], op.kernel[1]);
        std::tie(l.sh, l.sw) = std::make_pair(op.stride[0], op.stride[1]);
        std::tie(l.ph, l.pw) = std::make_pair(op.padding[0], op.padding[1]);
        if (max && op.dilation != std::array<int64_t, 2>{1, 1}) refuse(n, "dilation other than 1");
        if (op.ceil_mode) refuse(n, "ceil_mode=True");
        if (!max && !op.count_include_pad) refuse(n, "count_include_pad=False");
        if (!max && op.divisor_override) refuse(n, "divisor_override");
        break;
      }
      case OpKind::kFlatten:
        l.kind = LayerKind::kFlatten;
        if (op.start_dim != 1 || op.end_dim != -1) refuse(n, "only flatten(x, 1) (start_dim=1, end_dim=-1)");
        break;
      case OpKind::kReshape:
        // x.reshape([x.size(0), -1]) is a Flatten; reshape to fixed dims is the input shape.
        if (op.shape == Shape{-1}) {
          l.kind = LayerKind::kFlatten;
        } else if (spec_.layers.empty() &&
                   std::all_of(op.shape.begin(), op.shape.end(), [](int64_t d) { return d > 0; })) {
          first_shape_ = op.shape;  // the model's own view of its input
          current_ = n->output(0);
          return;
        } else {
          refuse(n, "a reshape other than to [batch, -1] or, first, to the input shape");
        }
        break;
      case OpKind::kDropout:
        if (op.feature) refuse(n, "channel dropout (Dropout2d)");
        l.kind = LayerKind::kDropout;
        l.p = static_cast<float>(op.p);
        break;
      case OpKind::kLayerNorm: {
        l.kind = LayerKind::kLayerNorm;
        l.in = 1;
        for (int64_t d : op.shape) l.in *= d;
        const bool w = param(n, op.tensors[0], l), b = param(n, op.tensors[1], l);
        if (w != b) refuse(n, "a weight without a bias or the reverse");
        l.bias = w ? 1 : 0;
        l.eps = static_cast<float>(op.eps);
        break;
      }
      case OpKind::kEmbedding:
        if (n->input(1) != current_) refuse(n, "the data is not the indices");
        l.kind = LayerKind::kEmbedding;
        param(n, op.tensors[0], l);
        if (op.padding_idx != -1) refuse(n, "padding_idx");
        if (op.flag) refuse(n, "scale_grad_by_freq");
        l.in = l.param_shapes[0][0];
        l.out = l.param_shapes[0][1];
        if (!spec_.layers.empty()) refuse(n, "an embedding that is not the first layer");
        first_shape_.clear();
        break;
      default:
        break;
    }
    if (n->input(0) != current_ && k != "aten::embedding") refuse(n, "its input is not the previous layer's output");
    add(n, std::move(l));
  }

  const ScriptGraph& sg_;
  std::shared_ptr<torch::jit::Graph> graph_;
  std::vector<std::string> trainable_;  // the parameters, dotted, in registration order
  std::map<const Node*, Lora> lora_;    // by the add that ends the pattern
  std::set<const Node*> lora_inner_;    // the pattern's other ops
  ModelSpec spec_;
  Shape first_shape_;
  std::vector<std::string> used_;
  Value* current_ = nullptr;
};

}  // namespace

Exported export_builtin(const std::string& name, const std::map<std::string, at::Tensor>& weights) {
  SPARROW_CHECK_T(ConfigError, name == "mlp" || name == "cnn" || name == "logreg",
                  "lite export: no lite form for model '" << name << "' (built-ins: mlp, cnn, logreg)");
  int64_t in = 0, classes = 10;
  if (name == "logreg") {
    auto it = weights.find("fc.weight");
    SPARROW_CHECK_T(ConfigError, it != weights.end() && it->second.dim() == 2,
                    "lite export: logreg needs a 2-D 'fc.weight'");
    classes = it->second.size(0);
    in = it->second.size(1);
  }
  return with_values(builtin_spec(name, in, classes), weights, name);
}

Exported export_torchscript(const torch::jit::Module& module, Shape input_shape) {
  std::unique_ptr<ScriptGraph> sg;
  try {
    sg = std::make_unique<ScriptGraph>(module, /*training=*/false);
  } catch (const ConfigError& e) {
    throw ConfigError(std::string("lite export: ") + e.what());
  }
  for (Node* n : sg->graph()->nodes()) {
    SPARROW_CHECK_T(ConfigError, n->blocks().empty(),
                    "lite export: forward has control flow (" << n->kind().toQualString()
                                                              << "); the lite runtime runs a fixed chain of layers");
  }
  return GraphReader(*sg).read(std::move(input_shape));
}

Exported export_torchscript_file(const std::string& path, Shape input_shape) {
  torch::jit::Module m;
  try {
    m = torch::jit::load(path, torch::kCPU);
  } catch (const std::exception&) {
    throw ConfigError("lite export: TorchScript model file '" + path + "' could not be loaded");
  }
  m.eval();
  try {
    return export_torchscript(m, std::move(input_shape));
  } catch (const ConfigError& e) {
    throw ConfigError(std::string(e.what()) + " [" + path + "]");
  }
}

}  // namespace sparrow::lite
