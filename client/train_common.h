#pragma once
// Internal to sparrow_client: the checks and bookkeeping that LocalTrainer and
// BatchedTrainer share, so both treat inputs and results identically.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "client/trainer.h"

namespace sparrow::client::detail {

// Fisher-Yates permutation of [0, n) from rng::Stream(rng::derive(seed, epoch)).
void fill_order(std::vector<int64_t>& order, int64_t n, uint64_t seed, int epoch);

std::string shape_str(at::IntArrayRef s);

// `w` must hold exactly `names` with the shapes of `params`; `allow_empty`
// lets an empty map stand for all zeros (SCAFFOLD controls).
void check_weights(const Weights& w, const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                   const char* what, bool allow_empty);

// Checks (x, y) as train() documents and returns them on `like`'s device,
// x in its dtype and y as int64.
std::pair<at::Tensor, at::Tensor> prepare_data(const at::Tensor& x, const at::Tensor& y, const at::Tensor& like);

// SCAFFOLD option II from a finished update (Karimireddy et al. 2020):
// c_i+ = c_i - c + (w_global - w_local) / (K lr); sets r.control_delta and
// replaces *client_control with c_i+.
void finish_scaffold(TrainResult& r, const std::vector<std::string>& names, double lr, Weights* client_control,
                     const Weights* server_control);

// FedDyn's state update from a finished update (Acar et al. 2021):
// *client_control (h_i; empty = zeros) becomes h_i - alpha * r.delta.
void finish_feddyn(const TrainResult& r, const std::vector<std::string>& names, double alpha, Weights* client_control);

// The mean loss over a client's steps from its per-step losses (one per
// step, minibatch means): the sample-weighted mean train() reports. Throws
// Error naming the first non-finite step.
double mean_step_loss(const double* losses, int64_t steps, int64_t n, int64_t batch, int epochs, double lr);

// One step of torch::optim::SGD (weight decay, then heavy-ball momentum with
// dampening 0, no Nesterov) on the algorithm's gradient, in place on p; g is
// modified. anchor (FedProx: g += mu (p - anchor)) and correction (SCAFFOLD:
// g += c - c_i) are applied when given; they may broadcast against p.
// momentum_buf: null without momentum; first_step copies g into it.
void sgd_update(at::Tensor& p, at::Tensor& g, const TrainConfig& cfg, const at::Tensor* anchor,
                const at::Tensor* correction, at::Tensor* momentum_buf, bool first_step);

// The algorithm's terms of torch::optim::SGD's gradient, in place on g (the
// first part of sgd_update): FedProx's mu (p - anchor), SCAFFOLD's
// correction and weight decay, each when given or non-zero.
void add_gradient_terms(at::Tensor& g, const at::Tensor& p, const TrainConfig& cfg, const at::Tensor* anchor,
                        const at::Tensor* correction);

}  // namespace sparrow::client::detail
