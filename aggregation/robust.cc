#include "aggregation/robust.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "aggregation/dp_accountant.h"
#include "compression/compressor.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/spec.h"

namespace sparrow::aggregation {

namespace {

constexpr uint64_t kCentralNoiseTag = 0x64702d6e6f697365ull;  // "dp-noise"
constexpr uint64_t kCountNoiseTag = 0x64702d636f756e74ull;    // "dp-count"

double l2(const at::Tensor& flat) { return std::sqrt(flat.to(at::kDouble).square().sum().item<double>()); }

// Fills t with N(0, std²) drawn from rng::normal(key, offset + i).
void add_noise(at::Tensor& t, double stddev, uint64_t key, uint64_t offset) {
  if (stddev <= 0) return;
  float* p = t.data_ptr<float>();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i)
    p[i] += static_cast<float>(stddev * rng::normal(key, offset + static_cast<uint64_t>(i)));
}

[[noreturn]] void bad(const std::string& key, const std::string& msg) { throw ConfigError(key + ": " + msg); }

}  // namespace

// ---- specs ------------------------------------------------------------------

RobustSpec::RobustSpec() {
  Spec s = Spec::parse("mean");
  rule = aggregator_factory("mean")(s);
}

RobustSpec RobustSpec::parse(const std::string& text) {
  Spec s = Spec::parse(text);
  RobustSpec r;
  r.text = text;
  r.method = s.method();
  try {
    r.rule = aggregator_factory(s.method())(s);
    SPARROW_CHECK(r.rule, "aggregator '" << s.method() << "': its factory returned no rule");
    s.check_all_consumed();
  } catch (const ConfigError& e) {
    bad("aggregator", e.what());
  }
  return r;
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
  if (d.mode == DpSpec::Mode::kCentral && !r.is_mean())
    bad("dp",
        "central DP calibrates its noise to the clipped sum: use it with aggregator = \"mean\" (got '" + r.text + "')");
  const bool plain = r.is_mean() && d.mode != DpSpec::Mode::kCentral;
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

bool Accumulator::plain() const { return robust_.is_mean() && dp_.mode != DpSpec::Mode::kCentral; }

void Accumulator::reset(double clip) {
  clip_ = clip;
  sum_.reset();
  flat_sum_ = at::Tensor();
  rows_.clear();
  weights_.clear();
  norms_.clear();
  ids_.clear();
  within_clip_ = clipped_ = count_ = 0;
  weight_ = 0;
}

int64_t Accumulator::buffered_bytes() const { return static_cast<int64_t>(rows_.size()) * numel_ * 4; }

void Accumulator::set_max_update_norm(double bound) {
  sum_.set_max_update_norm(bound);
  if (scratch_) scratch_->set_max_update_norm(bound);
  max_norm_ = sum_.max_update_norm();
}

void Accumulator::add(const EncodedUpdate& update, double weight, const ContextMap& contexts,
                      const std::string& client) {
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
  const double bound = central ? clip_ : robust_.clip();
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
  ids_.push_back(client);
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
  ids_.insert(ids_.end(), o.ids_.begin(), o.ids_.end());
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
  st.clip = all.clip_ > 0 ? all.clip_ : robust_.clip();
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

  at::Tensor flat;
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
  } else if (!robust_.buffers()) {
    // A rule that streams is the weighted mean of its (clipped) rows (AggregationRule::buffers).
    flat = all.flat_sum_ / all.total_weight();
  } else {
    flat = robust_.rule->combine(RoundRows{all.rows_, all.weights_, all.norms_, all.total_weight(), all.ids_}, st);
    SPARROW_CHECK(flat.defined() && flat.scalar_type() == at::kFloat && flat.numel() == all.numel_,
                  "aggregator '" << robust_.method << "' returned " << (flat.defined() ? flat.numel() : 0)
                                 << " values for a model of " << all.numel_);
    flat = flat.reshape({-1});
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
