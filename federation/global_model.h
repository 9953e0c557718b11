#pragma once
// The global side of a round, written once for sparrow-server and sparrow-sim
// (docs/architecture.md, "One round engine"): the model W_r, the broadcast
// model B_r (downlink compression), SCAFFOLD's server control c, the ACP shared
// factors and TCS masks of the next round, the per-tensor codec contexts of a
// round, and the global step that turns a round's aggregate into W_{r+1}.
//
// Rounds are numbered from 1 on both sides: round r's contexts carry
// Context::round = r (ACP's factor kind, random streams), and the central-DP
// noise of round r is drawn for r.
//
// Not thread-safe: the round thread (server) or the simulator's main thread
// owns it; readers of weights() outside that thread need the driver's lock.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "aggregation/aggregator.h"
#include "aggregation/robust.h"
#include "aggregation/server_optimizer.h"
#include "compression/compressor.h"
#include "federation/catchup.h"

namespace sparrow::federation {

// The keys of a run's config that the global side reads (both programs bind
// them under these names).
struct GlobalConfig {
  uint64_t seed = 1;
  std::string algorithm = "fedavg";                // "scaffold" keeps a server control, "feddyn" its h there
  double alpha = 0;                                // FedDyn's regulariser weight
  std::string compression = "none";                // the uplink codec: ACP rank, TCS masks
  std::string downlink = "none";                   // "none" or a codec spec for C_r = encode(W_r - B_{r-1})
  std::string downlink_catchup = kDefaultCatchup;  // clients further behind (federation/catchup.h)
  std::string server_optimizer = "fedavg";
};

// The GlobalConfig of a program's config (server::ServerConfig,
// simulator::SimConfig: both name these keys alike).
template <typename Config>
GlobalConfig global_config_of(const Config& c) {
  GlobalConfig g;
  g.seed = c.seed;
  g.algorithm = c.algorithm;
  g.alpha = c.feddyn_alpha;
  g.compression = c.compression;
  g.downlink = c.downlink;
  g.downlink_catchup = c.downlink_catchup;
  g.server_optimizer = c.server_optimizer;
  return g;
}

// What one global step did.
struct StepResult {
  bool applied = false;  // false: the round is abandoned, nothing changed (error says why)
  std::string error;
  Weights delta;  // the aggregate (the server optimiser's input); empty when not applied
  // Downlink: C_r per tensor in model order (empty without a downlink codec);
  // a tensor whose C_r is sparse with no value (B unchanged there) is left out,
  // unless it is the only one.
  std::vector<std::pair<std::string, compression::Encoded>> downlink;
};

class GlobalModel {
 public:
  // `names` is the model's tensor order (weights must hold exactly these).
  // Throws ConfigError for a bad codec or optimiser spec.
  GlobalModel(const GlobalConfig& cfg, Weights initial, std::vector<std::string> names);
  ~GlobalModel();
  GlobalModel(const GlobalModel&) = delete;
  GlobalModel& operator=(const GlobalModel&) = delete;

  const std::vector<std::string>& names() const { return names_; }
  // W_r. Mutable for checkpoint loading and for MPI ranks that receive it.
  Weights& weights() { return global_; }
  const Weights& weights() const { return global_; }
  // B_r: what clients hold after round r (W_r without a downlink codec).
  Weights& broadcast() { return down_ ? broadcast_ : global_; }
  const Weights& broadcast() const { return down_ ? broadcast_ : global_; }
  // Tensor-steps of a sparse model step (fedtopk values=sign) that the
  // downlink codec could not carry exactly and went as exact fp32 values.
  uint64_t exact_fallbacks() const { return exact_fallbacks_; }
  // SCAFFOLD's c (empty until the first step with control deltas = zeros);
  // FedDyn's h (federation/algorithms.h), empty until its first step.
  Weights& control() { return control_; }
  const Weights& control() const { return control_; }
  // ACP shared factors (by tensor name) and TCS masks (compression::mask_key)
  // for the next round; checkpointed as one weights blob.
  Weights& shared() { return shared_; }
  const Weights& shared() const { return shared_; }
  aggregation::ServerOptimizer& optimizer() { return *opt_; }

  bool has_downlink() const { return down_ != nullptr; }
  // Downlink catch-up: the snapshot for tasks that carry B_t (nullptr without
  // a downlink codec: B = W, and a client behind gets the dense model, since
  // a dense step changes every position). A t other than the last step's (a
  // restored checkpoint) knows nothing before t.
  std::shared_ptr<const CatchupView> catchup_view(uint64_t t) const;
  // Wire bytes of the last C as a one-step Delta to a client of protocol
  // 1.`minor` (CatchupHistory::delta_bytes); 0 without a downlink codec.
  uint64_t delta_bytes(uint16_t minor) const;
  int64_t acp_rank() const { return acp_rank_; }
  double mask_ratio() const { return mask_ratio_; }
  bool share_mean() const { return share_mean_; }

  // The TCS mask of tensor `name` for the coming round (undefined before the
  // first step or without tcs).
  at::Tensor mask(const std::string& name) const;

  // The per-tensor codec contexts of round r (>= 1) with `num_selected`
  // clients: seed, round, the ACP shared factor (its seeded initial one when
  // none of the round's kind is held; that one is then held), the TCS mask and
  // share_mean. `masks` overrides the masks (a gateway passes its root's on).
  aggregation::ContextMap contexts(uint64_t r, int num_selected, const Weights* masks = nullptr);

  // The global step of round r, all or nothing: aggregator.finish (robust
  // rule, central DP noise of round r), the server optimiser's step on W, the
  // next TCS masks (where the step moved W most), SCAFFOLD's c += Σ Δc_i /
  // population (FedNova: the mean scaled by fednova_scale; FedDyn: h and the
  // step of feddyn_step, with population as m), ACP's next shared factors (replacing the held ones: a tensor
  // without a factor this round gets its seeded initial one next round), and
  // the downlink C_r = encode(W_r - B_{r-1}), B_r = B_{r-1} + decode(C_r).
  // When finish or the step throws sparrow::Error (a non-finite aggregate),
  // the aggregator's state is restored and nothing changes: applied = false.
  // `population`: the clients c averages over (the simulator's `clients`,
  // the clients the server has seen).
  StepResult step(aggregation::Aggregator& aggregator, const aggregation::Accumulator& agg, const Weights& control_sum,
                  uint64_t r, double population, aggregation::AggregateStats* stats = nullptr);

  // A gateway's half of the step: the aggregate only (no optimiser; the root
  // steps its model), all or nothing as step(); applied = false also for a
  // non-finite aggregate.
  StepResult finish_only(aggregation::Aggregator& aggregator, const aggregation::Accumulator& agg, uint64_t r,
                         aggregation::AggregateStats* stats = nullptr);

 private:
  void encode_downlink(uint64_t r, StepResult& out);

  GlobalConfig cfg_;
  std::vector<std::string> names_;
  Weights global_, broadcast_, control_, shared_;
  std::unique_ptr<aggregation::ServerOptimizer> opt_;
  std::unique_ptr<compression::Compressor> down_;
  std::unique_ptr<CatchupHistory> catchup_;  // with down_
  int64_t acp_rank_ = 0;
  double mask_ratio_ = 0;
  bool share_mean_ = false;
  // fedtopk values=sign: the step is ±mu at its positions, which the downlink
  // is meant to carry exactly (encode_downlink keeps B = W bit for bit).
  bool exact_step_ = false;
  uint64_t exact_fallbacks_ = 0;
};

// Seed tag of the downlink codec's random streams: derive(seed, kDownTag).
constexpr uint64_t kDownTag = 0x646f776e;  // "down"

}  // namespace sparrow::federation
