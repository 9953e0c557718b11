#include "aggregation/dp_accountant.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "core/error.h"

namespace sparrow::aggregation {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kLogPi = 1.1447298858494002;

// Finite orders above this are reported as RDP +∞ (a valid, if useless, bound): the series cost O(α)
// terms and such orders are never the optimum for any sensible δ.
constexpr double kMaxSeriesOrder = 1e6;
// The fractional series stops once both new terms are below exp(-30) (A_α >= 1, so this is relative
// too) and i > α; its tail decays only polynomially in i, hence the generous cap.
constexpr double kSeriesTailLog = -30.0;
constexpr int64_t kMaxFracTerms = 10'000'000;

void check_q_sigma(double q, double sigma) {
  SPARROW_CHECK_T(ConfigError, q >= 0.0 && q <= 1.0, "dp accountant: sampling rate q must be in [0, 1], got " << q);
  SPARROW_CHECK_T(ConfigError, sigma > 0.0 && std::isfinite(sigma),
                  "dp accountant: noise multiplier sigma must be finite and > 0, got " << sigma);
}

void check_order(double alpha) {
  SPARROW_CHECK_T(ConfigError, alpha > 1.0, "dp accountant: Renyi order must be > 1, got " << alpha);
}

void check_steps(int64_t steps) {
  SPARROW_CHECK_T(ConfigError, steps >= 0, "dp accountant: steps must be >= 0, got " << steps);
}

void check_delta(double delta) {
  SPARROW_CHECK_T(ConfigError, delta > 0.0 && delta < 1.0, "dp accountant: delta must be in (0, 1), got " << delta);
}

// log(exp(x) + exp(y)).
double log_add(double x, double y) {
  if (x == -kInf) return y;
  if (y == -kInf) return x;
  const double hi = std::max(x, y);
  if (hi == kInf) return kInf;
  return hi + std::log1p(std::exp(std::min(x, y) - hi));
}

// log(exp(x) − exp(y)), x >= y.
double log_sub(double x, double y) {
  if (y == -kInf) return x;
  SPARROW_CHECK(x >= y, "dp accountant: series partial sum went negative (log " << x << " - log " << y << ")");
  if (x == y) return -kInf;
  if (x == kInf) return kInf;
  return x + std::log(-std::expm1(y - x));
}

// log(erfc(x)); the asymptotic expansion where erfc leaves the normal range (x > 26.5).
double log_erfc(double x) {
  if (x > 26.0) {
    const double u = 1.0 / (x * x);
    return -0.5 * kLogPi - std::log(x) - x * x + u * (-0.5 + u * (0.625 + u * (-37.0 / 24.0 + u * (353.0 / 64.0))));
  }
  return std::log(std::erfc(x));
}

// log A_α for integer α: Σ_{i=0}^{α} C(α, i) q^i (1 − q)^{α−i} exp((i² − i) / (2σ²)).
double log_a_int(double q, double sigma, double alpha) {
  const double lq = std::log(q), l1q = std::log1p(-q), inv_2s2 = 1.0 / (2.0 * sigma * sigma);
  const auto n = static_cast<int64_t>(alpha);
  double log_a = -kInf;
  double log_coef = 0.0;  // log C(α, i)
  for (int64_t k = 0; k <= n; ++k) {
    const double i = static_cast<double>(k);
    const double s = log_coef + i * lq + (alpha - i) * l1q + (i * i - i) * inv_2s2;
    if (std::isnan(s)) return kInf;  // 0 · ∞: σ² underflowed
    log_a = log_add(log_a, s);
    log_coef += std::log(alpha - i) - std::log(i + 1.0);
  }
  return log_a;
}

// log A_α for fractional α: the two-sided series of Mironov et al. (2019), Section 3.3, with
// generalised binomial coefficients carried as (log |C(α, i)|, sign).
double log_a_frac(double q, double sigma, double alpha) {
  const double lq = std::log(q), l1q = std::log1p(-q), inv_2s2 = 1.0 / (2.0 * sigma * sigma);
  const double z0 = sigma * sigma * (l1q - lq) + 0.5;
  const double log_half = std::log(0.5), inv_sqrt2_sigma = 1.0 / (std::sqrt(2.0) * sigma);
  double log_a0 = -kInf, log_a1 = -kInf;
  double log_coef = 0.0;  // log |C(α, i)|
  bool positive = true;   // sign of C(α, i)
  for (int64_t k = 0;; ++k) {
    SPARROW_CHECK(k < kMaxFracTerms, "dp accountant: RDP series for q=" << q << ", sigma=" << sigma
                                                                        << ", alpha=" << alpha << " did not converge");
    const double i = static_cast<double>(k), j = alpha - i;
    const double log_t0 = log_coef + i * lq + j * l1q;
    const double log_t1 = log_coef + j * lq + i * l1q;
    const double log_e0 = log_half + log_erfc((i - z0) * inv_sqrt2_sigma);
    const double log_e1 = log_half + log_erfc((z0 - j) * inv_sqrt2_sigma);
    const double log_s0 = log_t0 + (i * i - i) * inv_2s2 + log_e0;
    const double log_s1 = log_t1 + (j * j - j) * inv_2s2 + log_e1;
    if (std::isnan(log_s0) || std::isnan(log_s1)) return kInf;  // ∞ − ∞: the exponent overflowed
    if (positive) {
      log_a0 = log_add(log_a0, log_s0);
      log_a1 = log_add(log_a1, log_s1);
    } else {
      log_a0 = log_sub(log_a0, log_s0);
      log_a1 = log_sub(log_a1, log_s1);
    }
    if (log_a0 == kInf || log_a1 == kInf) return kInf;
    if (i > alpha && std::max(log_s0, log_s1) < kSeriesTailLog) break;
    log_coef += std::log(std::abs(alpha - i)) - std::log(i + 1.0);
    if (alpha - i < 0.0) positive = !positive;
  }
  return log_add(log_a0, log_a1);
}

}  // namespace

const std::vector<double>& default_rdp_orders() {
  static const std::vector<double> orders = [] {
    std::vector<double> v;
    for (int x = 1; x < 100; ++x) v.push_back(1.0 + x / 10.0);
    for (int a = 12; a < 64; ++a) v.push_back(a);
    v.push_back(128.0);
    v.push_back(256.0);
    return v;
  }();
  return orders;
}

double sgm_rdp(double q, double sigma, double alpha) {
  check_q_sigma(q, sigma);
  check_order(alpha);
  if (q == 0.0) return 0.0;
  if (q == 1.0) return alpha / (2.0 * sigma * sigma);
  if (!(alpha <= kMaxSeriesOrder)) return kInf;
  const double log_a = alpha == std::floor(alpha) ? log_a_int(q, sigma, alpha) : log_a_frac(q, sigma, alpha);
  if (std::isnan(log_a)) return kInf;
  // A_α >= 1; clamp rounding below it.
  return std::max(0.0, log_a / (alpha - 1.0));
}

std::vector<double> sgm_rdp(double q, double sigma, int64_t steps, const std::vector<double>& orders) {
  check_q_sigma(q, sigma);
  check_steps(steps);
  std::vector<double> out;
  out.reserve(orders.size());
  for (const double alpha : orders) {
    const double r = sgm_rdp(q, sigma, alpha);
    out.push_back(steps == 0 ? 0.0 : static_cast<double>(steps) * r);
  }
  return out;
}

PrivacySpent rdp_to_epsilon(const std::vector<double>& orders, const std::vector<double>& rdp, double delta) {
  check_delta(delta);
  SPARROW_CHECK_T(ConfigError, !orders.empty() && orders.size() == rdp.size(),
                  "dp accountant: need as many RDP values as orders (and at least one), got "
                      << rdp.size() << " values for " << orders.size() << " orders");
  const double log_delta = std::log(delta);
  PrivacySpent best{kInf, kNaN};
  for (size_t k = 0; k < orders.size(); ++k) {
    const double alpha = orders[k], r = rdp[k];
    check_order(alpha);
    SPARROW_CHECK_T(ConfigError, r >= 0.0, "dp accountant: RDP must be >= 0, got " << r << " at order " << alpha);
    if (!std::isfinite(r)) continue;
    double eps;
    if (delta * delta + std::expm1(-r) > 0.0) {
      eps = 0.0;  // δ > sqrt(1 − exp(−KL)) >= total variation: (0, δ)-DP.
    } else {
      eps = r - (log_delta + std::log(alpha)) / (alpha - 1.0) + std::log1p(-1.0 / alpha);
      if (!std::isfinite(eps)) continue;
      eps = std::max(eps, 0.0);
    }
    if (eps < best.epsilon) best = {eps, alpha};
  }
  return best;
}

PrivacySpent sgm_epsilon(double q, double sigma, int64_t steps, double delta, const std::vector<double>& orders) {
  check_delta(delta);
  return rdp_to_epsilon(orders, sgm_rdp(q, sigma, steps, orders), delta);
}

RdpAccountant::RdpAccountant(std::vector<double> orders) : orders_(std::move(orders)), rdp_(orders_.size(), 0.0) {
  SPARROW_CHECK_T(ConfigError, !orders_.empty(), "dp accountant: empty list of Renyi orders");
  for (const double alpha : orders_) check_order(alpha);
}

void RdpAccountant::add(double q, double sigma, int64_t steps) {
  const std::vector<double> r = sgm_rdp(q, sigma, steps, orders_);
  for (size_t k = 0; k < r.size(); ++k) rdp_[k] += r[k];
  steps_ += steps;
}

PrivacySpent RdpAccountant::epsilon(double delta) const { return rdp_to_epsilon(orders_, rdp_, delta); }

void RdpAccountant::reset() {
  std::fill(rdp_.begin(), rdp_.end(), 0.0);
  steps_ = 0;
}

}  // namespace sparrow::aggregation
