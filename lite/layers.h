#pragma once
// The layers of the lite runtime, each with a forward and a hand-written
// backward that match LibTorch's (tests/lite/layers_test.cc checks every one
// against LibTorch's forward and autograd). A model is a sequence of them
// (lite/model.h); what each layer is, is a LayerSpec, which the model file
// stores (lite/model_file.h).
//
// Shapes are batch first: a layer sees [B, ...per-sample shape]. Not
// thread-safe: a layer keeps scratch buffers between forward and backward.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lite/tensor.h"

namespace sparrow::lite {

// Stored in model files as u32: never renumber, only add.
enum class LayerKind : uint32_t {
  kLinear = 1,      // in -> out features on the last dimension; weight [out, in], bias [out]
  kConv2d = 2,      // [C, H, W] -> [O, Ho, Wo]; weight [O, C, kh, kw], bias [O]; groups = 1, dilation 1
  kRelu = 3,        //
  kGelu = 4,        // flag 0: exact (erf), flag 1: tanh approximation
  kMaxPool2d = 5,   // kernel, stride, padding (padded cells never win); dilation 1, floor mode
  kAvgPool2d = 6,   // kernel, stride, padding; padded cells count (count_include_pad), floor mode
  kFlatten = 7,     // every per-sample dimension into one (torch.flatten(x, 1))
  kDropout = 8,     // p; identity outside training
  kLayerNorm = 9,   // over the trailing `in` elements; weight and bias of that shape when bias = 1
  kEmbedding = 10,  // float indices [L] -> [L, out]; weight [in, out]
  // LoRA: a frozen Linear plus a trainable low-rank update on the last dimension,
  // y = x W^T + b + (alpha / r) (x A^T) B^T. W [out, in] and b [out] (when
  // bias = 1) are LayerSpec::frozen; A [r, in] and B [out, r] the parameters.
  // flag = r, p = alpha.
  kLoraLinear = 11
};

// "linear", "conv2d", ...; "layer kind N" for an unknown value.
std::string kind_name(LayerKind kind);

// A tensor a layer reads but never trains (a LoRA layer's base weight and
// bias): part of the architecture, stored in the model file, not in the flat
// parameter vector, so it is neither trained nor sent. The value is shared
// and immutable: copies of a spec (the model's, each layer's) hold one array.
struct FrozenTensor {
  std::string name;  // as the LibTorch model names the buffer ('.' as '_'), for messages
  Shape shape;
  std::shared_ptr<const std::vector<float>> value;
};

// One layer's architecture. Fields a kind does not use stay at their defaults.
struct LayerSpec {
  LayerKind kind = LayerKind::kRelu;
  int64_t in = 0;   // Linear in_features, Conv2d in_channels, Embedding num_embeddings, LayerNorm size
  int64_t out = 0;  // Linear out_features, Conv2d out_channels, Embedding embedding_dim
  int64_t kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0;  // Conv2d and pools
  int64_t bias = 1;   // Linear, Conv2d: has a bias; LayerNorm: has weight and bias (elementwise_affine)
  int64_t flag = 0;   // GELU: 1 = tanh approximation; LoRA linear: the rank r
  float p = 0.0f;     // Dropout probability, in [0, 1); LoRA linear: alpha (the update is scaled by alpha / r)
  float eps = 1e-5f;  // LayerNorm epsilon
  // The parameters' names (weight first, then bias), as the LibTorch model's
  // state_dict names them: what updates on the wire are keyed by.
  std::vector<std::string> param_names;
  // The parameters' shapes, same order; make_layer checks them against the fields.
  std::vector<Shape> param_shapes;
  // Frozen tensors (LoRA linear: weight, then bias when bias = 1); empty for
  // every other kind. make_layer checks their count, shapes and sizes.
  std::vector<FrozenTensor> frozen;
};

// How many frozen tensors a layer of this kind and bias flag holds (LoRA
// linear: 1 or 2, every other kind 0): the model file's leading tensors of
// the layer that are not parameters.
size_t frozen_count(LayerKind kind, int64_t bias);

// What a forward pass needs beyond its input.
struct ForwardContext {
  bool train = false;
  uint64_t dropout_key = 0;  // per step and layer: the dropout mask is rng::at(key, element)
};

class Layer {
 public:
  explicit Layer(LayerSpec spec) : spec_(std::move(spec)) {}
  virtual ~Layer() = default;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  // The per-sample output shape for a per-sample input shape; sparrow::Error
  // naming the layer when the input does not fit it.
  virtual Shape out_shape(const Shape& in) const = 0;
  // y = layer(x); y is resized here. Keeps what backward needs.
  virtual void forward(const Tensor& x, Tensor& y, const ForwardContext& ctx) = 0;
  // From x and y of the last forward and dy = dL/dy: overwrites every
  // parameter's grad with dL/dparam and, when dx is given, writes dL/dx
  // (resized here).
  virtual void backward(const Tensor& x, const Tensor& y, const Tensor& dy, Tensor* dx) = 0;

  const LayerSpec& spec() const { return spec_; }
  std::vector<Param>& params() { return params_; }
  const std::vector<Param>& params() const { return params_; }

 protected:
  LayerSpec spec_;
  std::vector<Param> params_;
};

// Builds a layer with zero parameters of the spec's shapes. sparrow::Error
// naming the layer for a bad field, a wrong parameter count or shape.
std::unique_ptr<Layer> make_layer(const LayerSpec& spec);

// Softmax cross-entropy, mean over the batch (torch::cross_entropy_loss):
// logits [B, C], labels in [0, C). Returns the loss; writes dL/dlogits into
// dlogits (resized) when given. sparrow::Error for a label out of range.
float softmax_cross_entropy(const Tensor& logits, const int64_t* labels, Tensor* dlogits);

// Layer factories for the spatial layers (conv_layers.cc).
std::unique_ptr<Layer> make_conv2d(const LayerSpec& spec);
std::unique_ptr<Layer> make_pool2d(const LayerSpec& spec);

}  // namespace sparrow::lite
