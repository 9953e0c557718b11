#pragma once
// Robust aggregation and differential privacy at the aggregator, shared by
// sparrow-sim and sparrow-server (docs/aggregation.md).
//
// Two spec strings configure it (core/spec.h; unknown keys are a ConfigError):
//
//   aggregator =   (the built-in rules of aggregation/rules.cc; more can be registered, rules.h)
//     mean                         sample-weighted mean, streamed (O(model) memory; the default)
//     median                       coordinate-wise median (mean of the two middle values for even n)
//     trimmed_mean[:beta=0.1]      per coordinate, drop the floor(beta·n) largest and smallest, average the rest
//     krum[:f=1]                   the update with the least sum of squared distances to its n − f − 2
//                                  nearest others (Blanchard et al., NeurIPS 2017); needs n >= 2f + 3
//     multikrum[:f=1,m=0]          the m best Krum scores (0: n − f), sample-weighted mean of them
//     bulyan[:f=1]                 Krum picks θ = n − 2f updates one by one, then per coordinate the
//                                  β = θ − 2f values nearest the median are averaged (El Mhamdi et al.,
//                                  ICML 2018); needs n >= 4f + 3
//     normclip:c=C | normclip:q=Q  clip each update's L2 norm to C, or to the Q-quantile of the round's
//                                  norms (Sun et al. 2019), then the sample-weighted mean
//
//   dp =
//     none
//     central:clip=C,noise=Z[,delta=1e-5][,adaptive=0,quantile=0.5,clip_lr=0.2,count_noise=0]
//         The server clips every update to L2 norm C, sums them unweighted, adds N(0, (Z·C)²) per
//         coordinate, and divides by the expected number of clients per round m (the fixed-denominator
//         estimator of DP-FedAvg, McMahan et al., ICLR 2018). adaptive=1: the clip follows the
//         `quantile` of the update norms (Andrew et al., NeurIPS 2021): C ← C·exp(−clip_lr·(b̃ − γ)),
//         b̃ = (#{‖Δ‖ <= C} + N(0, σ_b²)) / m with σ_b = count_noise (0: m / 20); the delta's noise
//         multiplier becomes (Z⁻² − (2σ_b)⁻²)^(−1/2) so that Z stays the whole round's multiplier.
//     local:clip=C,noise=Z[,delta=1e-5]
//         Each client clips its own update to C and adds N(0, (Z·C)²) before encoding (local_dp()).
//
// Mean (AggregationRule::is_mean) + no DP is the plain streaming path (compressed updates folded in without a dense
// copy). Every other combination decodes each update once into a dense float32 row; the buffering aggregators (median,
// trimmed_mean, krum, multikrum, bulyan, normclip:q) keep n rows of the model's size for the round: memory n × numel ×
// 4 bytes (plus one column block of sorting scratch), which the programs bound with max_buffer_mb. Central DP and
// normclip:c stream into one dense sum (O(model)).
//
// Not combinable (ConfigError from check_combination): central DP with anything but mean (the noise is
// calibrated to the sum's sensitivity); ACP uplink compression with anything but plain mean (ACP sums
// factors); SCAFFOLD with DP (its control variates would be released unprotected).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "aggregation/aggregator.h"
#include "aggregation/rules.h"

namespace sparrow::aggregation {

// The parsed `aggregator` spec: the registered rule it names (rules.h).
// Default-constructed: "mean".
struct RobustSpec {
  RobustSpec();
  std::string method = "mean";                  // the registered name
  std::string text = "mean";                    // the spec as written
  std::shared_ptr<const AggregationRule> rule;  // never null
  // Looks the method up in the aggregator registry and builds the rule;
  // ConfigError ("aggregator: ...") for an unknown method (listing the known
  // ones), an unknown key or a bad value.
  static RobustSpec parse(const std::string& spec);
  // The plain sample-weighted mean (AggregationRule::is_mean).
  bool is_mean() const { return rule->is_mean(); }
  // Keeps every update of the round.
  bool buffers() const { return rule->buffers(); }
  // Fewest updates for which the parameters are valid (1 for mean, median, trimmed mean, normclip).
  int64_t min_updates() const { return rule->min_updates(); }
  // The fixed per-update norm bound (normclip:c); 0: none.
  double clip() const { return rule->clip(); }
};

struct DpSpec {
  enum class Mode { kNone, kCentral, kLocal };
  Mode mode = Mode::kNone;
  std::string text = "none";
  double clip = 0;   // C
  double noise = 0;  // Z, the noise multiplier
  double delta = 1e-5;
  bool adaptive = false;
  double quantile = 0.5;                         // γ
  double clip_lr = 0.2;                          // η_C
  double count_noise = 0;                        // σ_b (0: expected clients / 20)
  static DpSpec parse(const std::string& spec);  // ConfigError
};

// ConfigError for the combinations the header lists. `compression` is the
// uplink compressor spec, `algorithm` fedavg | fedprox | scaffold.
void check_combination(const RobustSpec& r, const DpSpec& d, const std::string& compression,
                       const std::string& algorithm);

// Local DP on a client: scales the whole update to L2 norm <= clip, then adds
// N(0, (noise·clip)²) to every coordinate, drawn from rng::normal(key, i) in
// the model's tensor order (map order). Returns the norm before clipping.
double local_dp(std::map<std::string, at::Tensor>& update, double clip, double noise, uint64_t key);

// One worker's (or one process's) share of a round: decodes and clips updates
// as the plan needs, streams or buffers them. merge() combines shares. Not
// thread-safe; one thread owns it.
class Accumulator {
 public:
  Accumulator(TensorShapes shapes, RobustSpec robust, DpSpec dp);

  // Starts a round with this clip (central DP; 0 = none).
  void reset(double clip = 0);

  // As StreamingAggregator::add: the whole update is checked (decoded) before
  // anything changes, and a rejected update (FormatError) changes nothing. A
  // decoded update with a non-finite value is a FormatError.
  // `client` names the update for a buffering rule (RoundRows::ids).
  void add(const EncodedUpdate& update, double weight, const ContextMap& contexts = {}, const std::string& client = {});
  // Admission bound on an update's decoded L2 norm (StreamingAggregator::
  // set_max_update_norm), on every path: above it, add() is a FormatError.
  void set_max_update_norm(double bound);
  // Adds another share (same shapes and specs; a different clip is an Error).
  void merge(const Accumulator& other);

  int64_t count() const { return count_; }
  double total_weight() const { return weight_; }
  // The plain path's streaming sums (ACP factor means); empty on other paths.
  const StreamingAggregator& streaming() const { return sum_; }
  // Bytes held for buffered rows.
  int64_t buffered_bytes() const;

 private:
  friend class Aggregator;
  bool plain() const;
  TensorShapes shapes_;
  RobustSpec robust_;
  DpSpec dp_;
  int64_t numel_ = 0;
  double clip_ = 0;
  double max_norm_ = std::numeric_limits<float>::max();
  StreamingAggregator sum_;                       // plain path
  std::unique_ptr<StreamingAggregator> scratch_;  // decodes one update (dense paths only)
  at::Tensor flat_sum_;                           // streamed dense path: Σ w·clip(u) (central DP: Σ clip(u))
  std::vector<at::Tensor> rows_;                  // buffering path
  std::vector<double> weights_;
  std::vector<double> norms_;     // every update's L2 norm before clipping (dense paths)
  std::vector<std::string> ids_;  // every update's client id (dense paths)
  int64_t within_clip_ = 0;       // updates with norm <= clip (adaptive clipping)
  int64_t clipped_ = 0;
  int64_t count_ = 0;
  double weight_ = 0;
};

// The round-level aggregator: turns a round's merged Accumulator into the
// mean update Δ (what the server optimiser steps with), adding central DP's
// noise and adapting the clip. Its state (the adaptive clip) is serialisable
// for checkpoints; the noise of round r is a function of (seed, r).
class Aggregator {
 public:
  // expected_clients: m, the clients selected per round (central DP's
  // denominator and σ_b's default). ConfigError on bad specs.
  Aggregator(const std::string& aggregator_spec, const std::string& dp_spec, int64_t expected_clients, uint64_t seed);

  const RobustSpec& robust() const { return robust_; }
  const DpSpec& dp() const { return dp_; }
  // The clip the round's accumulators use (central DP's current C; 0 = none).
  double clip() const;
  Accumulator make_accumulator(const TensorShapes& shapes) const { return Accumulator(shapes, robust_, dp_); }

  // Aggregates round `round` (0-based). Throws sparrow::Error when the share
  // holds no update. Updates the adaptive clip.
  std::map<std::string, at::Tensor> finish(const Accumulator& all, uint64_t round, AggregateStats* stats = nullptr);

  // Privacy spent after `rounds` rounds, at dp.delta: central with client
  // sampling rate q (clients per round / population); local for a client that
  // took part `participations` times (no amplification). +inf without DP.
  double epsilon(int64_t rounds, double q, int64_t participations) const;

  std::string serialize_state() const;
  void deserialize_state(const std::string& bytes);  // FormatError on malformed bytes

 private:
  RobustSpec robust_;
  DpSpec dp_;
  int64_t expected_ = 1;
  uint64_t seed_ = 0;
  double clip_ = 0;  // current central clip
};

}  // namespace sparrow::aggregation
