#pragma once
// Internals of the sparsifying codecs, exposed so tests can check them and
// transcribe DGC independently: the selection kernels that topk, threshold and
// dgc share (defined in sparse.cc), and DGC's warm-up schedule and sampling plan
// (defined in dgc_cpu.cc). Internal to compression/: not part of the public interface.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "compression/codec_bits.h"

namespace sparrow::compression::detail {

// ---- selection kernels (sparse.cc) ----------------------------------------------

// Elements per scan block. Fixed, so the work split never depends on the thread count.
constexpr int64_t kScanBlock = int64_t{1} << 15;

// Runs fn(begin, end, part) over [0, n) in kScanBlock-sized blocks, in parallel
// (detail::parallel_for).
// fn appends the indices it selects from its block to `part` in ascending order;
// a thread's consecutive blocks share one part, and the parts are concatenated in
// block order into `out` (appended). The result is therefore ascending and
// identical for any thread count; fn may also update its block in place.
template <typename Fn>
void scan_blocks(int64_t n, std::vector<int64_t>& out, const Fn& fn) {
  if (n <= 0) return;
  const int64_t blocks = (n + kScanBlock - 1) / kScanBlock;
  std::vector<std::vector<int64_t>> parts(static_cast<size_t>(blocks));
  parallel_for(0, blocks, [&](int64_t b0, int64_t b1) {
    std::vector<int64_t>& part = parts[static_cast<size_t>(b0)];
    for (int64_t b = b0; b < b1; ++b) fn(b * kScanBlock, std::min(n, (b + 1) * kScanBlock), part);
  });
  size_t total = out.size();
  for (const auto& p : parts) total += p.size();
  out.reserve(total);
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
}

// The r-th largest (1-based) of the non-NaN values in s (the minimum of
// torch.topk(s, r)); the smallest of them when fewer than r remain, 0 when none.
// Reorders s and drops its NaNs.
float kth_largest(std::vector<float>& s, int64_t r);

// Appends every i in [0, n) with |a[i]| >= thr, ascending. NaN never passes.
void collect_abs_ge(const float* a, int64_t n, float thr, std::vector<int64_t>& out);

// Reduces `cand` (ascending, distinct indices into a) to its k best under the
// order |a[i]| descending, then i ascending (the order of a stable descending
// sort of |a|), keeping them ascending. No-op when cand.size() <= k.
// Entries of a at cand must not be NaN.
void keep_topk(const float* a, std::vector<int64_t>& cand, uint64_t k);

// Exact top-k of |a[0..n)| under the order of keep_topk, ascending, k clamped to n.
// Never sorts or selects over the whole array: a threshold from a strided sample,
// one candidate pass (repeated with a lower threshold only when it caught fewer
// than k), then a selection among the candidates. Throws sparrow::Error when
// fewer than k entries are not NaN.
std::vector<int64_t> topk_abs_indices(const float* a, int64_t n, int64_t k);

// ---- DGC (dgc_cpu.cc) --------------------------------------------------------------

// Density at 0-based step `step`: with warmup K > 0 and step < K it is
// max(0.25^(floor(4·step/K) + 1), ratio), i.e. 25%, 6.25%, 1.5625%, 0.390625% over
// four equal phases (the paper's exponential sparsity warm-up); afterwards `ratio`.
double dgc_density(uint64_t step, int64_t warmup, double ratio);

// The reference implementation's per-tensor sampling plan for one density
// (synxlin/deep-gradient-compression, DGCCompressor.initialize), arithmetic in
// double as in Python:
//   pct = ceil(n·sample), cpr = ceil(2/density)
//   n <= cpr: stride 1, num_samples n (exact: every element is a sample)
//   else: stride = ceil(n / max(pct, cpr) / 32)·32 + 1, num_samples = n / stride,
//         stride -= 8 while num_samples < max(pct, cpr)
//   top_k_samples = ceil(num_samples·density), k = ceil(n·density)
// The samples are |v| at offset, offset + stride, ... < n, which may be one more
// than num_samples; the threshold is the top_k_samples-th largest of them.
struct DgcSamplePlan {
  int64_t stride = 1;
  int64_t num_samples = 0;
  int64_t top_k_samples = 0;
  int64_t k = 0;  // values to send
  bool exact() const { return stride == 1; }
};
DgcSamplePlan dgc_sample_plan(int64_t n, double density, double sample_ratio);

// Offset of the strided sample in [0, stride): rng::below(key, 0, stride) with
// key = step_key(ctx, step), so every party that knows (seed, name, step) agrees.
int64_t dgc_sample_offset(uint64_t key, int64_t stride);

}  // namespace sparrow::compression::detail
