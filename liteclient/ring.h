#pragma once
// SecAgg+ quantisation of a weighted update into the ring, over a flat float
// vector: the same arithmetic and the same bytes as
// federation::quantise_update (federation/client_pipeline.h) over LibTorch
// tensors, for the same update, key and layout (tests/liteclient checks it
// against that function). Tensor k, at offset o_k of the flat vector (Layout),
// goes through secagg::quantise(weight, clip, scale) with its stochastic
// rounding drawn from rng::derive(key, o_k).

#include <cstddef>
#include <cstdint>
#include <vector>

#include "liteclient/layout.h"

namespace sparrow::liteclient {

struct RingUpdate {
  std::vector<uint32_t> x;  // layout.total values, tensors in layout order
  size_t clipped = 0;       // coordinates clamped to +-clip
};

// `delta` holds layout.total floats. sparrow::Error for another length or a
// non-finite coordinate (secagg::quantise).
RingUpdate quantise_update(const Layout& layout, const std::vector<float>& delta, double weight, double clip,
                           double scale, uint64_t key);

}  // namespace sparrow::liteclient
