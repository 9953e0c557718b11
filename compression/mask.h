#pragma once
// The server's shared mask for time-correlated sparsification (`tcs`,
// Ozfatura, Ozfatura & Gündüz, ISIT 2021). After each model step the aggregator
// keeps, per tensor, the positions of the largest entries of that step; the
// next round's clients send their values at exactly those positions, which
// therefore cost no index bits (IndexCoding::kMask), plus a few positions of
// their own. A mask is an ascending 1-D int64 CPU tensor of positions into the
// flattened tensor (Context::mask).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "compression/compressor.h"
#include "compression/encoded.h"

namespace sparrow::compression {

// The positions of the k = ceil(ratio·n) largest |step| entries, without the
// zero ones (a step with fewer nonzeros gives a smaller mask), ascending.
at::Tensor step_mask(const at::Tensor& step, double ratio);

// The mask as the server broadcasts it (Task.shared): a sparse tensor of
// `shape` whose positions are the mask's (sign values, all +1, magnitude 1;
// Rice, bitmap or varint positions, whichever is smallest).
Encoded mask_encoded(const at::Tensor& mask, const std::vector<int64_t>& shape);
// The mask a client reads back: the positions of the sparse tensor itself,
// whatever its values (validate()s it first; FormatError on a malformed or
// non-sparse tensor).
at::Tensor mask_positions(const Encoded& e);

// Throws FormatError unless a masked update (IndexCoding::kMask, validated)
// can be decoded with ctx: the round has a mask for it with exactly the
// update's params[1] positions. A no-op for every other tensor.
void check_mask(const Encoded& e, const Context& ctx);

// Masks travel in checkpoints and between simulator ranks with the other
// shared tensors, as float32 weights: key "mask/<name>", a [m, 2] tensor of
// (position >> 20, position & 0xfffff), both exact in float32 for any
// position below 2^40. mask_from_weights throws FormatError on a tensor that
// is not such a pair list, ascending, within [0, numel).
std::string mask_key(const std::string& name);
// After a model step from `before` to `after`: shared[mask_key(name)] = the
// checkpoint form of step_mask(after[name] - before[name], ratio), every tensor.
void put_step_masks(std::map<std::string, at::Tensor>& shared, const std::map<std::string, at::Tensor>& before,
                    const std::map<std::string, at::Tensor>& after, double ratio);
at::Tensor mask_to_weights(const at::Tensor& mask);
at::Tensor mask_from_weights(const at::Tensor& w, int64_t numel);

}  // namespace sparrow::compression
