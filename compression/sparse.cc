// Sparsifiers that send (index, value) pairs, Format::kSparse:
//   topk:ratio=R[,ef=0|1][,values=fp32|fp16|bf16|int8][,index=auto|rice][,decay=D,max_age=A]
//                                                    exact top-k by magnitude
//   stc:ratio=R[,ef=0|1][,values=sign|int8|fp16|bf16|fp32][,index=rice|auto][,decay=D,max_age=A]
//                                                    Sparse Ternary Compression (Sattler et al. 2019)
//   randomk:ratio=R[,ef=0|1]                         k shared-seed random indices, unbiased
//   threshold:tau=T[,ef=0|1]                         Strom (2015): ±tau where |residual| >= tau
//   tcs:ratio=R[,extra=E][,keep=P[,share=sum|mean]][,values=int8|sign|fp16|bf16|fp32][,block=B][,ef=0|1][,decay=D,max_age=A]
//                                                    time-correlated sparsification (Ozfatura et al. 2021):
//                                                    values on the server's mask plus the client's own top-E
// plus the selection kernels DGC shares (declared in dgc.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "compression/codec_bits.h"
#include "compression/codec_kernel.h"
#include "compression/dgc.h"
#include "core/rng.h"
#include "core/spec.h"

namespace sparrow::compression::detail {

// ---- selection kernels ----------------------------------------------------------

namespace {

// Selections are sparse: with SSE2 the lane masks of 4-wide comparisons find
// the selected elements with one branch per 16 elements.
inline void collect_abs_ge_range(const float* a, int64_t begin, int64_t end, float thr, std::vector<int64_t>& out) {
  int64_t i = begin;
#if defined(__SSE2__)
  const __m128 vt = _mm_set1_ps(thr);
  const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  for (; i + 16 <= end; i += 16) {
    unsigned mask = 0;
    for (int l = 0; l < 16; l += 4)
      mask |= static_cast<unsigned>(_mm_movemask_ps(_mm_cmpge_ps(_mm_and_ps(_mm_loadu_ps(a + i + l), abs_mask), vt)))
              << l;
    while (mask) {
      out.push_back(i + __builtin_ctz(mask));
      mask &= mask - 1;
    }
  }
#endif
  for (; i < end; ++i)
    if (std::fabs(a[i]) >= thr) out.push_back(i);
}

}  // namespace

float kth_largest(std::vector<float>& s, int64_t r) {
  s.erase(std::remove_if(s.begin(), s.end(), [](float x) { return std::isnan(x); }), s.end());
  if (s.empty() || r <= 0) return s.empty() ? 0.0f : *std::max_element(s.begin(), s.end());
  const int64_t size = static_cast<int64_t>(s.size());
  r = std::min(r, size);
  if (r * 64 <= size) {
    // Heap selection: for a small rank nearly every value fails one comparison
    // with the heap's minimum, about 10x faster than nth_element here.
    std::vector<float> heap(s.begin(), s.begin() + r);
    std::make_heap(heap.begin(), heap.end(), std::greater<float>());
    for (int64_t i = r; i < size; ++i) {
      const float x = s[static_cast<size_t>(i)];
      if (x > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
        heap.back() = x;
        std::push_heap(heap.begin(), heap.end(), std::greater<float>());
      }
    }
    return heap.front();
  }
  const auto pos = static_cast<std::ptrdiff_t>(r - 1);
  std::nth_element(s.begin(), s.begin() + pos, s.end(), std::greater<float>());
  return s[static_cast<size_t>(pos)];
}

void collect_abs_ge(const float* a, int64_t n, float thr, std::vector<int64_t>& out) {
  scan_blocks(n, out,
              [a, thr](int64_t b, int64_t e, std::vector<int64_t>& part) { collect_abs_ge_range(a, b, e, thr, part); });
}

void keep_topk(const float* a, std::vector<int64_t>& cand, uint64_t k) {
  if (cand.size() <= k) return;
  if (k == 0) {
    cand.clear();
    return;
  }
  // Select the k-th largest magnitude on a contiguous copy of the candidates'
  // magnitudes (cache-friendly, no indirection in the selection), then filter the
  // ascending list: everything above it, plus as many equal to it as are still
  // needed, lowest indices first. That is exactly the order of a stable sort.
  std::vector<float> mags(cand.size());
  for (size_t j = 0; j < cand.size(); ++j) mags[j] = std::fabs(a[cand[j]]);
  std::nth_element(mags.begin(), mags.begin() + static_cast<std::ptrdiff_t>(k - 1), mags.end(), std::greater<float>());
  const float pivot = mags[k - 1];
  uint64_t above = 0;
  for (const int64_t i : cand) above += std::fabs(a[i]) > pivot;
  uint64_t ties = k - above;
  size_t w = 0;
  for (const int64_t i : cand) {
    const float x = std::fabs(a[i]);
    if (x > pivot) {
      cand[w++] = i;
    } else if (x == pivot && ties > 0) {
      cand[w++] = i;
      --ties;
    }
  }
  cand.resize(w);
}

std::vector<int64_t> topk_abs_indices(const float* a, int64_t n, int64_t k) {
  std::vector<int64_t> cand;
  k = std::min(k, n);
  if (k <= 0) return cand;
  // Small tensors: every non-NaN entry is a candidate.
  constexpr int64_t kDirectBelow = 8192;
  if (n <= kDirectBelow) {
    collect_abs_ge(a, n, 0.0f, cand);
  } else {
    // Threshold = the r-th largest of m strided samples, with r a few standard
    // deviations above the expected number of samples in the top-k, so the
    // candidates (all |a| >= threshold) hold about k + O(sqrt(k)·n/m) entries.
    // Whenever they number at least k they provably contain the top-k: every
    // top-k entry is >= the k-th largest value, which is >= the threshold.
    const int64_t m = std::min<int64_t>(n, 65536);
    const int64_t stride = n / m;
    std::vector<float> samples;
    const double expected = static_cast<double>(m) * static_cast<double>(k) / static_cast<double>(n);
    auto r = static_cast<int64_t>(std::ceil(expected + 4.0 * std::sqrt(expected) + 4.0));
    while (true) {
      float thr = 0.0f;
      if (r < m) {
        samples.resize(static_cast<size_t>(m));  // kth_largest drops NaNs: refill every round
        for (int64_t j = 0; j < m; ++j) samples[static_cast<size_t>(j)] = std::fabs(a[j * stride]);
        thr = kth_largest(samples, r);
      }
      cand.clear();
      collect_abs_ge(a, n, thr, cand);
      if (static_cast<int64_t>(cand.size()) >= k || thr == 0.0f) break;
      r *= 4;  // unlucky sample (probability well below 1e-6): lower the threshold, rescan
    }
  }
  SPARROW_CHECK(static_cast<int64_t>(cand.size()) >= k,
                "top-k: only " << cand.size() << " of " << n << " values are not NaN, k = " << k);
  keep_topk(a, cand, static_cast<uint64_t>(k));
  return cand;
}

namespace {

double parse_ratio(Spec& spec, const char* method, double def) {
  const double ratio = spec.get_double("ratio", def);
  SPARROW_CHECK_T(ConfigError, ratio > 0.0 && ratio <= 1.0, method << ": ratio=" << ratio << " must be in (0, 1]");
  return ratio;
}

// k = max(1, ceil(ratio·n)), at most n.
int64_t count_for(double ratio, int64_t n) {
  const auto k = static_cast<int64_t>(std::ceil(ratio * static_cast<double>(n)));
  return std::min(n, std::max<int64_t>(1, k));
}

// A key from the bits of n floats: different inputs give different keys, the
// same input the same one. Eight independent multiply-xorshift lanes (a chain
// of rng::mix64 over 25M floats took 100 ms), folded with mix64.
uint64_t content_key(const float* p, int64_t n) {
  constexpr uint64_t kMul = 0x9e3779b97f4a7c15ull;
  uint64_t h[8];
  for (int k = 0; k < 8; ++k) h[k] = rng::mix64(static_cast<uint64_t>(n) + static_cast<uint64_t>(k));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) {
      uint32_t bits;
      std::memcpy(&bits, p + i + k, sizeof bits);
      h[k] = (h[k] ^ bits) * kMul;
      h[k] ^= h[k] >> 29;
    }
  }
  for (; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, sizeof bits);
    h[0] = rng::mix64(h[0] ^ bits);
  }
  uint64_t key = 0;
  for (int k = 0; k < 8; ++k) key = rng::mix64(key ^ h[k]);
  return key;
}

// Error feedback without n-sized temporaries: the residual slot is turned into
// the compensated tensor in place (r += x),
// and after encoding the decoded values are subtracted at the sent indices,
// which leaves r = compensated - decode(e), the error-feedback residual.
float* compensate_in_place(const float* x, const std::vector<int64_t>& shape, Slots& slots) {
  float* r = slots.slot("residual", shape);
  for (int64_t i = 0, n = numel_of(shape); i < n; ++i) r[i] += x[i];
  return r;
}

void subtract_sent(float* r, const Encoded& e, const int64_t* idx) {
  std::vector<float> dec(e.count);
  unpack_values(e.values.data(), e.count, e.value_type, value_scale(e), dec.data());
  for (uint64_t j = 0; j < e.count; ++j) r[idx[j]] -= dec[j];
}

std::vector<float> gather(const float* src, const std::vector<int64_t>& idx, float scale = 1.0f) {
  std::vector<float> vals(idx.size());
  for (size_t j = 0; j < idx.size(); ++j) vals[j] = src[idx[j]] * scale;
  return vals;
}

// Options every top-k style codec shares.
struct SparseOptions {
  double ratio = 0.01;
  bool ef = false;
  ValueType vt = ValueType::kF32;
  IndexMode index = IndexMode::kAuto;
  StalePolicy stale;
};

// The spec keys topk and stc share, with each method's defaults. "sign" values
// are accepted where they are the default (stc), not elsewhere.
SparseOptions parse_sparse_options(Spec& spec, const char* method, bool ef, const char* values, const char* index) {
  SparseOptions o;
  o.ratio = parse_ratio(spec, method, 0.01);
  o.ef = spec.get_bool("ef", ef);
  const std::string vt = spec.get_string("values", values);
  o.vt = vt == "sign" && std::string(values) == "sign" ? ValueType::kSign : parse_value_type(vt);
  o.index = parse_index_mode(spec.get_string("index", index));
  o.stale = parse_stale_policy(spec, method, o.ef);
  return o;
}

// Top-k of the (error-compensated) input. `ternary` is STC: the kept values are
// replaced by sign · mean |kept| before packing (with values=sign that is the
// format itself: one bit per value and one magnitude per tensor).
class TopKKernel final : public Kernel {
 public:
  TopKKernel(const char* method, SparseOptions o, bool ternary) : method_(method), o_(o), ternary_(ternary) {}
  std::string method() const override { return method_; }

  Encoded encode(const float* x, const std::vector<int64_t>& shape, Slots& slots, const CodecView& ctx) const override {
    const int64_t n = numel_of(shape);
    if (o_.ef) age_state(slots, ctx, o_.stale, {"residual"});
    float* res = o_.ef ? compensate_in_place(x, shape, slots) : nullptr;
    const float* src = o_.ef ? res : x;
    std::vector<int64_t> idx = topk_abs_indices(src, n, n == 0 ? 0 : count_for(o_.ratio, n));
    // STC sends ±mu: an exact zero among the top k (fewer than k nonzeros) would be
    // sent as +mu, so it is not sent at all.
    if (ternary_) erase_zero_positions(idx, src);
    std::vector<float> vals = gather(src, idx);
    float mu = 0.0f;
    if (ternary_ && !vals.empty()) {
      double sum = 0.0;
      for (float v : vals) sum += std::fabs(v);
      mu = static_cast<float>(sum / static_cast<double>(vals.size()));
      for (float& v : vals) v = v < 0.0f ? -mu : mu;
    }
    Encoded e = make_sparse(shape, idx.data(), vals.data(), idx.size(), o_.vt, mu, o_.index);
    if (o_.ef) subtract_sent(res, e, idx.data());
    ++slots.step();
    return e;
  }

 private:
  const char* method_;
  SparseOptions o_;
  bool ternary_;
};

// Random-k (Stich et al. 2018; GRACE's randomk without its bias): indices are a
// pure function of step_key(ctx, step), so they never travel (IndexCoding::kSeeded)
// and every party with the same (seed, name, step) derives the same set. Each index
// is chosen with probability k/n, so values scaled by n/k make decode unbiased.
// With error feedback the values go unscaled (as GRACE pairs random-k with
// residual memory): error feedback needs a contractive compressor,
// ||C(x) - x|| < ||x||, and the n/k-scaled estimate is not one — its residual
// grows without bound (measured: 4e5x the input after 30 steps at ratio 0.05).
class RandomKKernel final : public Kernel {
 public:
  RandomKKernel(double ratio, bool ef) : ratio_(ratio), ef_(ef) {}
  std::string method() const override { return "randomk"; }

  Encoded encode(const float* x, const std::vector<int64_t>& shape, Slots& slots, const CodecView& ctx) const override {
    const int64_t n = numel_of(shape);
    float* res = ef_ ? compensate_in_place(x, shape, slots) : nullptr;
    const float* src = ef_ ? res : x;
    const int64_t k = n == 0 ? 0 : count_for(ratio_, n);
    const uint64_t key = step_key(ctx, slots.step());
    const std::vector<int64_t> idx = seeded_indices(key, static_cast<uint64_t>(k), n);
    const float scale = (k == 0 || ef_) ? 1.0f : static_cast<float>(static_cast<double>(n) / static_cast<double>(k));
    const std::vector<float> vals = gather(src, idx, scale);
    Encoded e;
    e.format = Format::kSparse;
    e.shape = shape;
    e.value_type = ValueType::kF32;
    e.index_coding = IndexCoding::kSeeded;
    e.count = static_cast<uint64_t>(k);
    e.seed = key;
    pack_values(vals.data(), vals.size(), ValueType::kF32, e.values);
    if (ef_) subtract_sent(res, e, idx.data());
    ++slots.step();
    return e;
  }

 private:
  double ratio_;
  bool ef_;
};

// Strom (2015): the residual r accumulates gradients; every element with
// |r| >= tau is sent as ±tau (one sign bit, ValueType::kSign with magnitude tau)
// and tau·sign is subtracted from r. Without ef there is no memory: a plain
// ±tau quantiser of the elements of x above tau.
class ThresholdKernel final : public Kernel {
 public:
  ThresholdKernel(float tau, bool ef) : tau_(tau), ef_(ef) {}
  std::string method() const override { return "threshold"; }

  Encoded encode(const float* x, const std::vector<int64_t>& shape, Slots& slots, const CodecView&) const override {
    const int64_t n = numel_of(shape);
    float* res = nullptr;
    const float* src = x;
    if (ef_) {
      res = slots.slot("residual", shape);
      src = res;
    }
    std::vector<int64_t> idx;
    const float tau = tau_;
    if (ef_) {
      // One pass: r += x and collect |r| >= tau .
      const float* xs = x;
      scan_blocks(n, idx, [res, xs, tau](int64_t b, int64_t e, std::vector<int64_t>& part) {
        for (int64_t i = b; i < e; ++i) res[i] += xs[i];
        collect_abs_ge_range(res, b, e, tau, part);
      });
    } else {
      collect_abs_ge(src, n, tau, idx);
    }
    const std::vector<float> vals = gather(src, idx);
    Encoded e = make_sparse(shape, idx.data(), vals.data(), idx.size(), ValueType::kSign, tau);
    if (ef_)
      for (size_t j = 0; j < idx.size(); ++j) res[idx[j]] -= vals[j] < 0.0f ? -tau : tau;
    ++slots.step();
    return e;
  }

 private:
  float tau_;
  bool ef_;
};

// Time-correlated sparsification (Ozfatura, Ozfatura & Gündüz, "Time-Correlated
// Sparsification for Communication-Efficient Federated Learning", ISIT 2021).
// The aggregator broadcasts a mask per tensor, the ceil(R·n) largest entries of
// its last model step (mask_ratio() = R; compression/mask.h). A client sends its
// (error-compensated) update at every mask position, which costs no index bits,
// plus its own ceil(E·n) largest entries outside the mask at Rice-coded
// positions, so coordinates that grow large on one client can enter the next
// mask. Under partial participation this moves the choice of coordinates to the
// server, which sees every client's contribution: each client's top-k alone
// picks positions that mostly no other client sends. Values: int8 (max-scaled),
// sign (one mean magnitude per part, as STC), fp16, bf16 or fp32; the two parts
// are scaled separately (IndexCoding::kMask). Without a mask (the first round)
// only the client's own positions go. keep=P < 1 sends the values at a random
// ceil(P·m) of the m mask positions only, a different share per update, so a
// mask can cover far more positions than one update has bits for: at the same
// bytes a large mask sampled beats a small one sent whole (docs/results.md).
// mask=all: the mask is every position of the tensor, whatever the last step
// was. Nothing is broadcast for it (mask_ratio() = 0, so the server keeps and
// sends no mask) and the update names no positions: a mask of numel ascending
// positions in [0, numel) can only be 0..numel-1, which the decoder knows
// without the round's mask (codec_bits.h, mask_layout_for). With keep=P each
// update then carries a seeded random share of all positions, and no position
// lies outside the mask, so there are no own positions (extra is refused).
class TcsKernel final : public Kernel {
 public:
  TcsKernel(double ratio, double extra, bool ef, ValueType vt, int64_t block, StalePolicy stale, double keep,
            bool share_mean, bool mask_all)
      : ratio_(ratio),
        extra_(extra),
        ef_(ef),
        vt_(vt),
        block_(block),
        stale_(stale),
        keep_(keep),
        share_mean_(share_mean),
        mask_all_(mask_all) {}
  std::string method() const override { return "tcs"; }
  double mask_ratio() const override { return mask_all_ ? 0.0 : ratio_; }
  bool share_mean() const override { return share_mean_; }

  Encoded encode(const float* x, const std::vector<int64_t>& shape, Slots& slots, const CodecView& ctx) const override {
    const int64_t n = numel_of(shape);
    std::vector<float> copy;
    float* src = nullptr;
    if (ef_) {
      age_state(slots, ctx, stale_, {"residual"});
      src = compensate_in_place(x, shape, slots);
    } else {
      copy.assign(x, x + n);
      src = copy.data();
    }
    std::vector<int64_t> every;
    if (mask_all_) {
      every.resize(static_cast<size_t>(n));
      std::iota(every.begin(), every.end(), int64_t{0});
    }
    const int64_t* mk = mask_all_ ? every.data() : mask_data(ctx, n);
    const int64_t m = mask_all_ ? n : (mk ? ctx.mask_size : 0);
    SPARROW_CHECK(m < (int64_t{1} << 32), "tcs: a mask of " << m << " positions does not fit the format");
    // keep < 1: the values at a random share of the mask only, which entries a
    // key sent with the update says (seeded_indices); keyed by the step and the
    // update's content, so that the clients of a round send different shares.
    // Without ef those values are scaled by m/kept (each mask entry is sent with
    // probability kept/m, so the decode is unbiased); with ef they go unscaled,
    // as randomk's (error feedback needs a contractive compressor). With
    // share=mean they go unscaled too: the aggregator divides each position by
    // the weight of the updates that carried it.
    int64_t kept = m;
    std::vector<int64_t> pick;
    uint64_t key = 0;
    if (m > 0 && keep_ < 1.0) {
      kept = count_for(keep_, m);
      key = rng::derive(step_key(ctx, slots.step()), content_key(src, n));
      pick = seeded_indices(key, static_cast<uint64_t>(kept), m);
    }
    auto mask_pos = [&](int64_t j) { return mk[pick.empty() ? j : pick[static_cast<size_t>(j)]]; };
    const float gain = !ef_ && !share_mean_ && kept < m
                           ? static_cast<float>(static_cast<double>(m) / static_cast<double>(kept))
                           : 1.0f;
    std::vector<float> at_mask(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) at_mask[static_cast<size_t>(i)] = src[mk[i]];
    // The client's own positions: the largest outside the mask (masked entries
    // set to zero for the selection, then restored, also if the selection throws).
    // Exact zeros are not sent.
    for (int64_t i = 0; i < m; ++i) src[mk[i]] = 0.0f;
    std::vector<int64_t> own;
    try {
      if (!mask_all_) own = topk_abs_indices(src, n, n == 0 ? 0 : count_for(extra_, n));
    } catch (...) {
      for (int64_t i = 0; i < m; ++i) src[mk[i]] = at_mask[static_cast<size_t>(i)];
      throw;
    }
    // (Before the mask's values are back: a zero here may be a mask position.)
    erase_zero_positions(own, src);
    for (int64_t i = 0; i < m; ++i) src[mk[i]] = at_mask[static_cast<size_t>(i)];
    std::vector<float> vals;
    if (pick.empty()) {
      vals = std::move(at_mask);  // the whole mask (kept == m, gain 1)
    } else {
      vals.resize(static_cast<size_t>(kept));
      for (int64_t j = 0; j < kept; ++j) vals[static_cast<size_t>(j)] = gain * at_mask[static_cast<size_t>(pick[j])];
    }
    for (const int64_t i : own) vals.push_back(src[i]);
    saturate(vals.data(), vals.size(), vt_);  // m/k can lift an fp16 value past its range
    const auto total = static_cast<uint64_t>(vals.size());

    Encoded e;
    e.format = Format::kSparse;
    e.shape = shape;
    e.value_type = vt_;
    const RiceChoice rice = best_rice(own.data(), own.size());
    encode_indices_rice(own.data(), own.size(), rice.b, e);
    e.index_coding = IndexCoding::kMask;
    e.params = {rice.b, static_cast<uint32_t>(m)};
    if (block_ > 0 || kept < m) e.params.push_back(static_cast<uint32_t>(block_));
    if (kept < m) {
      e.params.push_back(static_cast<uint32_t>(kept));
      e.seed = key;
    }
    e.count = total;
    if (vt_ == ValueType::kSign || vt_ == ValueType::kInt8) {
      // A scale per group (the decoder's groups: the mask's blocks, then the
      // own positions); values are packed as multiples of their group's scale.
      const MaskScaleGroups g = mask_scale_groups(e);
      std::vector<double> sum(g.blocks + 1, 0.0);
      std::vector<float> peak(g.blocks + 1, 0.0f);
      std::vector<uint64_t> cnt(g.blocks + 1, 0);
      for (uint64_t j = 0; j < total; ++j) {
        const uint64_t k = g.of(j);
        sum[k] += std::fabs(vals[j]);
        peak[k] = std::max(peak[k], std::fabs(vals[j]));
        ++cnt[k];
      }
      e.scales.assign(g.blocks + 1, 0.0f);
      for (uint64_t k = 0; k <= g.blocks; ++k)
        e.scales[k] = vt_ == ValueType::kSign
                          ? (cnt[k] > 0 ? static_cast<float>(sum[k] / static_cast<double>(cnt[k])) : 0.0f)
                          : peak[k] / 127.0f;
      std::vector<float> units(vals.size());
      for (uint64_t j = 0; j < total; ++j) {
        const float scale = e.scales[g.of(j)];
        units[j] = scale > 0.0f ? vals[j] / scale : 0.0f;
      }
      pack_values(units.data(), total, vt_, e.values, 1.0f);
    } else {
      pack_values(vals.data(), total, vt_, e.values);
    }
    if (ef_) {
      std::vector<float> sent(total);
      unpack_sparse_values(e, sent.data());
      for (int64_t j = 0; j < kept; ++j) src[mask_pos(j)] -= sent[static_cast<size_t>(j)];
      for (size_t j = 0; j < own.size(); ++j) src[own[j]] -= sent[static_cast<size_t>(kept) + j];
    }
    ++slots.step();
    return e;
  }

 private:
  double ratio_;
  double extra_;
  bool ef_;
  ValueType vt_;
  int64_t block_;  // > 0: one scale per this many mask values (sign, int8)
  StalePolicy stale_;
  double keep_;      // the share of the mask each update carries
  bool share_mean_;  // keep < 1, share=mean: values unscaled, averaged per position by the aggregator
  bool mask_all_;    // mask=all: the mask is every position, never broadcast
};

}  // namespace

std::unique_ptr<Kernel> make_sparse_kernel(const std::string& method, Spec& spec) {
  if (method == "topk")
    return std::make_unique<TopKKernel>("topk", parse_sparse_options(spec, "topk", false, "fp32", "auto"), false);
  if (method == "stc")
    return std::make_unique<TopKKernel>("stc", parse_sparse_options(spec, "stc", true, "sign", "rice"), true);
  if (method == "tcs") {
    const std::string mask = spec.get_string("mask", "step");
    SPARROW_CHECK_T(ConfigError, mask == "step" || mask == "all",
                    "tcs: mask=" << mask << " must be step (the server's last step) or all (every position)");
    const bool all = mask == "all";
    SPARROW_CHECK_T(ConfigError, !all || (!spec.has("ratio") && !spec.has("extra")),
                    "tcs: mask=all takes neither ratio nor extra (the mask is every position; none lies outside it)");
    const double ratio = all ? 1.0 : parse_ratio(spec, "tcs", 0.01);
    const double extra = all ? 1.0 : spec.get_double("extra", ratio / 5.0);
    SPARROW_CHECK_T(ConfigError, extra > 0.0 && extra <= 1.0, "tcs: extra=" << extra << " must be in (0, 1]");
    const bool ef = spec.get_bool("ef", true);
    const std::string vt = spec.get_string("values", "int8");
    const ValueType v = vt == "sign" ? ValueType::kSign : parse_value_type(vt);
    const int64_t block = spec.get_int("block", 0);
    SPARROW_CHECK_T(ConfigError, block >= 0 && block <= (int64_t{1} << 30),
                    "tcs: block=" << block << " must be in [0, 2^30] (0 = one scale for the whole mask)");
    SPARROW_CHECK_T(ConfigError, block == 0 || v == ValueType::kSign || v == ValueType::kInt8,
                    "tcs: block needs values=sign or int8 (the other value types carry no scale)");
    const StalePolicy stale = parse_stale_policy(spec, "tcs", ef);
    const double keep = spec.get_double("keep", 1.0);
    SPARROW_CHECK_T(ConfigError, keep > 0.0 && keep <= 1.0, "tcs: keep=" << keep << " must be in (0, 1]");
    const std::string share = spec.get_string("share", "sum");
    SPARROW_CHECK_T(
        ConfigError, share == "sum" || share == "mean",
        "tcs: share=" << share << " must be sum (scaled by m/kept, summed) or mean (averaged per position)");
    SPARROW_CHECK_T(ConfigError, share == "sum" || keep < 1.0,
                    "tcs: share=mean needs keep < 1 (with the whole mask every update carries every position)");
    return std::make_unique<TcsKernel>(ratio, extra, ef, v, block, stale, keep, share == "mean", all);
  }
  if (method == "randomk") {
    const double ratio = parse_ratio(spec, "randomk", 0.01);
    const bool ef = spec.get_bool("ef", false);
    return std::make_unique<RandomKKernel>(ratio, ef);
  }
  if (method == "threshold") {
    const double tau = spec.require_double("tau");
    const auto tau_f = static_cast<float>(tau);
    SPARROW_CHECK_T(ConfigError, tau > 0.0 && tau_f > 0.0f && std::isfinite(tau_f),
                    "threshold: tau=" << tau << " must be a positive float32");
    const bool ef = spec.get_bool("ef", true);
    return std::make_unique<ThresholdKernel>(tau_f, ef);
  }
  return nullptr;
}

}  // namespace sparrow::compression::detail
