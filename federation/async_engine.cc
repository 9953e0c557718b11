// federation::AsyncEngine: buffered asynchronous aggregation on the global
// step both programs share (federation/async_engine.h).
#include "federation/async_engine.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "aggregation/robust.h"
#include "compression/compressor.h"
#include "core/error.h"
#include "core/spec.h"
#include "federation/run_config.h"
#include "secagg/secagg.h"

namespace sparrow::federation {

AsyncSettings async_settings(const RunConfig& c) {
  AsyncSettings s;
  s.enabled = c.mode == "async";
  s.buffer = c.buffer > 0 ? c.buffer : c.clients_per_round;
  s.max_concurrency = c.max_concurrency > 0 ? c.max_concurrency : s.buffer;
  s.staleness = c.staleness;
  return s;
}

std::vector<std::pair<std::string, std::string>> check_async(const RunConfig& c) {
  std::vector<std::pair<std::string, std::string>> out;
  auto bad = [&](const char* key, std::string why) { out.emplace_back(key, std::move(why)); };
  if (c.mode != "sync" && c.mode != "async") {
    bad("mode", "must be \"sync\" or \"async\" (got '" + c.mode + "')");
    return out;
  }
  if (c.buffer < 0 || c.buffer > 1000000) bad("buffer", "must be in [0, 1000000] (0 = clients_per_round)");
  if (c.max_concurrency < 0 || c.max_concurrency > 10000000)
    bad("max_concurrency", "must be in [0, 10000000] (0 = buffer)");
  try {
    make_staleness(c.staleness);
  } catch (const ConfigError& e) {
    bad("staleness", std::string("is not a staleness rule: ") + e.what());
  }
  if (c.mode != "async") {
    // A key without an effect is refused, not ignored (docs/configuration.md).
    const char* why = "has no effect unless mode = \"async\"";
    if (c.buffer != 0) bad("buffer", why);
    if (c.max_concurrency != 0) bad("max_concurrency", why);
    if (c.staleness != RunConfig{}.staleness) bad("staleness", why);
    return out;
  }
  const AsyncSettings a = async_settings(c);
  // A client trains each model version at most once: a buffer larger than
  // the population would never fill.
  if (c.clients > 0 && a.buffer > c.clients)
    bad("buffer", "must be at most clients = " + std::to_string(c.clients) + " (got " + std::to_string(a.buffer) + ")");
  if (c.clients > 0 && a.max_concurrency > c.clients)
    bad("max_concurrency",
        "must be at most clients = " + std::to_string(c.clients) + " (got " + std::to_string(a.max_concurrency) + ")");
  std::string method;
  try {
    method = Spec::parse(c.compression).method();
  } catch (const ConfigError&) {
  }
  if (method == "acp")
    bad("compression",
        "acp cannot run with mode = \"async\": its updates decode only with the shared factor of the round they "
        "were trained in; use powersgd, topk, dgc or a quantiser");
  if (method == "tcs")
    bad("compression",
        "tcs cannot run with mode = \"async\": its updates decode only with the mask of the round they were "
        "trained in; use stc, topk or dgc");
  try {
    if (aggregation::DpSpec::parse(c.dp).mode == aggregation::DpSpec::Mode::kCentral)
      bad("dp",
          "central DP cannot run with mode = \"async\": its accountant assumes each step samples clients "
          "uniformly, and asynchronous steps take whoever finishes first (fast devices more often); use "
          "dp = \"local:...\", whose guarantee is per update");
  } catch (const ConfigError&) {
  }
  try {
    if (secagg::Params::parse(c.secagg).enabled)
      bad("secagg",
          "SecAgg+ cannot run with mode = \"async\": its masks cancel only over a fixed cohort that finishes "
          "together; use mode = \"sync\"");
  } catch (const ConfigError&) {
  }
  try {
    const aggregation::RobustSpec r = aggregation::RobustSpec::parse(c.aggregator);
    if (r.min_updates() > a.buffer)
      bad("buffer", "'" + c.aggregator + "' needs at least " + std::to_string(r.min_updates()) +
                        " updates per step; buffer is " + std::to_string(a.buffer));
  } catch (const ConfigError&) {
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  return out;
}

AsyncEngine::AsyncEngine(GlobalModel& gm, aggregation::Aggregator& aggregator, aggregation::TensorShapes shapes,
                         int buffer, const std::string& staleness, uint64_t version, double max_update_norm)
    : gm_(gm),
      aggregator_(aggregator),
      shapes_(std::move(shapes)),
      buffer_(buffer),
      staleness_(make_staleness(staleness)),
      version_(version),
      acc_(aggregator.make_accumulator(shapes_)) {
  SPARROW_CHECK_T(ConfigError, buffer >= 1, "buffer: must be >= 1 (got " << buffer << ")");
  if (max_update_norm > 0) acc_.set_max_update_norm(max_update_norm);
  acc_.reset(aggregator_.clip());
  refresh_contexts();
}

void AsyncEngine::refresh_contexts() { contexts_ = gm_.contexts(version_ + 1, buffer_); }

AsyncEngine::Folded AsyncEngine::add(const std::string& client, uint64_t from_version, Arrival a) {
  std::lock_guard<std::mutex> g(mu_);
  SPARROW_CHECK_T(FormatError, from_version <= version_,
                  "client '" << client << "' sent an update of model version " << from_version
                             << ", which does not exist yet (the server is at version " << version_ << ")");
  Folded f;
  f.staleness = version_ - from_version;
  f.discount = staleness_(f.staleness);
  // The sample weight times the discount, one product: with "const" the
  // discount is 1 and the weight is the synchronous fold's, exactly.
  acc_.add(a.update, a.weight * f.discount, contexts_, client);  // all or nothing
  add_side_sums(a, control_sum_, metric_sum_, metric_weight_);
  ++count_;
  max_staleness_ = std::max(max_staleness_, f.staleness);
  sum_staleness_ += f.staleness;
  f.buffered = count_;
  return f;
}

StepResult AsyncEngine::step(double population, aggregation::AggregateStats* stats) {
  SPARROW_CHECK(count_ > 0, "async engine: a step at version " << version_ << " with an empty buffer");
  StepResult out = gm_.step(aggregator_, acc_, control_sum_, version_ + 1, population, stats);
  ++version_;
  acc_.reset(aggregator_.clip());
  control_sum_.clear();
  metric_sum_.clear();
  metric_weight_.clear();
  count_ = 0;
  max_staleness_ = sum_staleness_ = 0;
  refresh_contexts();
  return out;
}

}  // namespace sparrow::federation
