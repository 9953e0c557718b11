// No ATen in this file (the accountant is torch-free), so doctest is included directly: the glog macro
// clash that tests/sparrow_test.h guards against needs ATen in the same translation unit.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "aggregation/dp_accountant.h"
#include "core/error.h"

using sparrow::aggregation::default_rdp_orders;
using sparrow::aggregation::PrivacySpent;
using sparrow::aggregation::rdp_to_epsilon;
using sparrow::aggregation::RdpAccountant;
using sparrow::aggregation::sgm_epsilon;
using sparrow::aggregation::sgm_rdp;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool close(double a, double b, double rel, double abs = 0.0) {
  return std::abs(a - b) <= abs + rel * std::max(std::abs(a), std::abs(b));
}

// RDP of one SGM step by direct quadrature, independent of the series in dp_accountant.cc:
//   A_α = ∫ μ0(z) · ((1 − q) + q·exp((2z − 1) / (2σ²)))^α dz,   μ0 = N(0, σ²) density,
// composite Simpson in long double over z ∈ [−30σ, 30σ + α] (the integrand peaks near z = α with
// width ~σ), summed as exp(f − max f) so that large A_α cannot overflow. RDP = log A_α / (α − 1).
double rdp_by_quadrature(double q_in, double sigma_in, double alpha_in) {
  using LD = long double;
  const LD q = q_in, sigma = sigma_in, alpha = alpha_in;
  const LD s2 = sigma * sigma;
  const LD lo = -30 * sigma, hi = 30 * sigma + alpha;
  const int64_t n = 200000;  // even
  const LD h = (hi - lo) / n;
  const LD log_1q = std::log1p(-q), log_q = std::log(q);
  std::vector<LD> f(n + 1);
  LD fmax = -std::numeric_limits<LD>::infinity();
  for (int64_t k = 0; k <= n; ++k) {
    const LD z = lo + h * static_cast<LD>(k);
    const LD a = log_1q, b = log_q + (2 * z - 1) / (2 * s2);
    const LD big = std::max(a, b), small = std::min(a, b);
    const LD log_mix = big + std::log1p(std::exp(small - big));  // log((1 − q) + q·e^u)
    f[k] = -z * z / (2 * s2) + alpha * log_mix;
    fmax = std::max(fmax, f[k]);
  }
  LD sum = 0;
  for (int64_t k = 0; k <= n; ++k) {
    const LD w = (k == 0 || k == n) ? 1 : (k % 2 == 1 ? 4 : 2);
    sum += w * std::exp(f[k] - fmax);
  }
  const LD pi = 3.141592653589793238462643383279502884L;
  const LD log_a = fmax + std::log(sum * h / 3) - std::log(sigma * std::sqrt(2 * pi));
  return static_cast<double>(log_a / (alpha - 1));
}

// ε(α) of the conversion for the Gaussian mechanism (q = 1) composed `steps` times, written out here.
double gaussian_eps_at(double sigma, double steps, double delta, double alpha) {
  const double rdp = alpha * steps / (2 * sigma * sigma);
  return rdp - (std::log(delta) + std::log(alpha)) / (alpha - 1) + std::log((alpha - 1) / alpha);
}

}  // namespace

TEST_CASE("dp_accountant: sgm_rdp matches numerical integration of A_alpha") {
  for (const double q : {0.01, 0.1, 0.5}) {
    for (const double sigma : {0.7, 1.0, 2.0, 5.0}) {
      for (const double alpha : {1.5, 2.5, 3.7, 10.5, 2.0, 3.0, 8.0, 32.0}) {
        CAPTURE(q);
        CAPTURE(sigma);
        CAPTURE(alpha);
        const double got = sgm_rdp(q, sigma, alpha);
        const double want = rdp_by_quadrature(q, sigma, alpha);
        CHECK(std::isfinite(got));
        CHECK(want > 0.0);
        CHECK(close(got, want, 1e-6));
      }
    }
  }
}

TEST_CASE("dp_accountant: closed forms at q = 1, q = 0 and alpha = 2") {
  for (const double sigma : {0.3, 0.7, 1.0, 2.0, 5.0, 30.0}) {
    for (const double alpha : {1.1, 1.5, 2.0, 3.7, 8.0, 32.0, 256.0}) {
      CAPTURE(sigma);
      CAPTURE(alpha);
      CHECK(sgm_rdp(1.0, sigma, alpha) == doctest::Approx(alpha / (2 * sigma * sigma)).epsilon(1e-15));
      CHECK(sgm_rdp(0.0, sigma, alpha) == 0.0);
    }
    // A_2 = E[(μ/μ0)²] = 1 + q²(e^{1/σ²} − 1).
    for (const double q : {1e-4, 0.01, 0.1, 0.5, 0.9, 0.999}) {
      CAPTURE(sigma);
      CAPTURE(q);
      const double want = std::log1p(q * q * std::expm1(1 / (sigma * sigma)));
      CHECK(close(sgm_rdp(q, sigma, 2.0), want, 1e-8));
    }
  }
  CHECK(sgm_epsilon(0.0, 1.0, 1000, 1e-5).epsilon == 0.0);
  CHECK(sgm_epsilon(0.3, 1.0, 0, 1e-5).epsilon == 0.0);
}

TEST_CASE("dp_accountant: the fractional series joins the integer sum continuously") {
  for (const double q : {0.001, 0.05, 0.3, 0.8}) {
    for (const double sigma : {0.5, 1.0, 4.0}) {
      for (const double alpha : {2.0, 3.0, 8.0, 20.0}) {
        CAPTURE(q);
        CAPTURE(sigma);
        CAPTURE(alpha);
        const double at = sgm_rdp(q, sigma, alpha);
        const double below = sgm_rdp(q, sigma, alpha - 1e-7), above = sgm_rdp(q, sigma, alpha + 1e-7);
        CHECK(below <= at * (1 + 1e-9));
        CHECK(at <= above * (1 + 1e-9));
        CHECK(close(below, at, 1e-5));
        CHECK(close(above, at, 1e-5));
      }
    }
  }
}

TEST_CASE("dp_accountant: Gaussian-mechanism epsilon equals a brute-force minimisation") {
  // A fine grid of orders: α = 1 + e^t, t uniform over [log 1e-4, log 5000].
  std::vector<double> grid;
  const int n = 20000;
  const double t0 = std::log(1e-4), t1 = std::log(5000.0);
  for (int k = 0; k <= n; ++k) grid.push_back(1 + std::exp(t0 + (t1 - t0) * k / n));

  for (const double sigma : {0.8, 1.0, 2.0, 5.0, 10.0}) {
    for (const int64_t steps : {1, 10, 100, 1000}) {
      for (const double delta : {1e-5, 1e-3}) {
        CAPTURE(sigma);
        CAPTURE(steps);
        CAPTURE(delta);
        double best = kInf, best_alpha = 0;
        for (const double a : grid) {
          const double e = gaussian_eps_at(sigma, static_cast<double>(steps), delta, a);
          if (e < best) best = e, best_alpha = a;
        }
        REQUIRE(best_alpha > grid.front());  // an interior minimum
        REQUIRE(best_alpha < grid.back());
        best = std::max(best, 0.0);

        const PrivacySpent fine = sgm_epsilon(1.0, sigma, steps, delta, grid);
        CHECK(close(fine.epsilon, best, 1e-12));
        CHECK(fine.order == best_alpha);

        // The default orders are coarser: not below the fine optimum (up to the grid's own spacing) and
        // within 2% of it.
        const PrivacySpent coarse = sgm_epsilon(1.0, sigma, steps, delta);
        CHECK(coarse.epsilon >= best * (1 - 1e-6));
        CHECK(coarse.epsilon <= best * 1.02);

        // The classical bound ρ + 2√(ρ log(1/δ)) (ρ = steps / 2σ², plain conversion) is looser.
        const double rho = static_cast<double>(steps) / (2 * sigma * sigma);
        CHECK(fine.epsilon <= rho + 2 * std::sqrt(rho * std::log(1 / delta)));
      }
    }
  }
}

TEST_CASE("dp_accountant: epsilon falls with sigma and delta, grows with steps and q") {
  const double q = 0.01, delta = 1e-5;
  double prev = kInf;
  for (const double sigma : {0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0}) {
    const double e = sgm_epsilon(q, sigma, 1000, delta).epsilon;
    CAPTURE(sigma);
    CHECK(e < prev);
    prev = e;
  }
  prev = 0.0;
  for (const int64_t steps : {1, 10, 100, 1000, 10000, 100000}) {
    const double e = sgm_epsilon(q, 1.0, steps, delta).epsilon;
    CAPTURE(steps);
    CHECK(e > prev);
    prev = e;
  }
  prev = 0.0;
  for (const double rate : {0.001, 0.01, 0.1, 0.5, 1.0}) {
    const double e = sgm_epsilon(rate, 1.0, 100, delta).epsilon;
    CAPTURE(rate);
    CHECK(e > prev);
    prev = e;
  }
  CHECK(sgm_epsilon(q, 1.0, 1000, 1e-3).epsilon < sgm_epsilon(q, 1.0, 1000, 1e-5).epsilon);
  // RDP itself is non-decreasing in the order.
  double prev_rdp = 0.0;
  for (const double alpha : default_rdp_orders()) {
    const double r = sgm_rdp(0.05, 1.3, alpha);
    CAPTURE(alpha);
    CHECK(r >= prev_rdp * (1 - 1e-12));
    prev_rdp = r;
  }
}

TEST_CASE("dp_accountant: TF Privacy's published MNIST DP-SGD figures") {
  // tensorflow/privacy tutorials/README.md: N = 60000, batch 256, delta = 1e-5, eps from
  // compute_dp_sgd_privacy with the plain conversion eps = min_a rdp(a) + log(1/delta)/(a - 1) over
  // the orders 1 + x/10 (x = 1..99), 12..63 and steps = ceil(epochs * N / batch):
  //   sigma 1.3, 15 epochs: 1.19;  sigma 1.1, 60 epochs: 3.01;  sigma 0.7, 45 epochs: 7.10.
  // The improved conversion used by sgm_epsilon must give less.
  std::vector<double> orders;
  for (int x = 1; x < 100; ++x) orders.push_back(1 + x / 10.0);
  for (int a = 12; a < 64; ++a) orders.push_back(a);
  const double q = 256.0 / 60000.0, delta = 1e-5;
  struct Row {
    double sigma;
    int epochs;
    double eps;
  };
  for (const Row row : {Row{1.3, 15, 1.19}, Row{1.1, 60, 3.01}, Row{0.7, 45, 7.10}}) {
    CAPTURE(row.sigma);
    const auto steps = static_cast<int64_t>(std::ceil(row.epochs * 60000.0 / 256));
    double plain = kInf;
    for (const double alpha : orders) {
      const double rdp = static_cast<double>(steps) * sgm_rdp(q, row.sigma, alpha);
      plain = std::min(plain, rdp - std::log(delta) / (alpha - 1));
    }
    CHECK(std::abs(plain - row.eps) <= 0.005);
    const PrivacySpent improved = sgm_epsilon(q, row.sigma, steps, delta);
    CHECK(improved.epsilon < plain);
    CHECK(improved.epsilon > 0.75 * plain);
  }
}

TEST_CASE("dp_accountant: RdpAccountant composes heterogeneous steps") {
  RdpAccountant acc;
  CHECK(acc.orders() == default_rdp_orders());
  CHECK(acc.steps() == 0);
  CHECK(acc.epsilon(1e-5).epsilon == 0.0);

  acc.add(0.01, 1.0, 100);
  acc.add(0.02, 1.5, 50);
  acc.add(0.01, 1.0);
  CHECK(acc.steps() == 151);
  const auto& orders = acc.orders();
  const std::vector<double> a = sgm_rdp(0.01, 1.0, 101, orders), b = sgm_rdp(0.02, 1.5, 50, orders);
  for (size_t k = 0; k < orders.size(); ++k) CHECK(close(acc.rdp()[k], a[k] + b[k], 1e-12));
  const PrivacySpent e = acc.epsilon(1e-5);
  std::vector<double> sum(orders.size());
  for (size_t k = 0; k < orders.size(); ++k) sum[k] = a[k] + b[k];
  const PrivacySpent want = rdp_to_epsilon(orders, sum, 1e-5);
  CHECK(close(e.epsilon, want.epsilon, 1e-12));
  CHECK(e.epsilon > sgm_epsilon(0.01, 1.0, 101, 1e-5).epsilon);

  // Homogeneous steps in one call or many agree.
  RdpAccountant chunks({1.5, 2.0, 10.5, 64.0});
  for (int k = 0; k < 10; ++k) chunks.add(0.1, 2.0, 7);
  const PrivacySpent once = sgm_epsilon(0.1, 2.0, 70, 1e-6, {1.5, 2.0, 10.5, 64.0});
  CHECK(close(chunks.epsilon(1e-6).epsilon, once.epsilon, 1e-12));
  CHECK(chunks.epsilon(1e-6).order == once.order);

  // A plain value: copies are independent; reset keeps the orders.
  RdpAccountant copy = chunks;
  copy.add(0.5, 1.0, 10);
  CHECK(copy.epsilon(1e-6).epsilon > chunks.epsilon(1e-6).epsilon);
  CHECK(chunks.steps() == 70);
  copy.reset();
  CHECK(copy.steps() == 0);
  CHECK(copy.orders().size() == 4);
  CHECK(copy.epsilon(1e-6).epsilon == 0.0);
}

TEST_CASE("dp_accountant: huge orders and tiny sigma give +inf, never NaN") {
  CHECK(sgm_rdp(0.5, 1.0, kInf) == kInf);
  CHECK(sgm_rdp(0.0, 1.0, kInf) == 0.0);
  CHECK(sgm_rdp(0.1, 1.0, 1e12) == kInf);
  CHECK(sgm_rdp(0.1, 1e-200, 8.0) == kInf);
  CHECK(sgm_rdp(0.1, 1e-200, 8.5) == kInf);
  for (const double alpha : {256.0, 1000.0, 4096.0, 1000.5}) {
    const double r = sgm_rdp(0.5, 0.1, alpha);
    CAPTURE(alpha);
    CHECK(!std::isnan(r));
    CHECK(r > 0.0);
  }
  // Non-finite orders are skipped by the conversion.
  const std::vector<double> orders = {2.0, 8.0, 1e12, kInf};
  const PrivacySpent e = sgm_epsilon(0.01, 1.0, 100, 1e-5, orders);
  CHECK(std::isfinite(e.epsilon));
  CHECK(e.order == 8.0);
  const PrivacySpent none = rdp_to_epsilon({2.0, 3.0}, {kInf, kInf}, 1e-5);
  CHECK(none.epsilon == kInf);
  CHECK(std::isnan(none.order));
}

TEST_CASE("dp_accountant: bad parameters are ConfigErrors") {
  using sparrow::ConfigError;
  for (const double q : {-0.1, 1.1, kNaN}) CHECK_THROWS_AS(sgm_rdp(q, 1.0, 2.0), ConfigError);
  for (const double sigma : {0.0, -1.0, kNaN, kInf}) CHECK_THROWS_AS(sgm_rdp(0.1, sigma, 2.0), ConfigError);
  for (const double alpha : {1.0, 0.5, -3.0, kNaN}) CHECK_THROWS_AS(sgm_rdp(0.1, 1.0, alpha), ConfigError);
  for (const double delta : {0.0, 1.0, -1e-5, 2.0, kNaN})
    CHECK_THROWS_AS(sgm_epsilon(0.1, 1.0, 10, delta), ConfigError);
  CHECK_THROWS_AS(sgm_epsilon(0.1, 1.0, -1, 1e-5), ConfigError);
  CHECK_THROWS_AS(sgm_epsilon(0.1, 1.0, 10, 1e-5, {}), ConfigError);
  CHECK_THROWS_AS(sgm_epsilon(0.1, 1.0, 10, 1e-5, {2.0, 1.0}), ConfigError);
  CHECK_THROWS_AS(rdp_to_epsilon({2.0, 3.0}, {0.1}, 1e-5), ConfigError);
  CHECK_THROWS_AS(rdp_to_epsilon({2.0}, {-0.1}, 1e-5), ConfigError);
  CHECK_THROWS_AS(rdp_to_epsilon({2.0}, {kNaN}, 1e-5), ConfigError);
  CHECK_THROWS_AS(RdpAccountant(std::vector<double>{}), ConfigError);
  CHECK_THROWS_AS(RdpAccountant({3.0, 0.9}), ConfigError);

  RdpAccountant acc;
  acc.add(0.1, 1.0, 5);
  const std::vector<double> before = acc.rdp();
  CHECK_THROWS_AS(acc.add(0.1, 1.0, -1), ConfigError);
  CHECK_THROWS_AS(acc.add(1.5, 1.0, 1), ConfigError);
  CHECK_THROWS_AS(acc.add(0.1, 0.0, 1), ConfigError);
  CHECK_THROWS_AS(acc.epsilon(0.0), ConfigError);
  CHECK(acc.rdp() == before);  // a rejected add changes nothing
  CHECK(acc.steps() == 5);
  // ConfigError is a sparrow::Error.
  CHECK_THROWS_AS(sgm_rdp(2.0, 1.0, 2.0), sparrow::Error);
}
