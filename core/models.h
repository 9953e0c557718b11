#pragma once
// The model zoo. Every model is a torch::nn::Module with a forward(x) that maps
// a batch of inputs to logits; parameters are registered under stable names
// ("fc1.weight", ...) which is what updates and compressor state are keyed by.

#include <torch/nn/module.h>

#include <memory>
#include <string>

namespace sparrow::core {

class Model : public torch::nn::Module {
 public:
  virtual at::Tensor forward(const at::Tensor& x) = 0;
};

// "mlp": 784-200-200-10 with ReLU (McMahan et al. 2017's 2NN). Initialised from
// `seed` deterministically. ConfigError for an unknown name.
std::shared_ptr<Model> make_model(const std::string& name, uint64_t seed);

}  // namespace sparrow::core
