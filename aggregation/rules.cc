#include "aggregation/rules.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <numeric>

#include "core/error.h"
#include "core/registry.h"
#include "core/spec.h"

namespace sparrow::aggregation {

namespace {

// "method": RobustSpec::parse prefixes "aggregator: ", which gives the message
// users have always seen ("aggregator: unknown method 'x' (known: ...)").
core::Registry<AggregatorFactory>& registry() {
  static core::Registry<AggregatorFactory> r("method");
  return r;
}

// Columns sorted at once by median / trimmed mean / bulyan (bounds their scratch).
constexpr int64_t kColumnBlock = int64_t{1} << 16;

// Coordinate-wise order statistics over the rows of X [n, d], column block by
// column block: fn(sorted block [n, w]) -> [w].
template <class Fn>
at::Tensor by_columns(const at::Tensor& X, Fn fn) {
  const int64_t d = X.size(1);
  at::Tensor out = at::empty({d}, X.options());
  for (int64_t c = 0; c < d; c += kColumnBlock) {
    const int64_t w = std::min(kColumnBlock, d - c);
    out.narrow(0, c, w).copy_(fn(X.narrow(1, c, w)));
  }
  return out;
}

at::Tensor median_rows(const at::Tensor& X) {
  const int64_t n = X.size(0);
  return by_columns(X, [n](const at::Tensor& blk) {
    at::Tensor s = std::get<0>(blk.sort(0));
    if (n % 2 == 1) return s[n / 2].clone();
    return ((s[n / 2 - 1] + s[n / 2]) * 0.5).contiguous();
  });
}

// Σ w_i·row_i / Σ w_i over `ids` (all rows when empty).
at::Tensor weighted_mean(const RoundRows& r, const std::vector<size_t>& ids) {
  at::Tensor flat = at::zeros({r.rows.front().numel()}, r.rows.front().options());
  double w = 0;
  for (size_t j : ids) {
    flat.add_(r.rows[j], r.weights[j]);
    w += r.weights[j];
  }
  return flat.div_(w);
}

std::vector<size_t> all_ids(size_t n) {
  std::vector<size_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  return ids;
}

// Pairwise squared distances of the rows (double, exact differences rather
// than the Gram-matrix shortcut, which cancels badly for nearby updates).
std::vector<std::vector<double>> pairwise_sq(const std::vector<at::Tensor>& rows) {
  const size_t n = rows.size();
  std::vector<std::vector<double>> d(n, std::vector<double>(n, 0.0));
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j) {
      const double v = (rows[i] - rows[j]).to(at::kDouble).square().sum().item<double>();
      d[i][j] = d[j][i] = v;
    }
  return d;
}

// Krum scores of the candidates `cand`: Σ of the n − f − 2 smallest squared
// distances to the other candidates (at least 1 neighbour while there is one).
std::vector<double> krum_scores(const std::vector<std::vector<double>>& d, const std::vector<size_t>& cand, int64_t f) {
  const int64_t n = static_cast<int64_t>(cand.size());
  const int64_t k = std::max<int64_t>(std::min<int64_t>(n - f - 2, n - 1), n > 1 ? 1 : 0);
  std::vector<double> scores;
  for (size_t i : cand) {
    std::vector<double> others;
    for (size_t j : cand)
      if (j != i) others.push_back(d[i][j]);
    std::sort(others.begin(), others.end());
    scores.push_back(std::accumulate(others.begin(), others.begin() + k, 0.0));
  }
  return scores;
}

// ---- the built-in rules -------------------------------------------------------

class Mean final : public AggregationRule {
 public:
  bool is_mean() const override { return true; }
  bool buffers() const override { return false; }
  at::Tensor combine(const RoundRows& r, AggregateStats&) const override {
    return weighted_mean(r, all_ids(r.rows.size()));
  }
};

class Median final : public AggregationRule {
 public:
  at::Tensor combine(const RoundRows& r, AggregateStats&) const override { return median_rows(at::stack(r.rows)); }
};

class TrimmedMean final : public AggregationRule {
 public:
  explicit TrimmedMean(double beta) : beta_(beta) {}
  at::Tensor combine(const RoundRows& r, AggregateStats& st) const override {
    const int64_t n = static_cast<int64_t>(r.rows.size());
    const int64_t k = static_cast<int64_t>(std::floor(beta_ * static_cast<double>(n)));
    st.kept = n - 2 * k;
    return by_columns(at::stack(r.rows), [n, k](const at::Tensor& blk) {
      return std::get<0>(blk.sort(0)).narrow(0, k, n - 2 * k).mean(0);
    });
  }

 private:
  double beta_;
};

// krum, multikrum and bulyan: f lowered to what the round's n allows (a round
// that lost updates to stragglers), reported as stats.f_used.
class KrumFamily final : public AggregationRule {
 public:
  enum class Kind { kKrum, kMultiKrum, kBulyan };
  KrumFamily(Kind kind, int64_t f, int64_t m) : kind_(kind), f_(f), m_(m) {}
  int64_t min_updates() const override { return (kind_ == Kind::kBulyan ? 4 : 2) * f_ + 3; }
  at::Tensor combine(const RoundRows& r, AggregateStats& st) const override {
    const int64_t n = static_cast<int64_t>(r.rows.size());
    const int64_t per = kind_ == Kind::kBulyan ? 4 : 2;
    const int64_t f = std::max<int64_t>(0, std::min(f_, (n - 3) / per));
    st.f_used = f;
    const auto d = pairwise_sq(r.rows);
    std::vector<size_t> cand = all_ids(static_cast<size_t>(n));
    if (kind_ == Kind::kBulyan) {
      const int64_t theta = n - 2 * f;
      std::vector<at::Tensor> chosen;
      while (static_cast<int64_t>(chosen.size()) < theta) {
        const std::vector<double> sc = krum_scores(d, cand, f);
        const size_t best = static_cast<size_t>(std::min_element(sc.begin(), sc.end()) - sc.begin());
        chosen.push_back(r.rows[cand[best]]);
        cand.erase(cand.begin() + static_cast<std::ptrdiff_t>(best));
      }
      const int64_t beta = std::max<int64_t>(1, theta - 2 * f);
      st.kept = theta;
      return by_columns(at::stack(chosen), [beta](const at::Tensor& blk) {
        at::Tensor med = median_rows(blk.contiguous());
        at::Tensor idx = std::get<1>((blk - med).abs().topk(beta, 0, /*largest=*/false));
        return blk.gather(0, idx).mean(0);
      });
    }
    const std::vector<double> sc = krum_scores(d, cand, f);
    std::vector<size_t> order = all_ids(static_cast<size_t>(n));
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sc[a] < sc[b]; });
    if (kind_ == Kind::kKrum) {
      st.kept = 1;
      return r.rows[order[0]].clone();
    }
    const int64_t m = m_ > 0 ? std::min(m_, n) : n - f;
    st.kept = m;
    order.resize(static_cast<size_t>(m));
    return weighted_mean(r, order);
  }

 private:
  Kind kind_;
  int64_t f_;
  int64_t m_;  // multikrum (0 = n − f)
};

// normclip:c=C clips each update as it arrives and streams the weighted mean;
// normclip:q=Q buffers, then clips to the Q-quantile (nearest rank) of the
// round's norms.
class NormClip final : public AggregationRule {
 public:
  NormClip(double clip, double quantile) : clip_(clip), quantile_(quantile) {}
  bool buffers() const override { return quantile_ > 0; }
  double clip() const override { return clip_; }
  at::Tensor combine(const RoundRows& r, AggregateStats& st) const override {
    const int64_t n = static_cast<int64_t>(r.rows.size());
    if (quantile_ <= 0) return weighted_mean(r, all_ids(r.rows.size()));
    std::vector<double> v = r.norms;
    std::sort(v.begin(), v.end());
    const size_t idx = static_cast<size_t>(std::ceil(quantile_ * static_cast<double>(n))) - 1;
    const double c = v[std::min(idx, v.size() - 1)];
    st.clip = c;
    st.clipped = 0;
    at::Tensor flat = at::zeros({r.rows.front().numel()}, r.rows.front().options());
    for (size_t i = 0; i < r.rows.size(); ++i) {
      const double nm = r.norms[i];
      const double s = nm > c && nm > 0 ? c / nm : 1.0;
      if (s < 1) st.clipped += 1;
      flat.add_(r.rows[i], s * r.weights[i]);
    }
    return flat.div_(r.total_weight);
  }

 private:
  double clip_;
  double quantile_;
};

std::shared_ptr<const AggregationRule> make_krum(Spec& s, KrumFamily::Kind kind) {
  const int64_t f = s.get_int("f", 1);
  SPARROW_CHECK_T(ConfigError, f >= 0, s.method() << ": f must be >= 0");
  int64_t m = 0;
  if (kind == KrumFamily::Kind::kMultiKrum) {
    m = s.get_int("m", 0);
    SPARROW_CHECK_T(ConfigError, m >= 0, "multikrum: m must be >= 0 (0 = n - f)");
  }
  return std::make_shared<KrumFamily>(kind, f, m);
}

}  // namespace

void detail::register_rules() {
  auto& r = registry();
  r.add(
      "mean", [](Spec&) { return std::make_shared<Mean>(); },
      "sample-weighted mean, streamed (O(model) memory; the default)");
  r.add(
      "median", [](Spec&) { return std::make_shared<Median>(); },
      "coordinate-wise median (mean of the two middle values for even n)");
  r.add(
      "trimmed_mean",
      [](Spec& s) {
        const double beta = s.get_double("beta", 0.1);
        SPARROW_CHECK_T(ConfigError, beta >= 0 && beta < 0.5, "trimmed_mean: beta must be in [0, 0.5)");
        return std::make_shared<TrimmedMean>(beta);
      },
      "[beta=0.1] per coordinate, the floor(beta n) largest and smallest dropped, the rest averaged");
  r.add(
      "krum", [](Spec& s) { return make_krum(s, KrumFamily::Kind::kKrum); },
      "[f=1] the update with the least sum of squared distances to its n - f - 2 nearest others");
  r.add(
      "multikrum", [](Spec& s) { return make_krum(s, KrumFamily::Kind::kMultiKrum); },
      "[f=1,m=0] the m best Krum scores (0: n - f), sample-weighted mean");
  r.add(
      "bulyan", [](Spec& s) { return make_krum(s, KrumFamily::Kind::kBulyan); },
      "[f=1] Krum picks n - 2f updates, then per coordinate the values nearest the median are averaged");
  r.add(
      "normclip",
      [](Spec& s) {
        const double clip = s.get_double("c", 0);
        const double quantile = s.get_double("q", 0);
        SPARROW_CHECK_T(ConfigError, (clip > 0) != (quantile > 0) && clip >= 0 && quantile >= 0,
                        "normclip needs exactly one of c=C (> 0, a fixed norm) or q=Q (in (0, 1], a quantile)");
        SPARROW_CHECK_T(ConfigError, quantile <= 1, "normclip: q must be in (0, 1]");
        return std::make_shared<NormClip>(clip, quantile);
      },
      "c=C | q=Q: each update clipped to L2 norm C (or the round's Q-quantile), then the sample-weighted mean");
}

void register_builtins() {
  static std::once_flag once;
  std::call_once(once, [] {
    detail::register_rules();
    detail::register_optimizers();
  });
}

void register_aggregator(const std::string& name, AggregatorFactory factory, const std::string& description) {
  register_builtins();  // first, so that a user's name clashing with a built-in fails here
  SPARROW_CHECK(factory, "register_aggregator: '" << name << "' has no factory");
  registry().add(name, std::move(factory), description);
}

AggregatorFactory aggregator_factory(const std::string& name) {
  register_builtins();
  return registry().get(name);
}

std::vector<std::string> aggregator_names() {
  register_builtins();
  return registry().names();
}

bool known_aggregator(const std::string& name) {
  register_builtins();
  return registry().contains(name);
}

std::string aggregator_description(const std::string& name) {
  register_builtins();
  return registry().description(name);
}

}  // namespace sparrow::aggregation
