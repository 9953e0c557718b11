#pragma once
// The server-side terms of FedNova and FedDyn, written once for sparrow-server
// and sparrow-sim (docs/algorithms.md). The client side of both is
// client::LocalTrainer's; what is here is what a driver does with a client's
// update before it is folded, the parts of the global step that differ from
// FedAvg (GlobalModel::step calls them), and the checks of their keys.
//
// FedNova (Wang et al., NeurIPS 2020). Client i runs tau_i local SGD steps;
// with momentum rho its normaliser is a_i = (tau_i - rho (1 - rho^tau_i) /
// (1 - rho)) / (1 - rho) (a_i = tau_i without momentum). The global update is
//   tau_eff * Σ p_i Δ_i / a_i,   p_i = n_i / N,   tau_eff = Σ p_i a_i.
// tau_i is not sent: the server derives it from what it already knows exactly,
// the update's num_samples (the samples the client trained on), and its own
// local_epochs, batch_size and momentum, which every task carries and every
// client trains with: tau_i = local_epochs * ceil(n_i / min(batch_size, n_i)).
// So the wire is unchanged and a client cannot claim a different tau.
// Each update is folded with weight n_i / a_i (the normalisation, applied to
// the decoded update, so any linear codec works), plus three scalars summed
// beside it; the step scales the round's weighted mean by
//   s = (Σ n_i a_i) (Σ n_i / a_i) / N^2,
// which turns it into the formula above (s = 1 when all a_i are equal: FedAvg).
//
// FedDyn (Acar et al., ICLR 2021). Client i keeps h_i (its state, in the state
// store where SCAFFOLD keeps c_i; zero for a new client) and trains on
// g - h_i + alpha (w - w_global); then h_i <- h_i - alpha Δ_i. The server keeps
// h (GlobalModel::control(), checkpointed as SCAFFOLD's c is):
//   h <- h - alpha (k / m) Δ̄,   W <- W + Δ̄ - h / alpha,
// with Δ̄ the round's aggregate of its k updates (sample-weighted: the plain
// mean of the paper for clients of equal size) and m the population. alpha
// reaches clients as the task's proximal weight (TrainConfig::mu), which is
// what alpha is in FedDyn's objective.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "federation/ordered_fold.h"
#include "federation/run_config.h"

namespace sparrow::federation {

// tau_i: the local steps of a client with n samples (LocalTrainer's count).
int64_t fednova_steps(int64_t n, int local_epochs, int batch_size);
// a_i for tau local steps with heavy-ball momentum rho in [0, 1).
double fednova_norm(int64_t tau, double momentum);

// What a driver does to a client's update before it is folded: FedNova's
// weight n / a_i and its three summed scalars (control_delta entries whose
// names no model parameter has); FedAvg's weight n otherwise.
void fold_terms(const RunConfig& c, uint64_t num_samples, Arrival& a);

// FedNova's scale of the round's weighted mean, from the fold's control sums
// (1 when they hold none of FedNova's scalars). sparrow::Error when they are
// not positive.
double fednova_scale(const std::map<std::string, at::Tensor>& control_sum);
// The control_sum entries of FedNova (removed by GlobalModel::step before the
// rest is read as SCAFFOLD's).
bool is_fednova_key(const std::string& name);

// FedDyn's server step, in place: h <- h - alpha (count / population) delta,
// then delta <- delta - h / alpha (h zeros when empty).
void feddyn_step(std::map<std::string, at::Tensor>& h, std::map<std::string, at::Tensor>& delta, double alpha,
                 int64_t count, double population);

// The proximal weight a task carries: mu for fedprox, feddyn_alpha for feddyn, 0
// otherwise (both programs send or train with this).
double proximal_weight(const RunConfig& c);
// Whether the algorithm keeps a per-client tensor state (SCAFFOLD's c_i,
// FedDyn's h_i) in the state store.
bool has_client_state(const std::string& algorithm);

// The combinations fednova and feddyn cannot honour, as (key, why): async
// mode, SecAgg+, a robust aggregator or central DP with fednova,
// feddyn_alpha outside (0, 100] with feddyn or set without it.
std::vector<std::pair<std::string, std::string>> check_algorithm(const RunConfig& c);

}  // namespace sparrow::federation
