#pragma once
// Datasets as plain tensors: x is float32 [N, ...], y is int64 [N]. Federated data
// is one Dataset per client. Everything random here is counter-based (core/rng.h),
// so a dataset is a pure function of its seed.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/idx.h"

namespace sparrow::core {

struct Dataset {
  at::Tensor x;  // float32 [N, ...]
  at::Tensor y;  // int64 [N]
  int64_t size() const { return y.defined() ? y.size(0) : 0; }
};

// Rows `indices` of `d` (e.g. one client's share from core/partition.h), as new
// contiguous tensors. Throws ConfigError for an index outside [0, d.size()).
Dataset select(const Dataset& d, const std::vector<int64_t>& indices);

// Fashion-MNIST (or any MNIST-format folder) split "train" or "test": x is
// [N, 1, 28, 28] normalised with the training set's mean/std, y in [0, 10).
// Thin wrapper over load_mnist_format; ConfigError for a missing folder or split.
Dataset load_fashion_mnist(const std::string& dir = kFashionMnistDir, const std::string& split = "train");

struct FederatedData {
  std::vector<Dataset> train;  // one per client
  std::vector<Dataset> test;   // one per client, same order
};

// Knobs of the Synthetic(alpha, beta) generator; the defaults are the FedProx setup.
struct SyntheticOptions {
  int64_t dim = 60;
  int64_t classes = 10;
  // Per-client sample count: floor(exp(N(log_mean, log_std))) + min_samples, at
  // most max_samples (FedProx uses lognormal(4, 2) + 50 without a cap; the cap
  // keeps the heavy tail from producing a single client with 10^5 samples).
  double log_mean = 4.0;
  double log_std = 2.0;
  int64_t min_samples = 50;
  int64_t max_samples = 1000;
  // The first round(train_fraction * n) samples of a client train, the rest test.
  double train_fraction = 0.8;
};

// LEAF / FedProx Synthetic(alpha, beta) (Li et al., "Federated Optimization in
// Heterogeneous Networks", MLSys 2020; generate_synthetic.py). Per client k:
//   u_k ~ N(0, alpha^2), W_k ~ N(u_k, 1) [classes x dim], b_k ~ N(u_k, 1) [classes]
//   B_k ~ N(0, beta^2),  v_k ~ N(B_k, 1) [dim]
//   x ~ N(v_k, Sigma), Sigma diagonal with Sigma_jj = j^-1.2 (j = 1..dim)
//   y = argmax softmax(W_k x + b_k)
// alpha and beta are standard deviations, as in the reference code (np.random.normal's
// scale). alpha controls how much the client models differ, beta how much the
// client feature distributions differ: Synthetic(0, 0) is the most homogeneous,
// Synthetic(1, 1) strongly heterogeneous. Client k's data depend only on (seed,
// k), so adding clients does not change the existing ones. ConfigError for
// clients < 1, negative alpha/beta or bad options.
FederatedData make_synthetic(double alpha, double beta, int clients, uint64_t seed,
                             const SyntheticOptions& options = {});

}  // namespace sparrow::core
