#pragma once
// The round, one state machine for sparrow-server and sparrow-sim
// (docs/architecture.md, "One round engine"). The drivers decide who is
// asked and when a round ends (the server: live sessions, deadlines, quorum;
// the simulator: workers, batches, its clock and ranks); everything a round
// does with the model and the updates happens here, once:
//
//   kIdle --open(r, chosen)--> kOpen --close()--> kClosed --step()--> kIdle
//                                |                   |
//                                +----abandon()------+--> kIdle (nothing applied)
//
//   open     the round's codec contexts (GlobalModel::contexts: ACP factors,
//            TCS masks, 1-based round) and the fold in canonical id order
//   add      admission and folding of a client's update (OrderedFold: any
//            thread, any arrival order, the same bits); skip() a client that
//            will not send; add_secagg_sum() SecAgg+'s unmasked ring sum
//   close    what was held is folded; the round's sum, Σ Δc and metrics
//   step     the global step (GlobalModel::step: finish, optimiser, masks,
//            SCAFFOLD's c, ACP's factors, the downlink), all or nothing
//
// Thread-safety: add(), skip() from any threads while kOpen; everything else
// on the driver's round thread.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "federation/global_model.h"
#include "federation/ordered_fold.h"

namespace sparrow::federation {

// What a checkpoint holds of the global side, each piece serialized
// (compression::serialize_weights; the optimiser's and the aggregator's own
// formats). Both programs store these pieces (the server as columns of its
// checkpoints table, the simulator as meta of client_state.db); what they
// are, how they are written and how they are checked on resume is here.
struct GlobalState {
  std::string weights;     // W_r
  std::string server_opt;  // the server optimiser's state ("" = stateless)
  std::string control;     // SCAFFOLD's c ("" = none yet)
  std::string shared;      // ACP shared factors and TCS masks ("" = none)
  std::string aggregator;  // the adaptive clip of central DP
  std::string broadcast;   // B_r, with a downlink codec ("" otherwise)
};

class RoundEngine {
 public:
  enum class Phase { kIdle, kOpen, kClosed };

  // `slots`: the threads that add(); `fold_budget_bytes`: OrderedFold's bound
  // (0 = arrival order); `max_update_norm` > 0: the admission bound.
  RoundEngine(GlobalModel& gm, aggregation::Aggregator& aggregator, aggregation::TensorShapes shapes, size_t slots,
              int64_t fold_budget_bytes, double max_update_norm = 0);

  // kIdle -> kOpen: round r (1-based) with the chosen clients (any order).
  // `masks` overrides the TCS masks (a gateway passes its root's on).
  const aggregation::ContextMap& open(uint64_t r, const std::vector<std::string>& chosen,
                                      const Weights* masks = nullptr);
  // While kOpen: OrderedFold::add / skip.
  void add(size_t slot, const std::string& client, Arrival a, bool check = true) {
    fold_.add(slot, client, std::move(a), check);
  }
  void skip(const std::string& client) { fold_.skip(client); }
  // While kOpen, from the round thread: SecAgg+'s unmasked ring sum of the
  // weighted updates, dequantised with `scale` and divided by `weight_sum`
  // (Σ of the survivors' ring weights), folded as one update of `weight`.
  // `client_metrics`: each survivor's weight and reported metrics.
  using ClientMetrics = std::vector<std::pair<double, std::vector<std::pair<std::string, double>>>>;
  void add_secagg_sum(const std::vector<uint32_t>& sum, double scale, double weight_sum, double weight,
                      const ClientMetrics& client_metrics = {});
  // kOpen -> kClosed.
  void close();
  // kClosed -> kIdle: GlobalModel::step with the round's sum, all or nothing
  // (applied = false: nothing changed). `population`: SCAFFOLD's divisor.
  // The sum is released after it (read sum() before).
  StepResult step(double population, aggregation::AggregateStats* stats = nullptr);
  // kClosed -> kIdle: a gateway's half (GlobalModel::finish_only).
  StepResult finish_only(aggregation::AggregateStats* stats = nullptr);
  // Any phase -> kIdle, nothing applied (a stopped or abandoned round).
  void abandon();

  // The checkpoint's contents (while kIdle; the caller guards W against
  // concurrent readers as it does for the step).
  GlobalState save() const;
  // Restores them, all or nothing: FormatError naming `where` (the file)
  // when a piece does not parse or does not fit the model. An empty
  // broadcast with a downlink codec leaves B as it is (checkpoints of older
  // servers); an empty control or shared clears them.
  void load(const GlobalState& s, const std::string& where);

  Phase phase() const { return phase_; }
  uint64_t round() const { return round_; }
  const aggregation::ContextMap& contexts() const { return contexts_; }
  // The round's sums (after close(); cleared by the next open()).
  const aggregation::Accumulator& sum() { return fold_.sum(); }
  const Weights& control_sum() { return fold_.control_sum(); }
  const std::map<std::string, double>& metric_sum() const { return metric_sum_; }
  const std::map<std::string, double>& metric_weight() const { return metric_weight_; }
  bool relaxed() const { return fold_.relaxed(); }
  int64_t held_peak() const { return fold_.held_peak(); }
  const std::vector<std::string>& late_failures() const { return fold_.late_failures(); }

 private:
  void expect(Phase p, const char* what) const;

  GlobalModel& gm_;
  aggregation::Aggregator& aggregator_;
  aggregation::TensorShapes shapes_;
  OrderedFold fold_;
  Phase phase_ = Phase::kIdle;
  uint64_t round_ = 0;
  aggregation::ContextMap contexts_;
  std::map<std::string, double> metric_sum_, metric_weight_;
};

}  // namespace sparrow::federation
