#pragma once
// Local training: the one LocalTrainer that the simulator's workers and the
// deployed client both run. A trainer owns one model replica and the buffers
// training needs (minibatch, momentum, proximal anchor, SCAFFOLD correction);
// each train() copies the global weights into the replica instead of building
// a module, and reuses those buffers, so the per-client overhead is a handful
// of in-place copies and the per-step overhead is nothing LibTorch does not
// need for forward and backward.
//
// Clients are stateless towards the trainer: no optimizer momentum, gradient or
// weight survives from one train() call to the next. Per-client state that
// algorithms need (SCAFFOLD's c_i) is a value the caller owns and passes in.
//
// Not thread-safe: one thread owns a trainer (one trainer per worker thread;
// distinct replicas train concurrently without interference).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/models.h"

namespace sparrow::client {

struct TrainConfig {
  std::string algorithm = "fedavg";  // fedavg | fedprox | scaffold | fednova | feddyn
  int local_epochs = 1;
  int batch_size = 32;
  double lr = 0.01;
  double momentum = 0.0;      // heavy ball, dampening 0, as torch::optim::SGD
  double weight_decay = 0.0;  // L2 added to the gradient, as torch::optim::SGD
  double mu = 0.0;            // proximal weight: FedProx's mu, FedDyn's alpha (> 0 there)
};

// ConfigError on: unknown algorithm, local_epochs < 1, batch_size < 1, lr not
// finite and > 0, momentum outside [0, 1), weight_decay < 0, mu < 0 or not
// finite, mu != 0 with an algorithm other than fedprox or feddyn (a setting
// that would be silently ignored is an error, as with compressor specs), or
// feddyn with mu = 0.
void validate(const TrainConfig& cfg);

// "fedavg:lr=0.05,momentum=0.9,wd=1e-4,epochs=2,batch=64", "fedprox:mu=0.01",
// "scaffold:lr=0.1". Keys: lr, momentum, wd, epochs, batch, mu; unspecified
// keys keep TrainConfig's defaults; unknown keys and bad values are ConfigError.
TrainConfig parse_train_config(const std::string& spec);

// Name -> float32 tensor, one entry per model parameter (std::map: sorted by
// name, the same container StreamingAggregator::mean() returns).
using Weights = std::map<std::string, at::Tensor>;

// A detached copy of the module's parameters (e.g. the initial global model).
Weights get_weights(const torch::nn::Module& model);

struct TrainResult {
  Weights delta;          // local - global, on the replica's device
  Weights control_delta;  // SCAFFOLD: c_i+ - c_i; empty for other algorithms
  int64_t num_samples = 0;
  double mean_loss = 0.0;  // sample-weighted mean training loss over all steps
  int64_t steps = 0;       // K: local_epochs * ceil(num_samples / batch_size)
};

// The sample order of one epoch: a Fisher-Yates permutation of [0, n) drawn
// from rng::Stream(rng::derive(seed, epoch)). Public so that tests and tools
// can reproduce a client's minibatch sequence: epoch e's minibatch b holds
// order[b * batch_size, min(n, (b + 1) * batch_size)) (the last one may be short).
std::vector<int64_t> epoch_order(int64_t n, uint64_t seed, int epoch);

class LocalTrainer {
 public:
  // Takes the replica (its parameters define names, shapes, device and
  // dtype) and a config (validated here: ConfigError).
  LocalTrainer(std::shared_ptr<core::Model> replica, TrainConfig cfg);

  // Copies `global` into the replica, runs local_epochs of minibatch SGD with
  // cross-entropy loss on (x, y) in the order epoch_order(n, seed, epoch)
  // gives, and returns the update.
  //
  // x: {n, ...} floating, y: {n} int64 class labels; both are moved to the
  // replica's device once per call when they are elsewhere. The gradient step
  // is torch::optim::SGD's (weight decay, then momentum, dampening 0, no
  // Nesterov) applied to the algorithm's gradient:
  //   fedavg:   g
  //   fedprox:  g + mu (w - w_global)            (Li et al. 2020)
  //   scaffold: g + c - c_i                      (Karimireddy et al. 2020)
  //   fednova:  g (the server normalises; federation/algorithms.h)
  //   feddyn:   g - h_i + mu (w - w_global)      (Acar et al. 2021; mu = alpha)
  // SCAFFOLD needs client_control (c_i, in/out) and server_control (c); an
  // empty map means all zeros (a new client, round 0), otherwise a map must
  // hold exactly the model's parameters. On success *client_control becomes
  // c_i+ = c_i - c + (w_global - w_local) / (K lr) (option II) and
  // control_delta = c_i+ - c_i. FedDyn needs client_control (h_i, in/out;
  // empty = zeros) and no server_control; on success *client_control becomes
  // h_i - mu (w_local - w_global), and control_delta stays empty (nothing of
  // h_i is sent). Passing controls to another algorithm is an error.
  //
  // Throws sparrow::Error, changing nothing the caller owns, when `global`
  // does not hold exactly the model's parameters with their shapes, x/y are
  // empty, mismatched in size, or y is out of range for the model's outputs,
  // and when training diverges: a non-finite loss (the message names the
  // first such step, epoch and batch) or a non-finite update. A diverged
  // client never returns NaN.
  TrainResult train(const Weights& global, const at::Tensor& x, const at::Tensor& y, uint64_t seed,
                    Weights* client_control = nullptr, const Weights* server_control = nullptr);

  // Mean cross-entropy loss and accuracy (in [0, 1]) of `weights` on (x, y),
  // in batches of batch_size (0: the model's choice, core::Model::eval_batch,
  // which is measured), without autograd. Loads `weights` into the replica
  // (train() overwrites them anyway). Same input checks as train().
  std::pair<double, double> evaluate(const Weights& weights, const at::Tensor& x, const at::Tensor& y,
                                     int batch_size = 0);

  const TrainConfig& config() const { return cfg_; }
  // Parameter names in the model's named_parameters() order.
  const std::vector<std::string>& names() const { return names_; }
  core::Model& replica() { return *replica_; }

 private:
  void load(const Weights& weights);
  std::pair<at::Tensor, at::Tensor> prepare_data(const at::Tensor& x, const at::Tensor& y) const;
  void ensure_batch_buffers(const at::Tensor& x, const at::Tensor& y);

  std::shared_ptr<core::Model> replica_;
  TrainConfig cfg_;
  bool prox_ = false;
  bool scaffold_ = false;
  bool feddyn_ = false;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;  // the replica's parameters, names_ order
  // Per-parameter buffers, allocated once: momentum, w_global (the update's
  // origin and FedProx's anchor), SCAFFOLD's c - c_i or FedDyn's -h_i.
  std::vector<at::Tensor> momentum_, anchor_, correction_;
  // Minibatch buffers (re-allocated only when the data's shape changes),
  // the epoch order and the per-step losses (one host sync per train()).
  at::Tensor x_batch_, y_batch_, order_dev_, step_loss_;
  std::vector<int64_t> order_;
};

}  // namespace sparrow::client
