#pragma once
// RoundTrip: one client and the aggregator, minus the network. Each step
// encodes named tensors with persistent compressor state, serialises them as a
// ModelUpdate message, parses and verifies those bytes as a receiver would, and
// decodes. For ACP it also keeps the aggregator's shared factors, so successive
// steps alternate P and Q exactly as in a deployment. Used by sparrow-codec,
// sparrow-bench and tests; byte counts are the serialised message size.

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "compression/compressor.h"

namespace sparrow::wire {

struct RoundTripResult {
  // In the order given to step(). The buffers are reused by the next step():
  // clone what must outlive it.
  std::vector<at::Tensor> decoded;
  size_t wire_bytes = 0;    // size of the serialised message
  double encode_ms = 0;     // compressor encode, all tensors
  double serialize_ms = 0;  // build + parse/verify of the message
  double decode_ms = 0;     // zero the output buffer + decode_add, all tensors (ACP: + next shared factor)
};

class RoundTrip {
 public:
  RoundTrip(const compression::Compressor& compressor, uint64_t seed);
  RoundTripResult step(const std::vector<std::pair<std::string, at::Tensor>>& tensors);
  compression::State& state(const std::string& name) { return states_[name]; }

 private:
  const compression::Compressor& compressor_;
  uint64_t seed_;
  int64_t round_ = 0;
  std::map<std::string, compression::State> states_;
  std::map<std::string, at::Tensor> shared_;   // ACP: the aggregator's shared factor per tensor
  std::map<std::string, at::Tensor> masks_;    // TCS: the aggregator's mask per tensor
  std::map<std::string, at::Tensor> decoded_;  // output buffers, reused across steps
};

}  // namespace sparrow::wire
