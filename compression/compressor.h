#pragma once
// The compressor interface. A Compressor is an immutable codec built from a spec
// string ("dgc:ratio=0.001,momentum=0.9"); all mutable state lives in a State the
// caller owns, so one Compressor serves any number of tensors and clients and
// encode() may run concurrently on different states.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "compression/encoded.h"
#include "compression/state.h"

namespace sparrow {
class Spec;
}

namespace sparrow::compression {

// Inputs that are not the tensor and not per-tensor state.
struct Context {
  std::string name;          // tensor name; keys per-tensor random streams (same on every party)
  uint64_t seed = 0;         // run seed shared by every party
  int num_workers = 1;       // N, for DGC's local clipping threshold C·N^-1/2
  int64_t round = -1;        // global round (ACP picks P or Q by its parity); -1: use State::step
  at::Tensor shared_factor;  // ACP: the aggregator's current shared factor; undefined: derive from seed
  // TCS: the server's shared mask, ascending int64 positions into the flattened
  // tensor (compression/mask.h); undefined: none yet (the codec then sends only
  // its own top positions). Updates in IndexCoding::kMask decode only with it.
  at::Tensor mask;
  // TCS keep=P with share=mean: the aggregator divides each mask position by
  // the weight of the updates whose share carried it (StreamingAggregator),
  // and the clients send their shares unscaled. Set by the aggregating side
  // from its compressor's share_mean().
  bool share_mean = false;
};

class Compressor {
 public:
  virtual ~Compressor() = default;
  // The method name as registered ("dgc", "topk", ...).
  virtual std::string method() const = 0;
  // Compresses x (float32, any shape, CPU). Reads/updates state; increments state.step.
  // Throws sparrow::Error on a non-float32 or undefined tensor.
  virtual Encoded encode(const at::Tensor& x, State& state, const Context& ctx) const = 0;
  // The fraction of each tensor's positions the aggregator should broadcast as
  // its shared mask (Context::mask) for this codec; 0: the codec uses none.
  virtual double mask_ratio() const { return 0.0; }
  // Whether the aggregator should average each mask position over the updates
  // that carried it (Context::share_mean); false: a plain weighted sum.
  virtual bool share_mean() const { return false; }
  // Same as the free decode(): the format is self-describing.
  at::Tensor decode(const Encoded& e, const Context& ctx = {}) const;
};

// No infinity or NaN in t: one vectorised scan (detail::any_nonfinite_f32)
// of a contiguous float32 CPU tensor, else ATen's isfinite().all().
bool all_finite(const at::Tensor& t);

// Decodes any Encoded to a float32 tensor of e.shape. Validates first; throws
// FormatError on malformed input.
at::Tensor decode(const Encoded& e, const Context& ctx = {});
// `t` (any device, any float dtype) as a Dense F32 payload, its values copied:
// what a server sends as a full model, and a round's unmasked SecAgg+ mean.
Encoded dense_encoded(const at::Tensor& t);
// out += weight · decode(e), without materialising a dense copy for sparse and
// low-rank formats. out must be float32, contiguous, numel == e.numel().
// Throws FormatError on a malformed e, and then leaves out unchanged.
void decode_add(const Encoded& e, at::Tensor& out, float weight, const Context& ctx = {});

// out = weight · decode(e) for an `out` the caller knows to be all zero (float32,
// contiguous, numel == e.numel()). A dense fp32 tensor is written without a read
// of out (so there, out's prior contents do not matter); if its values are not
// yet known finite (validate(e, ValueCheck::kDeferDenseF32)) they are scanned
// and written in one pass, chunk by chunk: one read of the values. On a
// non-finite value it throws FormatError and out is all zero again. Every other
// tensor: decode_add (same guarantees).
void decode_fill(const Encoded& e, at::Tensor& out, float weight, const Context& ctx = {});
// out = held_weight · held + weight · e for two dense fp32 tensors (numel ==
// out.numel()), `held` already known finite (validated): both read once, out
// written once, its prior contents unread. e's values, when not yet known
// finite, are scanned in the same pass; on a non-finite one it throws
// FormatError and out is all zero. Throws FormatError (out untouched) when
// either is not dense fp32 or a size differs.
void decode_fill_pair(const Encoded& held, float held_weight, const Encoded& e, float weight, at::Tensor& out);

// True for formats whose malformation can surface only while decoding (a
// truncated Elias-gamma stream, a TernGrad code 3, nonzero padding), which
// validate() cannot see: decode_add and aggregators decode these into scratch.
bool decodes_late(Format f);

using Factory = std::function<std::unique_ptr<Compressor>(Spec& spec)>;

// Registers a method under `name`; the factory consumes the keys it knows and
// make_compressor rejects any key left unconsumed.
void register_compressor(const std::string& name, Factory factory);
// Registers every built-in method. Idempotent, thread-safe.
void register_builtins();
// Builds a compressor from a spec string; ConfigError for an unknown method or key.
std::unique_ptr<Compressor> make_compressor(const std::string& spec);
std::vector<std::string> registered_methods();

}  // namespace sparrow::compression
