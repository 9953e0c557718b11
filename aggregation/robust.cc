#include "aggregation/robust.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "aggregation/dp_accountant.h"
#include "compression/compressor.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/spec.h"

namespace sparrow::aggregation {

namespace {

constexpr uint64_t kCentralNoiseTag = 0x64702d6e6f697365ull;  // "dp-noise"
constexpr uint64_t kCountNoiseTag = 0x64702d636f756e74ull;    // "dp-count"
// Columns sorted at once by median / trimmed mean / bulyan (bounds their scratch).
constexpr int64_t kColumnBlock = int64_t{1} << 16;

double l2(const at::Tensor& flat) { return std::sqrt(flat.to(at::kDouble).square().sum().item<double>()); }

// Fills t with N(0, std²) drawn from rng::normal(key, offset + i).
void add_noise(at::Tensor& t, double stddev, uint64_t key, uint64_t offset) {
  if (stddev <= 0) return;
  float* p = t.data_ptr<float>();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i)
    p[i] += static_cast<float>(stddev * rng::normal(key, offset + static_cast<uint64_t>(i)));
}

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

// Pairwise squared distances of the rows (double, exact differences rather
// than the Gram-matrix shortcut, which cancels badly for nearby updates).
std::vector<std::vector<double>> pairwise_sq(const std::vector<at::Tensor>& rows, const std::vector<int64_t>& ids) {
  const size_t n = ids.size();
  std::vector<std::vector<double>> d(n, std::vector<double>(n, 0.0));
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j) {
      const double v = (rows[static_cast<size_t>(ids[i])] - rows[static_cast<size_t>(ids[j])])
                           .to(at::kDouble)
                           .square()
                           .sum()
                           .item<double>();
      d[i][j] = d[j][i] = v;
    }
  return d;
}

// Krum scores of the candidates `ids`: Σ of the n − f − 2 smallest squared
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

[[noreturn]] void bad(const std::string& key, const std::string& msg) { throw ConfigError(key + ": " + msg); }

}  // namespace

// ---- specs ------------------------------------------------------------------

RobustSpec RobustSpec::parse(const std::string& text) {
  Spec s = Spec::parse(text);
  RobustSpec r;
  r.text = text;
  const std::string& m = s.method();
  if (m == "mean") {
    r.method = Method::kMean;
  } else if (m == "median") {
    r.method = Method::kMedian;
  } else if (m == "trimmed_mean") {
    r.method = Method::kTrimmedMean;
    r.beta = s.get_double("beta", 0.1);
    if (!(r.beta >= 0 && r.beta < 0.5)) bad("aggregator", "trimmed_mean: beta must be in [0, 0.5)");
  } else if (m == "krum" || m == "multikrum" || m == "bulyan") {
    r.method = m == "krum" ? Method::kKrum : m == "multikrum" ? Method::kMultiKrum : Method::kBulyan;
    r.f = s.get_int("f", 1);
    if (r.f < 0) bad("aggregator", m + ": f must be >= 0");
    if (m == "multikrum") {
      r.m = s.get_int("m", 0);
      if (r.m < 0) bad("aggregator", "multikrum: m must be >= 0 (0 = n - f)");
    }
  } else if (m == "normclip") {
    r.method = Method::kNormClip;
    r.clip = s.get_double("c", 0);
    r.quantile = s.get_double("q", 0);
    if ((r.clip > 0) == (r.quantile > 0) || r.clip < 0 || r.quantile < 0)
      bad("aggregator", "normclip needs exactly one of c=C (> 0, a fixed norm) or q=Q (in (0, 1], a quantile)");
    if (r.quantile > 1) bad("aggregator", "normclip: q must be in (0, 1]");
  } else {
    bad("aggregator", "unknown method '" + m +
                          "' (mean, median, trimmed_mean:beta=, krum:f=, multikrum:f=,m=, bulyan:f=, "
                          "normclip:c= or normclip:q=)");
  }
  try {
    s.check_all_consumed();
  } catch (const ConfigError& e) {
    bad("aggregator", e.what());
  }
  return r;
}

bool RobustSpec::buffers() const {
  switch (method) {
    case Method::kMean:
      return false;
    case Method::kNormClip:
      return quantile > 0;
    default:
      return true;
  }
}

int64_t RobustSpec::min_updates() const {
  switch (method) {
    case Method::kKrum:
    case Method::kMultiKrum:
      return 2 * f + 3;
    case Method::kBulyan:
      return 4 * f + 3;
    default:
      return 1;
  }
}

DpSpec DpSpec::parse(const std::string& text) {
  Spec s = Spec::parse(text);
  DpSpec d;
  d.text = text;
  const std::string& m = s.method();
  if (m == "none") {
    d.mode = Mode::kNone;
  } else if (m == "central" || m == "local") {
    d.mode = m == "central" ? Mode::kCentral : Mode::kLocal;
    d.clip = s.require_double("clip");
    d.noise = s.require_double("noise");
    d.delta = s.get_double("delta", 1e-5);
    if (!(d.clip > 0)) bad("dp", "clip must be > 0");
    if (!(d.noise >= 0)) bad("dp", "noise must be >= 0");
    if (!(d.delta > 0 && d.delta < 1)) bad("dp", "delta must be in (0, 1)");
    if (m == "central") {
      d.adaptive = s.get_bool("adaptive", false);
      d.quantile = s.get_double("quantile", 0.5);
      d.clip_lr = s.get_double("clip_lr", 0.2);
      d.count_noise = s.get_double("count_noise", 0);
      if (!(d.quantile > 0 && d.quantile < 1)) bad("dp", "quantile must be in (0, 1)");
      if (!(d.clip_lr > 0)) bad("dp", "clip_lr must be > 0");
      if (!(d.count_noise >= 0)) bad("dp", "count_noise must be >= 0");
    }
  } else {
    bad("dp", "unknown mode '" + m + "' (none, central:clip=,noise= or local:clip=,noise=)");
  }
  try {
    s.check_all_consumed();
  } catch (const ConfigError& e) {
    bad("dp", e.what());
  }
  return d;
}

void check_combination(const RobustSpec& r, const DpSpec& d, const std::string& compression,
                       const std::string& algorithm) {
  if (d.mode == DpSpec::Mode::kCentral && r.method != RobustSpec::Method::kMean)
    bad("dp",
        "central DP calibrates its noise to the clipped sum: use it with aggregator = \"mean\" (got '" + r.text + "')");
  const bool plain = r.method == RobustSpec::Method::kMean && d.mode != DpSpec::Mode::kCentral;
  if (!plain && Spec::parse(compression).method() == "acp")
    bad("aggregator",
        "acp compression sums factors across clients; robust aggregation and central DP need each "
        "client's update: use powersgd, topk, dgc or a quantiser");
  if (!plain && compression::make_compressor(compression)->share_mean())
    bad("aggregator",
        "tcs share=mean averages each mask position over the updates that carried it, which only the plain mean "
        "does: use share=sum with robust aggregation or central DP");
  if (d.mode != DpSpec::Mode::kNone && algorithm == "scaffold")
    bad("dp", "scaffold's control variates would be released without protection: use fedavg or fedprox with dp");
}

double local_dp(std::map<std::string, at::Tensor>& update, double clip, double noise, uint64_t key) {
  double sq = 0;
  for (auto& [n, t] : update) sq += t.to(at::kDouble).square().sum().item<double>();
  const double norm = std::sqrt(sq);
  const double scale = norm > clip ? clip / norm : 1.0;
  uint64_t offset = 0;
  for (auto& [n, t] : update) {
    at::Tensor v = t.to(at::kCPU, at::kFloat).contiguous().clone();
    if (scale < 1) v.mul_(scale);
    add_noise(v, noise * clip, key, offset);
    offset += static_cast<uint64_t>(v.numel());
    t = v;
  }
  return norm;
}

// ---- Accumulator ------------------------------------------------------------

Accumulator::Accumulator(TensorShapes shapes, RobustSpec robust, DpSpec dp)
    : shapes_(std::move(shapes)), robust_(std::move(robust)), dp_(std::move(dp)), sum_(shapes_) {
  for (const auto& [n, s] : shapes_) {
    int64_t k = 1;
    for (int64_t v : s) k *= v;
    numel_ += k;
  }
  if (!plain()) scratch_ = std::make_unique<StreamingAggregator>(shapes_);
}

bool Accumulator::plain() const {
  return robust_.method == RobustSpec::Method::kMean && dp_.mode != DpSpec::Mode::kCentral;
}

void Accumulator::reset(double clip) {
  clip_ = clip;
  sum_.reset();
  flat_sum_ = at::Tensor();
  rows_.clear();
  weights_.clear();
  norms_.clear();
  within_clip_ = clipped_ = count_ = 0;
  weight_ = 0;
}

int64_t Accumulator::buffered_bytes() const { return static_cast<int64_t>(rows_.size()) * numel_ * 4; }

void Accumulator::set_max_update_norm(double bound) {
  sum_.set_max_update_norm(bound);
  if (scratch_) scratch_->set_max_update_norm(bound);
  max_norm_ = sum_.max_update_norm();
}

void Accumulator::add(const EncodedUpdate& update, double weight, const ContextMap& contexts) {
  if (plain()) {
    sum_.add(update, weight, contexts);
    count_ += 1;
    weight_ += weight;
    return;
  }
  SPARROW_CHECK(std::isfinite(weight) && weight > 0,
                "Accumulator: weight must be finite and > 0 (got " << weight << ")");
  // Decode once (validates names, shapes and payloads; nothing changes on a throw).
  scratch_->reset();
  scratch_->add(update, 1.0, contexts);
  std::map<std::string, at::Tensor> dense = scratch_->mean();
  scratch_->reset();
  at::Tensor row = at::empty({numel_}, at::TensorOptions().dtype(at::kFloat));
  int64_t off = 0;
  for (const auto& [n, s] : shapes_) {
    const at::Tensor& t = dense.at(n);
    row.narrow(0, off, t.numel()).copy_(t.reshape({-1}));
    off += t.numel();
  }
  SPARROW_CHECK_T(FormatError, compression::all_finite(row), "update has a non-finite value");
  const double norm = l2(row);
  SPARROW_CHECK_T(FormatError, norm <= max_norm_,
                  "update norm " << norm << " exceeds " << detail::norm_bound_text(max_norm_));
  const bool central = dp_.mode == DpSpec::Mode::kCentral;
  SPARROW_CHECK(!central || clip_ > 0, "Accumulator: central DP needs reset(clip) with the round's clip first");
  const double bound = central ? clip_ : (robust_.method == RobustSpec::Method::kNormClip ? robust_.clip : 0);
  if (bound > 0) {
    if (norm <= bound) within_clip_ += 1;
    if (norm > bound) {
      row.mul_(bound / norm);
      clipped_ += 1;
    }
  }
  if (robust_.buffers()) {
    rows_.push_back(std::move(row));
  } else {
    // Central DP sums unweighted (each client's contribution is bounded by C);
    // normclip:c keeps the sample weights.
    const double w = central ? 1.0 : weight;
    if (!flat_sum_.defined()) flat_sum_ = at::zeros({numel_}, at::TensorOptions().dtype(at::kFloat));
    flat_sum_.add_(row, w);
  }
  weights_.push_back(weight);
  norms_.push_back(norm);
  count_ += 1;
  weight_ += weight;
}

void Accumulator::merge(const Accumulator& o) {
  SPARROW_CHECK(o.shapes_ == shapes_ && o.robust_.text == robust_.text && o.dp_.text == dp_.text,
                "Accumulator::merge: shares of different aggregations");
  SPARROW_CHECK(o.clip_ == clip_, "Accumulator::merge: shares with different clips");
  if (plain()) {
    sum_.merge(o.sum_);
  } else {
    if (o.flat_sum_.defined()) {
      if (!flat_sum_.defined())
        flat_sum_ = o.flat_sum_.clone();
      else
        flat_sum_.add_(o.flat_sum_);
    }
    rows_.insert(rows_.end(), o.rows_.begin(), o.rows_.end());
  }
  weights_.insert(weights_.end(), o.weights_.begin(), o.weights_.end());
  norms_.insert(norms_.end(), o.norms_.begin(), o.norms_.end());
  within_clip_ += o.within_clip_;
  clipped_ += o.clipped_;
  count_ += o.count_;
  weight_ += o.weight_;
}

// ---- Aggregator -------------------------------------------------------------

Aggregator::Aggregator(const std::string& aggregator_spec, const std::string& dp_spec, int64_t expected_clients,
                       uint64_t seed)
    : robust_(RobustSpec::parse(aggregator_spec)),
      dp_(DpSpec::parse(dp_spec)),
      expected_(std::max<int64_t>(1, expected_clients)),
      seed_(seed) {
  if (dp_.mode == DpSpec::Mode::kCentral) {
    clip_ = dp_.clip;
    if (dp_.adaptive) {
      const double sb = dp_.count_noise > 0 ? dp_.count_noise : static_cast<double>(expected_) / 20.0;
      if (dp_.noise > 0 && !(2 * sb > dp_.noise))
        bad("dp", "adaptive clipping needs count_noise > noise / 2 (the count's noise takes part of the budget)");
    }
  }
}

double Aggregator::clip() const { return dp_.mode == DpSpec::Mode::kCentral ? clip_ : 0.0; }

std::map<std::string, at::Tensor> Aggregator::finish(const Accumulator& all, uint64_t round, AggregateStats* stats) {
  SPARROW_CHECK(all.count() > 0 && all.total_weight() > 0, "aggregate: the round has no update");
  AggregateStats st;
  st.updates = all.count();
  st.kept = all.count();
  st.clipped = all.clipped_;
  st.clip = all.clip_ > 0 ? all.clip_ : (robust_.method == RobustSpec::Method::kNormClip ? robust_.clip : 0);
  st.median_norm = std::numeric_limits<double>::quiet_NaN();
  if (!all.norms_.empty()) {
    std::vector<double> v = all.norms_;
    std::sort(v.begin(), v.end());
    const size_t k = v.size();
    st.median_norm = k % 2 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
  }
  if (all.plain()) {
    if (stats) *stats = st;
    return all.sum_.mean();
  }

  const int64_t n = all.count();
  at::Tensor flat;
  using M = RobustSpec::Method;
  if (dp_.mode == DpSpec::Mode::kCentral) {
    SPARROW_CHECK(all.clip_ == clip_,
                  "aggregate: the round's updates were clipped at " << all.clip_ << ", not at " << clip_);
    // (Σ clip(u) + N(0, (σ_Δ·C)²)) / m; adaptive: the clip follows the norms' quantile.
    double z = dp_.noise;
    double sb = 0;
    if (dp_.adaptive) {
      sb = dp_.count_noise > 0 ? dp_.count_noise : static_cast<double>(expected_) / 20.0;
      if (z > 0) z = 1.0 / std::sqrt(1.0 / (z * z) - 1.0 / (4 * sb * sb));
    }
    flat = all.flat_sum_.clone();
    add_noise(flat, z * all.clip_, rng::derive(rng::derive(seed_, kCentralNoiseTag), round), 0);
    flat.div_(static_cast<double>(expected_));
    if (dp_.adaptive) {
      const double noisy =
          static_cast<double>(all.within_clip_) +
          (dp_.noise > 0 ? sb * rng::normal(rng::derive(rng::derive(seed_, kCountNoiseTag), round), 0) : 0.0);
      const double frac = noisy / static_cast<double>(expected_);
      clip_ = all.clip_ * std::exp(-dp_.clip_lr * (frac - dp_.quantile));
    }
  } else if (robust_.method == M::kNormClip && robust_.quantile <= 0) {
    flat = all.flat_sum_ / all.total_weight();
  } else {
    const std::vector<at::Tensor>& rows = all.rows_;
    at::Tensor X = at::stack(rows);  // [n, d]
    switch (robust_.method) {
      case M::kMedian:
        flat = median_rows(X);
        break;
      case M::kTrimmedMean: {
        const int64_t k = static_cast<int64_t>(std::floor(robust_.beta * static_cast<double>(n)));
        st.kept = n - 2 * k;
        flat = by_columns(
            X, [n, k](const at::Tensor& blk) { return std::get<0>(blk.sort(0)).narrow(0, k, n - 2 * k).mean(0); });
        break;
      }
      case M::kNormClip: {
        // Clip to the q-quantile of the round's norms (nearest rank), weighted mean.
        std::vector<double> v = all.norms_;
        std::sort(v.begin(), v.end());
        const size_t idx = static_cast<size_t>(std::ceil(robust_.quantile * static_cast<double>(n))) - 1;
        const double c = v[std::min(idx, v.size() - 1)];
        st.clip = c;
        st.clipped = 0;
        flat = at::zeros({X.size(1)}, X.options());
        for (int64_t i = 0; i < n; ++i) {
          const double nm = all.norms_[static_cast<size_t>(i)];
          const double s = nm > c && nm > 0 ? c / nm : 1.0;
          if (s < 1) st.clipped += 1;
          flat.add_(X[i], s * all.weights_[static_cast<size_t>(i)]);
        }
        flat.div_(all.total_weight());
        break;
      }
      case M::kKrum:
      case M::kMultiKrum:
      case M::kBulyan: {
        // f lowered to what n allows (a round that lost updates to stragglers).
        const int64_t per = robust_.method == M::kBulyan ? 4 : 2;
        const int64_t f = std::max<int64_t>(0, std::min(robust_.f, (n - 3) / per));
        st.f_used = f;
        std::vector<int64_t> ids(static_cast<size_t>(n));
        std::iota(ids.begin(), ids.end(), 0);
        const auto d = pairwise_sq(rows, ids);
        std::vector<size_t> cand(static_cast<size_t>(n));
        std::iota(cand.begin(), cand.end(), 0);
        if (robust_.method == M::kBulyan) {
          const int64_t theta = n - 2 * f;
          std::vector<int64_t> chosen;
          while (static_cast<int64_t>(chosen.size()) < theta) {
            const std::vector<double> sc = krum_scores(d, cand, f);
            const size_t best = static_cast<size_t>(std::min_element(sc.begin(), sc.end()) - sc.begin());
            chosen.push_back(static_cast<int64_t>(cand[best]));
            cand.erase(cand.begin() + static_cast<std::ptrdiff_t>(best));
          }
          const int64_t beta = std::max<int64_t>(1, theta - 2 * f);
          at::Tensor S = X.index_select(0, at::tensor(chosen, at::kLong));
          st.kept = theta;
          flat = by_columns(S, [beta](const at::Tensor& blk) {
            at::Tensor med = median_rows(blk.contiguous());
            at::Tensor idx = std::get<1>((blk - med).abs().topk(beta, 0, /*largest=*/false));
            return blk.gather(0, idx).mean(0);
          });
        } else {
          const std::vector<double> sc = krum_scores(d, cand, f);
          std::vector<size_t> order(static_cast<size_t>(n));
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sc[a] < sc[b]; });
          if (robust_.method == M::kKrum) {
            st.kept = 1;
            flat = X[static_cast<int64_t>(order[0])].clone();
          } else {
            const int64_t m = robust_.m > 0 ? std::min(robust_.m, n) : n - f;
            st.kept = m;
            flat = at::zeros({X.size(1)}, X.options());
            double w = 0;
            for (int64_t i = 0; i < m; ++i) {
              const size_t j = order[static_cast<size_t>(i)];
              flat.add_(X[static_cast<int64_t>(j)], all.weights_[j]);
              w += all.weights_[j];
            }
            flat.div_(w);
          }
        }
        break;
      }
      default:
        SPARROW_CHECK(false, "aggregate: unhandled method");
    }
  }
  std::map<std::string, at::Tensor> out;
  int64_t off = 0;
  for (const auto& [name, shape] : all.shapes_) {
    int64_t k = 1;
    for (int64_t v : shape) k *= v;
    out[name] = flat.narrow(0, off, k).reshape(shape).contiguous();
    off += k;
  }
  if (stats) *stats = st;
  return out;
}

double Aggregator::epsilon(int64_t rounds, double q, int64_t participations) const {
  const double inf = std::numeric_limits<double>::infinity();
  if (dp_.mode == DpSpec::Mode::kNone || dp_.noise <= 0) return inf;
  if (dp_.mode == DpSpec::Mode::kCentral) {
    if (rounds <= 0) return 0;
    return sgm_epsilon(std::clamp(q, 0.0, 1.0), dp_.noise, rounds, dp_.delta).epsilon;
  }
  if (participations <= 0) return 0;
  return sgm_epsilon(1.0, dp_.noise, participations, dp_.delta).epsilon;
}

std::string Aggregator::serialize_state() const {
  std::string out = "SPAG1";
  out.append(reinterpret_cast<const char*>(&clip_), sizeof(clip_));
  return out;
}

void Aggregator::deserialize_state(const std::string& bytes) {
  if (bytes.empty()) return;  // a checkpoint from before robust aggregation: the initial state
  SPARROW_CHECK_T(FormatError, bytes.size() == 5 + sizeof(double) && bytes.compare(0, 5, "SPAG1") == 0,
                  "aggregator state: malformed (" << bytes.size() << " bytes)");
  double c;
  std::memcpy(&c, bytes.data() + 5, sizeof(c));
  SPARROW_CHECK_T(FormatError, std::isfinite(c) && c >= 0, "aggregator state: bad clip " << c);
  SPARROW_CHECK_T(FormatError, dp_.mode != DpSpec::Mode::kCentral || c > 0, "aggregator state: central DP clip is 0");
  if (dp_.mode == DpSpec::Mode::kCentral) clip_ = c;
}

}  // namespace sparrow::aggregation
