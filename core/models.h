#pragma once
// The model zoo. Every model is a torch::nn::Module with a forward(x) that maps
// a batch of inputs to logits; parameters are registered under stable names
// ("fc1.weight", ...) which is what updates and compressor state are keyed by.

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace sparrow {
class Spec;
}
namespace torch::jit {
struct Module;
}

namespace sparrow::core {

// One stage of a model that can be cut (split learning, edge/split.h): a named
// step of forward() and the names (as in named_parameters()) of the parameters
// it uses.
struct ModelStage {
  std::string name;
  std::vector<std::string> params;
};

class Model : public torch::nn::Module {
 public:
  virtual at::Tensor forward(const at::Tensor& x) = 0;

  // Split hook. A model that can be cut lists its stages in order; then
  // forward(x) == forward_stages(forward_stages(x, 0, k), k, n) for every k, and
  // every parameter belongs to at most one stage. The default (empty list, and
  // forward_stages throwing ConfigError) means "cannot be cut".
  virtual std::vector<ModelStage> stages() const { return {}; }
  // Runs stages [begin, end) on x (the output of stage begin - 1, or the model's
  // input when begin == 0). ConfigError for a bad range or an uncuttable model.
  virtual at::Tensor forward_stages(const at::Tensor& x, size_t begin, size_t end);

  // Batched clients (client/batched_trainer.h): K independent copies of the
  // model evaluated in one pass. A model that can do it returns true here and
  // implements forward_clients; the default cannot (TorchScript models, models
  // with buffers such as BatchNorm's running statistics).
  virtual bool can_forward_clients() const { return false; }
  // params: the model's parameters in named_parameters() order, each stacked
  // along a new leading client dimension ([K, ...shape]); x: [K, B, ...] (the
  // input shapes forward() accepts, per client). Returns [K, B, classes], row k
  // equal to forward() of a model holding params[.][k] on x[k] (up to float
  // rounding). Differentiable in params. ConfigError when not supported.
  virtual at::Tensor forward_clients(const std::vector<at::Tensor>& params, const at::Tensor& x);

  // One training step's loss and gradients for K stacked clients: the
  // softmax cross-entropy of forward_clients and its backward. params and x
  // as forward_clients; y [K * B] class labels (int64, client-major); w
  // [K * B] per-sample loss weights. Returns the per-client loss [K]
  // (sum over the client's rows of w * CE) and accumulates the gradient G_i of
  // that loss with respect to params[i] into grads[i] (same shape, contiguous):
  // grads[i] = beta * grads[i] + alpha * G_i (beta = 0 overwrites whatever it
  // held). grads[i] may be params[i] itself: every read of params[i] comes
  // before the write, so alpha = -lr, beta = 1 is a plain SGD step fused into
  // the backward (the weight-gradient GEMM writes the weights). The default
  // runs autograd through forward_clients; "mlp" and "cnn" (on the CPU) have a
  // hand-written backward instead, with no graph and no per-step gradient
  // allocation, equal to autograd up to float rounding
  // (tests/core/models_test.cc).
  virtual at::Tensor loss_backward_clients(const std::vector<at::Tensor>& params, const at::Tensor& x,
                                           const at::Tensor& y, const at::Tensor& w, std::vector<at::Tensor>& grads,
                                           double alpha = 1.0, double beta = 0.0);

  // The batch size evaluation (client::LocalTrainer::evaluate) runs this
  // model at on `device` unless its caller chooses one. 64 by default:
  // LibTorch 1.13's oneDNN convolutions evaluate the CNN's 10,000 test images
  // in 3.2 s at batch 64 and 21 s at batch 1000 on one core (a cliff between
  // 64 and 96; docs/performance.md). "cnn" on the CPU runs its own kernels,
  // which have no such cliff, and takes 256.
  virtual int64_t eval_batch(const at::Device& device) const;
};

// Building blocks for loss_backward_clients.
// Softmax cross-entropy on feature-major logits z [K, C, B] with labels y and
// weights w ([K * B], client-major): returns the per-client loss [K]
// (sum over the client's samples of w * CE) and replaces z by the gradient of
// that loss with respect to z.
at::Tensor softmax_xent_backward_clients(at::Tensor& z, const at::Tensor& y, const at::Tensor& w);
// Backward of linear_clients for the weights: with the incoming gradient dz
// [K, out, B] and the layer input h [K, in, B] given as its batch-major
// transpose ht [K, B, in], gw = beta gw + alpha dz ht and gb = beta gb + alpha
// sum_B dz. (The input gradient, weight^T dz, is the caller's, before gw is
// written when gw is the weight itself.)
void linear_clients_backward(const at::Tensor& dz, const at::Tensor& ht, at::Tensor& gw, at::Tensor& gb, double alpha,
                             double beta);

// Building block for forward_clients: K stacked Linear layers, feature-major:
// h [K, in, B], weight [K, out, in], bias [K, out] -> [K, out, B] (one batched
// GEMM W h + b, bias fused). Feature-major because then the weight is the
// GEMM's untransposed left operand and its gradient (g h^T) comes out
// contiguous in the parameter's own layout; the batch-major form
// x W^T leaves every weight gradient transposed, which costs a copy per
// layer and step (batched MLP step 4.5 ms vs 3.0 ms, K = 10, B = 32).
at::Tensor linear_clients(const at::Tensor& h, const at::Tensor& weight, const at::Tensor& bias);

// What a model factory gets besides its spec's keys.
struct ModelArgs {
  // LibTorch's global generator is seeded with it (torch::manual_seed) just
  // before the factory runs, under make_model's lock.
  uint64_t seed = 0;
  // The run's data, for models whose size follows it (the simulator's
  // "logreg"): features per sample (0: unknown) and classes.
  int64_t input_dim = 0;
  int64_t classes = 10;
};

// Builds a model from its spec ("resnet:in_channels=3" -> spec.method()
// "resnet"): reads the keys it knows (make_model rejects keys left unread) and
// throws ConfigError for a bad value. Runs under make_model's lock with the
// generator seeded, so initialisation is deterministic per seed.
using ModelFactory = std::function<std::shared_ptr<Model>(Spec& spec, const ModelArgs& args)>;
// The per-sample input shape a model is made for (without the batch
// dimension), from its spec's keys; model_input_shape uses it.
using ModelShapeFn = std::function<std::vector<int64_t>(Spec& spec)>;

// Registers `name` (model = "name:key=value" in configs), with an optional
// input shape (empty: unknown, as for TorchScript models). sparrow::Error when
// the name is taken (the built-ins are registered first) or is "torchscript".
// Thread-safe; register before the model is first made.
void register_model(const std::string& name, ModelFactory make, const std::string& description,
                    ModelShapeFn input_shape = {});
// Registers the built-in models (mlp, cnn, resnet). Idempotent and
// thread-safe; every lookup calls it.
void register_builtin_models();

// The TorchScript module behind a "torchscript:FILE" model (its parameters
// and buffers are the model's own tensors) and that FILE; null and "" for any
// other model. For batched clients (batched/program.h), which read the
// module's graph.
const torch::jit::Module* scripted_module(const Model& model);
std::string scripted_path(const Model& model);

// Builds a model from its name: a registered model (the built-ins below, or
// one added with register_model) or "torchscript:FILE". Registered models are
// initialised deterministically from `seed` (LibTorch's default initialisers
// under torch::manual_seed(seed); calls are serialised by a lock so concurrent
// make_model calls cannot interleave their draws, but other code drawing from
// LibTorch's global generator at the same time would):
//   "mlp"     784-200-200-10 with ReLU (McMahan et al. 2017's 2NN); 199,210 parameters.
//   "cnn"     the FedAvg CNN for 1x28x28 (McMahan et al. 2017; FedML's CNN_DropOut
//             without dropout): conv5x5(32, pad 2) - ReLU - maxpool2 - conv5x5(64,
//             pad 2) - ReLU - maxpool2 - fc 3136->512 - ReLU - fc 10; 1,663,370 parameters.
//   "resnet[:in_channels=1|3]"
//             ResNet-8: conv3x3(16)-BN-ReLU, three stages of one basic block each
//             (16, 32, 64 channels; stride 1, 2, 2; 1x1 conv + BN shortcut when
//             the shape changes), global average pooling, fc 10. Any spatial size
//             works; the canonical inputs are 1x28x28 and 3x32x32. BatchNorm
//             running statistics are buffers, not parameters: they are not part of
//             named_parameters() and so stay local unless the caller syncs them.
//   "torchscript:FILE"
//             a TorchScript module saved with torch.jit.save / Module::save; its
//             forward(x) must return a tensor. `seed` is unused (weights come from
//             the file). Parameters and buffers are registered on the Model with the
//             very same tensors (storage shared with the scripted module, so
//             updates to one are the other's), under the scripted names with '.'
//             replaced by '_' ("fc.weight" -> "fc_weight") because
//             torch::nn::Module::register_parameter rejects '.'. Names that collide
//             after the mapping are a ConfigError. train()/eval() propagate to the
//             scripted module.
// "mlp", "cnn" and 1-channel "resnet" also accept flattened [N, 784] input.
// Stages (Model::stages()): "mlp" fc1, fc2, fc3 (each Linear + ReLU, fc3 without);
// "cnn" conv1, conv2 (conv + ReLU + maxpool each), fc1 (flatten + Linear + ReLU),
// fc2; "resnet" stem (conv1 + bn1 + ReLU), layer1, layer2, layer3, head (pool +
// fc); "torchscript:FILE" one stage per direct child module of the scripted
// module, in registration order, applied one after another. That matches forward
// only when forward is exactly that composition (e.g. an nn.Sequential);
// edge::check_stages() tests it on a sample input.
// ConfigError for an unknown name (the message lists the known ones) or key,
// or a missing or unreadable TorchScript file (the message names the path).
std::shared_ptr<Model> make_model(const std::string& name, uint64_t seed);
// The same with the run's data shape for models that need it (ModelArgs).
std::shared_ptr<Model> make_model(const std::string& name, const ModelArgs& args);

// The registered model names, sorted (built-ins included; not "torchscript:FILE").
std::vector<std::string> model_names();
// Whether `name` (a method, without keys) is a registered model.
bool known_model(const std::string& name);
// The one-line description `name` was registered with; ConfigError if unknown.
std::string model_description(const std::string& name);

// The per-sample input shape (without the batch dimension) a registered model
// is made for, e.g. {1, 28, 28}; {3, 32, 32} for "resnet:in_channels=3".
// ConfigError for an unknown name, for TorchScript models and for registered
// models without a known shape.
std::vector<int64_t> model_input_shape(const std::string& name);

}  // namespace sparrow::core
