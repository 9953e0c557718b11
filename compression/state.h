#pragma once
// Per-tensor compressor state (error-feedback residual, DGC's u and v, PowerSGD's
// warm-start Q, ...). A plain value the caller owns: the simulator parks it in
// the state store, a client persists it. Compressors read and write it only
// inside encode().

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>

namespace sparrow::compression {

struct State {
  uint64_t step = 0;                          // encode() calls so far
  int64_t last_round = -1;                    // Context::round of the last encode that had one; -1: none
  std::map<std::string, at::Tensor> tensors;  // float32, contiguous, CPU

  bool has(const std::string& key) const { return tensors.count(key) != 0; }
  // The named slot, created as zeros of `like`'s shape when missing or when its
  // shape no longer matches (a changed model resets that slot).
  at::Tensor& slot(const std::string& key, const at::Tensor& like);

  // The bytes of state_format.h (magic "SPST"; flat::State's too), each
  // tensor read into its own at::Tensor. FormatError on malformed bytes.
  std::string serialize() const;
  static State deserialize(const std::string& bytes);
};

// A name -> tensor map (model weights, control variates, shared factors) as
// State bytes: each tensor as CPU float32, so the round trip is bit-exact for
// float32 weights. Empty bytes read as an empty map. The checkpoints of the
// simulator, the server and the client all use this; FormatError on bad bytes.
std::string serialize_weights(const std::map<std::string, at::Tensor>& weights);
std::map<std::string, at::Tensor> deserialize_weights(const std::string& bytes);

}  // namespace sparrow::compression
