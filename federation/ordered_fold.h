#pragma once
// Admission and folding of a round's updates, written once for sparrow-server
// and sparrow-sim: the updates are summed in the round's canonical client
// order (federation::id_less over the selected ids), whatever order they
// arrive in, so the round's aggregate is the same bits on the service (any
// arrival order, any number of ingest workers) as in the simulator (any number
// of workers or ranks). Float addition is not associative: a sum in arrival
// order differs in the last bits, and training amplifies that.
//
// How: an update whose predecessors in the order are all folded (or will not
// come) is folded at once, into the one accumulator; an early one is checked
// (the same Accumulator::add, into a scratch accumulator of the caller's slot,
// so it is refused or accepted exactly as a direct fold would) and held until
// its turn. Held updates are the encoded ones (compressed bytes; a dense one
// views the frame it came in). When they pass `budget_bytes`, what is held is
// folded at once in order and the round continues in arrival order: bounded
// memory over determinism, reported by relaxed(). A budget of 0 folds in
// arrival order from the start.
//
// Thread-safety: add() and skip() may be called from any threads (one slot per
// thread); open(), close() and the accessors only while no add() runs.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "aggregation/robust.h"

namespace sparrow::federation {

// One client's update as it is folded.
struct Arrival {
  aggregation::EncodedUpdate update;
  double weight = 0;                                // > 0: the samples it trained on
  std::map<std::string, at::Tensor> control_delta;  // SCAFFOLD's Δc, checked by the caller (empty otherwise)
  std::map<std::string, double> metrics;            // weighted by `weight` in metric_sum()
};

// Adds an arrival's side sums, kept beside the Accumulator by every fold
// (OrderedFold, AsyncEngine): SCAFFOLD's Δc summed by name, and each metric
// weighted by the update's samples (per metric: not every client reports
// every metric).
void add_side_sums(const Arrival& a, std::map<std::string, at::Tensor>& control_sum,
                   std::map<std::string, double>& metric_sum, std::map<std::string, double>& metric_weight);

class OrderedFold {
 public:
  // `slots`: the threads that call add() (each passes its own slot < slots).
  OrderedFold(const aggregation::Aggregator& aggregator, aggregation::TensorShapes shapes, size_t slots,
              int64_t budget_bytes);
  ~OrderedFold();
  OrderedFold(const OrderedFold&) = delete;
  OrderedFold& operator=(const OrderedFold&) = delete;

  // Admission bound on an update's L2 norm (Accumulator::set_max_update_norm).
  void set_max_update_norm(double bound);

  // Starts a round: `order` the clients that may send, in the canonical
  // order (the caller sorts; sparrow::Error on a repeated id), the round's
  // codec contexts and clip. Clears the sums.
  void open(std::vector<std::string> order, aggregation::ContextMap contexts, double clip);

  // Folds (or checks and holds) `client`'s update. Throws what
  // Accumulator::add throws for a refused update (FormatError, ...), and
  // sparrow::Error for a client not in the order or already folded; nothing
  // changes then and the client may send again. `check = false` holds an
  // early update unchecked (the simulator's own updates): a held update that
  // fails when its turn comes is dropped and counted in late_failures().
  void add(size_t slot, const std::string& client, Arrival a, bool check = true);

  // `client` sends nothing more this round (dropped, gone): later clients
  // stop waiting for it. Unknown or folded clients are ignored.
  void skip(const std::string& client);

  // Folds everything still held, in order. After the last add().
  void close();

  aggregation::Accumulator& sum() { return acc_; }
  std::map<std::string, at::Tensor>& control_sum() { return control_sum_; }
  const std::map<std::string, double>& metric_sum() const { return metric_sum_; }
  const std::map<std::string, double>& metric_weight() const { return metric_weight_; }
  // Updates folded out of canonical order this round (the budget was passed).
  bool relaxed() const { return relaxed_; }
  // The most bytes held at once this round.
  int64_t held_peak() const { return held_peak_; }
  // Held, checked-less updates that failed when folded (see add()).
  const std::vector<std::string>& late_failures() const { return late_failures_; }

 private:
  enum class State : uint8_t { kPending, kHeld, kDone };
  void fold_locked(const std::string& client, Arrival& a);
  void advance_locked();
  void flush_locked();
  static int64_t bytes_of(const Arrival& a);

  const aggregation::Aggregator& aggregator_;
  aggregation::TensorShapes shapes_;
  int64_t budget_;
  std::mutex mu_;
  aggregation::Accumulator acc_;
  std::vector<std::unique_ptr<aggregation::Accumulator>> scratch_;  // per slot, made on first use
  aggregation::ContextMap contexts_;
  double clip_ = 0;
  double max_norm_ = 0;  // 0: the accumulator's default
  std::map<std::string, size_t> pos_;
  std::vector<State> state_;
  std::vector<std::optional<Arrival>> held_;
  std::vector<int64_t> held_size_;  // bytes_of(*held_[i]) while held
  size_t next_ = 0;                 // first position not yet done
  int64_t held_bytes_ = 0, held_peak_ = 0;
  bool relaxed_ = false;
  std::vector<std::string> order_, late_failures_;
  std::map<std::string, at::Tensor> control_sum_;
  std::map<std::string, double> metric_sum_, metric_weight_;
};

}  // namespace sparrow::federation
