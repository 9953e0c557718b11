#include "edge/split.h"

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <limits>
#include <set>
#include <sstream>

#include "core/error.h"

namespace sparrow::edge {
namespace {

std::string joined(const std::vector<std::string>& names) {
  std::ostringstream os;
  for (size_t i = 0; i < names.size(); ++i) os << (i ? ", " : "") << names[i];
  return os.str();
}

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
}

}  // namespace

ModelPart::ModelPart(std::shared_ptr<core::Model> model, size_t begin, size_t end)
    : model_(std::move(model)), begin_(begin), end_(end) {
  SPARROW_CHECK_T(ConfigError, model_ != nullptr, "ModelPart: no model");
  const std::vector<core::ModelStage> stages = model_->stages();
  SPARROW_CHECK_T(ConfigError, begin < end && end <= stages.size(),
                  "ModelPart: stages [" << begin << ", " << end << ") not within the model's " << stages.size());
  for (size_t i = begin; i < end; ++i) names_.insert(names_.end(), stages[i].params.begin(), stages[i].params.end());
}

std::vector<at::Tensor> ModelPart::parameters() const {
  std::vector<at::Tensor> out;
  auto named = model_->named_parameters(/*recurse=*/true);
  for (const std::string& n : names_) {
    const at::Tensor* t = named.find(n);
    SPARROW_CHECK(t != nullptr, "ModelPart: the model has no parameter '" << n << "'");
    out.push_back(*t);
  }
  return out;
}

void ModelPart::set_trainable(bool on) {
  for (at::Tensor& t : parameters()) t.set_requires_grad(on);
}

std::vector<std::string> stage_names(const core::Model& model) {
  std::vector<std::string> out;
  for (const auto& s : model.stages()) out.push_back(s.name);
  return out;
}

namespace {

const char* stages_word(size_t k) { return k == 1 ? "stage" : "stages"; }

// "first:K": the bottom is the first K stages.
size_t first_stages(const std::string& cut, const std::string& count) {
  SPARROW_CHECK_T(ConfigError, all_digits(count), "cut '" << cut << "': 'first:' takes a number of stages");
  return count.size() > 6 ? 0 : static_cast<size_t>(std::stoul(count));
}

// "after:NAME" or a bare name: the bottom ends with stage NAME.
size_t through_stage(const std::vector<std::string>& names, const std::string& cut, const std::string& name) {
  auto it = std::find(names.begin(), names.end(), name);
  SPARROW_CHECK_T(ConfigError, it != names.end(), "unknown cut '" << cut << "' (stages: " << joined(names) << ")");
  return static_cast<size_t>(it - names.begin()) + 1;
}

}  // namespace

Split split_model(std::shared_ptr<core::Model> model, const std::string& cut) {
  SPARROW_CHECK_T(ConfigError, model != nullptr, "split_model: no model");
  const std::vector<core::ModelStage> stages = model->stages();
  const std::vector<std::string> names = stage_names(*model);
  SPARROW_CHECK_T(ConfigError, stages.size() >= 2, "this model lists no stages (or one), so it cannot be cut");
  size_t k = 0;
  if (cut.rfind("first:", 0) == 0) {
    k = first_stages(cut, cut.substr(6));
  } else if (cut.rfind("after:", 0) == 0) {
    k = through_stage(names, cut, cut.substr(6));
  } else if (all_digits(cut)) {
    // An nn.Sequential names its children 0, 1, 2, ...: there "1" is both the
    // stage named "1" (a bottom of two stages) and a count of one. Guessing
    // would train a different split than the user meant, so it is refused.
    auto it = std::find(names.begin(), names.end(), cut);
    if (it != names.end()) {
      const size_t through = static_cast<size_t>(it - names.begin()) + 1;
      const size_t count = cut.size() > 6 ? 0 : static_cast<size_t>(std::stoul(cut));
      std::ostringstream os;
      os << "cut '" << cut << "' is ambiguous: this model's stages are named by number (" << joined(names)
         << "), as an nn.Sequential's children are, so it could mean after the stage named '" << cut
         << "' or a count of stages; write cut = \"after:" << cut << "\" (the bottom is the first " << through << " "
         << stages_word(through) << ", up to the one named '" << cut << "')";
      if (count >= 1 && count < stages.size())
        os << " or cut = \"first:" << cut << "\" (the bottom is the first " << count << " " << stages_word(count)
           << ")";
      throw ConfigError(os.str());
    }
    k = first_stages(cut, cut);
  } else {
    k = through_stage(names, cut, cut);
  }
  SPARROW_CHECK_T(ConfigError, k >= 1 && k < stages.size(),
                  "cut '" << cut << "' leaves an empty half (cut after one of: "
                          << joined(std::vector<std::string>(names.begin(), names.end() - 1)) << ", or a count 1.."
                          << stages.size() - 1 << ")");
  // The top owns every parameter the bottom does not (also stage-less ones).
  ModelPart bottom(model, 0, k);
  ModelPart top(model, k, stages.size());
  return Split{std::move(bottom), std::move(top)};
}

double check_stages(const Split& split, const at::Tensor& sample) {
  torch::NoGradGuard no_grad;
  const bool was_training = split.bottom.model()->is_training();
  split.bottom.model()->eval();
  const at::Tensor full = split.bottom.model()->forward(sample);
  const at::Tensor cut = split.top.forward(split.bottom.forward(sample));
  split.bottom.model()->train(was_training);
  if (full.sizes() != cut.sizes()) return std::numeric_limits<double>::infinity();
  return (full - cut).abs().max().item<double>();
}

EdgeHalf::EdgeHalf(ModelPart bottom, const std::string& act_spec, bool freeze)
    : bottom_(std::move(bottom)), codec_(act_spec), frozen_(freeze) {
  if (freeze) bottom_.set_trainable(false);
}

ActPacket EdgeHalf::forward(const at::Tensor& x) {
  pending_ = at::Tensor();
  at::Tensor a = bottom_.forward(x);
  ActPacket p = codec_.encode(a, state_);
  p.want_gradient = !frozen_ && a.requires_grad();
  if (p.want_gradient) pending_ = a;
  return p;
}

void EdgeHalf::backward(const ActPacket& gradient) {
  SPARROW_CHECK(pending_.defined(), "EdgeHalf::backward: no pending forward that wants a gradient");
  at::Tensor g = decode_gradient(gradient, state_, pending_.sizes().vec());  // throws before any change
  pending_.backward(g.to(pending_.dtype()));
  pending_ = at::Tensor();
}

ActPacket EdgeHalf::infer(const at::Tensor& x) {
  torch::NoGradGuard no_grad;
  CodecState scratch = state_;  // the training basis, left as is
  ActPacket p = codec_.encode(bottom_.forward(x), scratch, /*infer=*/true);
  p.want_gradient = false;
  return p;
}

CloudHalf::CloudHalf(ModelPart top, const std::string& grad_spec) : top_(std::move(top)), grad_codec_(grad_spec) {
  SPARROW_CHECK_T(
      ConfigError, !grad_codec_.lowrank(),
      "gradient codec '" << grad_spec << "': lowrank gradients come only from lowrank activations (projected)");
}

CloudHalf::Result CloudHalf::step(const ActPacket& activation, const at::Tensor& labels) {
  CodecState next = peer_;                                 // committed only when the step goes through
  at::Tensor a_hat = decode_activation(activation, next);  // validates: FormatError before anything runs
  SPARROW_CHECK_T(FormatError,
                  labels.defined() && labels.dim() == 1 && labels.scalar_type() == at::kLong &&
                      labels.size(0) == activation.shape[0],
                  "labels must be int64 [" << activation.shape[0] << "]");
  SPARROW_CHECK_T(FormatError, labels.min().item<int64_t>() >= 0, "labels must be >= 0");
  if (activation.want_gradient) a_hat.set_requires_grad(true);
  at::Tensor logits = top_.forward(a_hat);
  SPARROW_CHECK_T(FormatError, logits.dim() == 2 && labels.max().item<int64_t>() < logits.size(1),
                  "labels must be < " << (logits.dim() == 2 ? logits.size(1) : 0));
  at::Tensor loss = torch::nn::functional::cross_entropy(logits, labels);
  Result r;
  r.loss = loss.item<double>();
  r.correct = logits.argmax(1).eq(labels).sum().item<int64_t>();
  if (loss.requires_grad()) loss.backward();
  peer_ = std::move(next);
  if (activation.want_gradient) {
    at::Tensor g = a_hat.grad();
    if (!g.defined()) g = at::zeros_like(a_hat);
    r.gradient = encode_gradient(g, activation, grad_codec_, peer_);
  }
  return r;
}

at::Tensor CloudHalf::predict(const ActPacket& activation) {
  CodecState scratch = peer_;
  at::Tensor a_hat = decode_activation(activation, scratch);
  torch::NoGradGuard no_grad;
  return top_.forward(a_hat);
}

}  // namespace sparrow::edge
