#include "core/models.h"

#include <torch/torch.h>

#include "core/error.h"

namespace sparrow::core {
namespace {

class Mlp final : public Model {
 public:
  Mlp() {
    fc1_ = register_module("fc1", torch::nn::Linear(784, 200));
    fc2_ = register_module("fc2", torch::nn::Linear(200, 200));
    fc3_ = register_module("fc3", torch::nn::Linear(200, 10));
  }
  at::Tensor forward(const at::Tensor& x) override {
    at::Tensor h = x.reshape({x.size(0), -1});
    h = torch::relu(fc1_->forward(h));
    h = torch::relu(fc2_->forward(h));
    return fc3_->forward(h);
  }

 private:
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr}, fc3_{nullptr};
};

}  // namespace

std::shared_ptr<Model> make_model(const std::string& name, uint64_t seed) {
  torch::manual_seed(seed);
  if (name == "mlp") return std::make_shared<Mlp>();
  throw ConfigError("unknown model '" + name + "' (known: mlp)");
}

}  // namespace sparrow::core
