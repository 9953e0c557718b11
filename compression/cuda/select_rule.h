#pragma once
// The decisions of DGC's device selection (compression/cuda/dgc_device.cu), as
// functions that compile for the host and the device, so that a CPU test
// (tests/compression/cuda_test.cc, "cuda: device selection rule ...") drives
// exactly the logic the kernels run and compares it with dgc.cc's CPU path.
// Plain C++: no CUDA or torch headers.
//
// The CPU path (dgc.cc select()) and the device path select the same set:
//   thr0 = k-th largest sampled |v| (kth_largest), thr_j = thr_{j-1}·0.8f;
//   j* = the first j <= 9 with count(|v| >= thr_j) >= 0.8k, else 10 (the
//   reference's adaptation loop, at most 10 lowerings);
//   if j* <= 9 and count_j* > 1.3k: the exact top-k of |v| (keep_topk: larger
//   first, ties by lower index), else the first min(count_j*, k) indices of
//   {|v| >= thr_j*} (idx[:k]).
// The device counts every level's |v| >= thr_j in the update pass and decides
// there; the top-k case finds the k-th largest |v| by radix select and takes
// {|v| > T} plus the first (k - #{|v| > T}) of {|v| == T}: keep_topk's set.

#include <cstdint>

#if defined(__CUDACC__)
#define SPARROW_HD __host__ __device__
#else
#define SPARROW_HD
#endif

namespace sparrow::compression::cuda {

constexpr int kDgcLevels = 11;   // thr_0 .. thr_10: the reference lowers at most 10 times
constexpr int kRadixPasses = 4;  // 8 bits per pass over a float's 32 bits
constexpr int kRadixBins = 256;

// Order-preserving key of |x|: non-negative floats order as their bit patterns.
SPARROW_HD inline uint32_t abs_key_bits(uint32_t float_bits) { return float_bits & 0x7fffffffu; }

// State of a radix select for the r-th largest key after `passes` completed
// histograms hist[p][256] (pass p counts bits [24-8p, 32-8p) of the keys whose
// higher bits equal the prefix so far). prefix/mask: the bits fixed so far;
// rank: the rank of the answer among the keys matching the prefix (1-based).
// After kRadixPasses passes, prefix is the r-th largest key, and exactly
// r - rank keys are larger than it.
// No member initialisers: the kernels keep one in __shared__ memory.
struct RadixState {
  uint32_t prefix;
  uint32_t mask;
  int64_t rank;
};

SPARROW_HD inline RadixState radix_walk(const uint32_t* hist, int passes, int64_t r) {
  RadixState s;
  s.prefix = 0;
  s.mask = 0;
  s.rank = r;
  for (int p = 0; p < passes; ++p) {
    const int shift = 24 - 8 * p;
    const uint32_t* h = hist + p * kRadixBins;
    int64_t above = 0;
    for (int b = kRadixBins - 1; b >= 0; --b) {
      const int64_t c = h[b];
      if (above + c >= s.rank) {
        s.prefix |= static_cast<uint32_t>(b) << shift;
        s.mask |= 0xffu << shift;
        s.rank -= above;
        break;
      }
      above += c;
    }
  }
  return s;
}

// The bin of `key` in pass p, or -1 when key does not match the prefix of s.
SPARROW_HD inline int radix_bin(uint32_t key, const RadixState& s, int p) {
  if ((key & s.mask) != s.prefix) return -1;
  return static_cast<int>((key >> (24 - 8 * p)) & 0xffu);
}

// The adaptation loop of dgc.cc on counts[j] = #{|v| >= thr_j}: the level j*
// and whether the exact top-k replaces the threshold set (topk = true).
struct DgcChoice {
  int level = 0;
  bool topk = false;
};

SPARROW_HD inline DgcChoice dgc_choose(const unsigned long long* counts, int64_t k_in, bool exact) {
  DgcChoice c;
  if (exact) return c;  // every element sampled: no adaptation (the reference's rule)
  const double k = static_cast<double>(k_in);
  for (int it = 0; it < kDgcLevels - 1; ++it) {
    const double found = static_cast<double>(counts[c.level]);
    if (found > k) {
      c.topk = found > k * 1.3;  // kUpperBound
      return c;
    }
    if (!(found < 0.8 * k)) return c;  // kLowerBound
    ++c.level;                         // thr *= 0.8f, collect again
  }
  return c;
}

// The final selection as two classes: every |v| > hi, plus the first `quota`
// (in index order) of lo <= |v| <= hi. Threshold case: hi = +inf, lo = thr_j*,
// quota = k. Top-k case: hi = lo = T, quota = rank from radix_walk.
SPARROW_HD inline bool class_a(float mag, float hi) { return mag > hi; }
SPARROW_HD inline bool class_b(float mag, float lo, float hi) { return !(mag > hi) && mag >= lo; }

}  // namespace sparrow::compression::cuda
