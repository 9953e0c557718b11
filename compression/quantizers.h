#pragma once
// Internal to compression/: the fixed-block loops the three quantizing
// kernels (qsgd.cc, terngrad.cc, sign_cpu.cc) share. Torch-free.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "compression/codec_bits.h"

namespace sparrow::compression::detail {

// Elements per block of the parallel reductions and packing loops. It is fixed,
// not derived from the thread count, so floating-point sums (and with them every
// scale on the wire) are bit-identical whatever the machine or thread count.
// A multiple of 8 and of 4, so packed bit/2-bit blocks never share a byte.
constexpr int64_t kBlock = int64_t{1} << 16;

// Runs fn(lo, hi) -> T on the blocks [b·kBlock, min(n, (b+1)·kBlock)) in
// parallel and returns the per-block results in block order; callers combine
// them sequentially, which keeps reductions deterministic.
template <typename T, typename F>
std::vector<T> per_block(int64_t n, const F& fn) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<T> out(static_cast<size_t>(blocks));
  parallel_for(0, blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) out[static_cast<size_t>(b)] = fn(b * kBlock, std::min(n, (b + 1) * kBlock));
  });
  return out;
}

// Runs fn(lo, hi) on the same blocks, for loops whose blocks write disjoint outputs.
template <typename F>
void for_blocks(int64_t n, const F& fn) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  parallel_for(0, blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) fn(b * kBlock, std::min(n, (b + 1) * kBlock));
  });
}

}  // namespace sparrow::compression::detail
