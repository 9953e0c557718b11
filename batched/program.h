#pragma once
// A user's TorchScript model as a batched layer program: the scripted
// forward, read in training mode (script_graph.h), becomes a list of steps in
// SSA form (each step reads earlier values, so residual adds make a DAG, not
// only a chain) over the batched ops (ops.h). ScriptedClients runs it for K
// clients in one pass behind core::Model's forward_clients /
// loss_backward_clients, which is what client::BatchedTrainer trains with.
//
// What translates: Linear, Conv2d (any kernel, stride and padding; dilation 1,
// groups 1), ReLU, GELU, Tanh, Sigmoid, MaxPool2d, AvgPool2d,
// AdaptiveAvgPool2d, Flatten, reshapes of the sample, Dropout, BatchNorm
// (training mode, a float momentum), LayerNorm, Embedding, and the add of two
// values computed before. Anything else is refused (Unsupported names the
// first op that is not supported), and the model trains one client at a
// time.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "batched/script_graph.h"
#include "core/models.h"

namespace sparrow::batched {

class Program {
 public:
  // One BatchNorm layer's running statistics: the flat names of its
  // buffers in the model ("" when it tracks none) and its momentum.
  struct BatchNormSlot {
    std::string running_mean, running_var;
    double momentum = 0.1;
  };
  // A buffer the forward adds a constant to in place each call
  // (BatchNorm's num_batches_tracked).
  struct BufferCount {
    std::string name;
    double add = 1;
  };
  // Per forward call in training: each BatchNorm's batch mean and unbiased
  // variance, [K, C] each.
  struct Stats {
    std::vector<at::Tensor> mean, var;
  };

  // Reads `module`'s forward in training mode. `names` are the model's
  // parameter names in core::Model order (flat: '.' -> '_'). Unsupported for
  // the first op or setting the program cannot run.
  static Program translate(const torch::jit::Module& module, const std::vector<std::string>& names);

  // params as core::Model::forward_clients ([K, ...] in `names` order), x
  // [K, B, ...]; returns [K, B, classes]. mask [K, B] (or undefined: all
  // real) marks the real samples BatchNorm's statistics cover; stats, when
  // not null, receives each BatchNorm's batch statistics.
  at::Tensor forward(const std::vector<at::Tensor>& params, const at::Tensor& x, const at::Tensor& mask,
                     Stats* stats) const;

  const std::vector<BatchNormSlot>& batch_norms() const { return batch_norms_; }
  const std::vector<BufferCount>& counts() const { return counts_; }
  size_t size() const { return steps_.size(); }

 private:
  struct Step {
    ScriptOp op;
    std::vector<int> in;     // value ids read (0: the model's input)
    int out = 0;             // the value id written
    std::vector<int> param;  // per op.tensors: parameter index, -1 for none
    int bn = -1;             // BatchNorm slot
  };
  std::vector<Step> steps_;
  std::vector<BatchNormSlot> batch_norms_;
  std::vector<BufferCount> counts_;
  int values_ = 1;
  int output_ = 0;
};

// K clients of a TorchScript model (core::scripted_module) in one pass:
// forward_clients runs the program; loss_backward_clients is core::Model's
// (autograd through forward_clients) with BatchNorm's statistics over each
// client's real samples only (a padded sample has loss weight 0) and logged
// per step, so that fold_running_stats can give the model's buffers exactly
// what training the same clients one at a time would have given them.
class ScriptedClients final : public core::Model {
 public:
  // Unsupported when the model's graph does not translate; ConfigError when
  // `model` is no TorchScript model.
  explicit ScriptedClients(std::shared_ptr<core::Model> model);

  at::Tensor forward(const at::Tensor& x) override { return model_->forward(x); }
  bool can_forward_clients() const override { return true; }
  at::Tensor forward_clients(const std::vector<at::Tensor>& params, const at::Tensor& x) override;
  at::Tensor loss_backward_clients(const std::vector<at::Tensor>& params, const at::Tensor& x, const at::Tensor& y,
                                   const at::Tensor& w, std::vector<at::Tensor>& grads, double alpha = 1.0,
                                   double beta = 0.0) override;

  // Whether training changes the model's buffers (BatchNorm).
  bool has_buffers() const { return !program_.batch_norms().empty() || !program_.counts().empty(); }
  // Forgets the statistics logged so far (call before a batched train()).
  void clear_stats() { log_.clear(); }
  // Updates the model's buffers as LocalTrainer's steps would have, training
  // the clients one after another in `order`: client order[i] sat at stack
  // position position[i] and took steps[i] steps (its rows of the first
  // steps[i] logged steps). Then clears the log.
  void fold_running_stats(const std::vector<int64_t>& position, const std::vector<int64_t>& steps);

  const Program& program() const { return program_; }

 private:
  std::shared_ptr<core::Model> model_;
  Program program_;
  at::Tensor mask_;                  // set during loss_backward_clients
  std::vector<Program::Stats> log_;  // one per training step
};

// Whether `model` is a TorchScript model whose graph translates into a
// Program. When it is one that does not, logs once per model file (info) that
// it trains one client at a time and the first op that is not supported.
bool translates(const core::Model& model);

// Whether the batched path for TorchScript models is switched on: only when
// the environment has SPARROW_BATCHED_TORCHSCRIPT=1 (read once). Off by
// default while it is experimental: it is not faster than one client at a
// time yet (convolutions still run per client) and one test model (Linear,
// LayerNorm, GELU, Sigmoid) diverges on it where LocalTrainer does not
// (docs/data-and-models.md).
bool enabled();

}  // namespace sparrow::batched
