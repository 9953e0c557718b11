#pragma once
// Server optimisers: how the aggregator turns the mean client update into a
// step of the global model. Sign convention: a client's update is its weights
// after local training minus the global weights it started from,
// Δ_i = x_i − x, and the pseudo-gradient is their weighted mean Δ_t (what
// StreamingAggregator::mean() returns). Every optimiser applies x ← x + step,
// so fedavg with lr = 1 makes x the clients' weighted average.
//
// Specs (core/spec.h; unknown keys are a ConfigError):
//   fedavg[:lr=1]                                       x += lr·Δ
//   fedavgm[:lr=1,momentum=0.9]                         m = momentum·m + Δ;  x += lr·m   (Hsu et al., 2019)
//   fedadam[:lr=0.01,beta1=0.9,beta2=0.99,tau=1e-3]     Reddi et al., "Adaptive Federated
//   fedyogi[:lr=0.01,beta1=0.9,beta2=0.99,tau=1e-3]     Optimization" (ICLR 2021), Algorithm 2:
//   fedadagrad[:lr=0.01,tau=1e-3,beta1=0]
//     m_t = β1·m_{t−1} + (1 − β1)·Δ_t                    (m_{−1} = 0)
//     adagrad: v_t = v_{t−1} + Δ_t²
//     yogi:    v_t = v_{t−1} − (1 − β2)·Δ_t²·sign(v_{t−1} − Δ_t²)
//     adam:    v_t = β2·v_{t−1} + (1 − β2)·Δ_t²
//     x_{t+1} = x_t + η·m_t / (√v_t + τ)                 (v_{−1} = τ², the paper's bound v_{−1} ≥ τ²)
//   The paper's Algorithm 2 has β1 for FedAdagrad too; our default there is 0
//   (plain Adagrad, as Flower's FedAdagrad), settable with beta1=.
// No bias correction (the paper has none). Arithmetic is float32, element-wise.
//   fedtopk:ratio=R[,lr=1,momentum=0,values=fp32|sign,scope=tensor|model]   sparse server step with server-side error
//     feedback, as FetchSGD (Rothchild et al., ICML 2020) applies it to the aggregate:
//     m = momentum·m + Δ;  e += lr·m;  S = top-k(|e|), k = ceil(R·n) per tensor;
//     x[S] += e[S];  e[S] = 0;  m[S] = 0 (when momentum > 0).
//   values=sign: ternary, x[S] += ±mu with mu = mean |e[S]| per tensor, its
//     mantissa rounded to 8 bits (exact zeros of e[S] not sent), e[S] −= ±mu:
//     the step that stc encodes without loss (x ± mu is exact for |x| <= 2^16·mu),
//     so a downlink stc at a ratio >= each tensor's share keeps the broadcast at
//     the model bit for bit.
//   scope=model: one k = ceil(R·N) over all N parameters instead of per tensor.
//   With the exact (dense) aggregate this is the upper bound of what a k-sparse
//   model step can reach (docs/results.md); with a sparse downlink it is what the
//   clients would receive.
//   fedlowrank:rank=R[,lr=1,momentum=0]   rank-R server step with server-side error
//     feedback: PowerSGD (Vogels et al., NeurIPS 2019) on one worker, warm-started,
//     applied to the exact aggregate. m = momentum·m + Δ;  e += lr·m;  per tensor
//     that PowerSGD/ACP compress at rank R (compression/lowrank.h), M = e as rows ×
//     cols: P = orth(M·Q);  Q = Mᵀ·P;  x += P·Qᵀ;  e −= P·Qᵀ (Q kept for the next
//     step, starting from ACP's seeded factor); any other tensor: x += e;  e = 0.
//     The upper bound of what a rank-R model step can reach (docs/results.md).
//
// Each method is registered under its name (the registry of core/registry.h);
// the built-ins above register through aggregation::register_builtins(), and a
// program or a test adds its own with register_server_optimizer() without
// editing the library (docs/aggregation.md, "Adding a server optimiser").
//
// State (the method's slots per tensor, e.g. m and v, and the step count) is
// created on the first step() from the shapes of `weights` and is
// serialisable for checkpoints.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace sparrow {
class Spec;
}

namespace sparrow::aggregation {

// One tensor's optimiser state: slot name ("m", "v", ...) -> tensor. A slot is
// undefined (absent) until the method first writes it.
using Slots = std::map<std::string, at::Tensor>;

// One server optimiser method, built from its spec by its registered factory.
// Immutable and stateless: what it keeps between rounds lives in the
// ServerOptimizer's Slots, which serialise with it, so checkpoints and resumes
// work for every registered method alike.
class OptimizerMethod {
 public:
  virtual ~OptimizerMethod() = default;
  // The slots it keeps with each weight's shape, all created by the first
  // step() for every tensor ({"m"} for fedavgm, {"m", "v"} for fedadam). The
  // ServerOptimizer checks that every later step's tensors match them.
  virtual std::vector<std::string> moments() const { return {}; }
  // Any other slots (fedlowrank's factor "q"); restored ones are checked by check_slots.
  virtual std::vector<std::string> extra_slots() const { return {}; }
  // step() writes through flat views of w, so weights must be contiguous.
  virtual bool needs_contiguous() const { return false; }
  // w += this method's step for the mean update d of tensor `name` (both
  // float32 on the CPU, equal shapes, d contiguous and finite). Runs after every
  // tensor was checked, so it must not throw.
  virtual void step(const std::string& name, at::Tensor& w, const at::Tensor& d, Slots& slots) const = 0;
  // A restored tensor's slots, its moments already checked to cover it with one
  // shape: FormatError when an extra slot does not fit.
  virtual void check_slots(const std::string& /*name*/, const Slots& /*slots*/) const {}
  // The whole model's step at once: weights and delta already checked as for
  // step() (same names and shapes, float32 CPU, finite), `state` each tensor's
  // slots. The default calls step() tensor by tensor in name order. A method
  // that needs every tensor in one call (a Python function) overrides it; it
  // may throw, and must then leave weights and state as they were. It must
  // leave moments() defined for every tensor, with the weight's shape.
  virtual void step_model(std::map<std::string, at::Tensor>& weights, const std::map<std::string, at::Tensor>& delta,
                          std::map<std::string, Slots>& state) const;
};

// Builds a method from its spec: reads the keys it knows (the ServerOptimizer
// rejects keys left unread) and throws ConfigError for a bad value.
using OptimizerFactory = std::function<std::shared_ptr<const OptimizerMethod>(Spec& spec)>;

// Registers `name` (server_optimizer = "name:key=value"). sparrow::Error when
// the name is taken (the built-ins are registered first). Thread-safe.
void register_server_optimizer(const std::string& name, OptimizerFactory factory, const std::string& description);
// Registered server optimiser names, sorted (built-ins included).
std::vector<std::string> server_optimizer_names();
// Whether `name` (a method, without keys) is a registered server optimiser.
bool known_server_optimizer(const std::string& name);
// The one-line description `name` was registered with; ConfigError if unknown.
std::string server_optimizer_description(const std::string& name);
// Registers the built-in aggregators and server optimisers (also declared in
// aggregation/rules.h). Idempotent; every lookup calls it.
void register_builtins();

class ServerOptimizer {
 public:
  // Throws ConfigError on an unknown method (listing the known ones), an
  // unknown key or an out-of-range value (lr > 0; momentum, beta1, beta2 in
  // [0, 1); tau > 0).
  explicit ServerOptimizer(const std::string& spec);

  const std::string& method() const { return method_; }
  const std::string& spec() const { return spec_; }
  // step() calls so far.
  uint64_t steps() const { return steps_; }

  // weights[name] += step(delta[name]) for every tensor; delta must have exactly
  // the keys of weights with equal shapes (float32, CPU) and finite values,
  // else sparrow::Error and nothing changes. The state's tensor set is fixed by
  // the first step; a later step with other names or shapes is an Error.
  void step(std::map<std::string, at::Tensor>& weights, const std::map<std::string, at::Tensor>& delta);

  // Self-describing bytes: magic "SPSO", version, the method, then a
  // compression::State (step count; one "<slot>/<name>" tensor per slot, e.g.
  // "m/fc.weight").
  std::string serialize_state() const;
  // Replaces the state. Throws FormatError on malformed bytes, a slot the
  // method does not keep, or a state saved by a different method.
  void deserialize_state(const std::string& bytes);
  // Forgets the slots and the step count.
  void reset_state();

  // The optimiser's m / v of a tensor (undefined before the first step or for
  // methods without it), for tests and diagnostics.
  at::Tensor first_moment(const std::string& name) const;
  at::Tensor second_moment(const std::string& name) const;

 private:
  at::Tensor slot(const std::string& name, const std::string& slot) const;
  std::shared_ptr<const OptimizerMethod> impl_;  // never null
  std::string method_;
  std::string spec_;
  uint64_t steps_ = 0;
  std::map<std::string, Slots> state_;  // tensor name -> its slots
};

}  // namespace sparrow::aggregation
