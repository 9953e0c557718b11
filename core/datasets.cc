#include "core/datasets.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/rng.h"

namespace sparrow::core {
namespace {

// Sub-stream tags of one synthetic client; each quantity draws from its own
// stream so changing one size (e.g. the sample count) leaves the others alone.
enum SyntheticStream : uint64_t { kModelMean, kFeatureMean, kWeights, kBias, kCenter, kCount, kFeatures };

at::Tensor to_tensor(const std::vector<double>& v, at::IntArrayRef shape) {
  return at::from_blob(const_cast<double*>(v.data()), shape, at::TensorOptions().dtype(at::kDouble)).clone();
}

}  // namespace

Dataset select(const Dataset& d, const std::vector<int64_t>& indices) {
  const int64_t n = d.size();
  for (int64_t i : indices)
    SPARROW_CHECK_T(ConfigError, i >= 0 && i < n, "select: index " << i << " outside a dataset of " << n << " samples");
  at::Tensor idx = at::tensor(indices, at::TensorOptions().dtype(at::kLong));
  return Dataset{d.x.index_select(0, idx).contiguous(), d.y.index_select(0, idx).contiguous()};
}

Dataset load_fashion_mnist(const std::string& dir, const std::string& split) {
  ImageSplit s = load_mnist_format(dir, split);
  return Dataset{s.images, s.labels};
}

FederatedData make_synthetic(double alpha, double beta, int clients, uint64_t seed, const SyntheticOptions& o) {
  SPARROW_CHECK_T(ConfigError, clients >= 1, "synthetic: clients must be >= 1, got " << clients);
  SPARROW_CHECK_T(ConfigError, std::isfinite(alpha) && alpha >= 0 && std::isfinite(beta) && beta >= 0,
                  "synthetic: alpha and beta must be finite and >= 0, got " << alpha << ", " << beta);
  SPARROW_CHECK_T(ConfigError, o.dim >= 1 && o.classes >= 2, "synthetic: need dim >= 1 and classes >= 2");
  SPARROW_CHECK_T(ConfigError, o.min_samples >= 2 && o.max_samples >= o.min_samples,
                  "synthetic: need 2 <= min_samples <= max_samples, got " << o.min_samples << ", " << o.max_samples);
  SPARROW_CHECK_T(ConfigError, o.train_fraction > 0 && o.train_fraction < 1,
                  "synthetic: train_fraction must be in (0, 1), got " << o.train_fraction);
  SPARROW_CHECK_T(ConfigError, std::isfinite(o.log_mean) && std::isfinite(o.log_std) && o.log_std >= 0,
                  "synthetic: bad lognormal parameters " << o.log_mean << ", " << o.log_std);

  const int64_t dim = o.dim, classes = o.classes;
  std::vector<double> stddev(dim);
  for (int64_t j = 0; j < dim; ++j) stddev[j] = std::sqrt(std::pow(static_cast<double>(j + 1), -1.2));

  const uint64_t base = rng::derive(seed, rng::hash_name("synthetic"));
  FederatedData out;
  out.train.reserve(clients);
  out.test.reserve(clients);
  for (int k = 0; k < clients; ++k) {
    const uint64_t key = rng::derive(base, static_cast<uint64_t>(k));
    auto stream = [key](SyntheticStream s) { return rng::derive(key, s); };
    const double u = alpha * rng::normal(stream(kModelMean), 0);
    const double b_mean = beta * rng::normal(stream(kFeatureMean), 0);

    std::vector<double> w(classes * dim), b(classes), v(dim);
    for (int64_t i = 0; i < classes * dim; ++i) w[i] = u + rng::normal(stream(kWeights), i);
    for (int64_t i = 0; i < classes; ++i) b[i] = u + rng::normal(stream(kBias), i);
    for (int64_t i = 0; i < dim; ++i) v[i] = b_mean + rng::normal(stream(kCenter), i);

    // Clamp in double before converting: exp() of a large draw is inf.
    const double raw = std::floor(std::exp(o.log_mean + o.log_std * rng::normal(stream(kCount), 0)));
    const int64_t n = raw >= static_cast<double>(o.max_samples - o.min_samples)
                          ? o.max_samples
                          : static_cast<int64_t>(raw) + o.min_samples;

    std::vector<double> x(n * dim);
    const uint64_t xkey = stream(kFeatures);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < dim; ++j)
        x[i * dim + j] = v[j] + stddev[j] * rng::normal(xkey, static_cast<uint64_t>(i * dim + j));

    at::Tensor xt = to_tensor(x, {n, dim});
    at::Tensor logits = at::matmul(xt, to_tensor(w, {classes, dim}).t()) + to_tensor(b, {classes});
    at::Tensor y = logits.argmax(1);  // argmax of softmax == argmax of logits
    at::Tensor xf = xt.to(at::kFloat);

    const int64_t n_train = std::clamp<int64_t>(std::llround(o.train_fraction * static_cast<double>(n)), 1, n - 1);
    out.train.push_back(Dataset{xf.slice(0, 0, n_train).contiguous(), y.slice(0, 0, n_train).contiguous()});
    out.test.push_back(Dataset{xf.slice(0, n_train).contiguous(), y.slice(0, n_train).contiguous()});
  }
  return out;
}

}  // namespace sparrow::core
