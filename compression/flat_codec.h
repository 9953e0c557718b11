#pragma once
// The codecs without LibTorch: the same spec strings, the same Encoded bytes,
// over plain float buffers. What the lite client (sparrow-client-lite) encodes
// its updates and decodes the server's models with, linking no LibTorch
// (target sparrow_codec_core). The LibTorch codecs (compression/compressor.h)
// run the same CPU code through this layer, so both give the same bytes for the
// same input, state and context (tests/compression/flat_codec_test.cc).
//
// Methods: those `flat_methods()` lists, every registered method. powersgd
// runs the LibTorch codec's steps over the same low-rank kernels
// (lowrank_kernel.h), so it gives the same bytes and state too; acp is one
// kernel for both (acp_cpu.cc), its round's shared factor in the Context.
// Encoding runs on the calling thread.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "compression/encoded.h"
#include "compression/state_format.h"

namespace sparrow::compression::flat {

// One float32 tensor, row-major.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// A codec's per-tensor state (residual, DGC's u and v, ...): compression::State
// without LibTorch. Its bytes are compression::State's (state_format.h: one
// writer and reader for both), so a client's state file is the same either way.
struct State {
  uint64_t step = 0;
  int64_t last_round = -1;
  std::map<std::string, Tensor> tensors;

  bool has(const std::string& key) const { return tensors.count(key) != 0; }
  // The named slot, created as zeros of `shape` when missing or when its shape
  // differs (a changed model resets that slot), as compression::State::slot.
  Tensor& slot(const std::string& key, const std::vector<int64_t>& shape);
  std::string serialize() const;
  // serialize()'s size, and its bytes to a sink in pieces: the lite state
  // file streams a state to its file without building the string.
  uint64_t serialized_size() const;
  void serialize_to(const state_format::Sink& sink) const;
  // FormatError on bad bytes; reads both versions.
  static State deserialize(const char* p, size_t n);
  static State deserialize(const std::string& bytes) { return deserialize(bytes.data(), bytes.size()); }
};

// compression::Context without LibTorch.
struct Context {
  std::string name;
  uint64_t seed = 0;
  int num_workers = 1;
  int64_t round = -1;
  // TCS: the server's shared mask (ascending positions); has_mask false: none.
  bool has_mask = false;
  std::vector<int64_t> mask;
  bool share_mean = false;
  // ACP: the aggregator's shared factor of this tensor for ctx.round, {k, r}
  // row-major (Q̂, cols × r, in even rounds; P̂, rows × r, in odd ones), as the
  // server sends it in Task.shared; has_shared_factor false: none, the codec
  // derives the seeded initial one (round 0's), as compression::Context's
  // undefined shared_factor. Read by acp's encode and by decode_add of its
  // factors; a wrong shape or a non-finite value is a FormatError.
  bool has_shared_factor = false;
  Tensor shared_factor;
};

class Codec {
 public:
  virtual ~Codec() = default;
  virtual std::string method() const = 0;
  // Compresses x (n = product of shape values, row-major float32). Reads and
  // updates state in place; increments state.step. sparrow::Error on a
  // non-finite input (the LibTorch codec's message), before any state changes.
  // Immutable: encode may run concurrently on different states.
  virtual Encoded encode(const float* x, const std::vector<int64_t>& shape, State& state, const Context& ctx) const = 0;
  virtual double mask_ratio() const { return 0.0; }
  virtual bool share_mean() const { return false; }
};

// Builds a codec from a spec string ("dgc:ratio=0.001"); ConfigError for an
// unknown method or key.
std::unique_ptr<Codec> make_codec(const std::string& spec);
std::vector<std::string> flat_methods();

// out[0, n) += weight · decode(e). Validates e first (FormatError, out
// unchanged, on a malformed e or n != e.numel()); bit-stream formats decode
// into scratch first, so a stream found bad half way leaves out unchanged too.
// kLowRank and kLowRankSparse (powersgd) add weight · P·Qᵀ (+ the sparse
// correction); kLowRankFactor (acp) adds F·Q̂ᵀ or P̂·Fᵀ against ctx's shared
// factor (the seeded initial one without), as compression::decode_add. A
// kMask update needs the round's mask in ctx (has_mask, mask), as
// compression::decode_add.
void decode_add(const Encoded& e, float* out, int64_t n, float weight, const Context& ctx = {});

// An acp shared factor as a Task's `shared` carries it, as the {k, r} tensor
// Context::shared_factor takes: a kLowRankFactor (what sparrow-server sends,
// compression::acp_factor_encoded: its values are the factor itself, read as
// compression::acp_factor reads them) or a tensor of any other format,
// decoded to its shape (as compression::decode). FormatError for a malformed e.
Tensor shared_factor_of(const Encoded& e);

}  // namespace sparrow::compression::flat
