// federation::RoundEngine: the round's phases around OrderedFold and
// GlobalModel, for both drivers.
#include "federation/round_engine.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "compression/state.h"
#include "core/error.h"
#include "federation/sampler.h"
#include "secagg/secagg.h"

namespace sparrow::federation {

RoundEngine::RoundEngine(GlobalModel& gm, aggregation::Aggregator& aggregator, aggregation::TensorShapes shapes,
                         size_t slots, int64_t fold_budget_bytes, double max_update_norm)
    : gm_(gm),
      aggregator_(aggregator),
      shapes_(shapes),
      fold_(aggregator, std::move(shapes), slots, fold_budget_bytes) {
  if (max_update_norm > 0) fold_.set_max_update_norm(max_update_norm);
}

void RoundEngine::expect(Phase p, const char* what) const {
  SPARROW_CHECK(phase_ == p, "round engine: " << what << " in round " << round_ << " out of turn");
}

const aggregation::ContextMap& RoundEngine::open(uint64_t r, const std::vector<std::string>& chosen,
                                                 const Weights* masks) {
  expect(Phase::kIdle, "open");
  round_ = r;
  contexts_ = gm_.contexts(r, static_cast<int>(chosen.size()), masks);
  std::vector<std::string> order = chosen;
  std::sort(order.begin(), order.end(), id_less);  // the canonical order
  fold_.open(std::move(order), contexts_, aggregator_.clip());
  metric_sum_.clear();
  metric_weight_.clear();
  phase_ = Phase::kOpen;
  return contexts_;
}

void RoundEngine::add_secagg_sum(const std::vector<uint32_t>& sum, double scale, double weight_sum, double weight,
                                 const ClientMetrics& client_metrics) {
  expect(Phase::kOpen, "add_secagg_sum");
  Arrival a;
  size_t off = 0;
  for (const auto& [name, shape] : shapes_) {
    at::Tensor x = at::empty(shape, at::kFloat);
    const size_t len = static_cast<size_t>(x.numel());
    SPARROW_CHECK(off + len <= sum.size(), "secagg: the unmasked sum has " << sum.size() << " coordinates");
    secagg::dequantise(sum.data() + off, len, scale, x.data_ptr<float>());
    x.div_(weight_sum);
    off += len;
    a.update.emplace_back(name, compression::dense_encoded(x));
  }
  SPARROW_CHECK(off == sum.size(), "secagg: the unmasked sum has " << sum.size() << " coordinates, the model " << off);
  a.weight = weight;
  // Its own slot in the order: the masked sum is one update of the round.
  fold_.close();
  aggregation::Accumulator& acc = fold_.sum();
  acc.add(a.update, a.weight, contexts_);
  for (const auto& [w, ms] : client_metrics)
    for (const auto& [k, v] : ms) {
      metric_sum_[k] += w * v;
      metric_weight_[k] += w;
    }
}

void RoundEngine::close() {
  expect(Phase::kOpen, "close");
  fold_.close();
  for (const auto& [k, v] : fold_.metric_sum()) metric_sum_[k] += v;
  for (const auto& [k, v] : fold_.metric_weight()) metric_weight_[k] += v;
  phase_ = Phase::kClosed;
}

StepResult RoundEngine::step(double population, aggregation::AggregateStats* stats) {
  expect(Phase::kClosed, "step");
  phase_ = Phase::kIdle;
  StepResult out = gm_.step(aggregator_, fold_.sum(), fold_.control_sum(), round_, population, stats);
  fold_.sum().reset(aggregator_.clip());  // frees what it holds (views of frames, rows) before the checkpoint
  return out;
}

StepResult RoundEngine::finish_only(aggregation::AggregateStats* stats) {
  expect(Phase::kClosed, "finish_only");
  phase_ = Phase::kIdle;
  StepResult out = gm_.finish_only(aggregator_, fold_.sum(), round_, stats);
  fold_.sum().reset(aggregator_.clip());
  return out;
}

GlobalState RoundEngine::save() const {
  expect(Phase::kIdle, "save");
  GlobalState s;
  s.weights = compression::serialize_weights(gm_.weights());
  s.server_opt = gm_.optimizer().serialize_state();
  if (!gm_.control().empty()) s.control = compression::serialize_weights(gm_.control());
  if (!gm_.shared().empty()) s.shared = compression::serialize_weights(gm_.shared());
  s.aggregator = aggregator_.serialize_state();
  if (gm_.has_downlink()) s.broadcast = compression::serialize_weights(gm_.broadcast());
  return s;
}

namespace {
// `bytes` as weights of exactly the model's tensors and shapes.
Weights fitting(const std::string& bytes, const Weights& model, const std::string& where, const char* what) {
  Weights w;
  try {
    w = compression::deserialize_weights(bytes);
  } catch (const Error& e) {
    throw FormatError(where + ": the checkpoint's " + what + " does not parse (" + e.what() + ")");
  }
  SPARROW_CHECK_T(
      FormatError, w.size() == model.size(),
      where << ": the checkpoint's " << what << " has " << w.size() << " tensors, the model " << model.size());
  for (const auto& [k, v] : model)
    SPARROW_CHECK_T(FormatError, w.count(k) && w.at(k).sizes() == v.sizes(),
                    where << ": the checkpoint's " << what << " does not match the model at '" << k << "'");
  return w;
}
}  // namespace

void RoundEngine::load(const GlobalState& s, const std::string& where) {
  expect(Phase::kIdle, "load");
  // Everything parsed and checked first: a bad piece changes nothing.
  Weights w = fitting(s.weights, gm_.weights(), where, "model");
  Weights c = s.control.empty() ? Weights{} : fitting(s.control, gm_.weights(), where, "SCAFFOLD control");
  Weights b;
  if (gm_.has_downlink() && !s.broadcast.empty()) b = fitting(s.broadcast, gm_.weights(), where, "broadcast model");
  Weights sh;
  if (!s.shared.empty()) {
    try {
      sh = compression::deserialize_weights(s.shared);
    } catch (const Error& e) {
      throw FormatError(where + ": the checkpoint's shared factors do not parse (" + e.what() + ")");
    }
  }
  const std::string opt_before = gm_.optimizer().serialize_state();
  const std::string agg_before = aggregator_.serialize_state();
  try {
    if (!s.server_opt.empty()) gm_.optimizer().deserialize_state(s.server_opt);
    if (!s.aggregator.empty()) aggregator_.deserialize_state(s.aggregator);
  } catch (const Error& e) {
    if (!opt_before.empty()) gm_.optimizer().deserialize_state(opt_before);
    if (!agg_before.empty()) aggregator_.deserialize_state(agg_before);
    throw FormatError(where + ": the checkpoint's optimiser or aggregator state does not load (" + e.what() + ")");
  }
  for (auto& [k, v] : gm_.weights()) v.copy_(w.at(k));
  gm_.control() = std::move(c);
  gm_.shared() = std::move(sh);
  if (!b.empty())
    for (auto& [k, v] : gm_.broadcast()) v.copy_(b.at(k));
}

void RoundEngine::abandon() {
  if (phase_ == Phase::kOpen) fold_.close();
  fold_.sum().reset(aggregator_.clip());
  phase_ = Phase::kIdle;
}

}  // namespace sparrow::federation
