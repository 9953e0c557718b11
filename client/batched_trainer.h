#pragma once
// Batched clients: K clients of one built-in architecture trained in one pass.
//
// Each parameter is stacked along a leading client dimension ([K, ...]); the
// model's loss_backward_clients() gives every client its own loss and
// gradient in one call (a hand-written backward for the built-in models,
// autograd through forward_clients otherwise), and each client's SGD step
// (weight decay, momentum, FedProx's proximal term, SCAFFOLD's correction) is
// applied elementwise on the stacked tensors; plain SGD is fused into the
// backward itself. What each client computes is exactly what LocalTrainer
// computes for it, up to float rounding:
//  - its minibatches are the same samples in the same order (epoch_order with
//    its own seed);
//  - clients with less data run fewer steps: clients are ordered by step count,
//    so the active clients are a prefix of the stack and a finished client
//    leaves the batch (its parameters are no longer touched);
//  - a minibatch shorter than the step's batch (a client's short last
//    minibatch, or a client with fewer samples than batch_size) is padded with
//    samples of weight 0 and its real samples weigh 1/len, so each client's
//    loss and gradient are the mean over its own samples only.
// The loss over the whole batch is the sum of the clients' losses; since no
// parameter is shared, its gradient with respect to client k's parameters is
// client k's gradient.
//
// Per-step work has no host synchronisation: every step's sample indices and
// weights are computed on the host up front and copied to the device once, and
// the step losses stay on the device until the end (as LocalTrainer does).
//
// Not thread-safe: one thread owns a trainer.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "client/trainer.h"

namespace sparrow::batched {
class ScriptedClients;
}

namespace sparrow::client {

// One client's share of a batched train() call.
struct ClientJob {
  at::Tensor x;  // {n, ...} floating
  at::Tensor y;  // {n} integer class labels
  uint64_t seed = 0;
  // SCAFFOLD's c_i (in/out), as LocalTrainer::train's client_control; null
  // for the other algorithms.
  Weights* client_control = nullptr;
};

class BatchedTrainer {
 public:
  // `replica` defines names, shapes, device and dtype; it must support
  // forward_clients() (supports(); ConfigError otherwise). cfg is validated.
  BatchedTrainer(std::shared_ptr<core::Model> replica, TrainConfig cfg);

  // True when `model` can train several clients in one pass: the built-in
  // "mlp" and "cnn", the simulator's "logreg", and TorchScript models whose
  // forward translates into a batched layer program (batched/program.h;
  // for one that does not, the reason is logged once per model file) when
  // that experimental path is switched on (SPARROW_BATCHED_TORCHSCRIPT=1,
  // batched::enabled()).
  // A TorchScript model's BatchNorm running statistics (its buffers) end a
  // train() call as they would after training the jobs one after another, in
  // jobs' order, with LocalTrainer on this replica.
  static bool supports(const core::Model& model);

  // Trains every job from `global` and returns one TrainResult per job, in
  // jobs' order, each as LocalTrainer::train would return it for that job
  // alone (same checks, same errors; a diverged client throws Error naming it,
  // and nothing the caller owns changes). server_control: SCAFFOLD's c (empty
  // map = zeros), null for other algorithms.
  std::vector<TrainResult> train(const Weights& global, std::vector<ClientJob>& jobs,
                                 const Weights* server_control = nullptr);

  // Bytes of stacked state one client adds to a batch (parameters, gradients,
  // optimizer buffers), used to bound K by memory.
  int64_t bytes_per_client() const;

  const TrainConfig& config() const { return cfg_; }
  const std::vector<std::string>& names() const { return names_; }

 private:
  std::shared_ptr<core::Model> replica_;
  // What runs the K clients: the replica itself, or a TorchScript replica's
  // batched program (scripted_, which also folds its buffers).
  std::shared_ptr<core::Model> engine_;
  std::shared_ptr<batched::ScriptedClients> scripted_;
  TrainConfig cfg_;
  bool prox_ = false;
  bool scaffold_ = false;
  bool feddyn_ = false;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;  // the replica's (shapes, device, dtype)
};

}  // namespace sparrow::client
