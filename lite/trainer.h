#pragma once
// Local training on a lite model: the same algorithm, minibatch order and
// arithmetic as the LibTorch client's LocalTrainer (client/trainer.h), on
// flat float vectors instead of named tensors. A flat vector holds every
// parameter of the model in Model::param_names() order (the LibTorch model's
// named_parameters() order, same names), each row-major: the LibTorch
// client's weights flattened in that order are the same numbers, so its
// codecs and wire can carry what this trainer takes and returns.
//
// Not thread-safe: one thread owns a trainer and its model.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lite/model.h"

namespace sparrow::lite {

// As client::TrainConfig; the same checks (validate).
struct TrainConfig {
  std::string algorithm = "fedavg";  // fedavg | fedprox | scaffold
  int local_epochs = 1;
  int batch_size = 32;
  double lr = 0.01;
  double momentum = 0.0;      // heavy ball, dampening 0, as torch::optim::SGD
  double weight_decay = 0.0;  // L2 added to the gradient, as torch::optim::SGD
  double mu = 0.0;            // FedProx proximal weight (only with fedprox)
};

// sparrow::ConfigError for what client::validate refuses: an unknown
// algorithm, epochs or batch < 1, lr not finite and > 0, momentum outside
// [0, 1), weight decay or mu negative or not finite, mu without fedprox.
void validate(const TrainConfig& cfg);

struct TrainResult {
  std::vector<float> delta;          // local - global
  std::vector<float> control_delta;  // SCAFFOLD: c_i+ - c_i; empty otherwise
  int64_t num_samples = 0;
  double mean_loss = 0.0;  // sample-weighted mean training loss over all steps
  int64_t steps = 0;       // local_epochs * ceil(num_samples / batch_size)
};

// client::epoch_order: a Fisher-Yates permutation of [0, n) from
// rng::Stream(rng::derive(seed, epoch)); the same numbers on every platform.
std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int epoch);

class Trainer {
 public:
  // Takes the model (its parameters are overwritten by every train()) and a
  // config (validated here: ConfigError).
  Trainer(std::shared_ptr<Model> model, TrainConfig cfg);

  // Loads `global`, runs local_epochs of minibatch SGD with softmax
  // cross-entropy on (x, y) in epoch_order(n, seed, epoch), and returns the
  // update. x: n samples of model().input_size() floats each, row-major
  // (any per-sample shape of that size); y: n labels in [0, classes).
  // The step is client::LocalTrainer's (weight decay, momentum with
  // dampening 0, no Nesterov) on the algorithm's gradient:
  //   fedavg: g   fedprox: g + mu (w - w_global)   scaffold: g + c - c_i
  // SCAFFOLD takes client_control (c_i, in/out) and server_control (c),
  // empty meaning zeros; *client_control becomes c_i - c + (w_global - w) / (K lr).
  // Dropout masks come from (seed, step): the same call gives the same result.
  // sparrow::Error, changing nothing the caller owns, for a wrong length of
  // global or a control, mismatched or empty data, a label out of range, a
  // control passed to another algorithm, and for divergence (a non-finite
  // loss, naming the step, or a non-finite update).
  TrainResult train(const std::vector<float>& global, const std::vector<float>& x, const std::vector<int64_t>& y,
                    uint64_t seed, std::vector<float>* client_control = nullptr,
                    const std::vector<float>* server_control = nullptr);

  // Mean cross-entropy and accuracy of `weights` on (x, y), in batches of
  // batch_size, dropout off. Loads `weights` into the model.
  std::pair<double, double> evaluate(const std::vector<float>& weights, const std::vector<float>& x,
                                     const std::vector<int64_t>& y, int batch_size = 64);

  const TrainConfig& config() const { return cfg_; }
  Model& model() { return *model_; }

 private:
  int64_t check_data(const std::vector<float>& x, const std::vector<int64_t>& y) const;
  void fill_batch(const std::vector<float>& x, const std::vector<int64_t>& y, const int64_t* idx, int64_t len);

  std::shared_ptr<Model> model_;
  TrainConfig cfg_;
  std::vector<float> anchor_, momentum_, correction_, values_, grads_;
  std::vector<int64_t> order_, y_batch_;
  std::vector<float> step_loss_;
  Tensor dlogits_;
};

}  // namespace sparrow::lite
