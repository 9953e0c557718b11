#include "kernels/linear.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>

#include "core/error.h"
#include "kernels/cpu.h"
#include "kernels/gemm.h"
#include "kernels/simd.h"

#ifdef SPARROW_HAVE_LIBXSMM
#include <libxsmm.h>
#endif

namespace sparrow::kernels {
namespace {

using SgemmFn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                         const int*, const float*, const int*, const float*, float*, const int*);

// The BLAS LibTorch itself calls (libblas.so.3 through its dependency).
SgemmFn blas_sgemm() {
  static const SgemmFn fn = reinterpret_cast<SgemmFn>(dlsym(RTLD_DEFAULT, "sgemm_"));
  return fn;
}

void blas_gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c, bool accumulate) {
  const SgemmFn f = blas_sgemm();
  SPARROW_CHECK(f != nullptr, "no BLAS sgemm_ is loaded");
  // Row-major C = A B is column-major C^T = B^T A^T: the same arrays.
  const int mi = static_cast<int>(n), ni = static_cast<int>(m), ki = static_cast<int>(k);
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  f("N", "N", &mi, &ni, &ki, &one, b, &mi, a, &ki, &beta, c, &mi);
}

#ifdef SPARROW_HAVE_LIBXSMM
void init_libxsmm() {
  static std::once_flag once;
  std::call_once(once, [] { libxsmm_init(); });
}
#endif

// Per-thread scratch: grows to the largest step and is then reused.
struct Scratch {
  std::vector<float> buf;
  float* take(size_t& at, int64_t n) {
    float* p = buf.data() + at;
    at += static_cast<size_t>(n);
    return p;
  }
};

#ifndef SPARROW_HAVE_LIBXSMM
// dst[c, r] = src[r, c], in 8 x 32 tiles: eight source rows are read
// together, each tile row of dst written contiguously. __restrict lets the
// compiler vectorise (the pointers never alias here).
void transpose_tiles(const float* __restrict src, int64_t rows, int64_t cols, float* __restrict dst) {
  constexpr int64_t kR = 8, kC = 32;
  for (int64_t r0 = 0; r0 < rows; r0 += kR) {
    const int64_t r1 = std::min(rows, r0 + kR);
    for (int64_t c0 = 0; c0 < cols; c0 += kC) {
      const int64_t c1 = std::min(cols, c0 + kC);
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * cols + c];
    }
  }
}
#endif

// out = act > 0 ? d : 0 (the ReLU's backward), branch-free.
SPARROW_SIMD_CLONES
void relu_backward(const float* __restrict act, const float* __restrict d, float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = d[i];  // loaded unconditionally, so the select vectorises
    out[i] = act[i] > 0.0f ? v : 0.0f;
  }
}

// row[i] = max(row[i] + bias, 0) or row[i] + bias.
SPARROW_SIMD_CLONES
void bias_act(float* __restrict row, float bias, int64_t n, bool relu) {
  if (relu)
    for (int64_t i = 0; i < n; ++i) row[i] = std::max(row[i] + bias, 0.0f);
  else
    for (int64_t i = 0; i < n; ++i) row[i] += bias;
}

SPARROW_SIMD_CLONES
void scale(float* __restrict v, float f, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] *= f;
}

// gb = beta gb + alpha (sum of the rows of the batch-major m [rows, cols]):
// the bias gradient, vectorised along the contiguous columns.
SPARROW_SIMD_CLONES
void bias_grad(const float* __restrict m, int64_t rows, int64_t cols, float alpha, float beta, float* __restrict gb) {
  for (int64_t c = 0; c < cols; ++c) gb[c] = beta == 0.0f ? 0.0f : beta * gb[c];
  for (int64_t r = 0; r < rows; ++r) {
    const float* __restrict row = m + r * cols;
    for (int64_t c = 0; c < cols; ++c) gb[c] += alpha * row[c];
  }
}

// Softmax cross-entropy of `classes` x `batch` feature-major logits z (a
// column per sample); writes w_i (softmax - onehot) batch-major into g and
// returns sum_i w_i (logsumexp_i - z[y_i, i]). One exp per logit, in float;
// the sum and logarithm in double.
double softmax_xent(const float* z, int64_t batch, int64_t classes, const int64_t* y, const float* wt, float* g) {
  double loss = 0;
  for (int64_t i = 0; i < batch; ++i) {
    float* gi = g + i * classes;
    float mx = -INFINITY;
    for (int64_t c = 0; c < classes; ++c) {
      gi[c] = z[c * batch + i];
      mx = std::max(mx, gi[c]);
    }
    const float zy = gi[y[i]];
    double sum = 0;
    for (int64_t c = 0; c < classes; ++c) {
      gi[c] = std::exp(gi[c] - mx);
      sum += gi[c];
    }
    loss += static_cast<double>(wt[i]) * (static_cast<double>(mx) + std::log(sum) - static_cast<double>(zy));
    const auto f = static_cast<float>(static_cast<double>(wt[i]) / sum);
    for (int64_t c = 0; c < classes; ++c) gi[c] *= f;
    gi[y[i]] -= wt[i];
  }
  return loss;
}

}  // namespace

void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c, bool accumulate) {
  if (!libraries_enabled()) return gemm(false, false, m, n, k, 1.0f, a, b, accumulate ? 1.0f : 0.0f, c);
#ifdef SPARROW_HAVE_LIBXSMM
  init_libxsmm();
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  // Column-major kernel for C^T = B^T A^T (see blas_gemm_nn); libxsmm caches
  // the generated kernel per shape.
  const libxsmm_smmfunction f =
      libxsmm_smmdispatch(static_cast<libxsmm_blasint>(n), static_cast<libxsmm_blasint>(m),
                          static_cast<libxsmm_blasint>(k), nullptr, nullptr, nullptr, &one, &beta, nullptr, nullptr);
  if (f) {
    f(b, a, c);
    return;
  }
#endif
  blas_gemm_nn(m, n, k, a, b, c, accumulate);
}

void gemm_tn(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c, bool accumulate) {
  if (!libraries_enabled()) return gemm(true, false, m, n, k, 1.0f, a, b, accumulate ? 1.0f : 0.0f, c);
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
#ifdef SPARROW_HAVE_LIBXSMM
  init_libxsmm();
  // Column-major C^T [n, m] = B^T [n, k] (B as stored) times A^T given
  // transposed (A as stored, [m, k] column-major): libxsmm's TRANS_B.
  const int flags = LIBXSMM_GEMM_FLAG_TRANS_B;
  const libxsmm_smmfunction f =
      libxsmm_smmdispatch(static_cast<libxsmm_blasint>(n), static_cast<libxsmm_blasint>(m),
                          static_cast<libxsmm_blasint>(k), nullptr, nullptr, nullptr, &one, &beta, &flags, nullptr);
  if (f) {
    f(b, a, c);
    return;
  }
#endif
  const SgemmFn fn = blas_sgemm();
  SPARROW_CHECK(fn != nullptr, "no BLAS sgemm_ is loaded");
  const int mi = static_cast<int>(n), ni = static_cast<int>(m), ki = static_cast<int>(k);
  fn("N", "T", &mi, &ni, &ki, &one, b, &mi, a, &ni, &beta, c, &mi);
}

void gemm_nt(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c, bool accumulate) {
  if (!libraries_enabled()) return gemm(false, true, m, n, k, 1.0f, a, b, accumulate ? 1.0f : 0.0f, c);
  const SgemmFn fn = blas_sgemm();
  SPARROW_CHECK(fn != nullptr, "no BLAS sgemm_ is loaded");
  // Column-major C^T [n, m] = B [n, k] (B^T as stored, transposed) A^T (A as stored).
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const int mi = static_cast<int>(n), ni = static_cast<int>(m), ki = static_cast<int>(k);
  fn("T", "N", &mi, &ni, &ki, &one, b, &ki, a, &ki, &beta, c, &mi);
}

void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  if (!libraries_enabled()) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
    return;
  }
#ifdef SPARROW_HAVE_LIBXSMM
  init_libxsmm();
  // Row-major [rows, cols] is column-major [cols, rows]: libxsmm's JIT
  // transpose kernels, 4-6x faster than the tiled loop at these sizes.
  libxsmm_otrans(dst, src, sizeof(float), static_cast<libxsmm_blasint>(cols), static_cast<libxsmm_blasint>(rows),
                 static_cast<libxsmm_blasint>(cols), static_cast<libxsmm_blasint>(rows));
#else
  transpose_tiles(src, rows, cols, dst);
#endif
}

const char* gemm_backend() {
  if (!libraries_enabled()) return "reference (SPARROW_KERNELS=reference)";
#ifdef SPARROW_HAVE_LIBXSMM
  init_libxsmm();
  static const std::string name = std::string("libxsmm (") + libxsmm_get_target_arch() + ")";
  return name.c_str();
#else
  return "BLAS";
#endif
}

double linear_chain_step(int64_t batch, const float* xt, const std::vector<LinearRef>& layers, const int64_t* y,
                         const float* wt, float* dxt, float alpha, float beta) {
  const auto nl = static_cast<int64_t>(layers.size());
  SPARROW_CHECK(nl >= 1 && batch >= 1, "linear_chain_step: no layers or an empty batch");
  const int64_t bsz = batch;
  // Scratch: per layer the batch-major input ht [B, in] (layer 0: xt itself)
  // and the feature-major output a [out, B]; plus dz [out, B], dzt [B, out]
  // and the batch-major input gradient [B, in] for the backward.
  thread_local Scratch s;
  size_t need = 0;
  int64_t widest = 0;
  for (const LinearRef& l : layers) {
    need += static_cast<size_t>((l.in + 2 * l.out) * bsz);
    widest = std::max({widest, l.in, l.out});
  }
  need += static_cast<size_t>(4 * widest * bsz);
  if (s.buf.size() < need) s.buf.resize(need);
  size_t at = 0;
  std::vector<const float*> ht(nl);  // batch-major input of each layer
  std::vector<float*> a(nl);         // feature-major output of each layer
  ht[0] = xt;
  float* hfm = s.take(at, layers[0].in * bsz);  // the current layer's feature-major input
  transpose(xt, bsz, layers[0].in, hfm);
  float* dz = s.take(at, widest * bsz);
  float* dzt = s.take(at, widest * bsz);
  float* dht = s.take(at, widest * bsz);
  for (int64_t l = 0; l < nl; ++l) {
    const LinearRef& L = layers[l];
    a[l] = s.take(at, L.out * bsz);
    gemm_nn(L.out, bsz, L.in, L.w, hfm, a[l], false);  // a = W h
    const bool relu = l + 1 < nl;
    for (int64_t o = 0; o < L.out; ++o) bias_act(a[l] + o * bsz, L.b[o], bsz, relu);
    hfm = a[l];
    if (relu) {  // batch-major copy for the next layer's weight gradient
      float* next = s.take(at, L.out * bsz);
      transpose(a[l], L.out, bsz, next);
      ht[l + 1] = next;
    }
  }
  // Softmax cross-entropy per sample (a column of the logits), and its
  // gradient w_i (softmax - onehot) into dzt (batch-major, one row per sample).
  const LinearRef& last = layers.back();
  const int64_t classes = last.out;
  for (int64_t i = 0; i < bsz; ++i)
    SPARROW_CHECK(y[i] >= 0 && y[i] < classes,
                  "class label " << y[i] << " but the model has " << classes << " outputs");
  const double loss = softmax_xent(a[nl - 1], bsz, classes, y, wt, dzt);
  // Backward, last layer first. dzt holds dL/dz batch-major [B, out].
  for (int64_t l = nl - 1; l >= 0; --l) {
    const LinearRef& L = layers[l];
    const bool want_input = l > 0 || dxt != nullptr;
    float* dh = l > 0 ? dht : dxt;
    // Input gradient before the weights change: dh [B, in] = dzt [B, out] W.
    if (want_input) gemm_nn(bsz, L.in, L.out, dzt, L.w, dh, false);
    // dz feature-major, scaled by alpha (folded into the small operand).
    transpose(dzt, bsz, L.out, dz);
    if (alpha != 1.0f) scale(dz, alpha, L.out * bsz);
    if (beta != 0.0f && beta != 1.0f) scale(L.gw, beta, L.out * L.in);
    gemm_nn(L.out, L.in, bsz, dz, ht[l], L.gw, beta != 0.0f);  // gw (+)= alpha dz h^T
    bias_grad(dzt, bsz, L.out, alpha, beta, L.gb);
    // Through the previous layer's ReLU (ht[l] is its batch-major output):
    // dzt for layer l - 1.
    if (l > 0) relu_backward(ht[l], dht, dzt, bsz * L.in);
  }
  return loss;
}

}  // namespace sparrow::kernels
