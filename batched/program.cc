#include "batched/program.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/ir.h>

#include <algorithm>
#include <functional>
#include <map>
#include <cstdlib>
#include <mutex>
#include <set>

#include <spdlog/spdlog.h>

#include "batched/ops.h"

namespace sparrow::batched {

using torch::jit::Node;
using torch::jit::Value;

namespace {

[[noreturn]] void refuse(const Node* n, const std::string& why) {
  throw Unsupported(n->kind().toQualString(), ScriptGraph::where(n), why);
}

// Whether any node in n's blocks (nested) reads one of `data`.
bool blocks_read(const Node* n, const std::map<const Value*, int>& data) {
  for (const torch::jit::Block* b : n->blocks()) {
    for (const Node* m : b->nodes()) {
      for (const Value* v : m->inputs())
        if (data.count(v)) return true;
      if (blocks_read(m, data)) return true;
    }
  }
  return false;
}

}  // namespace

Program Program::translate(const torch::jit::Module& module, const std::vector<std::string>& names) {
  const ScriptGraph sg(module, /*training=*/true);
  const auto& g = sg.graph();
  SPARROW_CHECK_T(ConfigError, g->inputs().size() == 2, "forward must take one input");
  Program prog;
  std::map<const Value*, int> values{{g->inputs()[1], 0}};
  auto param_index = [&](const Node* n, const std::string& path) -> int {
    if (path.empty()) return -1;
    if (sg.is_buffer(path)) refuse(n, "'" + path + "' is a buffer read as a weight");
    auto it = std::find(names.begin(), names.end(), flat_name(path));
    if (it == names.end()) refuse(n, "'" + path + "' is no parameter of the model");
    return static_cast<int>(it - names.begin());
  };
  for (Node* n : g->nodes()) {
    std::vector<int> in;
    for (const Value* v : n->inputs())
      if (auto it = values.find(v); it != values.end()) in.push_back(it->second);
    if (in.empty()) {
      if (blocks_read(n, values)) refuse(n, "control flow on the data");
      // Shape arithmetic, checks, constants. An in-place op on a buffer
      // runs once per call: BatchNorm's num_batches_tracked += 1.
      const std::string k = n->kind().toQualString();
      if (!n->inputs().empty() && k.back() == '_' && k.rfind("aten::", 0) == 0) {
        const std::string path = sg.attr_path_of(n->input(0));
        if (!path.empty() && sg.is_buffer(path)) {
          c10::IValue by, alpha(int64_t{1});
          if (n->inputs().size() >= 2)
            if (auto c = torch::jit::toIValue(n->input(1))) by = *c;
          if (n->inputs().size() >= 3) {
            auto c = torch::jit::toIValue(n->input(2));
            alpha = c ? *c : c10::IValue();
          }
          if (k != "aten::add_" || !by.isInt() || !alpha.isInt())
            refuse(n, "an in-place change of the buffer '" + path + "' other than adding a constant");
          prog.counts_.push_back(
              {flat_name(path), static_cast<double>(by.toInt()) * static_cast<double>(alpha.toInt())});
        }
      }
      continue;
    }
    if (!n->blocks().empty()) refuse(n, "control flow on the data");
    const std::string k = n->kind().toQualString();
    if (k == "aten::size" || k == "aten::dim" || k == "aten::len") continue;  // shapes: the op's own business
    if (!ScriptGraph::kind_of(n)) refuse(n, "not supported");
    Step s;
    s.op = sg.decode(n);
    const ScriptOp& op = s.op;
    auto data_at = [&](size_t i) {
      auto it = values.find(n->input(i));
      if (it == values.end()) refuse(n, "input " + std::to_string(i) + " is not the data");
      return it->second;
    };
    switch (op.kind) {
      case OpKind::kEmbedding:
        s.in = {data_at(1)};
        if (op.padding_idx != -1) refuse(n, "padding_idx");
        if (op.flag) refuse(n, "scale_grad_by_freq");
        break;
      case OpKind::kAdd:
        s.in = {data_at(0), data_at(1)};
        break;
      default:
        s.in = {data_at(0)};
        for (size_t i = 1; i < n->inputs().size(); ++i)
          if (values.count(n->input(i))) refuse(n, "the data is read as a setting or weight");
        break;
    }
    switch (op.kind) {
      case OpKind::kConv2d:
        if (op.padding_string) refuse(n, "padding given as a string ('same'/'valid')");
        if (op.dilation != std::array<int64_t, 2>{1, 1}) refuse(n, "dilation other than 1");
        if (op.transposed) refuse(n, "transposed convolution");
        if (op.groups != 1) refuse(n, "groups other than 1");
        break;
      case OpKind::kAvgPool2d:
        if (op.divisor_override) refuse(n, "divisor_override");
        break;
      case OpKind::kFlatten:
        if (op.start_dim < 1) refuse(n, "a flatten of the batch dimension (start_dim 0)");
        break;
      case OpKind::kReshape:
        if (std::count(op.shape.begin(), op.shape.end(), -1) > 1 ||
            std::any_of(op.shape.begin(), op.shape.end(), [](int64_t d) { return d < -1 || d == 0; }))
          refuse(n, "a reshape to a shape other than [batch, ...]");
        break;
      case OpKind::kDropout:
        if (op.feature) refuse(n, "channel dropout (Dropout2d)");
        break;
      case OpKind::kBatchNorm: {
        if (!op.training) refuse(n, "BatchNorm with its running statistics in training (training=False)");
        if ((op.tensors[2].empty()) != (op.tensors[3].empty())) refuse(n, "a running mean without a variance");
        BatchNormSlot slot;
        for (int i : {2, 3}) {
          const std::string& path = op.tensors[static_cast<size_t>(i)];
          if (!path.empty() && !sg.is_buffer(path)) refuse(n, "the running statistic '" + path + "' is no buffer");
        }
        slot.running_mean = op.tensors[2].empty() ? "" : flat_name(op.tensors[2]);
        slot.running_var = op.tensors[3].empty() ? "" : flat_name(op.tensors[3]);
        slot.momentum = op.momentum;
        s.bn = static_cast<int>(prog.batch_norms_.size());
        prog.batch_norms_.push_back(slot);
        break;
      }
      default:
        break;
    }
    const size_t weights = op.kind == OpKind::kBatchNorm ? 2 : op.tensors.size();
    for (size_t i = 0; i < weights; ++i) s.param.push_back(param_index(n, op.tensors[i]));
    if ((op.kind == OpKind::kLinear || op.kind == OpKind::kConv2d || op.kind == OpKind::kEmbedding) && s.param[0] < 0)
      refuse(n, "no weight");
    s.out = prog.values_++;
    values[n->output(0)] = s.out;
    // An in-place op (relu_, add_) changes its input: later reads of that
    // value see the result.
    if (k.back() == '_') values[n->input(0)] = s.out;
    s.op.node = nullptr;  // the graph is gone after translate
    prog.steps_.push_back(std::move(s));
  }
  const auto outs = g->outputs();
  SPARROW_CHECK_T(ConfigError, outs.size() == 1 && values.count(outs[0]),
                  "forward must return one tensor computed from its input");
  SPARROW_CHECK_T(ConfigError, !prog.steps_.empty(), "forward has no layer");
  prog.output_ = values.at(outs[0]);
  return prog;
}

at::Tensor Program::forward(const std::vector<at::Tensor>& params, const at::Tensor& x, const at::Tensor& mask,
                            Stats* stats) const {
  std::vector<at::Tensor> v(static_cast<size_t>(values_));
  v[0] = x;
  if (stats) {
    stats->mean.assign(batch_norms_.size(), at::Tensor());
    stats->var.assign(batch_norms_.size(), at::Tensor());
  }
  auto p = [&](const Step& s, size_t i) {
    return i < s.param.size() && s.param[i] >= 0 ? params[static_cast<size_t>(s.param[i])] : at::Tensor();
  };
  const int64_t k = x.size(0), b = x.size(1);
  for (const Step& s : steps_) {
    const ScriptOp& op = s.op;
    const at::Tensor& a = v[static_cast<size_t>(s.in[0])];
    at::Tensor out;
    switch (op.kind) {
      case OpKind::kLinear:
        out = linear_clients(a, p(s, 0), p(s, 1));
        break;
      case OpKind::kConv2d:
        out = conv2d_clients(a, p(s, 0), p(s, 1), op.stride, op.padding);
        break;
      case OpKind::kRelu:
        out = at::relu(a);
        break;
      case OpKind::kGelu:
        out = at::gelu(a, op.flag ? "tanh" : "none");
        break;
      case OpKind::kTanh:
        out = at::tanh(a);
        break;
      case OpKind::kSigmoid:
        out = at::sigmoid(a);
        break;
      case OpKind::kMaxPool2d:
        out = max_pool2d_clients(a, op.kernel, op.stride, op.padding, op.dilation, op.ceil_mode);
        break;
      case OpKind::kAvgPool2d:
        out = avg_pool2d_clients(a, op.kernel, op.stride, op.padding, op.ceil_mode, op.count_include_pad);
        break;
      case OpKind::kAdaptiveAvgPool2d:
        out = adaptive_avg_pool2d_clients(a, {op.shape[0], op.shape[1]});
        break;
      case OpKind::kFlatten: {
        // Sample dims shift by one: the client dimension leads.
        const int64_t end = op.end_dim < 0 ? op.end_dim : op.end_dim + 1;
        out = a.flatten(op.start_dim + 1, end);
        break;
      }
      case OpKind::kReshape: {
        std::vector<int64_t> shape{k, b};
        shape.insert(shape.end(), op.shape.begin(), op.shape.end());
        out = a.reshape(shape);
        break;
      }
      case OpKind::kDropout:
        out = at::dropout(a, op.p, op.training);
        break;
      case OpKind::kBatchNorm: {
        at::Tensor* mean = stats ? &stats->mean[static_cast<size_t>(s.bn)] : nullptr;
        at::Tensor* var = stats ? &stats->var[static_cast<size_t>(s.bn)] : nullptr;
        out = batch_norm_clients(a, p(s, 0), p(s, 1), op.eps, mask, mean, var);
        break;
      }
      case OpKind::kLayerNorm:
        out = layer_norm_clients(a, op.shape, p(s, 0), p(s, 1), op.eps);
        break;
      case OpKind::kEmbedding:
        out = embedding_clients(a, p(s, 0));
        break;
      case OpKind::kAdd:
        out = op.alpha == 1 ? a + v[static_cast<size_t>(s.in[1])] : a + v[static_cast<size_t>(s.in[1])] * op.alpha;
        break;
      case OpKind::kIdentity:
        out = a;
        break;
    }
    v[static_cast<size_t>(s.out)] = std::move(out);
  }
  return v[static_cast<size_t>(output_)];
}

ScriptedClients::ScriptedClients(std::shared_ptr<core::Model> model) : model_(std::move(model)) {
  const torch::jit::Module* m = core::scripted_module(*model_);
  SPARROW_CHECK_T(ConfigError, m != nullptr, "batched programs are made from TorchScript models");
  std::vector<std::string> names;
  for (const auto& p : model_->named_parameters()) names.push_back(p.key());
  program_ = Program::translate(*m, names);
}

at::Tensor ScriptedClients::forward_clients(const std::vector<at::Tensor>& params, const at::Tensor& x) {
  SPARROW_CHECK(x.dim() >= 3, "forward_clients: x must be [clients, batch, ...], got " << x.sizes());
  Program::Stats stats;
  const bool log = mask_.defined();
  at::Tensor out = program_.forward(params, x, mask_, log ? &stats : nullptr);
  if (log && !program_.batch_norms().empty()) log_.push_back(std::move(stats));
  return out;
}

at::Tensor ScriptedClients::loss_backward_clients(const std::vector<at::Tensor>& params, const at::Tensor& x,
                                                  const at::Tensor& y, const at::Tensor& w,
                                                  std::vector<at::Tensor>& grads, double alpha, double beta) {
  mask_ = w.gt(0).view({x.size(0), x.size(1)});
  try {
    at::Tensor loss = core::Model::loss_backward_clients(params, x, y, w, grads, alpha, beta);
    mask_ = at::Tensor();
    return loss;
  } catch (...) {
    mask_ = at::Tensor();
    throw;
  }
}

void ScriptedClients::fold_running_stats(const std::vector<int64_t>& position, const std::vector<int64_t>& steps) {
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> buffers;
  for (const auto& b : model_->named_buffers()) buffers[b.key()] = b.value();
  int64_t total = 0;
  for (int64_t s : steps) total += s;
  for (const Program::BufferCount& c : program_.counts()) {
    auto it = buffers.find(c.name);
    if (it == buffers.end()) continue;
    const double by = c.add * static_cast<double>(total);
    if (at::isIntegralType(it->second.scalar_type(), /*includeBool=*/false))
      it->second.add_(static_cast<int64_t>(by));
    else
      it->second.add_(by);
  }
  const auto& slots = program_.batch_norms();
  const int64_t logged = static_cast<int64_t>(log_.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    const Program::BatchNormSlot& slot = slots[i];
    if (slot.running_mean.empty() || logged == 0) continue;
    at::Tensor rm = buffers.at(slot.running_mean), rv = buffers.at(slot.running_var);
    const double m = slot.momentum;
    // Client j's T steps fold into r as r (1-m)^T + sum_t m (1-m)^(T-1-t) stat_t:
    // one weighted sum per client over its logged rows, then the clients in
    // order (float32 like ATen's own update; rounding aside, the same).
    const int64_t k = log_.front().mean[i].size(0), c = rm.numel();
    at::Tensor means = at::zeros({logged, k, c}, rm.options()), vars = at::zeros({logged, k, c}, rv.options());
    for (int64_t s = 0; s < logged; ++s) {
      const at::Tensor& lm = log_[static_cast<size_t>(s)].mean[i];
      means[s].narrow(0, 0, lm.size(0)).copy_(lm);
      vars[s].narrow(0, 0, lm.size(0)).copy_(log_[static_cast<size_t>(s)].var[i]);
    }
    for (size_t j = 0; j < position.size(); ++j) {
      const int64_t t = std::min(steps[j], logged), a = position[j];
      std::vector<double> coef(static_cast<size_t>(t));
      double decay = 1;
      for (int64_t q = t; q-- > 0;) {
        coef[static_cast<size_t>(q)] = m * decay;
        decay *= 1 - m;
      }
      const at::Tensor cw = at::tensor(coef, at::kDouble).to(rm.options()).view({t, 1});
      rm.mul_(decay).add_((means.narrow(0, 0, t).select(1, a) * cw).sum(0));
      rv.mul_(decay).add_((vars.narrow(0, 0, t).select(1, a) * cw).sum(0));
    }
  }
  log_.clear();
}

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("SPARROW_BATCHED_TORCHSCRIPT");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

bool translates(const core::Model& model) {
  const torch::jit::Module* m = core::scripted_module(model);
  if (!m) return false;
  std::vector<std::string> names;
  for (const auto& p : model.named_parameters()) names.push_back(p.key());
  std::string why;
  try {
    Program::translate(*m, names);
    return true;
  } catch (const Unsupported& e) {
    why = e.op() + e.where() + (e.why() == "not supported" ? " is not supported" : ": " + e.why());
  } catch (const ConfigError& e) {
    why = e.what();
  }
  static std::mutex mu;
  static std::set<std::string> logged;
  const std::string path = core::scripted_path(model);
  std::lock_guard<std::mutex> lock(mu);
  if (logged.insert(path).second)
    spdlog::info("batched clients: torchscript model '{}' runs one client at a time: {}", path, why);
  return false;
}

}  // namespace sparrow::batched
