#include "simulator/attack.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"
#include "core/spec.h"

namespace sparrow::simulator {

namespace {
constexpr uint64_t kAdversaryTag = 0x6164766572736172ull;  // "adversar"

// Standard normal quantile by bisection on the CDF (monotone; 1e-12 is plenty).
double normal_quantile(double p) {
  double lo = -40, hi = 40;
  for (int i = 0; i < 200 && hi - lo > 1e-12; ++i) {
    const double mid = 0.5 * (lo + hi);
    if (0.5 * std::erfc(-mid / std::sqrt(2.0)) < p)
      lo = mid;
    else
      hi = mid;
  }
  return 0.5 * (lo + hi);
}
}  // namespace

AttackSpec AttackSpec::parse(const std::string& text) {
  Spec s = Spec::parse(text);
  AttackSpec a;
  const std::string& m = s.method();
  if (m == "sign_flip") {
    a.kind = Kind::kSignFlip;
    a.scale = s.get_double("scale", 10);
    SPARROW_CHECK_T(ConfigError, a.scale > 0 && std::isfinite(a.scale), "sign_flip: scale must be > 0");
  } else if (m == "scale") {
    a.kind = Kind::kScale;
    a.factor = s.get_double("factor", 10);
    SPARROW_CHECK_T(ConfigError, std::isfinite(a.factor), "scale: factor must be finite");
  } else if (m == "gaussian") {
    a.kind = Kind::kGaussian;
    a.stddev = s.get_double("std", 1);
    SPARROW_CHECK_T(ConfigError, a.stddev > 0 && std::isfinite(a.stddev), "gaussian: std must be > 0");
  } else if (m == "label_flip") {
    a.kind = Kind::kLabelFlip;
  } else if (m == "alie") {
    a.kind = Kind::kAlie;
    a.z = s.get_double("z", 0);
    SPARROW_CHECK_T(ConfigError, a.z >= 0 && std::isfinite(a.z), "alie: z must be >= 0 (0 = z_max)");
  } else {
    throw ConfigError("unknown attack '" + m +
                      "' (sign_flip[:scale=], scale[:factor=], gaussian[:std=], label_flip, alie[:z=])");
  }
  s.check_all_consumed();
  return a;
}

std::vector<char> choose_adversaries(int clients, double fraction, uint64_t seed) {
  std::vector<char> out(static_cast<size_t>(std::max(clients, 0)), 0);
  const auto k = static_cast<size_t>(std::llround(fraction * clients));
  std::vector<size_t> ids(out.size());
  std::iota(ids.begin(), ids.end(), 0);
  rng::Stream s(rng::derive(seed, kAdversaryTag));
  for (size_t i = 0; i < k && i < ids.size(); ++i) {
    std::swap(ids[i], ids[i + s.below(ids.size() - i)]);
    out[ids[i]] = 1;
  }
  return out;
}

std::map<std::string, at::Tensor> attack_update(const AttackSpec& a, const std::map<std::string, at::Tensor>& delta,
                                                uint64_t key) {
  std::map<std::string, at::Tensor> out;
  uint64_t offset = 0;
  for (const auto& [n, d] : delta) {
    switch (a.kind) {
      case AttackSpec::Kind::kSignFlip:
        out[n] = d * (-a.scale);
        break;
      case AttackSpec::Kind::kScale:
        out[n] = d * a.factor;
        break;
      case AttackSpec::Kind::kGaussian: {
        at::Tensor g = at::empty(d.sizes(), d.options().dtype(at::kFloat).device(at::kCPU));
        float* p = g.data_ptr<float>();
        for (int64_t i = 0; i < g.numel(); ++i)
          p[i] = static_cast<float>(a.stddev * rng::normal(key, offset + static_cast<uint64_t>(i)));
        offset += static_cast<uint64_t>(g.numel());
        out[n] = g.to(d.device());
        break;
      }
      default:
        out[n] = d;  // label_flip acts on the data, alie on the pool
    }
  }
  return out;
}

double alie_z(int64_t n, int64_t f) {
  const int64_t s = n / 2 + 1 - f;
  const double p = static_cast<double>(n - s) / static_cast<double>(n);
  if (p <= 0) return 0;
  return std::max(0.0, normal_quantile(std::min(p, 1 - 1e-12)));
}

std::map<std::string, at::Tensor> alie_update(const std::vector<std::map<std::string, at::Tensor>>& honest, double z) {
  SPARROW_CHECK(!honest.empty(), "alie: no update to pool");
  std::map<std::string, at::Tensor> out;
  for (const auto& [n, d0] : honest.front()) {
    std::vector<at::Tensor> xs;
    for (const auto& h : honest) xs.push_back(h.at(n).to(at::kCPU, at::kFloat));
    at::Tensor X = at::stack(xs);
    at::Tensor mu = X.mean(0);
    at::Tensor sd = X.std(0, /*unbiased=*/false);
    out[n] = (mu - sd * z).to(d0.device());
  }
  return out;
}

}  // namespace sparrow::simulator
