#pragma once
// Buffered asynchronous aggregation (FedBuff: Nguyen et al., AISTATS 2022;
// docs/async.md), the asynchronous counterpart of RoundEngine for
// sparrow-server and sparrow-sim. There is no round barrier: a driver hands
// the current model to any free client (at most `max_concurrency` at once,
// the driver's business), each update says which model version it started
// from, and is folded as it arrives with weight
//
//   w(version() - from_version) x its sample count      (async_staleness.h)
//
// into one buffer; every `buffer` updates the driver calls step(), which is
// GlobalModel::step with the buffer's sum as the round's aggregate (server
// optimisers, robust rules over the buffer's rows, SCAFFOLD's c, the
// downlink), and the version advances. The step's mean is Σ w_i n_i Δ_i /
// Σ w_i n_i: with `staleness = "const"`, buffer = max_concurrency = the
// clients and every update from the current version, a step is a FedAvg
// round, bit for bit when the updates arrive in client-id order (the
// synchronous fold's order).
//
// Versions: version() counts the steps taken (applied or abandoned), so the
// step that ends the buffer at version v is "round v + 1" to the global side
// (its codec contexts, its central-DP stream), as in a synchronous run.
//
// What does not work without a round barrier is refused by check_async()
// (a ConfigError naming the key): SecAgg+ (the masks cancel only over a fixed
// cohort), central DP (its accountant assumes a uniform sample each round),
// and the codecs whose decoding needs the round's shared state (acp's shared
// factor, tcs's mask): a stale update was encoded against another one.
//
// Thread-safety: add() from any threads (serialised: updates fold in the order
// add() is entered); step() and the accessors on the driver's thread while no
// add() runs.

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "federation/async_staleness.h"
#include "federation/global_model.h"
#include "federation/ordered_fold.h"

namespace sparrow::federation {

struct RunConfig;

// The async keys of a run (RunConfig: mode, buffer, max_concurrency,
// staleness), resolved: 0 = the default.
struct AsyncSettings {
  bool enabled = false;     // mode = "async"
  int buffer = 1;           // K: updates per global step (0 in the file = clients_per_round)
  int max_concurrency = 1;  // C: clients training at once (0 in the file = buffer)
  std::string staleness = "poly:a=0.5";
};
AsyncSettings async_settings(const RunConfig& c);

// The combinations async mode refuses, as (key, why) pairs in key order; empty
// when the config is synchronous or fine. federation::validate fails on the
// first.
std::vector<std::pair<std::string, std::string>> check_async(const RunConfig& c);

class AsyncEngine {
 public:
  // `buffer`: K; `staleness`: a make_staleness spec (ConfigError when bad);
  // `version`: the steps already taken (a resumed run); `max_update_norm` > 0:
  // the admission bound (Accumulator::set_max_update_norm).
  AsyncEngine(GlobalModel& gm, aggregation::Aggregator& aggregator, aggregation::TensorShapes shapes, int buffer,
              const std::string& staleness, uint64_t version = 0, double max_update_norm = 0);

  // The model version a client handed a task now starts from.
  uint64_t version() const { return version_; }
  // The codec contexts of tasks handed out at this version (GlobalModel::
  // contexts(version() + 1, buffer)); also what updates are decoded with.
  const aggregation::ContextMap& contexts() const { return contexts_; }
  int buffer() const { return buffer_; }
  double weight_of(uint64_t staleness) const { return staleness_(staleness); }

  // What add() did with an update.
  struct Folded {
    uint64_t staleness = 0;
    double discount = 1;  // w(staleness)
    size_t buffered = 0;  // updates in the buffer now, this one included
  };
  // Folds `client`'s update, trained from `from_version`: its Arrival::weight
  // (the samples) times w(version() - from_version). Throws what
  // Accumulator::add throws for a refused update (FormatError, ...), and
  // FormatError for a version from the future; nothing changes then.
  Folded add(const std::string& client, uint64_t from_version, Arrival a);
  // Updates folded since the last step.
  size_t buffered() const { return count_; }
  bool due() const { return count_ >= static_cast<size_t>(buffer_); }

  // The global step with the buffer as round version() + 1, all or nothing
  // (GlobalModel::step; applied = false: the model is unchanged). Either way
  // the buffer is emptied and the version advances. `population`: SCAFFOLD's
  // divisor. Needs at least one update (sparrow::Error otherwise).
  StepResult step(double population, aggregation::AggregateStats* stats = nullptr);

  // The buffer's metrics: Σ n_i m_i and Σ n_i per metric (sample-weighted,
  // not discounted), and its staleness (max, Σ).
  const std::map<std::string, double>& metric_sum() const { return metric_sum_; }
  const std::map<std::string, double>& metric_weight() const { return metric_weight_; }
  uint64_t max_staleness() const { return max_staleness_; }
  double mean_staleness() const { return count_ > 0 ? static_cast<double>(sum_staleness_) / count_ : 0.0; }
  const aggregation::Accumulator& sum() const { return acc_; }

 private:
  void refresh_contexts();

  GlobalModel& gm_;
  aggregation::Aggregator& aggregator_;
  aggregation::TensorShapes shapes_;
  int buffer_;
  StalenessFn staleness_;
  uint64_t version_;
  aggregation::ContextMap contexts_;
  std::mutex mu_;
  aggregation::Accumulator acc_;
  std::map<std::string, at::Tensor> control_sum_;
  std::map<std::string, double> metric_sum_, metric_weight_;
  size_t count_ = 0;
  uint64_t max_staleness_ = 0, sum_staleness_ = 0;
};

}  // namespace sparrow::federation
