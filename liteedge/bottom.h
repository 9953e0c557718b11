#pragma once
// The device half of split fine-tuning on the lite runtime: what
// edge::EdgeHalf and the device's Sgd are for sparrow-edge, without LibTorch.
// The bottom of a built-in model (lite::builtin_bottom_spec) holding the
// initial weights of `weights`, the activation codec (edge/codec/
// act_codec_flat.h) with its state, and plain SGD with momentum (buf <- m buf
// + g, w <- w - lr buf, as edge::Sgd). Not thread-safe; one step at a time:
// forward, then backward and step.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "compression/flat_codec.h"
#include "edge/codec/act_codec_flat.h"
#include "lite/model.h"
#include "liteedge/config.h"

namespace sparrow::liteedge {

class Bottom {
 public:
  // Builds the bottom of cfg.model cut at cfg.cut and loads its weights from
  // cfg.weights: a weights file (compression::State bytes: the whole model's
  // tensors by name, as sparrow-edge's `weights`) or a lite model file of the
  // whole model. ConfigError for a model, cut or codec it cannot run;
  // FormatError for a file that is neither or does not hold every bottom
  // parameter at its shape (or names a tensor the model does not have).
  explicit Bottom(const DeviceConfig& cfg);

  int64_t input_size() const { return model_->input_size(); }
  // Runs the bottom on `rows` samples (rows * input_size() floats) in training
  // mode and encodes the activation; want_gradient unless frozen. Keeps what
  // backward() needs until the next forward() or infer().
  edge::ActPacket forward(const float* x, int64_t rows);
  // Applies the cloud's gradient for the last forward(): every parameter's
  // grad. FormatError (nothing changed: the step can be retried) for a packet
  // that does not fit; Error when no forward wants a gradient.
  void backward(const edge::ActPacket& gradient);
  // The SGD step on the grads of the last backward().
  void step();
  // Evaluation: the activation encoded with the current basis (the training
  // codec state is left as is). Ends any pending forward.
  edge::ActPacket infer(const float* x, int64_t rows);

  const edge::flat::ActCodec& codec() const { return codec_; }
  edge::flat::CodecState& codec_state() { return state_; }
  const edge::flat::CodecState& codec_state() const { return state_; }
  void force_basis_refresh() { state_.refresh_next = true; }
  bool frozen() const { return frozen_; }

  // The parameters in the LibTorch bottom's order (ModelPart::parameter_names()).
  const std::vector<std::string>& names() const { return names_; }
  std::vector<std::vector<int64_t>> shapes() const { return model_->param_shapes(); }
  // Hello's model digest: core::model_digest of the bottom's shapes, as
  // sparrow-edge computes it (edge::bottom_digest).
  uint64_t digest() const { return digest_; }
  // Parameter i's values and SGD momentum buffer, row-major.
  std::vector<float>& value(size_t i) { return model_->params()[i]->value; }
  std::vector<float>& momentum(size_t i) { return momentum_[i]; }
  const std::vector<float>& value(size_t i) const { return model_->params()[i]->value; }
  const std::vector<float>& momentum(size_t i) const { return momentum_[i]; }
  // The bottom's parameters by name (copies).
  std::map<std::string, compression::flat::Tensor> weights() const;

 private:
  void load_weights(const std::string& path, const std::string& model);

  std::unique_ptr<lite::Model> model_;
  std::vector<std::string> names_;
  uint64_t digest_ = 0;
  edge::flat::ActCodec codec_;
  edge::flat::CodecState state_;
  bool frozen_;
  float lr_, momentum_factor_;
  std::vector<std::vector<float>> momentum_;
  bool pending_ = false;  // the model's buffers hold a training forward that wants a gradient
  int64_t rows_ = 0;      // the pending forward's batch
  lite::Tensor grad_;     // dL/d(activation), decoded
};

}  // namespace sparrow::liteedge
