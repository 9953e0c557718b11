#pragma once
// A lite model: a sequence of layers (lite/layers.h) on a fixed per-sample
// input shape, ending in [classes] logits. Its parameters are, in order, the
// LibTorch model's named_parameters() under the same names, so a flat float
// vector of them is what the LibTorch client's weights flatten to (each tensor
// row-major, one after another) and the same codecs and wire can carry it.
// A LoRA layer's frozen base is part of the spec (LayerSpec::frozen), as the
// LibTorch model's buffers are: in no flat vector.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lite/layers.h"

namespace sparrow::lite {

struct ModelSpec {
  Shape input_shape;  // per sample, e.g. {1, 28, 28}; inputs of the same size are reshaped to it
  std::vector<LayerSpec> layers;
};

// What a model's last layer gives: [classes] logits (a whole model), or any
// per-sample shape (the bottom of a split model, whose output is the
// activation at the cut, edge/split.h).
enum class ModelOutput { kLogits, kAny };

class Model {
 public:
  // Builds the layers (parameters zero) and checks that the shapes chain from
  // input_shape to [classes] logits (kLogits) or to any non-empty shape
  // (kAny): sparrow::Error naming the layer that does not fit, a duplicated
  // parameter name, or a model without parameters.
  explicit Model(ModelSpec spec, ModelOutput output = ModelOutput::kLogits);

  const ModelSpec& spec() const { return spec_; }
  const Shape& input_shape() const { return spec_.input_shape; }
  int64_t input_size() const { return numel(spec_.input_shape); }
  // The logits per sample; 0 for a kAny model.
  int64_t classes() const { return classes_; }
  // The last layer's per-sample output shape ([classes] for kLogits).
  const Shape& output_shape() const { return output_shape_; }

  // Parameters in model order (= the LibTorch model's named_parameters()).
  const std::vector<Param*>& params() { return params_; }
  std::vector<std::string> param_names() const;
  std::vector<Shape> param_shapes() const;
  // Elements of all parameters together (the flat vector's length).
  int64_t num_values() const { return num_values_; }
  // The flat vector <-> the parameters. sparrow::Error for a wrong length.
  std::vector<float> get_values() const;
  void set_values(const std::vector<float>& values);

  // The input buffer of a batch of `batch` samples ([batch, input_shape...]):
  // the caller fills it, then calls forward().
  Tensor& input(int64_t batch);
  // Runs every layer on input(); returns the logits [batch, classes], or the
  // output [batch, output_shape...] of a kAny model (valid until the next call).
  const Tensor& forward(const ForwardContext& ctx);
  // Backward of the last forward from dL/d(output) (dL/dlogits, or for a
  // bottom the gradient the cloud sent for the activation; the caller checks
  // its size): overwrites every parameter's grad.
  void backward(const Tensor& doutput);

  // Per layer, for tests and tools.
  size_t num_layers() const { return layers_.size(); }
  Layer& layer(size_t i) { return *layers_[i]; }

 private:
  ModelSpec spec_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<Param*> params_;
  int64_t classes_ = 0;
  Shape output_shape_;
  int64_t num_values_ = 0;
  std::vector<Tensor> acts_;  // acts_[0] input, acts_[i + 1] output of layer i
  Tensor grad_a_, grad_b_;    // dL/d(activation), alternating down the layers
};

// The spec of a built-in model (core/models.h) with these parameter names:
// "mlp" (784-200-200-10, ReLU), "cnn" (the FedAvg CNN on 1x28x28), and
// "logreg" (one Linear on `input_dim` features to `classes`, the simulator's).
// sparrow::Error for another name.
ModelSpec builtin_spec(const std::string& name, int64_t input_dim = 0, int64_t classes = 10);

// Split fine-tuning's bottom (edge/split.h) on the lite runtime. A built-in
// model's stages, as core::Model::stages() lists them: "mlp" fc1, fc2 (Linear
// + ReLU each), fc3; "cnn" conv1, conv2 (conv + ReLU + max-pool each), fc1
// (flatten + Linear + ReLU), fc2. `layers`: how many of builtin_spec's layers
// the stage is.
struct Stage {
  std::string name;
  size_t layers = 0;
};
// The stages of "mlp" and "cnn"; sparrow::Error for another name (not cuttable).
std::vector<Stage> builtin_stages(const std::string& name);

// How many stages the bottom of `name` cut at `cut` holds, with
// edge::split_model's reading of a cut: a stage name ("fc1"), "after:NAME",
// "first:K", or a count ("1"). The bottom and the top each keep at least one
// stage. ConfigError (the message lists the stages) for anything else.
size_t builtin_cut(const std::string& name, const std::string& cut);

// The bottom of a built-in model cut at `cut`: builtin_spec(name)'s layers of
// the first builtin_cut(name, cut) stages, built as a ModelOutput::kAny model.
// Its parameters are the LibTorch bottom's (edge::ModelPart::parameter_names()),
// in the same order, so its digest and SplitFed updates are the same.
ModelSpec builtin_bottom_spec(const std::string& name, const std::string& cut);

}  // namespace sparrow::lite
