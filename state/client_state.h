#pragma once
// One client's persistent state as a plain value: what a stateful client carries
// from one round it takes part in to the next. The simulator parks 10^5 of these
// in the ClientStateStore (state/store.h); a real client can persist its own.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "compression/state.h"

namespace sparrow::state {

struct ClientState {
  // Per model tensor name: the compressor's state (residual, momentum, factors).
  std::map<std::string, compression::State> compressor;
  // Per model tensor name: SCAFFOLD's control variate c_i (or any other
  // per-client tensor). Dense tensors of float32/float64/float16/bfloat16/
  // int64/int32/int8/uint8/bool on any device; stored as CPU tensors.
  std::map<std::string, at::Tensor> control;
  uint64_t rng = 0;     // the client's RNG counter (core/rng.h)
  uint64_t rounds = 0;  // rounds this client has taken part in

  // Self-describing little-endian bytes: magic "SPCL", version, rng, rounds,
  // then (name, compression::State bytes) per compressor entry and
  // (name, dtype, shape, data) per control tensor. Throws sparrow::Error for a
  // tensor it cannot store (unsupported dtype, sparse layout).
  std::string serialize() const;
  // Throws FormatError on truncated, malformed or trailing bytes.
  static ClientState deserialize(const std::string& bytes);

  // A copy that shares no tensor storage with this one (CPU, contiguous,
  // detached). Throws sparrow::Error for a tensor serialize() would refuse.
  ClientState deep_copy() const;
  // The same guarantee for a state the caller gives up: a tensor that is
  // already a dense CPU tensor sole owner of exactly its storage is kept as is
  // (no copy), any other is copied. Same checks and errors as deep_copy();
  // on error the state is left unchanged.
  static ClientState into_owned(ClientState&& s);
  // Approximate memory footprint: tensor bytes plus a small per-entry overhead.
  size_t approx_bytes() const;
};

}  // namespace sparrow::state
