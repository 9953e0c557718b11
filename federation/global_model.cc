#include "federation/global_model.h"

#include <ATen/ATen.h>

#include <utility>

#include <spdlog/spdlog.h>

#include "compression/codec_bits.h"
#include "compression/lowrank.h"
#include "compression/mask.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/spec.h"
#include "federation/algorithms.h"

namespace sparrow::federation {

GlobalModel::GlobalModel(const GlobalConfig& cfg, Weights initial, std::vector<std::string> names)
    : cfg_(cfg), names_(std::move(names)), global_(std::move(initial)) {
  SPARROW_CHECK(global_.size() == names_.size(),
                "GlobalModel: " << names_.size() << " names for " << global_.size() << " tensors");
  for (const auto& n : names_) SPARROW_CHECK(global_.count(n), "GlobalModel: no tensor '" << n << "'");
  compression::register_builtins();
  opt_ = std::make_unique<aggregation::ServerOptimizer>(cfg_.server_optimizer);
  Spec up = Spec::parse(cfg_.compression);
  if (up.method() == "acp") acp_rank_ = up.get_int("rank", 0);
  {
    const auto uplink = compression::make_compressor(cfg_.compression);
    mask_ratio_ = uplink->mask_ratio();
    share_mean_ = uplink->share_mean();
  }
  if (cfg_.downlink != "none") {
    down_ = compression::make_compressor(cfg_.downlink);
    exact_step_ = cfg_.server_optimizer.rfind("fedtopk", 0) == 0 &&
                  cfg_.server_optimizer.find("values=sign") != std::string::npos;
    for (const auto& n : names_) broadcast_[n] = global_.at(n).clone();
    catchup_ = std::make_unique<CatchupHistory>(parse_catchup(cfg_.downlink_catchup), names_, broadcast_);
  } else {
    parse_catchup(cfg_.downlink_catchup);  // a bad key is an error with or without a codec
  }
}

GlobalModel::~GlobalModel() = default;

at::Tensor GlobalModel::mask(const std::string& name) const {
  auto it = shared_.find(compression::mask_key(name));
  if (it == shared_.end()) return {};
  return compression::mask_from_weights(it->second, global_.at(name).numel());
}

aggregation::ContextMap GlobalModel::contexts(uint64_t r, int num_selected, const Weights* masks) {
  SPARROW_CHECK(r >= 1, "GlobalModel::contexts: rounds start at 1, got " << r);
  aggregation::ContextMap out;
  for (const auto& n : names_) {
    compression::Context c;
    c.name = n;
    c.seed = cfg_.seed;
    c.num_workers = num_selected;
    c.round = static_cast<int64_t>(r);
    const std::vector<int64_t> shape = global_.at(n).sizes().vec();
    if (acp_rank_ > 0 && compression::lowrank_compressible(shape, acp_rank_)) {
      const auto d = compression::lowrank_dims(shape, acp_rank_);
      auto it = shared_.find(n);
      if (it == shared_.end() || it->second.sizes().vec() != compression::acp_shared_shape(d, c.round))
        shared_[n] = compression::acp_initial_shared(c, d, c.round);
      c.shared_factor = shared_.at(n);
    }
    if (mask_ratio_ > 0) {
      if (masks != nullptr) {
        if (auto it = masks->find(n); it != masks->end()) c.mask = it->second;
      } else {
        c.mask = mask(n);
      }
    }
    c.share_mean = share_mean_;  // also without a broadcast mask (tcs mask=all)
    out[n] = std::move(c);
  }
  return out;
}

StepResult GlobalModel::finish_only(aggregation::Aggregator& aggregator, const aggregation::Accumulator& agg,
                                    uint64_t r, aggregation::AggregateStats* stats) {
  StepResult out;
  const std::string saved = aggregator.serialize_state();
  try {
    out.delta = aggregator.finish(agg, r, stats);
    for (const auto& [n, v] : out.delta)
      SPARROW_CHECK(compression::all_finite(v), "non-finite aggregate at '" << n << "'");
  } catch (const Error& e) {
    aggregator.deserialize_state(saved);
    out.delta.clear();
    out.error = e.what();
    return out;
  }
  out.applied = true;
  return out;
}

StepResult GlobalModel::step(aggregation::Aggregator& aggregator, const aggregation::Accumulator& agg,
                             const Weights& control_sum, uint64_t r, double population,
                             aggregation::AggregateStats* stats) {
  SPARROW_CHECK(population > 0, "GlobalModel::step: population must be > 0");
  const std::string saved = aggregator.serialize_state();
  StepResult out;
  Weights before, h;
  try {
    out.delta = aggregator.finish(agg, r, stats);
    if (cfg_.algorithm == "fednova") {
      const double s = fednova_scale(control_sum);
      for (auto& [n, v] : out.delta) v.mul_(s);
    } else if (cfg_.algorithm == "feddyn") {
      for (const auto& [n, v] : control_) h[n] = v.clone();  // committed with the step
      feddyn_step(h, out.delta, cfg_.alpha, agg.count(), population);
    }
    if (mask_ratio_ > 0)
      for (const auto& [n, v] : global_) before[n] = v.clone();
    opt_->step(global_, out.delta);  // throws, changing nothing, on a non-finite delta
  } catch (const Error& e) {
    aggregator.deserialize_state(saved);
    out.delta.clear();
    out.error = e.what();
    return out;
  }
  out.applied = true;
  if (cfg_.algorithm == "feddyn") control_ = std::move(h);
  // TCS: the next round's mask is where this step moved the model most.
  if (mask_ratio_ > 0) compression::put_step_masks(shared_, before, global_, mask_ratio_);
  if (cfg_.algorithm == "scaffold" && !control_sum.empty()) {
    if (control_.empty())
      for (const auto& [n, v] : global_) control_[n] = at::zeros_like(v);
    for (const auto& [n, v] : control_sum) control_.at(n).add_(v, 1.0 / population);
  }
  if (acp_rank_ > 0) {
    Weights next;
    for (const auto& n : names_) {
      at::Tensor f = agg.streaming().total_weight() > 0 ? agg.streaming().factor_mean(n) : at::Tensor();
      if (f.defined()) next[n] = compression::acp_next_shared(f);
    }
    shared_ = std::move(next);
  }
  encode_downlink(r, out);
  return out;
}

void GlobalModel::encode_downlink(uint64_t r, StepResult& out) {
  if (!down_) return;
  const uint64_t key = rng::derive(cfg_.seed, kDownTag);
  const bool track = catchup_->policy().patch();
  catchup_->begin_step(r);
  std::vector<wire::NamedTensor> kept;
  for (size_t i = 0; i < names_.size(); ++i) {
    const std::string& n = names_[i];
    const at::Tensor diff = (global_.at(n) - broadcast_.at(n)).contiguous();
    compression::Context c;
    c.name = n;
    c.seed = key;
    c.round = static_cast<int64_t>(r);
    // W - B already holds everything not yet broadcast: it is the error
    // feedback. The codec's own memory (residual, DGC's u and v) would count
    // that part a second time and overshoot, so each round starts from an
    // empty state at step r - 1 (one encode a round: its random streams).
    compression::State st;
    st.step = r - 1;
    compression::Encoded e = down_->encode(diff, st, c);
    const at::Tensor before = track || exact_step_ ? broadcast_.at(n).clone() : at::Tensor();
    compression::decode_add(e, broadcast_.at(n), 1.0f, c);
    // The sparse model step moves W by ±mu, which a codec that sends every
    // nonzero of W - B with one magnitude (stc:ratio=1) carries exactly. When
    // a move was not exact in fp32 (a weight that crosses into the next binade
    // with an odd last bit rounds), W - B is ±mu plus a rounding there, the
    // codec's magnitude misses at every position of the tensor, and B would
    // drift from W for good (every later C then carries the drift: 5x the
    // downlink in one MLP seed of five). Then this tensor's C is W - B itself,
    // fp32 at its nonzero positions: B + (W - B) is W exactly.
    if (exact_step_ && !at::equal(broadcast_.at(n), global_.at(n))) {
      const at::Tensor nz = diff.reshape(-1).nonzero().reshape(-1).contiguous();
      const at::Tensor vals = diff.reshape(-1).index_select(0, nz).contiguous();
      e = compression::detail::make_sparse(diff.sizes().vec(), nz.data_ptr<int64_t>(), vals.data_ptr<float>(),
                                           static_cast<uint64_t>(nz.numel()), compression::ValueType::kF32, 0.0f,
                                           compression::detail::IndexMode::kRice);
      broadcast_.at(n).copy_(before);
      compression::decode_add(e, broadcast_.at(n), 1.0f, c);
      ++exact_fallbacks_;
      if (!at::equal(broadcast_.at(n), global_.at(n)))
        spdlog::warn("downlink: round {}: '{}' could not be broadcast exactly; clients lag the model there", r, n);
      else
        spdlog::debug("downlink: round {}: '{}' sent as exact fp32 values (a step rounded in fp32)", r, n);
    }
    if (track) catchup_->record_tensor(i, before, broadcast_.at(n));
    // A sparse C with no value leaves B as it was: it is not sent (a Delta
    // names the tensors it changes), except one, so that a Delta against
    // B_{r-2} always carries a tensor.
    const bool empty = e.format == compression::Format::kSparse && e.count == 0;
    if (empty && !(i + 1 == names_.size() && kept.empty())) continue;
    kept.push_back({n, e});
    out.downlink.emplace_back(n, std::move(e));
  }
  catchup_->end_step(std::move(kept));
}

uint64_t GlobalModel::delta_bytes(uint16_t minor) const { return catchup_ ? catchup_->delta_bytes(minor) : 0; }

std::shared_ptr<const CatchupView> GlobalModel::catchup_view(uint64_t t) const {
  return catchup_ ? catchup_->view(t, broadcast_) : nullptr;
}

}  // namespace sparrow::federation
