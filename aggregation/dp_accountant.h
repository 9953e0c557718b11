#pragma once
// Rényi differential privacy (RDP) accounting for the sampled Gaussian mechanism (SGM): each step
// releases f(S) + N(0, σ²·C²) where S is a Poisson sample of the data (or of the clients) with rate q
// and f has L2 sensitivity C. σ is the noise multiplier; C drops out.
//
// One step at order α > 1 (Mironov, Talwar, Zhang 2019, "Rényi Differential Privacy of the Sampled
// Gaussian Mechanism"):
//   RDP(α) = log A_α / (α − 1),   A_α = E_{z∼μ0}[(μ(z)/μ0(z))^α],
//   μ0 = N(0, σ²),   μ = (1 − q)·N(0, σ²) + q·N(1, σ²).
// q = 0 gives 0 and q = 1 (the plain Gaussian mechanism) α / (2σ²). Integer α sums the binomial
// expansion; fractional α uses the two-sided series with erfc terms; both are evaluated in log space
// as in TensorFlow Privacy's rdp_accountant (_compute_log_a_int / _compute_log_a_frac). RDP composes
// additively over steps, so k steps cost k·RDP(α).
//
// Conversion to (ε, δ)-DP (Canonne, Kamath, Steinke 2020; Balle et al. 2020; as Opacus):
//   ε(α) = RDP_total(α) − (log δ + log α) / (α − 1) + log((α − 1) / α),
// minimised over the given orders, orders with a non-finite ε skipped, ε clamped at >= 0. An order
// whose total RDP r satisfies δ² > 1 − exp(−r) gives ε = 0 outright (the KL / total-variation bound
// of Google's dp_accounting), so zero steps or q = 0 spend ε = 0.
//
// Parameters are checked: q in [0, 1], σ finite and > 0, δ in (0, 1), steps >= 0, every order > 1
// (+∞ allowed; its RDP is +∞ unless q = 0). A bad value throws sparrow::ConfigError. A numerical
// failure of the series (it should not happen) throws sparrow::Error. RDP that overflows a double
// (huge orders, tiny σ) is +∞, never NaN.
//
// Pure math: no torch, no global state; all functions are thread-safe.

#include <cstdint>
#include <vector>

namespace sparrow::aggregation {

// The default Rényi orders: Opacus's (1 + x/10 for x = 1..99, then 12..63) plus 128 and 256.
const std::vector<double>& default_rdp_orders();

// RDP at order `alpha` of one step of the SGM with sampling rate q and noise multiplier sigma.
double sgm_rdp(double q, double sigma, double alpha);

// RDP of `steps` SGM steps at each of `orders` (steps · sgm_rdp(q, sigma, order); 0 when steps = 0).
std::vector<double> sgm_rdp(double q, double sigma, int64_t steps, const std::vector<double>& orders);

struct PrivacySpent {
  double epsilon;  // +∞ when no order gives a finite value
  double order;    // the order that attains it (NaN when epsilon is +∞)
};

// (ε, best order) at `delta` for accumulated RDP values rdp[i] at orders[i] (equal, non-zero sizes;
// rdp values must be >= 0 or +∞).
PrivacySpent rdp_to_epsilon(const std::vector<double>& orders, const std::vector<double>& rdp, double delta);

// (ε, best order) of `steps` SGM steps at `delta`.
PrivacySpent sgm_epsilon(double q, double sigma, int64_t steps, double delta,
                         const std::vector<double>& orders = default_rdp_orders());

// Accumulates RDP over heterogeneous runs of SGM steps (e.g. a sampling rate or noise multiplier that
// changes between rounds) and converts to ε on demand. A plain copyable value.
class RdpAccountant {
 public:
  // Throws ConfigError on an empty list or an order <= 1.
  explicit RdpAccountant(std::vector<double> orders = default_rdp_orders());

  // Accounts `steps` steps of the SGM with sampling rate q and noise multiplier sigma.
  void add(double q, double sigma, int64_t steps = 1);
  // (ε, best order) of everything added so far.
  PrivacySpent epsilon(double delta) const;

  const std::vector<double>& orders() const { return orders_; }
  // Total RDP per order, parallel to orders().
  const std::vector<double>& rdp() const { return rdp_; }
  // Sum of the steps passed to add().
  int64_t steps() const { return steps_; }
  // Forgets everything added (keeps the orders).
  void reset();

 private:
  std::vector<double> orders_;
  std::vector<double> rdp_;
  int64_t steps_ = 0;
};

}  // namespace sparrow::aggregation
