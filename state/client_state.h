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
#include "state/encoding.h"

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
  // kFp32 writes version 1, bit-exact (what every build reads). kBf16 writes
  // version 2, which says its encoding and, per tensor, how it is stored: the
  // narrowable compressor slots (narrowable_slot) and float32 controls as
  // bfloat16, everything else as kFp32 would. Throws sparrow::Error naming the
  // tensor for a value bf16 cannot hold (NaN, inf, beyond its range).
  std::string serialize(Encoding encoding = Encoding::kFp32) const;
  // Reads either version; bf16 tensors come back as float32. Throws
  // FormatError on truncated, malformed or trailing bytes.
  static ClientState deserialize(const std::string& bytes);
  // Rounds in place the tensors `encoding` stores narrower to the values a
  // serialize(encoding) / deserialize() round trip gives, so a state kept in
  // memory equals the one read back (a resumed run continues bit-exactly).
  // kFp32: nothing. Checks every tensor first: the same error as serialize(),
  // and nothing changed then.
  void round_to(Encoding encoding);

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
