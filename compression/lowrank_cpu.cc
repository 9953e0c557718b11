// The low-rank codecs' arithmetic without LibTorch (lowrank_kernel.h): the
// matrix view, Gram–Schmidt, the skinny products, the factors' value coding,
// the kLowRank(Sparse) decoder and PowerSGD's options.
#include <algorithm>
#include <cmath>
#include <limits>

#include "compression/dgc.h"
#include "compression/lowrank_kernel.h"
#include "core/rng.h"
#include "core/spec.h"

namespace sparrow::compression {

LowRankDims lowrank_dims(const std::vector<int64_t>& shape, int64_t rank) {
  LowRankDims d;
  if (shape.empty()) return d;
  const int64_t numel = detail::numel_of(shape);
  if (numel <= 0 || shape[0] <= 0) return d;
  d.rows = shape[0];
  d.cols = numel / d.rows;
  d.rank = std::max<int64_t>(0, std::min({rank, d.rows, d.cols}));
  return d;
}

bool lowrank_compressible(const std::vector<int64_t>& shape, int64_t rank, double min_rate) {
  if (shape.size() < 2) return false;
  const LowRankDims d = lowrank_dims(shape, rank);
  if (d.rank < 1) return false;
  constexpr int64_t kMaxParam = std::numeric_limits<uint32_t>::max();
  if (d.rows > kMaxParam || d.cols > kMaxParam) return false;
  return static_cast<double>((d.rows + d.cols) * d.rank) * min_rate < static_cast<double>(d.rows * d.cols);
}

namespace detail {

namespace {

// Gram–Schmidt on a row-major n × r float matrix. Works on a column-major
// double copy (columns contiguous), projects each column twice against the
// earlier ones, zeroes columns that are ~0. Returns the number of zero columns.
int64_t gram_schmidt(float* a, int64_t n, int64_t r, std::vector<double>& buf) {
  buf.assign(static_cast<size_t>(n * r), 0.0);
  double scale = 0.0;
  for (int64_t j = 0; j < r; ++j) {
    double* c = buf.data() + j * n;
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      c[i] = a[i * r + j];
      ss += c[i] * c[i];
    }
    if (std::isfinite(ss)) scale = std::max(scale, std::sqrt(ss));
  }
  const double tol = 1e-8 * scale;
  int64_t zero = 0;
  for (int64_t j = 0; j < r; ++j) {
    double* c = buf.data() + j * n;
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t k = 0; k < j; ++k) {
        const double* b = buf.data() + k * n;
        double dot = 0.0;
        for (int64_t i = 0; i < n; ++i) dot += b[i] * c[i];
        if (dot == 0.0) continue;  // includes zeroed columns
        for (int64_t i = 0; i < n; ++i) c[i] -= dot * b[i];
      }
    }
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += c[i] * c[i];
    const double norm = std::sqrt(ss);
    if (!(norm > tol) || !std::isfinite(norm)) {  // also catches scale == 0 and NaN
      std::fill(c, c + n, 0.0);
      ++zero;
      continue;
    }
    const double inv = 1.0 / norm;
    for (int64_t i = 0; i < n; ++i) c[i] *= inv;
  }
  for (int64_t j = 0; j < r; ++j) {
    const double* c = buf.data() + j * n;
    for (int64_t i = 0; i < n; ++i) a[i * r + j] = static_cast<float>(c[i]);
  }
  return zero;
}

}  // namespace

int64_t orthonormalize(float* a, int64_t n, int64_t r) {
  std::vector<double> buf;
  return gram_schmidt(a, n, r, buf);
}

int64_t orthonormalize_refill(float* a, int64_t n, int64_t r, uint64_t key) {
  std::vector<double> buf;
  if (gram_schmidt(a, n, r, buf) == 0) return 0;
  for (int64_t j = 0; j < r; ++j) {
    bool is_zero = true;
    for (int64_t i = 0; i < n && is_zero; ++i) is_zero = a[i * r + j] == 0.0f;
    if (!is_zero) continue;
    for (int64_t i = 0; i < n; ++i) a[i * r + j] = rng::normal(key, static_cast<uint64_t>(i * r + j));
  }
  return gram_schmidt(a, n, r, buf);
}

void initial_factor(uint64_t key, int64_t k, int64_t r, float* out) {
  for (int64_t i = 0; i < k * r; ++i) out[i] = rng::normal(key, static_cast<uint64_t>(i));
  orthonormalize(out, k, r);
}

namespace {

// Columns handled per block of a row, so a block of A and of Bᵀ stay in L1/L2
// however long the rows are.
constexpr int64_t kBlock = 2048;
constexpr int kLanes = 16;

// Rows per parallel task: at least ~32K elements each.
int64_t row_grain(int64_t m) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(m, 1)); }

// fn(b, e) over [begin, end) in tasks of at least `grain` items (on the calling
// thread when there are fewer), as at::parallel_for(begin, end, grain, fn).
template <typename F>
void parallel_rows(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (end - begin <= grain) {
    if (begin < end) fn(begin, end);
    return;
  }
  const int64_t tasks = (end - begin + grain - 1) / grain;
  parallel_for(0, tasks, [&](int64_t t0, int64_t t1) { fn(begin + t0 * grain, std::min(end, begin + t1 * grain)); });
}

// Σ a[l]·b[l] in kLanes independent float lanes (vectorisable without
// reassociation, so the order is fixed), summed in double.
inline double dot(const float* a, const float* b, int64_t len) {
  float acc[kLanes] = {};
  int64_t l = 0;
  for (; l + kLanes <= len; l += kLanes) {
    for (int k = 0; k < kLanes; ++k) acc[k] += a[l + k] * b[l + k];
  }
  double s = 0.0;
  for (int k = 0; k < kLanes; ++k) s += acc[k];
  for (; l < len; ++l) s += static_cast<double>(a[l]) * b[l];
  return s;
}

inline void axpy(float* y, float alpha, const float* x, int64_t len) {
  for (int64_t l = 0; l < len; ++l) y[l] += alpha * x[l];
}

// m × r row-major -> r × m row-major.
std::vector<float> transposed(const float* b, int64_t m, int64_t r) {
  std::vector<float> t(static_cast<size_t>(m * r));
  for (int64_t l = 0; l < m; ++l)
    for (int64_t j = 0; j < r; ++j) t[j * m + l] = b[l * r + j];
  return t;
}

// Row i of A, or of A + x (written to sum's row, or to scratch when sum is null).
const float* source_row(const float* a, const float* x, float* sum, int64_t i, int64_t m, float* scratch) {
  const float* ar = a + i * m;
  if (x == nullptr) return ar;
  const float* xr = x + i * m;
  float* dst = sum != nullptr ? sum + i * m : scratch;
  for (int64_t l = 0; l < m; ++l) dst[l] = ar[l] + xr[l];
  return dst;
}

}  // namespace

void skinny_mm(const float* a, const float* x, float* sum, int64_t n, int64_t m, const float* b, int64_t r,
               float* out) {
  if (n <= 0 || r <= 0) return;
  const std::vector<float> bt = transposed(b, m, r);
  parallel_rows(0, n, row_grain(m), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(x != nullptr && sum == nullptr ? static_cast<size_t>(m) : 0);
    std::vector<double> acc(static_cast<size_t>(r));
    for (int64_t i = begin; i < end; ++i) {
      const float* row = source_row(a, x, sum, i, m, scratch.data());
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t l0 = 0; l0 < m; l0 += kBlock) {
        const int64_t len = std::min(kBlock, m - l0);
        for (int64_t j = 0; j < r; ++j) acc[j] += dot(row + l0, bt.data() + j * m + l0, len);
      }
      for (int64_t j = 0; j < r; ++j) out[i * r + j] = static_cast<float>(acc[j]);
    }
  });
}

void skinny_mm_t(const float* a, const float* x, float* sum, int64_t n, int64_t m, const float* p, int64_t r,
                 float* out) {
  if (m <= 0 || r <= 0) return;
  if (n <= 0) {
    std::fill(out, out + m * r, 0.0f);
    return;
  }
  // Rows are split into a fixed number of chunks (a function of the shape, not
  // of the thread count); each chunk accumulates its own r × m partial sum (Qᵀ),
  // and the partials are added in chunk order.
  constexpr int64_t kMaxChunks = 16;
  constexpr int64_t kMaxPartialFloats = int64_t{1} << 22;
  int64_t chunks = std::min({kMaxChunks, n, std::max<int64_t>(1, kMaxPartialFloats / (r * m))});
  const int64_t rows_per = (n + chunks - 1) / chunks;
  chunks = (n + rows_per - 1) / rows_per;
  std::vector<float> part(static_cast<size_t>(chunks * r * m), 0.0f);
  parallel_rows(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    std::vector<float> scratch(x != nullptr && sum == nullptr ? static_cast<size_t>(m) : 0);
    for (int64_t c = cb; c < ce; ++c) {
      float* qt = part.data() + c * r * m;
      const int64_t i_end = std::min(n, (c + 1) * rows_per);
      for (int64_t i = c * rows_per; i < i_end; ++i) {
        const float* row = source_row(a, x, sum, i, m, scratch.data());
        for (int64_t l0 = 0; l0 < m; l0 += kBlock) {
          const int64_t len = std::min(kBlock, m - l0);
          for (int64_t j = 0; j < r; ++j) axpy(qt + j * m + l0, p[i * r + j], row + l0, len);
        }
      }
    }
  });
  parallel_rows(0, m, row_grain(r * chunks), [&](int64_t lb, int64_t le) {
    for (int64_t l = lb; l < le; ++l) {
      for (int64_t j = 0; j < r; ++j) {
        float s = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) s += part[(c * r + j) * m + l];
        out[l * r + j] = s;
      }
    }
  });
}

void rank_update(float* a, int64_t n, int64_t m, const float* p, const float* q, int64_t r, float alpha) {
  if (n <= 0 || m <= 0 || r <= 0) return;
  const std::vector<float> qt = transposed(q, m, r);
  parallel_rows(0, n, row_grain(m), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = a + i * m;
      for (int64_t l0 = 0; l0 < m; l0 += kBlock) {
        const int64_t len = std::min(kBlock, m - l0);
        for (int64_t j = 0; j < r; ++j) {
          const float c = alpha * p[i * r + j];
          if (c != 0.0f) axpy(row + l0, c, qt.data() + j * m + l0, len);
        }
      }
    }
  });
}

void unpack_factor(const Encoded& e, int part, int64_t k, int64_t r, float* out) {
  if (k <= 0 || r <= 0) return;
  const uint64_t n = static_cast<uint64_t>(k * r);
  const uint64_t first = part == 0 ? 0 : static_cast<uint64_t>(e.params[0]) * static_cast<uint64_t>(r);
  if (e.value_type != ValueType::kInt8) {
    unpack_values(e.values.data() + value_bytes(e.value_type, first), n, e.value_type, 0.0f, out);
    return;
  }
  const float* scale = e.scales.data() + static_cast<size_t>(part) * static_cast<size_t>(r);
  const auto* q = reinterpret_cast<const int8_t*>(e.values.data() + first);
  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = 0; j < r; ++j) out[i * r + j] = static_cast<float>(q[i * r + j]) * scale[j];
}

void pack_factor(float* a, int64_t k, int64_t r, ValueType vt, Encoded& e) {
  const uint64_t n = static_cast<uint64_t>(k * r);
  const size_t base = e.values.size();
  for (uint64_t i = 0; i < n; ++i)
    SPARROW_CHECK(std::isfinite(a[i]), "low-rank factor entry " << i << " is not finite (fp32 overflow)");
  saturate(a, n, vt);
  if (vt != ValueType::kInt8) {
    pack_values(a, n, vt, e.values);
    if (vt != ValueType::kF32) unpack_values(e.values.data() + base, n, vt, 0.0f, a);
    return;
  }
  std::vector<float> scale(static_cast<size_t>(r), 0.0f);
  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = 0; j < r; ++j) scale[j] = std::max(scale[j], std::fabs(a[i * r + j]));
  for (float& s : scale) s /= 127.0f;  // finite entries: <= FLT_MAX/127, as validate() requires
  e.values.resize_uninitialized(base + n);
  auto* q = reinterpret_cast<int8_t*>(e.values.data() + base);
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < r; ++j) {
      const float s = scale[j];
      const float v = s > 0.0f ? std::nearbyint(std::clamp(a[i * r + j] / s, -127.0f, 127.0f)) : 0.0f;
      q[i * r + j] = static_cast<int8_t>(v);
      a[i * r + j] = v * s;
    }
  }
  e.scales.insert(e.scales.end(), scale.begin(), scale.end());
}

void add_sparse_correction(float* res, int64_t numel, double sparse, ValueType vt, Encoded& e) {
  const int64_t k = std::min(numel, static_cast<int64_t>(std::ceil(sparse * static_cast<double>(numel))));
  std::vector<int64_t> idx = topk_abs_indices(res, numel, k);
  // Exact zeros (fewer than k nonzero entries) are not worth their bytes.
  erase_zero_positions(idx, res);
  std::vector<float> vals(idx.size());
  for (size_t j = 0; j < idx.size(); ++j) vals[j] = res[idx[j]];
  saturate(vals.data(), vals.size(), vt);
  const RiceChoice rice = best_rice(idx.data(), idx.size());
  std::vector<uint32_t> params = e.params;
  encode_indices_rice(idx.data(), idx.size(), rice.b, e);  // sets count, indices, params = {b}
  params.push_back(rice.b);
  e.params = std::move(params);
  e.format = Format::kLowRankSparse;
  const size_t base = e.values.size();
  const float scale = vt == ValueType::kInt8 ? int8_scale(vals.data(), vals.size()) : 0.0f;
  pack_values(vals.data(), vals.size(), vt, e.values, scale);
  if (vt == ValueType::kInt8) e.scales.push_back(scale);
  // What the receiver will add: subtract exactly that from E.
  unpack_values(e.values.data() + base, vals.size(), vt, scale, vals.data());
  for (size_t j = 0; j < idx.size(); ++j) res[idx[j]] -= vals[j];
}

namespace {

// The sparse correction of a kLowRankSparse tensor: its positions and values
// (after the factors, of the factors' type; kInt8 with the last scale).
void sparse_correction(const Encoded& e, std::vector<int64_t>& idx, std::vector<float>& vals) {
  const uint64_t rows = e.params[0], cols = e.params[1], r = e.params[2];
  idx = decode_rice_positions(e.indices, e.count, e.params[3], static_cast<int64_t>(rows * cols));
  vals.resize(e.count);
  const float scale = e.value_type == ValueType::kInt8 ? e.scales[2 * r] : 0.0f;
  unpack_values(e.values.data() + value_bytes(e.value_type, (rows + cols) * r), e.count, e.value_type, scale,
                vals.data());
}

}  // namespace

void decode_lowrank_add(const Encoded& e, float* out, float weight) {
  const int64_t rows = e.params[0], cols = e.params[1], r = e.params[2];
  std::vector<int64_t> idx;
  std::vector<float> vals;
  // Positions first: a malformed stream throws before out is touched.
  if (e.format == Format::kLowRankSparse) sparse_correction(e, idx, vals);
  std::vector<float> p(static_cast<size_t>(rows * r)), q(static_cast<size_t>(cols * r));
  unpack_factor(e, 0, rows, r, p.data());
  unpack_factor(e, 1, cols, r, q.data());
  rank_update(out, rows, cols, p.data(), q.data(), r, weight);
  for (size_t j = 0; j < idx.size(); ++j) out[idx[j]] += weight * vals[j];
}

PowerSgdOptions parse_powersgd_options(Spec& spec) {
  PowerSgdOptions o;
  SPARROW_CHECK_T(ConfigError, spec.has("rank"), "powersgd: 'rank' is required (e.g. powersgd:rank=4)");
  o.rank = spec.get_int("rank", 0);
  SPARROW_CHECK_T(ConfigError, o.rank >= 1, "powersgd: rank must be >= 1, got " << o.rank);
  o.warm_start = spec.get_bool("warm_start", true);
  o.ef = spec.get_bool("ef", true);
  o.vt = parse_value_type(spec.get_string("values", "fp32"));  // fp32|fp16|bf16|int8
  o.iters = spec.get_int("iters", 1);
  SPARROW_CHECK_T(ConfigError, o.iters >= 1 && o.iters <= 16, "powersgd: iters must be in [1, 16], got " << o.iters);
  o.min_rate = spec.get_double("min_rate", 2.0);
  SPARROW_CHECK_T(ConfigError, std::isfinite(o.min_rate) && o.min_rate >= 1.0,
                  "powersgd: min_rate must be >= 1, got " << o.min_rate);
  o.stale = parse_stale_policy(spec, "powersgd", o.ef);
  o.sparse = spec.get_double("sparse", 0.0);
  SPARROW_CHECK_T(ConfigError, std::isfinite(o.sparse) && o.sparse >= 0.0 && o.sparse <= 1.0,
                  "powersgd: sparse must be in [0, 1], got " << o.sparse);
  SPARROW_CHECK_T(ConfigError, o.sparse == 0.0 || o.ef,
                  "powersgd: sparse needs ef=1 (it sends the largest entries of the residual)");
  return o;
}

}  // namespace detail
}  // namespace sparrow::compression
