#pragma once
// Client-side (local) DP of an update over a flat float vector: the same
// arithmetic as federation::local_dp_update (federation/client_pipeline.h,
// aggregation::local_dp) over LibTorch tensors. The whole update is clipped to
// L2 norm `clip` and N(0, (noise * clip)^2) is added to every coordinate,
// coordinate i of the update counted with the tensors in *name* order (the
// order of sparrow-client's std::map), drawn from rng::normal(key, i).
// tests/liteclient checks it against the LibTorch function.

#include <cstdint>
#include <string>
#include <vector>

#include "liteclient/layout.h"

namespace sparrow::liteclient {

struct LocalDp {
  bool on = false;  // "none": off
  double clip = 0, noise = 0, delta = 1e-5;
};

// "none" or "local:clip=C,noise=Z[,delta=D]" (the `dp` key); ConfigError for
// anything else, central DP included (the server's setting).
LocalDp parse_local_dp(const std::string& text);

// Clips and noises `delta` (layout.total floats) in place; returns its norm
// before clipping. sparrow::Error for another length.
double local_dp_update(const Layout& layout, std::vector<float>& delta, double clip, double noise, uint64_t key);

}  // namespace sparrow::liteclient
