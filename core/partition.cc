#include "core/partition.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"
#include "core/spec.h"

namespace sparrow::core {
namespace {

// Uniform in the open interval (0, 1) with 53 random bits (log() and pow() safe).
double uniform_open(uint64_t key, uint64_t i) {
  return (static_cast<double>(rng::at(key, i) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// Fisher–Yates with counter-based draws: a pure function of (v, key).
void shuffle(std::vector<int64_t>& v, uint64_t key) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng::below(key, i, i)]);
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// Cuts `order` into consecutive pieces of the given sizes (which sum to its length).
std::vector<std::vector<int64_t>> cut(const std::vector<int64_t>& order, const std::vector<int64_t>& sizes) {
  std::vector<std::vector<int64_t>> out(sizes.size());
  size_t pos = 0;
  for (size_t c = 0; c < sizes.size(); ++c) {
    out[c].assign(order.begin() + pos, order.begin() + pos + sizes[c]);
    pos += sizes[c];
  }
  return out;
}

std::vector<std::vector<int64_t>> sorted(std::vector<std::vector<int64_t>> parts) {
  for (auto& p : parts) std::sort(p.begin(), p.end());
  return parts;
}

double positive_alpha(Spec& s) {
  const double alpha = s.require_double("alpha");
  SPARROW_CHECK_T(ConfigError, alpha > 0, "partition '" << s.text() << "': alpha must be > 0, got " << alpha);
  return alpha;
}

std::vector<std::vector<int64_t>> split_iid(int64_t n, int clients, uint64_t key) {
  std::vector<int64_t> order = iota(n);
  shuffle(order, key);
  std::vector<int64_t> sizes(clients);
  for (int c = 0; c < clients; ++c) sizes[c] = n / clients + (c < n % clients ? 1 : 0);
  return cut(order, sizes);
}

std::vector<std::vector<int64_t>> split_dirichlet(const std::vector<int64_t>& y, int clients, double alpha,
                                                  int64_t min_size, const std::string& text, uint64_t key) {
  const int64_t n = static_cast<int64_t>(y.size());
  const int64_t classes = *std::max_element(y.begin(), y.end()) + 1;
  std::vector<std::vector<int64_t>> by_class(classes);
  for (int64_t i = 0; i < n; ++i) by_class[y[i]].push_back(i);
  const double fair_share = static_cast<double>(n) / clients;

  for (int attempt = 0; attempt < kDirichletTries; ++attempt) {
    const uint64_t tkey = rng::derive(key, static_cast<uint64_t>(attempt));
    std::vector<std::vector<int64_t>> parts(clients);
    for (int64_t k = 0; k < classes; ++k) {
      std::vector<int64_t> idx = by_class[k];
      if (idx.empty()) continue;
      shuffle(idx, rng::derive(tkey, 2 * k));
      std::vector<double> p = sample_dirichlet(alpha, clients, rng::derive(tkey, 2 * k + 1));
      // FedML's balancing: clients already at their fair share take no more.
      double sum = 0;
      for (int c = 0; c < clients; ++c) {
        if (static_cast<double>(parts[c].size()) >= fair_share) p[c] = 0;
        sum += p[c];
      }
      if (sum <= 0) {  // every draw landed on full clients: spread over the others
        for (int c = 0; c < clients; ++c) p[c] = static_cast<double>(parts[c].size()) < fair_share ? 1.0 : 0.0;
        sum = std::accumulate(p.begin(), p.end(), 0.0);
        if (sum <= 0) std::fill(p.begin(), p.end(), 1.0), sum = clients;
      }
      // Boundaries floor(cumsum(p) * len), as numpy's astype(int) in FedML.
      const int64_t len = static_cast<int64_t>(idx.size());
      std::vector<int64_t> sizes(clients);
      double cum = 0;
      int64_t prev = 0;
      for (int c = 0; c < clients; ++c) {
        cum += p[c] / sum;
        int64_t b = c + 1 == clients ? len : std::clamp<int64_t>(static_cast<int64_t>(cum * len), prev, len);
        sizes[c] = b - prev;
        prev = b;
      }
      auto pieces = cut(idx, sizes);
      for (int c = 0; c < clients; ++c) parts[c].insert(parts[c].end(), pieces[c].begin(), pieces[c].end());
    }
    bool ok = true;
    for (const auto& p : parts) ok = ok && static_cast<int64_t>(p.size()) >= min_size;
    if (ok) return parts;
  }
  throw ConfigError("partition '" + text + "': no split in " + std::to_string(kDirichletTries) +
                    " tries gave each of " + std::to_string(clients) + " clients at least " + std::to_string(min_size) +
                    " sample(s) from " + std::to_string(n) + " samples; raise alpha or use fewer clients");
}

std::vector<std::vector<int64_t>> split_shards(const std::vector<int64_t>& y, int clients, int64_t per_client,
                                               const std::string& text, uint64_t key) {
  const int64_t n = static_cast<int64_t>(y.size());
  SPARROW_CHECK_T(ConfigError, per_client <= n / clients,
                  "partition '" << text << "': " << clients << " clients x " << per_client
                                << " shards need at least as many samples, got " << n);
  const int64_t shards = clients * per_client;
  // Shuffle first so the order within a label (and so each shard's content) depends on the seed.
  std::vector<int64_t> order = iota(n);
  shuffle(order, rng::derive(key, 0));
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return y[a] < y[b]; });
  std::vector<int64_t> shard_sizes(shards);
  for (int64_t s = 0; s < shards; ++s) shard_sizes[s] = n / shards + (s < n % shards ? 1 : 0);
  auto shard = cut(order, shard_sizes);
  std::vector<int64_t> assign = iota(shards);
  shuffle(assign, rng::derive(key, 1));
  std::vector<std::vector<int64_t>> parts(clients);
  for (int c = 0; c < clients; ++c)
    for (int64_t j = 0; j < per_client; ++j) {
      const auto& s = shard[assign[c * per_client + j]];
      parts[c].insert(parts[c].end(), s.begin(), s.end());
    }
  return parts;
}

std::vector<std::vector<int64_t>> split_quantity(int64_t n, int clients, double alpha, uint64_t key) {
  const std::vector<double> p = sample_dirichlet(alpha, clients, rng::derive(key, 0));
  const int64_t rest = n - clients;  // one sample per client is reserved
  std::vector<int64_t> sizes(clients);
  double cum = 0;
  int64_t prev = 0;
  for (int c = 0; c < clients; ++c) {
    cum += p[c];
    int64_t b = c + 1 == clients ? rest : std::clamp<int64_t>(static_cast<int64_t>(cum * rest), prev, rest);
    sizes[c] = 1 + b - prev;
    prev = b;
  }
  std::vector<int64_t> order = iota(n);
  shuffle(order, rng::derive(key, 1));
  return cut(order, sizes);
}

}  // namespace

double sample_gamma(double shape, uint64_t key, uint64_t& counter) {
  SPARROW_CHECK_T(ConfigError, std::isfinite(shape) && shape > 0, "gamma shape must be > 0, got " << shape);
  if (shape < 1) {
    const double g = sample_gamma(shape + 1, key, counter);
    return g * std::pow(uniform_open(key, counter++), 1.0 / shape);
  }
  const double d = shape - 1.0 / 3.0;
  const double c = 1.0 / std::sqrt(9.0 * d);
  for (;;) {
    const double x = rng::normal(key, counter++);
    double v = 1.0 + c * x;
    if (v <= 0) continue;
    v = v * v * v;
    const double u = uniform_open(key, counter++);
    if (u < 1.0 - 0.0331 * x * x * x * x) return d * v;
    if (std::log(u) < 0.5 * x * x + d * (1.0 - v + std::log(v))) return d * v;
  }
}

std::vector<double> sample_dirichlet(double alpha, int n, uint64_t key) {
  SPARROW_CHECK_T(ConfigError, n >= 1, "dirichlet dimension must be >= 1, got " << n);
  std::vector<double> g(n);
  uint64_t counter = 0;
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += (g[i] = sample_gamma(alpha, key, counter));
  if (!(sum > 0) || !std::isfinite(sum)) {
    std::fill(g.begin(), g.end(), 0.0);
    g[rng::below(rng::derive(key, 1), 0, n)] = 1.0;
    return g;
  }
  for (double& x : g) x /= sum;
  return g;
}

std::vector<std::vector<int64_t>> partition(const at::Tensor& labels, int clients, const std::string& spec,
                                            uint64_t seed) {
  Spec s = Spec::parse(spec);
  const std::string& method = s.method();
  double alpha = 0;
  int64_t per_client = 0, min_size = 1;
  if (method == "dirichlet" || method == "quantity") {
    alpha = positive_alpha(s);
    if (method == "dirichlet") {
      min_size = s.get_int("min_size", 1);
      SPARROW_CHECK_T(ConfigError, min_size >= 1,
                      "partition '" << spec << "': min_size must be >= 1, got " << min_size);
    }
  } else if (method == "shards") {
    per_client = s.get_int("per_client", 2);
    SPARROW_CHECK_T(ConfigError, per_client >= 1,
                    "partition '" << spec << "': per_client must be >= 1, got " << per_client);
  } else {
    SPARROW_CHECK_T(ConfigError, method == "iid",
                    "unknown partition '" << method << "' (known: iid, dirichlet, shards, quantity)");
  }
  s.check_all_consumed();

  SPARROW_CHECK_T(ConfigError,
                  labels.defined() && labels.dim() == 1 && !labels.is_floating_point() && !labels.is_complex() &&
                      labels.scalar_type() != at::kBool,
                  "partition: labels must be a 1-D integer tensor");
  const int64_t n = labels.size(0);
  SPARROW_CHECK_T(ConfigError, clients >= 1 && clients <= n,
                  "partition '" << spec << "': need 1 <= clients <= samples, got " << clients << " clients for " << n
                                << " samples");
  SPARROW_CHECK_T(ConfigError, min_size <= n / clients,
                  "partition '" << spec << "': " << clients << " clients x min_size " << min_size << " exceeds " << n
                                << " samples");
  at::Tensor y_t = labels.to(at::kCPU, at::kLong).contiguous();
  std::vector<int64_t> y(y_t.data_ptr<int64_t>(), y_t.data_ptr<int64_t>() + n);
  SPARROW_CHECK_T(ConfigError, *std::min_element(y.begin(), y.end()) >= 0, "partition: labels must be >= 0");

  const uint64_t key = rng::derive(seed, rng::hash_name(method));
  if (method == "iid") return sorted(split_iid(n, clients, key));
  if (method == "dirichlet") return sorted(split_dirichlet(y, clients, alpha, min_size, spec, key));
  if (method == "shards") return sorted(split_shards(y, clients, per_client, spec, key));
  return sorted(split_quantity(n, clients, alpha, key));
}

}  // namespace sparrow::core
