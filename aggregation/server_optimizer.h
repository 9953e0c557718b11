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
//   fedtopk:ratio=R[,lr=1,momentum=0]   sparse server step with server-side error
//     feedback, as FetchSGD (Rothchild et al., ICML 2020) applies it to the aggregate:
//     m = momentum·m + Δ;  e += lr·m;  S = top-k(|e|), k = ceil(R·n) per tensor;
//     x[S] += e[S];  e[S] = 0;  m[S] = 0 (when momentum > 0).
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
// State (m, v per tensor and the step count) is created on the first step()
// from the shapes of `weights` and is serialisable for checkpoints.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>

namespace sparrow::aggregation {

class ServerOptimizer {
 public:
  // Throws ConfigError on an unknown method, unknown key or out-of-range value
  // (lr > 0; momentum, beta1, beta2 in [0, 1); tau > 0).
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
  // compression::State (step count; "m/<name>", "v/<name>" slots).
  std::string serialize_state() const;
  // Replaces the state. Throws FormatError on malformed bytes or a state saved
  // by a different method.
  void deserialize_state(const std::string& bytes);
  // Forgets m, v and the step count.
  void reset_state();

  // The optimiser's m / v of a tensor (undefined before the first step or for
  // methods without it), for tests and diagnostics.
  at::Tensor first_moment(const std::string& name) const;
  at::Tensor second_moment(const std::string& name) const;

 private:
  enum class Kind { kFedAvg, kFedAvgM, kFedAdam, kFedYogi, kFedAdagrad, kFedTopK, kFedLowRank };
  // fedtopk / fedlowrank: m = momentum·m + d;  e += lr·m (both created as
  // zeros on the first step); returns e.
  at::Tensor& compensate(const std::string& name, const at::Tensor& w, const at::Tensor& d, float lr);
  Kind kind_;
  std::string method_;
  std::string spec_;
  double lr_ = 1.0;
  double momentum_ = 0.0;
  double beta1_ = 0.0;
  double beta2_ = 0.0;
  double tau_ = 0.0;
  double ratio_ = 0.0;
  int64_t rank_ = 0;
  uint64_t steps_ = 0;
  std::map<std::string, at::Tensor> m_;
  std::map<std::string, at::Tensor> v_;
  std::map<std::string, at::Tensor> q_;  // fedlowrank: the warm-start factor Q ({cols, r}) per compressed tensor
};

}  // namespace sparrow::aggregation
