#pragma once
// Streaming aggregation: clients' compressed updates are folded into a running
// weighted sum the moment they arrive, so memory is O(model), never
// O(clients × model). Sparse, quantised and PowerSGD updates are added with
// compression::decode_add (no dense per-client copy for sparse and low-rank
// formats); ACP factors (kLowRankFactor) are summed as factors and expanded once,
// in mean(), with the round's shared factor (compression/lowrank.h).
//
// Hierarchy is the same operation twice: a worker or an edge gateway aggregates
// its clients into a StreamingAggregator and the global one merge()s the
// partials. Merging partials in a fixed order gives the flat result up to fp32
// rounding (sums are float32; weights are double).
//
// Not thread-safe: one thread owns an aggregator (shard by worker and merge).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "compression/compressor.h"
#include "compression/encoded.h"

namespace sparrow::aggregation {

// One named tensor of the model, in the model's order.
using TensorShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;
// One client's update: every model tensor exactly once, in any order.
using EncodedUpdate = std::vector<std::pair<std::string, compression::Encoded>>;
// Per-tensor decode contexts (ACP: the round and the shared factor). A tensor
// without an entry decodes with Context{name = tensor name}.
using ContextMap = std::map<std::string, compression::Context>;

class StreamingAggregator {
 public:
  // Throws sparrow::Error on an empty or duplicate name or a negative dimension.
  explicit StreamingAggregator(TensorShapes shapes);

  // sum += weight · decode(update), count += 1, total_weight += weight.
  //
  // All-or-nothing: the whole update is checked before the sum is touched, and
  // a rejected update changes nothing. Rejected (FormatError) are: an unknown
  // or repeated tensor name, a missing tensor, an Encoded that fails
  // compression::validate(), a shape that differs from the model's, an ACP
  // factor whose kind (P/Q) does not match contexts[name].round (when >= 0) or
  // whose shared factor does not fit or differs from the one this aggregator
  // already holds for the tensor. A weight that is not finite and > 0 throws
  // sparrow::Error. Bit-stream formats (QSGD, TernGrad, sign), whose
  // malformation can only show while decoding, are decoded into per-update
  // scratch before the sum is touched; if anything still throws while the
  // update is being added (in practice only std::bad_alloc), the tensors of
  // this update already added are subtracted again (restored up to fp32
  // rounding) and the exception propagates.
  //
  // A dense fp32 tensor whose slot is still all zero (the first update a
  // worker's partial takes in a round) is checked and written in one pass
  // (compression::decode_fill): its values are read once, and a non-finite
  // value found half way zeroes the slot again, so the rejection is exact.
  // When its values are a view (Bytes::view: a received frame that wire::parse
  // left the values in), they are only scanned, and the slot holds the view
  // and the weight instead of a written sum: the frame stays alive until the
  // slot is written (the next add(), or merge() into a slot that is not
  // empty), read by mean(), or reset(). So the server acknowledges a worker's
  // first dense update of a round after one read-only pass over it. A dense
  // fp32 tensor added to a slot that holds one writes both in one pass
  // (compression::decode_fill_pair: the new one scanned as it is read), and a
  // non-finite value there leaves the slot holding what it held.
  //
  // kLowRankFactor tensors need the round's shared factor: contexts[name]
  // .shared_factor, or, when undefined, the seeded initial one derived from
  // contexts[name] (seed, name) exactly as the clients derive it.
  //
  // Admission by norm (before anything is added): an update whose decoded L2
  // norm, over all its tensors, exceeds the bound set by set_max_update_norm
  // (FLT_MAX by default) or is not finite is a FormatError. Low-rank products
  // are always measured (compression::lowrank_norm, from the factors: finite
  // factors may still overflow float32 once multiplied); other formats only
  // under a bound below FLT_MAX (one extra read of a dense update's values).
  void add(const EncodedUpdate& update, double weight, const ContextMap& contexts = {});
  // The admission bound of add(): > 0; +inf or FLT_MAX for none.
  void set_max_update_norm(double bound);
  double max_update_norm() const { return max_norm_; }

  // Adds another aggregator's sums, weight and count (hierarchical partial
  // aggregates). Throws sparrow::Error, changing nothing, when the tensor lists
  // differ, both hold ACP factors of a tensor with different kinds or shared
  // factors, or both hold share weights over different masks. partial may be
  // empty (weight 0).
  void merge(const StreamingAggregator& partial);

  // The weighted mean per tensor (float32, model shapes), ACP factors expanded.
  // A tensor that took masked shares with Context::share_mean (tcs keep=P,
  // share=mean) has each carried mask position divided by the weight of the
  // updates whose share carried it instead (a position none carried is 0).
  // Throws sparrow::Error when total_weight() is 0.
  std::map<std::string, at::Tensor> mean() const;

  // ACP: the weighted mean factor F̄ of `name` ({k, r}), what
  // compression::acp_next_shared() turns into the next round's shared factor;
  // undefined when no factor update for it was added. Throws sparrow::Error
  // for an unknown name or when total_weight() is 0.
  at::Tensor factor_mean(const std::string& name) const;

  double total_weight() const { return total_weight_; }
  // Updates added, including those inside merged partials.
  int64_t count() const { return count_; }
  const TensorShapes& shapes() const { return shapes_; }
  // Back to the state right after construction (sums zero, no factors).
  void reset();

 private:
  struct Slot {
    std::vector<int64_t> shape;
    at::Tensor sum;         // float32, contiguous, model shape: Σ w·decode for non-factor updates
    at::Tensor factor_sum;  // ACP: Σ w·F ({k, r}); undefined until a factor arrives
    at::Tensor shared;      // ACP: the shared factor the factors were taken against
    int which = -1;         // ACP: 0 = P sent, 1 = Q sent; -1 = no factor yet
    bool zero = true;       // sum is all zero (nothing written since construction or reset())
    // A dense fp32 update held as a view, checked finite, not yet written:
    // the slot stands for sum + held_weight · held (sum is then all zero).
    compression::Encoded held;
    float held_weight = 0;  // > 0 while one is held
    // tcs keep=P, share=mean (Context::share_mean): the round's mask positions
    // and, per position, the weight of the updates whose share carried it;
    // mean() divides those positions by it instead of the total weight.
    at::Tensor share_pos;
    std::vector<double> share_w;
  };
  // Writes a held update into the (zero) sum and releases the view.
  static void settle(Slot& s);
  Slot& slot(const std::string& name);
  const Slot& slot(const std::string& name) const;

  TensorShapes shapes_;
  std::map<std::string, Slot> slots_;
  double total_weight_ = 0.0;
  int64_t count_ = 0;
  double max_norm_;  // set_max_update_norm
};

namespace detail {
// What an update's norm exceeded, for add()'s refusal: "max_update_norm = B"
// under a set bound, else float32's range.
std::string norm_bound_text(double bound);
// Test hook: make the next add() throw std::runtime_error after this many
// tensors of its update have been added to the sum (exercises the rollback).
// -1 (the default) disables it. Not thread-safe; tests only.
void inject_add_failure_after(int tensors);
}  // namespace detail

}  // namespace sparrow::aggregation
