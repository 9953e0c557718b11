#include "federation/algorithms.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace sparrow::federation {

namespace {
// FedNova's summed scalars: N = Σ n_i, NA = Σ n_i a_i, W = Σ n_i / a_i. The
// '#' keeps them apart from any parameter name (LibTorch's are dotted
// identifiers).
constexpr const char* kSumN = "#fednova.n";
constexpr const char* kSumNA = "#fednova.na";
constexpr const char* kSumW = "#fednova.w";

double scalar_of(const std::map<std::string, at::Tensor>& m, const char* key) {
  const auto it = m.find(key);
  SPARROW_CHECK(it != m.end() && it->second.numel() == 1, "fednova: the round's sums lack " << key);
  return it->second.item<double>();
}
}  // namespace

int64_t fednova_steps(int64_t n, int local_epochs, int batch_size) {
  SPARROW_CHECK(n > 0 && local_epochs >= 1 && batch_size >= 1,
                "fednova_steps: n = " << n << ", local_epochs = " << local_epochs << ", batch_size = " << batch_size);
  const int64_t bs = std::min<int64_t>(batch_size, n);
  return static_cast<int64_t>(local_epochs) * ((n + bs - 1) / bs);
}

double fednova_norm(int64_t tau, double momentum) {
  SPARROW_CHECK(tau >= 1 && momentum >= 0 && momentum < 1,
                "fednova_norm: tau = " << tau << ", momentum = " << momentum);
  const auto t = static_cast<double>(tau);
  if (momentum == 0) return t;
  const double r = momentum;
  return (t - r * (1 - std::pow(r, t)) / (1 - r)) / (1 - r);
}

void fold_terms(const RunConfig& c, uint64_t num_samples, Arrival& a) {
  SPARROW_CHECK_T(FormatError, num_samples > 0, "num_samples must be > 0");
  const auto n = static_cast<double>(num_samples);
  if (c.algorithm != "fednova") {
    a.weight = n;
    return;
  }
  const double ai =
      fednova_norm(fednova_steps(static_cast<int64_t>(num_samples), c.local_epochs, c.batch_size), c.momentum);
  a.weight = n / ai;
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  a.control_delta[kSumN] = at::scalar_tensor(n, opts);
  a.control_delta[kSumNA] = at::scalar_tensor(n * ai, opts);
  a.control_delta[kSumW] = at::scalar_tensor(n / ai, opts);
}

bool is_fednova_key(const std::string& name) { return name == kSumN || name == kSumNA || name == kSumW; }

double fednova_scale(const std::map<std::string, at::Tensor>& control_sum) {
  if (control_sum.find(kSumN) == control_sum.end()) return 1.0;
  const double n = scalar_of(control_sum, kSumN), na = scalar_of(control_sum, kSumNA),
               w = scalar_of(control_sum, kSumW);
  SPARROW_CHECK(n > 0 && na > 0 && w > 0, "fednova: non-positive sums (N " << n << ", NA " << na << ", W " << w << ")");
  return na * w / (n * n);
}

void feddyn_step(std::map<std::string, at::Tensor>& h, std::map<std::string, at::Tensor>& delta, double alpha,
                 int64_t count, double population) {
  SPARROW_CHECK(alpha > 0 && count >= 0 && population > 0,
                "feddyn_step: alpha = " << alpha << ", count = " << count << ", population = " << population);
  const double f = -alpha * static_cast<double>(count) / population;
  for (auto& [n, d] : delta) {
    auto it = h.find(n);
    if (it == h.end()) it = h.emplace(n, at::zeros_like(d)).first;
    it->second.add_(d.to(it->second.device(), it->second.scalar_type()), f);
    d = d - it->second.to(d.device(), d.scalar_type()) / alpha;
  }
}

double proximal_weight(const RunConfig& c) {
  if (c.algorithm == "fedprox") return c.mu;
  if (c.algorithm == "feddyn") return c.feddyn_alpha;
  return 0.0;
}

bool has_client_state(const std::string& algorithm) { return algorithm == "scaffold" || algorithm == "feddyn"; }

std::vector<std::pair<std::string, std::string>> check_algorithm(const RunConfig& c) {
  std::vector<std::pair<std::string, std::string>> out;
  auto bad = [&](const char* key, std::string why) { out.emplace_back(key, std::move(why)); };
  const bool nova = c.algorithm == "fednova", dyn = c.algorithm == "feddyn";
  if (!(c.feddyn_alpha >= 0 && c.feddyn_alpha <= 100)) bad("feddyn_alpha", "must be in [0, 100]");
  if (dyn && c.feddyn_alpha <= 0)
    bad("feddyn_alpha", "must be > 0 with algorithm = \"feddyn\" (its regulariser weight, e.g. 0.01)");
  if (!dyn && c.feddyn_alpha != 0)
    bad("feddyn_alpha", "has no effect unless algorithm = \"feddyn\" (its regulariser weight)");
  if (!nova && !dyn) return out;
  const std::string name = "algorithm \"" + c.algorithm + "\"";
  if (c.mode == "async")
    bad("mode", "cannot be \"async\" with " + name +
                    (nova ? " (its normalisation is over one round's updates)"
                          : " (its server state h assumes rounds without staleness)"));
  if (c.secagg != "none") bad("secagg", "cannot be used with " + name + " (the server needs each client's weight)");
  if (nova && c.aggregator != "mean")
    bad("aggregator", "must be \"mean\" with algorithm \"fednova\" (its normalisation is a weighted mean)");
  if (nova && c.dp.rfind("central", 0) == 0)
    bad("dp", "cannot be central with algorithm \"fednova\" (its scale would scale the noise); use local");
  return out;
}

}  // namespace sparrow::federation
