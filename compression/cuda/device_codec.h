#pragma once
// Device-level DGC: encode a CUDA tensor and keep the result on the GPU, with
// no host synchronisation inside the call, and fold such results into a dense
// device accumulator. Declared in every build; defined only with
// SPARROW_WITH_CUDA (in compression/dgc.cc), so only CUDA builds may call them.
//
// A caller that wants the wire message uses Compressor::encode on the CUDA
// tensor instead: it runs the same step and synchronises once, at the end.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "compression/compressor.h"

namespace sparrow::compression::cuda {

struct DeviceEncoded {
  std::vector<int64_t> shape;
  // A tensor dgc sends dense (0-d, or 1-D with dense1d=1): values is the
  // input, flattened (not a copy); indices, count and status are undefined.
  bool dense = false;
  int64_t capacity = 0;  // the most entries: DGC's k = ceil(numel·density)
  at::Tensor indices;    // int64 [capacity] on the device: [0, count) ascending
  at::Tensor values;     // float32 [capacity]: v at those indices
  at::Tensor count;      // int64 [1] on the device, <= capacity
  // int32 [1] on the device: 1 when the input held NaN or infinity. Then
  // nothing was selected (count 0) and u and v are unchanged; encode() throws.
  at::Tensor status;
};

// Encodes x (float32, on a CUDA device) with `codec`, which must be a dgc
// codec: the same step, state update and selected set as codec.encode on the
// CPU (docs/gpu.md), all on the device and asynchronous on ATen's current
// stream. Increments state.step. Throws sparrow::Error for another codec or a
// CPU tensor. check_finite = false skips the pass over x that detects NaN and
// infinity (4 of the 28 bytes per element the step moves) for callers that
// know x is finite; a non-finite x then ends up in u and v.
// fused = true runs the fused variant (docs/gpu.md): one pass reads x, u, v and
// writes the new u, v to fresh buffers that replace the state's slots, with
// the finiteness check in that pass (check_finite is then ignored: always on)
// and the selection reading only the candidates above the sampled threshold
// when that threshold is kept. Same results as the plain variant.
DeviceEncoded encode_device(const Compressor& codec, const at::Tensor& x, State& state, const Context& ctx,
                            bool check_finite = true, bool fused = false);

// dense (float32, same device, numel = the encoded tensor's) += weight · e,
// scattered at e's indices with its count read on the device (a dense e adds
// all of its values). No host synchronisation.
void fold_device(const DeviceEncoded& e, float weight, at::Tensor& dense);

}  // namespace sparrow::compression::cuda
