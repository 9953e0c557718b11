#pragma once
// Split fine-tuning: a model cut into a Bottom (run on the device, on its private
// data) and a Top (run in the cloud). The halves share the original model's
// parameter tensors; only the activation at the cut and its gradient cross.
//
// One training step, as a device/cloud process pair calls it:
//   device: ActPacket act = edge.forward(x);            // bottom forward + encode
//           send act (act.serialize()) and the labels
//   cloud:  CloudHalf::Result r = cloud.step(act, y);    // decode, top forward,
//           optimiser step on the top;                   // loss, backward
//           send r.gradient (when act.want_gradient)
//   device: edge.backward(gradient); optimiser step on the bottom.
// Optimisers are the caller's (parameters() lists what each half trains), so
// several devices can share one cloud top and bottoms can be averaged (SplitFed).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/models.h"
#include "edge/act_codec.h"

namespace sparrow::edge {

// Stages [begin, end) of a model, sharing its parameters.
class ModelPart {
 public:
  ModelPart(std::shared_ptr<core::Model> model, size_t begin, size_t end);

  at::Tensor forward(const at::Tensor& x) const { return model_->forward_stages(x, begin_, end_); }
  // The part's parameters (the model's tensors, not copies) and their names.
  std::vector<at::Tensor> parameters() const;
  const std::vector<std::string>& parameter_names() const { return names_; }
  // requires_grad on every parameter of the part (false = frozen).
  void set_trainable(bool on);
  void train(bool on) { model_->train(on); }
  const std::shared_ptr<core::Model>& model() const { return model_; }
  size_t begin() const { return begin_; }
  size_t end() const { return end_; }

 private:
  std::shared_ptr<core::Model> model_;
  size_t begin_, end_;
  std::vector<std::string> names_;
};

struct Split {
  ModelPart bottom;
  ModelPart top;
};

// The names of the model's stages (where it can be cut); empty if it cannot be.
std::vector<std::string> stage_names(const core::Model& model);

// Cuts `model` after stage `cut`: a stage name ("conv2": the bottom ends with
// conv2) or a count ("2": the bottom is the first two stages), or explicitly
// "after:NAME" / "first:K". A bare number that is also a stage's name (an
// nn.Sequential's children are named 0, 1, ...) is refused as ambiguous, the
// message naming both explicit forms. The bottom must have at least one stage
// and the top too. The bottom's parameters are those of its stages; the top
// gets every other parameter. ConfigError for an uncuttable model or an
// unknown/out-of-range/ambiguous cut (the message lists the stages).
Split split_model(std::shared_ptr<core::Model> model, const std::string& cut);

// Max |forward(x) - top(bottom(x))| on a sample input (eval mode for the check,
// the model's mode restored). For TorchScript models, whose stages are their
// children run in order, a large value means forward is not that composition.
double check_stages(const Split& split, const at::Tensor& sample);

// The device half. Not thread-safe; one step at a time: forward, then backward.
class EdgeHalf {
 public:
  // `act_spec`: an ActCodec spec. freeze: the bottom's parameters stop requiring
  // gradients (this changes the shared model's flags), and activations are sent
  // with want_gradient = false.
  EdgeHalf(ModelPart bottom, const std::string& act_spec, bool freeze);

  // Runs the bottom on x and encodes the activation. Keeps the autograd graph
  // until backward() or the next forward().
  ActPacket forward(const at::Tensor& x);
  // Applies the cloud's gradient packet for the last forward(): accumulates
  // gradients into the bottom's parameters (.grad). FormatError (nothing changed,
  // the step can be retried) for a packet that does not fit; Error if there is
  // no pending forward.
  void backward(const ActPacket& gradient);
  // Inference: bottom forward under no-grad, encoded. Does not touch the pending step.
  ActPacket infer(const at::Tensor& x);

  ModelPart& bottom() { return bottom_; }
  const ActCodec& codec() const { return codec_; }
  // After the cloud answers "basis unknown" (it restarted or lost the state):
  // the next forward() sends a fresh basis.
  void force_basis_refresh() { state_.refresh_next = true; }
  CodecState& codec_state() { return state_; }
  bool frozen() const { return frozen_; }

 private:
  ModelPart bottom_;
  ActCodec codec_;
  CodecState state_;
  bool frozen_;
  at::Tensor pending_;  // the activation of the last forward(), with its graph
};

// The cloud half. Not thread-safe (serve one device step at a time, or one
// CloudHalf per thread over distinct tops).
class CloudHalf {
 public:
  // `grad_spec`: ActCodec spec for gradients of non-lowrank activations ("none",
  // "q8", "q4", "topk:..."); lowrank activations always get the projected
  // gradient. ConfigError for a bad spec or "lowrank".
  CloudHalf(ModelPart top, const std::string& grad_spec);

  struct Result {
    std::optional<ActPacket> gradient;  // set when the activation wanted it
    double loss = 0;                    // mean cross-entropy over the batch
    int64_t correct = 0;                // argmax == label
  };
  // Decodes and validates the activation and the labels (int64 [N], >= 0 and <
  // the number of logits) before any backward: a bad packet or bad labels throw
  // FormatError and leave the top's gradients untouched. Otherwise accumulates
  // the top's parameter gradients (.grad) from the mean cross-entropy loss.
  Result step(const ActPacket& activation, const at::Tensor& labels);
  // Logits for an activation, no gradients.
  at::Tensor predict(const ActPacket& activation);

  ModelPart& top() { return top_; }
  // The basis this cloud half holds for its device (lowrank codecs).
  const CodecState& peer_state() const { return peer_; }
  // Puts back a basis saved from peer_state() (the cloud's state store).
  void restore_peer_state(CodecState s) { peer_ = std::move(s); }

 private:
  ModelPart top_;
  ActCodec grad_codec_;
  CodecState peer_;  // the device's last lowrank basis
};

}  // namespace sparrow::edge
