#pragma once
// Aggregation rules: what the `aggregator` key names ("median", "krum:f=2").
// Each rule is registered under its name with a factory that reads the spec's
// keys; RobustSpec::parse (aggregation/robust.h) looks the name up here and the
// round's Aggregator::finish calls the rule it got. The built-ins (mean,
// median, trimmed_mean, krum, multikrum, bulyan, normclip) register through
// register_builtins(); a program or a test adds its own with
// register_aggregator() before it parses a config, without editing the library
// (docs/aggregation.md, "Adding an aggregator").

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace sparrow {
class Spec;
}

namespace sparrow::aggregation {

// What one round's aggregation did, for metrics and logs.
struct AggregateStats {
  int64_t updates = 0;     // updates aggregated
  int64_t kept = 0;        // updates that entered the result (krum family: selected; trimmed: per coordinate)
  int64_t f_used = 0;      // krum/multikrum/bulyan: f after lowering to what n allows
  int64_t clipped = 0;     // updates scaled down by a norm bound
  double clip = 0;         // the norm bound used this round (0 = none)
  double median_norm = 0;  // median L2 norm of the round's updates (dense paths; NaN on the plain path)
};

// A round's updates as a buffering rule sees them: every update decoded into
// one dense float32 row [d] (the model's tensors flattened in its order),
// already scaled to the rule's clip() when that is > 0.
struct RoundRows {
  const std::vector<at::Tensor>& rows;
  const std::vector<double>& weights;  // each update's sample weight
  const std::vector<double>& norms;    // each update's L2 norm before any clipping
  double total_weight;                 // Σ weights
  // Each update's client id, as the fold named it ("" where the caller named
  // none, e.g. SecAgg+'s one summed update). The built-in rules ignore it; a
  // rule written in Python is handed it (docs/python.md).
  const std::vector<std::string>& ids;
};

// One aggregation rule, built from the `aggregator` spec by its registered
// factory. Immutable: one instance is shared by a run's Accumulators and its
// Aggregator, possibly on several threads, so combine() keeps no state.
class AggregationRule {
 public:
  virtual ~AggregationRule() = default;
  // True only for the plain sample-weighted mean of the updates as sent. Then
  // (without central DP) compressed updates are folded in as they arrive,
  // never decoded into rows: O(model) memory, and ACP and tcs share=mean work.
  virtual bool is_mean() const { return false; }
  // Keeps every update of the round as a row for combine(). A rule that
  // returns false must be the sample-weighted mean of its (clipped) rows: the
  // rows are then summed as they arrive, O(model) memory, and combine() is
  // never called.
  virtual bool buffers() const { return true; }
  // The fewest updates for which the rule's parameters are valid; both
  // programs refuse a config whose rounds can be smaller.
  virtual int64_t min_updates() const { return 1; }
  // A fixed L2 bound every update is scaled down to as it arrives (normclip:c);
  // 0: none.
  virtual double clip() const { return 0; }
  // The round's aggregate, a float32 tensor [d]. Called with at least one row.
  // May set stats.kept, f_used, clip and clipped (already filled with the
  // round's defaults: kept = updates).
  virtual at::Tensor combine(const RoundRows& round, AggregateStats& stats) const = 0;
};

// Builds a rule from its spec. It reads the keys it knows (RobustSpec::parse
// rejects any key left unread) and throws ConfigError for a bad value.
using AggregatorFactory = std::function<std::shared_ptr<const AggregationRule>(Spec& spec)>;

// Registers `name` (the method users write: aggregator = "name:key=value").
// sparrow::Error when the name is taken (the built-ins are registered first).
// Thread-safe.
void register_aggregator(const std::string& name, AggregatorFactory factory, const std::string& description);
// The factory of `name`; ConfigError "unknown method 'x' (known: ...)".
AggregatorFactory aggregator_factory(const std::string& name);
// Registered aggregator names, sorted (built-ins included).
std::vector<std::string> aggregator_names();
// Whether `name` (a method, without keys) is a registered aggregator.
bool known_aggregator(const std::string& name);
// The one-line description `name` was registered with; ConfigError if unknown.
std::string aggregator_description(const std::string& name);

// Registers every built-in aggregator and server optimiser. Idempotent and
// thread-safe; every lookup above calls it, so callers rarely need to.
void register_builtins();

namespace detail {
void register_rules();       // rules.cc
void register_optimizers();  // server_optimizer.cc
}  // namespace detail

}  // namespace sparrow::aggregation
