// DGC on the device with no host synchronisation (kernels.h: dgc_encode_device,
// fold_sparse). The decisions are select_rule.h's, shared with a CPU test.
//
// One call, in stream order (every step after the first reads the control
// block's status and does nothing once the input was found non-finite):
//   1. memset of the control block; with check_finite, a pass over g that
//      flags NaN/inf (4 bytes/element read)
//   2. the samples |v_new| at offset + j·stride, evaluated without writing
//      (same float operations as the update, so the same values)
//   3. radix select of the sample_rank-th largest sample (4 histogram passes
//      over the ~1% sample), then thr_j = thr_{j-1}·0.8f for j = 1..10
//   4. the update u = m·u + coef·g, v += u, counting |v| >= thr_j for every
//      level j per 4096-element tile (read g, u, v; write u, v: 20 bytes/element)
//   5. the level choice (dgc_choose) on one thread
//   6. only when the choice is the exact top-k: radix select of the k-th
//      largest |v| (4 passes over v) and per-tile counts of the two classes;
//      otherwise these kernels return at once
//   7. exclusive scans of the per-tile counts (one block) and the count
//   8. the scatter: each tile ranks its elements with warp ballots and writes
//      the selected (index, v[i]) at their global positions, ascending, then
//      zeroes u[i] and v[i] (reads v: 4 bytes/element; tiles with nothing
//      selected return at once)
// So the common case moves 24 bytes/element (28 with check_finite) against 8
// for a copy of g: 3x (3.5x) a device-to-device copy is the floor of this
// design; the launches add a few microseconds each.
//
// The fused variant (step.u_out/v_out set) replaces 1, 4 and the pass over v:
//   - no finiteness pre-pass: step 4 reads g, u, v and writes the new u, v to
//     u_out, v_out (20 bytes/element), flags NaN/inf in the same pass, counts
//     the 11 levels and keeps the candidates |v_new| >= thr0 of each tile, in
//     index order, in `cap` slots per tile (cand_idx/cand_val);
//   - when the choice is level 0 (the sampled threshold; the exact top-k case
//     is at level 0 too) and no tile had more than cap candidates, the top-k
//     select, the class counts and the scatter read the candidates only;
//   - otherwise (a lowered threshold, or a tile overflowed) the same kernels
//     read v_out in full as in the plain variant: correct, one more pass;
//   - with a non-finite g, a last kernel copies u, v into u_out, v_out.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "compression/cuda/kernels.h"
#include "compression/cuda/select_rule.h"

namespace sparrow::compression::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 16;
constexpr int64_t kTile = kThreads * kItems;  // the same tiles as kernels.cu's selection
constexpr int kWarps = kThreads / 32;
constexpr int kScanThreads = 1024;
constexpr unsigned kMaxStrideGrid = 1024;  // grid-stride kernels: enough blocks to fill an H200

struct Control {
  unsigned long long counts[kDgcLevels];  // #{|v| >= thr_j} after the update
  float thr[kDgcLevels];
  uint32_t hist_sample[kRadixPasses * kRadixBins];
  uint32_t hist_v[kRadixPasses * kRadixBins];
  int status;  // 1: g has NaN or infinity, nothing is written
  int level;
  int topk;
  float hi, lo;  // select |v| > hi, plus the first quota of lo <= |v| <= hi
  long long quota;
  int overflow;  // fused: some tile had more candidates than its slots
  int use_cand;  // fused: the selection reads the candidates, not v
};

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("sparrow cuda: ") + what + ": " + cudaGetErrorString(err));
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
int64_t tiles_of(int64_t n) { return (n + kTile - 1) / kTile; }
size_t align256(size_t b) { return (b + 255) / 256 * 256; }
unsigned stride_grid(int64_t work) {
  const int64_t g = (work + kTile - 1) / kTile;
  return static_cast<unsigned>(g < 1 ? 1 : (g > kMaxStrideGrid ? kMaxStrideGrid : g));
}

// Workspace layout (each part 256-byte aligned).
struct Layout {
  size_t control, samples, level_counts, count_a, count_b, off_a, off_b, cand_idx, cand_val, total;
  Layout(int64_t n, int64_t samples_n, int64_t cap = 0) {
    const auto t = static_cast<size_t>(tiles_of(n));
    control = 0;
    samples = align256(sizeof(Control));
    level_counts = samples + align256(static_cast<size_t>(samples_n) * sizeof(float));
    count_a = level_counts + align256(kDgcLevels * t * sizeof(int));
    count_b = count_a + align256(t * sizeof(int));
    off_a = count_b + align256(t * sizeof(int));
    off_b = off_a + align256((t + 1) * sizeof(long long));
    cand_idx = off_b + align256((t + 1) * sizeof(long long));
    cand_val = cand_idx + align256(t * static_cast<size_t>(cap) * sizeof(int64_t));
    total = cand_val + align256(t * static_cast<size_t>(cap) * sizeof(float));
  }
};

__device__ __forceinline__ float dgc_new_u(float m, float u, float g, float coef) {
  return __fadd_rn(__fmul_rn(m, u), __fmul_rn(g, coef));  // never contracted: the CPU's rounding
}

__global__ void nonfinite_kernel(const float* __restrict__ g, int64_t n, Control* ctl) {
  int bad = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    bad |= !isfinite(g[i]);
  if (__syncthreads_or(bad) && threadIdx.x == 0) ctl->status = 1;
}

__global__ void sample_kernel(const float* __restrict__ g, const float* __restrict__ u, const float* __restrict__ v,
                              DgcDeviceStep s, float* __restrict__ samples, const Control* ctl) {
  if (ctl->status) return;
  const float coef = s.coef_device ? *s.coef_device : s.coef;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < s.sample_count;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = s.sample_offset + j * s.sample_stride;
    samples[j] = fabsf(__fadd_rn(v[i], dgc_new_u(s.momentum, u[i], g[i], coef)));
  }
}

// radix_walk (select_rule.h) by a whole block of kThreads (>= kRadixBins)
// threads: each pass loads the 256 bins at once and finds the bin with a
// suffix scan, instead of one thread walking up to 256 bins per pass serially
// through L2. Same result as radix_walk; every thread must call it.
__device__ RadixState block_radix_walk(const uint32_t* hist, int passes, int64_t r) {
  __shared__ long long incl[kRadixBins];
  __shared__ RadixState st;
  if (threadIdx.x == 0) {
    st.prefix = 0;
    st.mask = 0;
    st.rank = r;
  }
  for (int p = 0; p < passes; ++p) {
    // Position q holds bin 255 - q: the inclusive scan counts the keys in bins >= 255 - q.
    const int q = threadIdx.x;
    const long long c = q < kRadixBins ? hist[p * kRadixBins + (kRadixBins - 1 - q)] : 0;
    if (q < kRadixBins) incl[q] = c;
    __syncthreads();
    for (int off = 1; off < kRadixBins; off <<= 1) {  // Hillis-Steele inclusive scan
      const long long add = q < kRadixBins && q >= off ? incl[q - off] : 0;
      __syncthreads();
      if (q < kRadixBins) incl[q] += add;
      __syncthreads();
    }
    const long long rank = st.rank;
    __syncthreads();  // everyone has read st.rank before it changes
    // The first q whose inclusive count reaches the rank: unique (its own count is > 0).
    if (q < kRadixBins && incl[q] >= rank && incl[q] - c < rank) {
      const int shift = 24 - 8 * p;
      st.prefix |= static_cast<uint32_t>(kRadixBins - 1 - q) << shift;
      st.mask |= 0xffu << shift;
      st.rank = rank - (incl[q] - c);
    }
    __syncthreads();
  }
  __syncthreads();
  const RadixState out = st;
  __syncthreads();  // st may be reused by a later call in the same kernel
  return out;
}

// Candidates of the fused variant: tile b's are slots [b·cap, b·cap + min(tc[b], cap)).
struct Cands {
  const int64_t* idx = nullptr;
  const float* val = nullptr;
  const int* tc = nullptr;  // per-tile counts of |v_new| >= thr0 (level_counts row 0)
  int64_t cap = 0;
  int64_t tiles = 0;
};

// Element e of tile `tile` in the selection's source: v itself (kItems rounds
// of kThreads) or the tile's candidates. Sets *i (the index into v) and *x
// (v_new[i]); false when e is past the tile's end.
__device__ __forceinline__ int source_rounds(bool cand, const Cands& cd, int64_t tile) {
  if (!cand) return kItems;
  const int64_t c = cd.tc[tile] < cd.cap ? cd.tc[tile] : cd.cap;
  return static_cast<int>((c + kThreads - 1) / kThreads);
}
__device__ __forceinline__ bool source_get(bool cand, const Cands& cd, const float* v, int64_t n, int64_t tile,
                                           int64_t e, int64_t* i, float* x) {
  if (cand) {
    if (e >= cd.tc[tile] || e >= cd.cap) return false;
    *i = cd.idx[tile * cd.cap + e];
    *x = cd.val[tile * cd.cap + e];
    return true;
  }
  *i = tile * kTile + e;
  if (*i >= n) return false;
  *x = v[*i];
  return true;
}

// One radix pass: histogram of bits [24-8p, 32-8p) of |a| over the keys that
// match the prefix of the passes before. which = 0: the sample select (runs
// unless the input was non-finite); 1: the top-k select over v, or over the
// candidates when ctl->use_cand (runs only when the level choice asked for the
// exact top-k).
__global__ void radix_hist_kernel(const float* __restrict__ a_in, int64_t len_in, Control* ctl, int which, int pass,
                                  int64_t rank, Cands cd) {
  if (ctl->status || (which == 1 && !ctl->topk)) return;
  const bool cand = which == 1 && ctl->use_cand;
  const float* a = cand ? cd.val : a_in;
  const int64_t len = cand ? cd.cap * cd.tiles : len_in;
  uint32_t* hist = which == 0 ? ctl->hist_sample : ctl->hist_v;
  __shared__ uint32_t h[kRadixBins];
  for (int b = threadIdx.x; b < kRadixBins; b += blockDim.x) h[b] = 0;
  const RadixState s = block_radix_walk(hist, pass, rank);
  const int lane = threadIdx.x & 31;
  // base is uniform over the block, so every lane runs the same iterations
  // (the warp intrinsics below need all 32 lanes).
  for (int64_t base = blockIdx.x * static_cast<int64_t>(blockDim.x); base < len;
       base += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const bool ok = i < len && (!cand || i % cd.cap < cd.tc[i / cd.cap]);
    const int bin = ok ? radix_bin(abs_key_bits(__float_as_uint(a[i])), s, pass) : -1;
    const unsigned active = __ballot_sync(0xffffffffu, bin >= 0);
    if (bin >= 0) {
      const unsigned peers = __match_any_sync(active, bin);  // warp-aggregated: exponents cluster
      if (lane == __ffs(peers) - 1) atomicAdd(&h[bin], static_cast<uint32_t>(__popc(peers)));
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kRadixBins; b += blockDim.x)
    if (h[b]) atomicAdd(&hist[pass * kRadixBins + b], h[b]);
}

__global__ void thresholds_kernel(Control* ctl, int64_t rank) {  // one block of kThreads
  if (ctl->status) return;
  const RadixState s = block_radix_walk(ctl->hist_sample, kRadixPasses, rank);
  if (threadIdx.x != 0) return;
  float t = __uint_as_float(s.prefix);
  for (int j = 0; j < kDgcLevels; ++j) {
    ctl->thr[j] = t;
    t = __fmul_rn(t, 0.8f);  // dgc.cc: thr = thr * kLowerBoundF
  }
}

__global__ void update_count_kernel(const float* __restrict__ g, float* __restrict__ u, float* __restrict__ v,
                                    int64_t n, float m, float coef_host, const float* coef_device, Control* ctl,
                                    int* __restrict__ level_counts, int64_t tiles) {
  if (ctl->status) return;
  const float coef = coef_device ? *coef_device : coef_host;
  float t[kDgcLevels];
  int c[kDgcLevels];
#pragma unroll
  for (int j = 0; j < kDgcLevels; ++j) {
    t[j] = ctl->thr[j];
    c[j] = 0;
  }
  const int64_t base = blockIdx.x * kTile;
#pragma unroll 4
  for (int r = 0; r < kItems; ++r) {
    const int64_t i = base + r * kThreads + threadIdx.x;
    if (i < n) {
      const float uu = dgc_new_u(m, u[i], g[i], coef);
      u[i] = uu;
      const float vv = __fadd_rn(v[i], uu);
      v[i] = vv;
      const float mag = fabsf(vv);
#pragma unroll
      for (int j = 0; j < kDgcLevels; ++j) c[j] += mag >= t[j] ? 1 : 0;
    }
  }
  __shared__ int sums[kDgcLevels][kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < kDgcLevels; ++j) {
    int x = c[j];
    for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
    if (lane == 0) sums[j][warp] = x;
  }
  __syncthreads();
  if (threadIdx.x < kDgcLevels) {
    int total = 0;
    for (int w = 0; w < kWarps; ++w) total += sums[threadIdx.x][w];
    level_counts[threadIdx.x * tiles + blockIdx.x] = total;
    if (total) atomicAdd(&ctl->counts[threadIdx.x], static_cast<unsigned long long>(total));
  }
}

// The fused variant's pass: update_count_kernel's work with the new state
// written to u_out, v_out, the finiteness flag, and the candidates
// |v_new| >= thr0 of this tile ranked by warp ballots (ascending) into its cap
// slots. Runs whatever the status (it is the pass that sets it).
__global__ void fused_update_kernel(const float* __restrict__ g, const float* __restrict__ u,
                                    const float* __restrict__ v, float* __restrict__ u_out, float* __restrict__ v_out,
                                    int64_t n, float m, float coef_host, const float* coef_device, Control* ctl,
                                    int* __restrict__ level_counts, int64_t tiles, int64_t cap,
                                    int64_t* __restrict__ cand_idx, float* __restrict__ cand_val) {
  const float coef = coef_device ? *coef_device : coef_host;
  float t[kDgcLevels];
  int c[kDgcLevels];
#pragma unroll
  for (int j = 0; j < kDgcLevels; ++j) {
    t[j] = ctl->thr[j];
    c[j] = 0;
  }
  __shared__ int wc[kWarps];
  __shared__ int wbase[kWarps + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned lt_mask = (1u << lane) - 1u;
  const int64_t base = blockIdx.x * kTile;
  int bad = 0;
  long long run = 0;  // candidates of this tile so far (the same in every thread)
  for (int r = 0; r < kItems; ++r) {
    const int64_t i = base + r * kThreads + threadIdx.x;
    bool cand = false;
    float vv = 0.0f;
    if (i < n) {
      const float gg = g[i];
      bad |= !isfinite(gg);
      const float uu = dgc_new_u(m, u[i], gg, coef);
      u_out[i] = uu;
      vv = __fadd_rn(v[i], uu);
      v_out[i] = vv;
      const float mag = fabsf(vv);
#pragma unroll
      for (int j = 0; j < kDgcLevels; ++j) c[j] += mag >= t[j] ? 1 : 0;
      cand = mag >= t[0];
    }
    const unsigned bal = __ballot_sync(0xffffffffu, cand);
    if (lane == 0) wc[warp] = __popc(bal);
    __syncthreads();
    if (threadIdx.x == 0) {
      int tot = 0;
      for (int w = 0; w < kWarps; ++w) {
        wbase[w] = tot;
        tot += wc[w];
      }
      wbase[kWarps] = tot;
    }
    __syncthreads();
    const long long pos = run + wbase[warp] + __popc(bal & lt_mask);
    if (cand && pos < cap) {
      cand_idx[blockIdx.x * cap + pos] = i;
      cand_val[blockIdx.x * cap + pos] = vv;
    }
    run += wbase[kWarps];
    __syncthreads();  // wc and wbase are rewritten in the next round
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) ctl->status = 1;
  if (threadIdx.x == 0 && run > cap) ctl->overflow = 1;
  __shared__ int sums[kDgcLevels][kWarps];
#pragma unroll
  for (int j = 0; j < kDgcLevels; ++j) {
    int x = c[j];
    for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
    if (lane == 0) sums[j][warp] = x;
  }
  __syncthreads();
  if (threadIdx.x < kDgcLevels) {
    int total = 0;
    for (int w = 0; w < kWarps; ++w) total += sums[threadIdx.x][w];
    level_counts[threadIdx.x * tiles + blockIdx.x] = total;
    if (total) atomicAdd(&ctl->counts[threadIdx.x], static_cast<unsigned long long>(total));
  }
}

// Fused variant, non-finite g only: the state stays as it was (u_out, v_out = u, v).
__global__ void restore_kernel(const float* __restrict__ u, const float* __restrict__ v, float* __restrict__ u_out,
                               float* __restrict__ v_out, int64_t n, const Control* ctl) {
  if (!ctl->status) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    u_out[i] = u[i];
    v_out[i] = v[i];
  }
}

__global__ void choose_kernel(Control* ctl, int64_t k, bool exact, bool fused) {
  if (ctl->status) return;
  const DgcChoice c = dgc_choose(ctl->counts, k, exact);
  ctl->level = c.level;
  ctl->topk = c.topk ? 1 : 0;
  // Level 0 is the candidates' threshold; the exact top-k there is a subset of
  // them (count_0 >= k). A lowered level needs v in full (rare).
  ctl->use_cand = fused && c.level == 0 && !ctl->overflow ? 1 : 0;
  if (!c.topk) {
    ctl->hi = __int_as_float(0x7f800000);  // +inf: class A is empty
    ctl->lo = ctl->thr[c.level];
    ctl->quota = k;  // idx[:k]
  }
}

__global__ void finish_topk_kernel(Control* ctl, int64_t k) {  // one block of kThreads
  if (ctl->status || !ctl->topk) return;
  const RadixState s = block_radix_walk(ctl->hist_v, kRadixPasses, k);
  if (threadIdx.x != 0) return;
  ctl->hi = ctl->lo = __uint_as_float(s.prefix);
  ctl->quota = s.rank;  // keep_topk: the first (k - #{|v| > T}) of the ties
}

// Top-k case only: per-tile counts of |v| > hi and lo <= |v| <= hi.
__global__ void class_count_kernel(const float* __restrict__ v, int64_t n, const Control* ctl, int* count_a,
                                   int* count_b, int64_t tiles, Cands cd) {
  if (ctl->status || !ctl->topk) return;
  const bool cand = ctl->use_cand != 0;
  const float hi = ctl->hi, lo = ctl->lo;
  __shared__ int wa[kWarps], wb[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    int a = 0, b = 0;
    const int rounds = source_rounds(cand, cd, tile);
    for (int r = 0; r < rounds; ++r) {
      int64_t i = 0;
      float x = 0.0f;
      if (source_get(cand, cd, v, n, tile, r * kThreads + threadIdx.x, &i, &x)) {
        const float mag = fabsf(x);
        a += class_a(mag, hi) ? 1 : 0;
        b += class_b(mag, lo, hi) ? 1 : 0;
      }
    }
    for (int off = 16; off > 0; off >>= 1) {
      a += __shfl_down_sync(0xffffffffu, a, off);
      b += __shfl_down_sync(0xffffffffu, b, off);
    }
    if (lane == 0) {
      wa[warp] = a;
      wb[warp] = b;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int ta = 0, tb = 0;
      for (int w = 0; w < kWarps; ++w) {
        ta += wa[w];
        tb += wb[w];
      }
      count_a[tile] = ta;
      count_b[tile] = tb;
    }
    __syncthreads();
  }
}

// Exclusive scan of src[0..t) (zeros when src is null) into out[0..t], out[t] = total. Block-wide helper.
__device__ long long block_exclusive_scan(const int* src, int64_t t, long long* out, long long* s) {
  const int64_t seg = (t + kScanThreads - 1) / kScanThreads;
  const int64_t lo = threadIdx.x * seg, hi = lo + seg < t ? lo + seg : t;
  long long sum = 0;
  if (src)
    for (int64_t i = lo; i < hi; ++i) sum += src[i];
  s[threadIdx.x] = sum;
  __syncthreads();
  for (int off = 1; off < kScanThreads; off <<= 1) {  // Hillis-Steele inclusive scan
    const long long add = threadIdx.x >= off ? s[threadIdx.x - off] : 0;
    __syncthreads();
    s[threadIdx.x] += add;
    __syncthreads();
  }
  long long run = s[threadIdx.x] - sum;
  for (int64_t i = lo; i < hi; ++i) {
    out[i] = run;
    run += src ? src[i] : 0;
  }
  const long long total = s[kScanThreads - 1];
  __syncthreads();  // s is reused by the next scan
  return total;
}

__global__ void scan_kernel(const Control* ctl, const int* level_counts, const int* count_a, const int* count_b,
                            int64_t tiles, long long* off_a, long long* off_b, int64_t* count, int32_t* status) {
  __shared__ long long s[kScanThreads];
  if (ctl->status) {
    if (threadIdx.x == 0) {
      *count = 0;
      *status = 1;
    }
    return;
  }
  const bool topk = ctl->topk != 0;
  const long long ta = block_exclusive_scan(topk ? count_a : nullptr, tiles, off_a, s);
  const long long tb = block_exclusive_scan(topk ? count_b : level_counts + ctl->level * tiles, tiles, off_b, s);
  if (threadIdx.x == 0) {
    off_a[tiles] = ta;
    off_b[tiles] = tb;
    *count = ta + (tb < ctl->quota ? tb : ctl->quota);
    *status = 0;
  }
}

// Tile b writes its selected elements: class A always, class B while its global
// rank is below quota, at position (A before it) + min(B before it, quota).
// Ranked in rounds of kThreads consecutive elements by warp ballots, so the
// indices come out ascending. u may be null (no masking).
__global__ void scatter_kernel(float* __restrict__ u, float* __restrict__ v, int64_t n, const Control* ctl,
                               const long long* off_a, const long long* off_b, int64_t* __restrict__ idx,
                               float* __restrict__ val, Cands cd) {
  if (ctl->status) return;
  const bool cand = ctl->use_cand != 0;
  const float hi = ctl->hi, lo = ctl->lo;
  const long long quota = ctl->quota;
  const int64_t b = blockIdx.x;
  long long out_a = off_a[b], out_b = off_b[b];
  if (off_a[b + 1] == out_a && (off_b[b + 1] == out_b || out_b >= quota)) return;  // nothing selected here
  __shared__ int wa[kWarps], wb[kWarps];
  __shared__ int base_a[kWarps + 1], base_b[kWarps + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned lt_mask = (1u << lane) - 1u;
  const int rounds = source_rounds(cand, cd, b);
  for (int r = 0; r < rounds; ++r) {
    int64_t i = 0;
    float x = 0.0f;
    bool a = false, bb = false;
    if (source_get(cand, cd, v, n, b, r * kThreads + threadIdx.x, &i, &x)) {
      const float mag = fabsf(x);
      a = class_a(mag, hi);
      bb = class_b(mag, lo, hi);
    }
    const unsigned bal_a = __ballot_sync(0xffffffffu, a), bal_b = __ballot_sync(0xffffffffu, bb);
    if (lane == 0) {
      wa[warp] = __popc(bal_a);
      wb[warp] = __popc(bal_b);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int ta = 0, tb = 0;
      for (int w = 0; w < kWarps; ++w) {
        base_a[w] = ta;
        base_b[w] = tb;
        ta += wa[w];
        tb += wb[w];
      }
      base_a[kWarps] = ta;
      base_b[kWarps] = tb;
    }
    __syncthreads();
    const long long ga = out_a + base_a[warp] + __popc(bal_a & lt_mask);
    const long long gb = out_b + base_b[warp] + __popc(bal_b & lt_mask);
    if (a || (bb && gb < quota)) {
      const long long pos = ga + (gb < quota ? gb : quota);
      idx[pos] = i;
      val[pos] = x;
      if (u) {
        u[i] = 0.0f;  // momentum factor masking
        v[i] = 0.0f;
      }
    }
    out_a += base_a[kWarps];
    out_b += base_b[kWarps];
    __syncthreads();  // the bases are rewritten in the next round
  }
}

__global__ void fold_kernel(const int64_t* __restrict__ idx, const float* __restrict__ val, const int64_t* count,
                            int64_t capacity, float weight, float* __restrict__ dense) {
  const int64_t c = *count < capacity ? *count : capacity;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < c;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float w = weight == 1.0f ? val[j] : __fmul_rn(weight, val[j]);
    dense[idx[j]] = __fadd_rn(dense[idx[j]], w);
  }
}

unsigned elem_grid(int64_t work) {
  const int64_t g = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(g < 1 ? 1 : (g > 65535 * 4 ? 65535 * 4 : g));
}

}  // namespace

// Candidate slots per tile of the fused variant: four times the expected
// count of a tile (k/n of its 4096 elements) plus 64, at most the tile. A tile
// with more (clustered large values) sends the step down the full pass over v.
static int64_t cand_cap(const DgcDeviceStep& step) {
  if (step.u_out == nullptr || step.v_out == nullptr) return 0;
  const int64_t mean = (kTile * step.k + step.n - 1) / step.n;
  const int64_t cap = 4 * mean + 64;
  return cap < kTile ? cap : kTile;
}

size_t dgc_device_workspace_bytes(int64_t n, int64_t sample_count) { return Layout(n, sample_count).total; }

size_t dgc_device_workspace_bytes(const DgcDeviceStep& step) {
  return Layout(step.n, step.sample_count, step.n > 0 && step.k > 0 ? cand_cap(step) : 0).total;
}

void dgc_encode_device(const float* g, float* u, float* v, const DgcDeviceStep& step, void* workspace, int64_t* idx,
                       float* val, int64_t* count, int32_t* status, void* stream) {
  if (step.n <= 0 || step.k <= 0 || step.sample_count <= 0 || step.sample_rank < 1 ||
      step.sample_rank > step.sample_count || step.sample_offset < 0 || step.sample_stride < 1 ||
      step.sample_offset + (step.sample_count - 1) * step.sample_stride >= step.n)
    throw std::runtime_error("sparrow cuda: dgc_encode_device: inconsistent step (n, k or sample plan)");
  if ((step.u_out == nullptr) != (step.v_out == nullptr) ||
      (step.u_out != nullptr && (step.u_out == u || step.v_out == v)))
    throw std::runtime_error(
        "sparrow cuda: dgc_encode_device: the fused variant needs both u_out and v_out, apart from u, v");
  const bool fused = step.u_out != nullptr;
  const cudaStream_t st = as_stream(stream);
  const int64_t n = step.n, tiles = tiles_of(n), cap = cand_cap(step);
  const Layout L(n, step.sample_count, cap);
  auto* base = static_cast<char*>(workspace);
  auto* ctl = reinterpret_cast<Control*>(base + L.control);
  auto* samples = reinterpret_cast<float*>(base + L.samples);
  auto* level_counts = reinterpret_cast<int*>(base + L.level_counts);
  auto* count_a = reinterpret_cast<int*>(base + L.count_a);
  auto* count_b = reinterpret_cast<int*>(base + L.count_b);
  auto* off_a = reinterpret_cast<long long*>(base + L.off_a);
  auto* off_b = reinterpret_cast<long long*>(base + L.off_b);
  Cands cd;  // read only when ctl->use_cand, which only the fused variant sets
  if (fused) {
    cd.idx = reinterpret_cast<int64_t*>(base + L.cand_idx);
    cd.val = reinterpret_cast<float*>(base + L.cand_val);
    cd.tc = level_counts;  // row 0: the counts of |v_new| >= thr0
    cd.cap = cap;
    cd.tiles = tiles;
  }
  // The selection reads and masks the new state: u_out, v_out in the fused variant.
  float* su = fused ? step.u_out : u;
  float* sv = fused ? step.v_out : v;

  check(cudaMemsetAsync(ctl, 0, sizeof(Control), st), "dgc_encode_device (reset)");
  if (step.check_finite && !fused) {
    nonfinite_kernel<<<elem_grid(n), kThreads, 0, st>>>(g, n, ctl);
    check(cudaGetLastError(), "dgc_encode_device (finite check)");
  }
  sample_kernel<<<elem_grid(step.sample_count), kThreads, 0, st>>>(g, u, v, step, samples, ctl);
  check(cudaGetLastError(), "dgc_encode_device (sample)");
  for (int p = 0; p < kRadixPasses; ++p) {
    radix_hist_kernel<<<stride_grid(step.sample_count), kThreads, 0, st>>>(samples, step.sample_count, ctl, 0, p,
                                                                           step.sample_rank, Cands());
    check(cudaGetLastError(), "dgc_encode_device (sample radix)");
  }
  thresholds_kernel<<<1, kThreads, 0, st>>>(ctl, step.sample_rank);
  check(cudaGetLastError(), "dgc_encode_device (thresholds)");
  if (fused) {
    fused_update_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, st>>>(
        g, u, v, step.u_out, step.v_out, n, step.momentum, step.coef, step.coef_device, ctl, level_counts, tiles, cap,
        reinterpret_cast<int64_t*>(base + L.cand_idx), reinterpret_cast<float*>(base + L.cand_val));
    check(cudaGetLastError(), "dgc_encode_device (fused update)");
  } else {
    update_count_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, st>>>(g, u, v, n, step.momentum, step.coef,
                                                                           step.coef_device, ctl, level_counts, tiles);
    check(cudaGetLastError(), "dgc_encode_device (update)");
  }
  choose_kernel<<<1, 1, 0, st>>>(ctl, step.k, step.exact, fused);
  check(cudaGetLastError(), "dgc_encode_device (choose)");
  for (int p = 0; p < kRadixPasses; ++p) {
    radix_hist_kernel<<<stride_grid(n), kThreads, 0, st>>>(sv, n, ctl, 1, p, step.k, cd);
    check(cudaGetLastError(), "dgc_encode_device (top-k radix)");
  }
  finish_topk_kernel<<<1, kThreads, 0, st>>>(ctl, step.k);
  check(cudaGetLastError(), "dgc_encode_device (top-k threshold)");
  class_count_kernel<<<stride_grid(n), kThreads, 0, st>>>(sv, n, ctl, count_a, count_b, tiles, cd);
  check(cudaGetLastError(), "dgc_encode_device (top-k counts)");
  scan_kernel<<<1, kScanThreads, 0, st>>>(ctl, level_counts, count_a, count_b, tiles, off_a, off_b, count, status);
  check(cudaGetLastError(), "dgc_encode_device (scan)");
  scatter_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, st>>>(su, sv, n, ctl, off_a, off_b, idx, val, cd);
  check(cudaGetLastError(), "dgc_encode_device (scatter)");
  if (fused) {
    restore_kernel<<<stride_grid(n), kThreads, 0, st>>>(u, v, step.u_out, step.v_out, n, ctl);
    check(cudaGetLastError(), "dgc_encode_device (restore)");
  }
}

void fold_sparse(const int64_t* idx, const float* val, const int64_t* count, int64_t capacity, float weight,
                 float* dense, void* stream) {
  if (capacity <= 0) return;
  fold_kernel<<<elem_grid(capacity), kThreads, 0, as_stream(stream)>>>(idx, val, count, capacity, weight, dense);
  check(cudaGetLastError(), "fold_sparse");
}

void copy_to_host_async(void* host, const void* device, size_t bytes, void* stream) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, as_stream(stream)), "copy_to_host_async");
}

void stream_synchronize(void* stream) { check(cudaStreamSynchronize(as_stream(stream)), "stream_synchronize"); }

}  // namespace sparrow::compression::cuda
