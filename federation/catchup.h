#pragma once
// Downlink catch-up (docs/server.md, "Send tasks"): what the server sends a
// client that holds an older broadcast model B_s than the round's B_t, written
// once for sparrow-server (sync and async) and sparrow-sim, which counts the
// bytes of what the server would send by the same rule.
//
// With a downlink codec the broadcast moves by B_t = B_{t-1} + decode(C_t). A
// client holding B_{t-1} gets C_t (a Delta); one further behind gets, by the
// run's `downlink_catchup` policy, the chain C_{s+1} .. C_t (kept for the last
// K steps), a patch (the positions where B_t differs from B_s with B_t's exact
// fp32 values there, from a per-position "last changed" round), or the dense
// model. Every plan ends the client at B_t bit for bit: a chain repeats the
// server's own decode_add steps, a patch sets values.
//
// The history is run state that is not checkpointed: after a restart at B_R it
// knows nothing before R, and a client further behind gets the dense model.
//
// CatchupHistory is owned by GlobalModel (the round thread, or the
// simulator's main thread); a CatchupView is an immutable snapshot that the
// tasks of one round read from any thread.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "compression/encoded.h"
#include "wire/wire.h"

namespace sparrow::federation {

using Weights = std::map<std::string, at::Tensor>;

// The `downlink_catchup` key: "full" | "chain[:max=K]" | "patch" | "auto[:max=K]".
// full: the dense model to any client further behind than one step (the
// behaviour before catch-up); chain: the chain when it is kept and smaller
// than the dense model; patch: the patch when it is known and smaller; auto:
// the smallest of the three. K (default 256, >= 2) bounds the steps a chain
// may span; the kept steps are also bounded by bytes: never more than one
// dense model's worth beyond the newest step (a longer chain would not be
// sent).
enum class CatchupMode { kFull, kChain, kPatch, kAuto };
struct CatchupPolicy {
  CatchupMode mode = CatchupMode::kAuto;
  uint64_t max_steps = 256;
  bool chain() const { return mode == CatchupMode::kChain || mode == CatchupMode::kAuto; }
  bool patch() const { return mode == CatchupMode::kPatch || mode == CatchupMode::kAuto; }
};
// ConfigError (naming downlink_catchup) for anything else.
CatchupPolicy parse_catchup(const std::string& spec);
constexpr const char* kDefaultCatchup = "auto";

// One broadcast step: C_t per tensor, model order, and its wire bytes.
struct DownStep {
  uint64_t round = 0;
  std::vector<wire::NamedTensor> tensors;
  uint64_t bytes = 0;         // as tables: Σ wire::encoded_size
  uint64_t packed_bytes = 0;  // as a packed list (1.10): wire::packed_list_size, model-order name indices
};

// What a client that holds B_s is sent to reach B_t.
struct CatchupPlan {
  // kDelta: s = t (no tensors) or s = t - 1 (C_t); kChain: C_{s+1} .. C_t
  // (t - s >= 2); kPatch: the patch tensors (those that changed).
  enum class Kind { kFull, kDelta, kChain, kPatch };
  Kind kind = Kind::kFull;
  uint64_t base = 0;  // s (not kFull)
  std::vector<std::shared_ptr<const DownStep>> chain;
  std::vector<wire::NamedTensor> patch;
  uint64_t bytes = 0;  // model payload: Σ wire::encoded_size of what is sent
};
const char* plan_name(CatchupPlan::Kind k);  // "full", "delta", "chain", "patch"

// B_t's catch-up sources, frozen: what the tasks of a round read.
class CatchupView {
 public:
  uint64_t round() const { return round_; }
  // Bytes of the dense model (Σ wire::encoded_size of each tensor in full).
  uint64_t full_bytes() const { return full_bytes_; }
  // The plan for a client that holds B_held (nullopt: nothing, or a model of
  // another run, or a B_s newer than B_t) and speaks protocol 1.`minor`: from
  // 1.9 (kCatchupMinor) it reads Chain and Patch (an older client gets the
  // dense model where they would go); from 1.10 (kPackedMinor) the server
  // packs Delta, Chain and Patch tasks, and `bytes` counts them packed (name
  // table, list counts and records; wire::packed_*_size).
  CatchupPlan plan(std::optional<uint64_t> held, uint16_t minor) const;
  CatchupPlan plan(std::optional<uint64_t> held, bool) const = delete;  // pass the client's minor

 private:
  friend class CatchupHistory;
  CatchupPolicy policy_;
  uint64_t round_ = 0;
  uint64_t full_bytes_ = 0;
  uint64_t known_from_ = 0;                             // bases before it: nothing known
  std::vector<std::shared_ptr<const DownStep>> steps_;  // consecutive, ending at round_
  // Patch: per tensor (model order) the round each position last changed in,
  // and B_t's values.
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<std::shared_ptr<const std::vector<uint32_t>>> changed_;
  uint64_t packed_frame_ = 0;  // wire::packed_frame_size of the model's names, one list
  std::vector<at::Tensor> values_;
};

class CatchupHistory {
 public:
  // `b` is the broadcast model B_round (names in model order).
  CatchupHistory(const CatchupPolicy& policy, const std::vector<std::string>& names, const Weights& b,
                 uint64_t round = 0);

  // After step t: B_t = before + decode(C_t) per tensor. A step that does
  // not follow the last one recorded (a checkpoint restored at B_{t-1})
  // forgets everything before t - 1.
  void begin_step(uint64_t t);
  void record_tensor(size_t i, const at::Tensor& before, const at::Tensor& after);
  void end_step(std::vector<wire::NamedTensor> c);

  // The snapshot for tasks that carry B_t (`b`). For a t other than the last
  // step recorded (a restart), nothing before t is known.
  std::shared_ptr<const CatchupView> view(uint64_t t, const Weights& b) const;

  const CatchupPolicy& policy() const { return policy_; }

  // Wire bytes of the newest step C_t as a one-step Delta's model part to a
  // client of protocol 1.`minor` (packed from 1.10); 0 before any step.
  uint64_t delta_bytes(uint16_t minor) const;

 private:
  void forget_before(uint64_t r);

  CatchupPolicy policy_;
  std::vector<std::string> names_;
  std::vector<std::vector<int64_t>> shapes_;
  uint64_t full_bytes_ = 0;
  uint64_t packed_frame_ = 0;  // wire::packed_frame_size of the model's names, one list
  std::shared_ptr<const DownStep> newest_;
  uint64_t round_ = 0;       // last B recorded
  uint64_t known_from_ = 0;  // oldest base the history covers
  uint64_t stepping_ = 0;    // the step between begin_step and end_step
  std::vector<std::shared_ptr<const DownStep>> steps_;
  std::vector<std::shared_ptr<std::vector<uint32_t>>> changed_;  // patch: shared with views, copied on write
};

// The patch of one tensor: the positions of `changed` after `base`, with the
// values of `values` (fp32, contiguous) there; nullopt when none changed.
// Positions coded as the smallest of Rice, delta-varint and bitmap.
std::optional<compression::Encoded> make_patch(const std::vector<int64_t>& shape, const uint32_t* changed,
                                               const float* values, int64_t numel, uint64_t base);

}  // namespace sparrow::federation
