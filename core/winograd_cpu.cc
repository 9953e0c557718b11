#include "core/winograd_cpu.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/linear_cpu.h"
#include "core/simd.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define SPARROW_POOL_AVX512 1
#endif

// The transforms are vectorised across channels and compiled per ISA (core/simd.h).

namespace sparrow::core::cpu {
namespace {

// Parameter lists of six (and, below, eight) channel vectors: the 1-D
// transforms are vectorised across the channels.
#define SPARROW_SIX(p)                                                                      \
  const float* __restrict p##0, const float* __restrict p##1, const float* __restrict p##2, \
      const float* __restrict p##3, const float* __restrict p##4, const float* __restrict p##5
#define SPARROW_SIX_OUT(p)                                                                        \
  float* __restrict p##0, float* __restrict p##1, float* __restrict p##2, float* __restrict p##3, \
      float* __restrict p##4, float* __restrict p##5

// The six vectors p[0], p[s], ..., p[5 s].
#define SPARROW_AT6(p, s) (p), (p) + (s), (p) + 2 * (s), (p) + 3 * (s), (p) + 4 * (s), (p) + 5 * (s)

// pad [rows, cols, c] (interior from row and column 2) from x [c, h, w]: channels last,
// so the tile transforms vectorise across channels.
SPARROW_SIMD_CLONES
void pad_channels_last(const float* __restrict x, int64_t c, int64_t h, int64_t w, int64_t cols,
                       float* __restrict pad) {
  for (int64_t y = 0; y < h; ++y)
    for (int64_t xx = 0; xx < w; ++xx) {
      float* __restrict dst = pad + ((y + 2) * cols + xx + 2) * c;
      const float* __restrict src = x + y * w + xx;
      for (int64_t ci = 0; ci < c; ++ci) dst[ci] = src[ci * h * w];
    }
}

// dx [c, h, w] from dpad [rows, cols, c] (interior from row and column 2; the border dropped).
SPARROW_SIMD_CLONES
void unpad_channels_first(const float* __restrict dpad, int64_t c, int64_t h, int64_t w, int64_t cols,
                          float* __restrict dx) {
  for (int64_t y = 0; y < h; ++y)
    for (int64_t xx = 0; xx < w; ++xx) {
      const float* __restrict src = dpad + ((y + 2) * cols + xx + 2) * c;
      float* __restrict dst = dx + y * w + xx;
      for (int64_t ci = 0; ci < c; ++ci) dst[ci * h * w] = src[ci];
    }
}

// The ReLU + max of one 2x2 window (v0 v1 / v2 v3, row-major) as ATen's relu
// then max_pool2d compute it: the first of equal maxima wins; a NaN wins over
// numbers (the last one, as ATen's `val > max || isnan(val)` scan) and passes
// the ReLU. which: the winner 0..3, or 4 when the ReLU zeroed the window (no
// gradient flows). Branch-free float selects, so callers' loops vectorise.
[[gnu::always_inline]] inline void relu_max4(float v0, float v1, float v2, float v3, float& out, float& which) {
  // Each test as a float flag, summed for "or": GCC vectorises float selects
  // on them, not selects on combined bools.
  const float c01 = (v1 > v0 ? 1.0f : 0.0f) + (v1 != v1 ? 1.0f : 0.0f);
  const float c23 = (v3 > v2 ? 1.0f : 0.0f) + (v3 != v3 ? 1.0f : 0.0f);
  const float b01 = c01 > 0 ? v1 : v0, w01 = c01 > 0 ? 1.0f : 0.0f;
  const float b23 = c23 > 0 ? v3 : v2, w23 = c23 > 0 ? 3.0f : 2.0f;
  const float c = (b23 > b01 ? 1.0f : 0.0f) + (b23 != b23 ? 1.0f : 0.0f);
  const float best = c > 0 ? b23 : b01, w = c > 0 ? w23 : w01;
  const float keep = (best > 0 ? 1.0f : 0.0f) + (best != best ? 1.0f : 0.0f);
  out = keep > 0 ? best : 0.0f;
  which = keep > 0 ? w : 4.0f;
}

// One row of windows: in0/in1 the two input rows (2 n values each).
SPARROW_SIMD_CLONES
void relu_maxpool2_row(const float* __restrict in0, const float* __restrict in1, int64_t n, float* __restrict out,
                       int32_t* __restrict arg) {
  for (int64_t x = 0; x < n; ++x) {
    float which;
    relu_max4(in0[2 * x], in0[2 * x + 1], in1[2 * x], in1[2 * x + 1], out[x], which);
    if (arg) arg[x] = static_cast<int32_t>(which);
  }
}

SPARROW_SIMD_CLONES
void relu_maxpool2_backward_row(const int32_t* __restrict arg, const float* __restrict dout, int64_t n,
                                float* __restrict din0, float* __restrict din1) {
  for (int64_t x = 0; x < n; ++x) {
    const float q = static_cast<float>(arg[x]), d = dout[x];
    din0[2 * x] = q == 0.0f ? d : 0.0f;
    din0[2 * x + 1] = q == 1.0f ? d : 0.0f;
    din1[2 * x] = q == 2.0f ? d : 0.0f;
    din1[2 * x + 1] = q == 3.0f ? d : 0.0f;
  }
}

// The sum of n floats (16 partial sums, so it vectorises without -ffast-math).
SPARROW_SIMD_CLONES
float row_sum(const float* __restrict x, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += x[i + j];
  float s = 0;
  for (; i < n; ++i) s += x[i];
  for (float p : part) s += p;
  return s;
}

#ifdef SPARROW_POOL_AVX512
// One 16-window step of a pooling row from window x0 of ow: the masks of its
// two 16-float input (or input-gradient) halves and of its windows, and where
// the second half starts (no address past the row when its mask is empty).
struct PoolStep {
  __mmask16 lo, hi, windows;
  int64_t second;
};
inline PoolStep pool_step(int64_t x0, int64_t ow) {
  const int64_t k = std::min<int64_t>(16, ow - x0);  // windows in this step: 2 k inputs per row
  PoolStep s;
  s.lo = static_cast<__mmask16>(k >= 8 ? 0xFFFF : (1u << (2 * k)) - 1);
  s.hi = static_cast<__mmask16>(k <= 8 ? 0 : (1u << (2 * k - 16)) - 1);
  s.windows = static_cast<__mmask16>((1u << k) - 1);
  s.second = s.hi ? 2 * x0 + 16 : 2 * x0;
  return s;
}

// ReLU + max pooling of 16 windows: a0 a1 the top row's 32 values, b0 b1 the
// bottom row's. Even and odd columns are split by a two-register permute; the
// comparisons follow relu_max4's rules, so the results are identical to the
// scalar loop's. Stores the windows in mask wm to out and (unless null) arg.
[[gnu::always_inline]] inline __attribute__((target("avx512f"))) void pool16(__m512 a0, __m512 a1, __m512 b0, __m512 b1,
                                                                             __mmask16 wm, float* out, int32_t* arg) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512 y0 = _mm512_permutex2var_ps(a0, even, a1), y1 = _mm512_permutex2var_ps(a0, odd, a1);
  const __m512 y2 = _mm512_permutex2var_ps(b0, even, b1), y3 = _mm512_permutex2var_ps(b0, odd, b1);
  // relu_max4's rules: greater, or NaN (unordered with itself); kept if > 0 or NaN.
  const __mmask16 m01 = _mm512_cmp_ps_mask(y1, y0, _CMP_GT_OQ) | _mm512_cmp_ps_mask(y1, y1, _CMP_UNORD_Q);
  const __mmask16 m23 = _mm512_cmp_ps_mask(y3, y2, _CMP_GT_OQ) | _mm512_cmp_ps_mask(y3, y3, _CMP_UNORD_Q);
  const __m512 b01 = _mm512_mask_blend_ps(m01, y0, y1), b23 = _mm512_mask_blend_ps(m23, y2, y3);
  const __mmask16 m = _mm512_cmp_ps_mask(b23, b01, _CMP_GT_OQ) | _mm512_cmp_ps_mask(b23, b23, _CMP_UNORD_Q);
  const __m512 best = _mm512_mask_blend_ps(m, b01, b23);
  const __mmask16 pos = _mm512_cmp_ps_mask(best, _mm512_setzero_ps(), _CMP_NLE_UQ);
  _mm512_mask_storeu_ps(out, wm, _mm512_maskz_mov_ps(pos, best));
  if (arg) {
    const __m512i w01 = _mm512_mask_blend_epi32(m01, _mm512_setzero_si512(), _mm512_set1_epi32(1));
    const __m512i w23 = _mm512_mask_blend_epi32(m23, _mm512_set1_epi32(2), _mm512_set1_epi32(3));
    const __m512i which = _mm512_mask_blend_epi32(m, w01, w23);
    _mm512_mask_storeu_epi32(arg, wm, _mm512_mask_blend_epi32(pos, _mm512_set1_epi32(4), which));
  }
}

// The same pooling with AVX-512 intrinsics, 16 windows per step: the
// compiler's vectorisation of the stride-2 window loop above runs mostly in
// scalar code on 14-window rows (a tenth of a CNN training step).
__attribute__((target("avx512f"))) void relu_maxpool2_avx512(const float* in, int64_t rows, int64_t ow, float* out,
                                                             int32_t* arg) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in0 = in + 4 * r * ow;
    const float* in1 = in0 + 2 * ow;
    for (int64_t x0 = 0; x0 < ow; x0 += 16) {
      const PoolStep st = pool_step(x0, ow);
      const __mmask16 lo = st.lo, hi = st.hi, wm = st.windows;
      const int64_t second = st.second;
      const __m512 a0 = _mm512_maskz_loadu_ps(lo, in0 + 2 * x0), a1 = _mm512_maskz_loadu_ps(hi, in0 + second);
      const __m512 b0 = _mm512_maskz_loadu_ps(lo, in1 + 2 * x0), b1 = _mm512_maskz_loadu_ps(hi, in1 + second);
      pool16(a0, a1, b0, b1, wm, out + r * ow + x0, arg ? arg + r * ow + x0 : nullptr);
    }
  }
}

__attribute__((target("avx512f"))) void relu_maxpool2_backward_avx512(const int32_t* arg, const float* dout,
                                                                      int64_t rows, int64_t ow, float* din) {
  // Interleaving two 16-lane vectors u, v into u0 v0 u1 v1 ...: lanes 0-15 and 16-31.
  const __m512i ilo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i ihi = _mm512_add_epi32(ilo, _mm512_set1_epi32(8));
  const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2), three = _mm512_set1_epi32(3);
  for (int64_t r = 0; r < rows; ++r) {
    float* din0 = din + 4 * r * ow;
    float* din1 = din0 + 2 * ow;
    for (int64_t x0 = 0; x0 < ow; x0 += 16) {
      const PoolStep st = pool_step(x0, ow);
      const __mmask16 lo = st.lo, hi = st.hi, wm = st.windows;
      const int64_t second = st.second;
      const __m512i q = _mm512_maskz_loadu_epi32(wm, arg + r * ow + x0);
      const __m512 d = _mm512_maskz_loadu_ps(wm, dout + r * ow + x0);
      const __m512 v0 = _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(q, _mm512_setzero_si512()), d);
      const __m512 v1 = _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(q, one), d);
      const __m512 v2 = _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(q, two), d);
      const __m512 v3 = _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(q, three), d);
      _mm512_mask_storeu_ps(din0 + 2 * x0, lo, _mm512_permutex2var_ps(v0, ilo, v1));
      _mm512_mask_storeu_ps(din0 + second, hi, _mm512_permutex2var_ps(v0, ihi, v1));
      _mm512_mask_storeu_ps(din1 + 2 * x0, lo, _mm512_permutex2var_ps(v2, ilo, v3));
      _mm512_mask_storeu_ps(din1 + second, hi, _mm512_permutex2var_ps(v2, ihi, v3));
    }
  }
}

// conv5x5_one_channel_relu_pool on AVX-512 (w <= 32, h <= kConv1MaxH, cout a
// multiple of 4): a register-blocked direct convolution. 16 accumulators hold
// 4 output channels x 2 output rows (a pooling row pair) x 32 columns; each of
// the pair's 6 input rows is loaded as 5 shifted vector pairs, each of which
// feeds both output rows it reaches (broadcast weights); the accumulators are
// then pooled from registers by pool16. The output never goes to memory
// unpooled, and no im2col is built.
constexpr int64_t kConv1Stride = 48;  // a padded row: columns -2 .. 45 (loads reach column kx + 31 <= 35)
constexpr int64_t kConv1MaxH = 60;
__attribute__((target("avx512f"))) void conv1_relu_pool_avx512(const float* x, int64_t h, int64_t w,
                                                               const float* weight, const float* bias, int64_t cout,
                                                               float* out, int32_t* arg) {
  alignas(64) float xp[(kConv1MaxH + 4) * kConv1Stride];
  std::fill(xp, xp + (h + 4) * kConv1Stride, 0.0f);
  for (int64_t y = 0; y < h; ++y) std::copy(x + y * w, x + (y + 1) * w, xp + (y + 2) * kConv1Stride + 2);
  const int64_t oh = h / 2, ow = w / 2;
  const __mmask16 wm = static_cast<__mmask16>((1u << ow) - 1);
  for (int64_t co = 0; co < cout; co += 4) {
    const float* wc = weight + co * 25;
    for (int64_t py = 0; py < oh; ++py) {
      __m512 acc[4][2][2];  // [channel][output row][half]
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[c][0][0] = acc[c][0][1] = acc[c][1][0] = acc[c][1][1] = _mm512_setzero_ps();
      const float* rows = xp + 2 * py * kConv1Stride;
#pragma GCC unroll 6
      for (int t = 0; t < 6; ++t)  // input row 2 py + t - 2: kernel row t of output row 0, t - 1 of row 1
#pragma GCC unroll 5
        for (int kx = 0; kx < 5; ++kx) {
          const __m512 lo = _mm512_loadu_ps(rows + t * kConv1Stride + kx);
          const __m512 hi = _mm512_loadu_ps(rows + t * kConv1Stride + kx + 16);
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) {
            if (t < 5) {
              const __m512 wv = _mm512_set1_ps(wc[c * 25 + t * 5 + kx]);
              acc[c][0][0] = _mm512_fmadd_ps(wv, lo, acc[c][0][0]);
              acc[c][0][1] = _mm512_fmadd_ps(wv, hi, acc[c][0][1]);
            }
            if (t > 0) {
              const __m512 wv = _mm512_set1_ps(wc[c * 25 + (t - 1) * 5 + kx]);
              acc[c][1][0] = _mm512_fmadd_ps(wv, lo, acc[c][1][0]);
              acc[c][1][1] = _mm512_fmadd_ps(wv, hi, acc[c][1][1]);
            }
          }
        }
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {  // the bias after the sum, as a GEMM onto the bias adds it
        const __m512 b = _mm512_set1_ps(bias[co + c]);
        const int64_t o = (co + c) * oh * ow + py * ow;
        pool16(_mm512_add_ps(acc[c][0][0], b), _mm512_add_ps(acc[c][0][1], b), _mm512_add_ps(acc[c][1][0], b),
               _mm512_add_ps(acc[c][1][1], b), wm, out + o, arg ? arg + o : nullptr);
      }
    }
  }
}

bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}
#endif

// F(4, 5) (core/winograd_cpu.h), derived with exact
// rationals from the points 0, 1, -1, 2, -2, 1/2, -1/2 and infinity, B^T's
// rows scaled to integers (G's rows scaled back):
//   B^T = [4 0 -21 0 21 0 -4 0; 0 -4 -4 17 17 -4 -4 0; 0 4 -4 -17 17 4 -4 0;
//          0 2 1 -10 -5 8 4 0; 0 -2 1 10 -5 -8 4 0; 0 4 8 -5 -10 1 2 0;
//          0 -4 8 5 -10 -1 2 0; 0 -4 0 21 0 -21 0 4]
//   A^T = [1 1 1 1 1 1 1 0; 0 1 -1 2 -2 1/2 -1/2 0; 0 1 1 4 4 1/4 1/4 0; 0 1 -1 8 -8 1/8 -1/8 1]
constexpr int kA8 = 8;
constexpr float kG8[kA8][5] = {{1.0f / 4, 0, 0, 0, 0},
                               {1.0f / 18, 1.0f / 18, 1.0f / 18, 1.0f / 18, 1.0f / 18},
                               {1.0f / 18, -1.0f / 18, 1.0f / 18, -1.0f / 18, 1.0f / 18},
                               {1.0f / 360, 1.0f / 180, 1.0f / 90, 1.0f / 45, 2.0f / 45},
                               {1.0f / 360, -1.0f / 180, 1.0f / 90, -1.0f / 45, 2.0f / 45},
                               {16.0f / 45, 8.0f / 45, 4.0f / 45, 2.0f / 45, 1.0f / 45},
                               {16.0f / 45, -8.0f / 45, 4.0f / 45, -2.0f / 45, 1.0f / 45},
                               {0, 0, 0, 0, 1.0f / 4}};

#define SPARROW_EIGHT(p) SPARROW_SIX(p), const float* __restrict p##6, const float* __restrict p##7
#define SPARROW_EIGHT_OUT(p) SPARROW_SIX_OUT(p), float* __restrict p##6, float* __restrict p##7
#define SPARROW_FOUR_OUT(p) \
  float* __restrict p##0, float* __restrict p##1, float* __restrict p##2, float* __restrict p##3
#define SPARROW_AT8(p, s) SPARROW_AT6(p, s), (p) + 6 * (s), (p) + 7 * (s)
#define SPARROW_AT4(p, s) (p), (p) + (s), (p) + 2 * (s), (p) + 3 * (s)

// o = B^T x on eight vectors of n floats.
[[gnu::always_inline]] inline void bt8(SPARROW_EIGHT(x), SPARROW_EIGHT_OUT(o), int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float d0 = x0[i], d1 = x1[i], d2 = x2[i], d3 = x3[i], d4 = x4[i], d5 = x5[i], d6 = x6[i], d7 = x7[i];
    o0[i] = 4 * (d0 - d6) + 21 * (d4 - d2);
    const float a1 = 17 * d4 - 4 * (d2 + d6), b1 = 17 * d3 - 4 * (d1 + d5);
    o1[i] = a1 + b1;
    o2[i] = a1 - b1;
    const float a3 = d2 - 5 * d4 + 4 * d6, b3 = 2 * d1 - 10 * d3 + 8 * d5;
    o3[i] = a3 + b3;
    o4[i] = a3 - b3;
    const float a5 = 8 * d2 - 10 * d4 + 2 * d6, b5 = 4 * d1 - 5 * d3 + d5;
    o5[i] = a5 + b5;
    o6[i] = a5 - b5;
    o7[i] = 4 * (d7 - d1) + 21 * (d3 - d5);
  }
}

// o = A^T m: four vectors from eight.
[[gnu::always_inline]] inline void at8(SPARROW_EIGHT(m), SPARROW_FOUR_OUT(o), int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s12 = m1[i] + m2[i], d12 = m1[i] - m2[i], s34 = m3[i] + m4[i], d34 = m3[i] - m4[i], s56 = m5[i] + m6[i],
                d56 = m5[i] - m6[i];
    o0[i] = m0[i] + s12 + s34 + s56;
    o1[i] = d12 + 2 * d34 + 0.5f * d56;
    o2[i] = s12 + 4 * s34 + 0.25f * s56;
    o3[i] = d12 + 8 * d34 + 0.125f * d56 + m7[i];
  }
}

// V[pos, row0 + t, c] = (B^T d_t B)[pos] for every 8x8 tile d_t of one
// image's pad [4 th + 4, 4 tw + 4, c] (stride 4); vstride = the rows of V per
// position times c. tmp: 8 (4 tw + 4) c floats.
SPARROW_SIMD_CLONES
void input_tiles(const float* pad, int64_t c, int64_t th, int64_t tw, float* v, int64_t vstride, int64_t row0,
                 float* tmp) {
  const int64_t band = (4 * tw + 4) * c;
  for (int64_t ty = 0; ty < th; ++ty) {
    const float* base = pad + 4 * ty * band;                     // rows 4 ty .. 4 ty + 7, each `band` floats
    bt8(SPARROW_AT8(base, band), SPARROW_AT8(tmp, band), band);  // tmp[a, col, c] = (B^T d)[a, col]
    for (int64_t tx = 0; tx < tw; ++tx) {
      float* out = v + (row0 + ty * tw + tx) * c;
      for (int a = 0; a < kA8; ++a)  // V[a, b] = (tmp B)[a, b]: along row a
        bt8(SPARROW_AT8(tmp + a * band + 4 * tx * c, c), SPARROW_AT8(out + a * kA8 * vstride, vstride), c);
    }
  }
}

// out [co] = relu(the window's max + bias) for one 2x2 window whose values
// are y00, y01 (+c) and y10, y11 (+4c) of a tile's [4, 4, c] outputs; arg
// (or null) the winner as output_tiles writes it.
[[gnu::always_inline]] inline void pool_window(const float* __restrict y, const float* __restrict bias,
                                               float* __restrict out, int32_t* __restrict arg, int64_t c) {
  const float* __restrict y01 = y + c;
  const float* __restrict y10 = y + 4 * c;
  const float* __restrict y11 = y + 5 * c;
  for (int64_t co = 0; co < c; ++co) {
    const float b = bias[co];
    float which;
    relu_max4(y[co] + b, y01[co] + b, y10[co] + b, y11[co] + b, out[co], which);
    if (arg) arg[co] = static_cast<int32_t>(which);
  }
}

// For one image's tiles (rows row0.. of M; mstride = M's rows per position
// times c): y = A^T M A (4x4) + bias, ReLU, 2x2 max pooling, into
// out [ph, pw, c] (windows past ph, pw are the tiling's padding, dropped).
// tmp: 48 c floats.
SPARROW_SIMD_CLONES
void output_tiles(const float* m, int64_t mstride, int64_t row0, const float* bias, int64_t c, int64_t th, int64_t tw,
                  int64_t ph, int64_t pw, float* out, int32_t* arg, float* tmp) {
  float* y = tmp + 4 * kA8 * c;  // [4, 4, c]
  for (int64_t ty = 0; ty < th; ++ty)
    for (int64_t tx = 0; tx < tw; ++tx) {
      const float* mt = m + (row0 + ty * tw + tx) * c;
      for (int b = 0; b < kA8; ++b)  // tmp[i, b] = (A^T M)[i, b]: down column b
        at8(SPARROW_AT8(mt + b * mstride, kA8 * mstride), SPARROW_AT4(tmp + b * c, kA8 * c), c);
      for (int i = 0; i < 4; ++i)  // y[i, j] = (tmp A)[i, j]: along row i
        at8(SPARROW_AT8(tmp + i * kA8 * c, c), SPARROW_AT4(y + i * 4 * c, c), c);
      for (int pi = 0; pi < 2; ++pi)
        for (int pj = 0; pj < 2; ++pj) {
          const int64_t py = 2 * ty + pi, px = 2 * tx + pj;
          if (py < ph && px < pw)
            pool_window(y + (2 * pi * 4 + 2 * pj) * c, bias, out + (py * pw + px) * c,
                        arg ? arg + (py * pw + px) * c : nullptr, c);
        }
    }
}

// o = B x (B^T's transpose, for the input gradient): eight vectors from
// eight; acc adds into o.
template <bool acc>
[[gnu::always_inline]] inline void b8(SPARROW_EIGHT(x), SPARROW_EIGHT_OUT(o), int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v0 = x0[i], v7 = x7[i];
    const float d12 = x2[i] - x1[i], s12 = x1[i] + x2[i], d34 = x3[i] - x4[i], s34 = x3[i] + x4[i], d56 = x5[i] - x6[i],
                s56 = x5[i] + x6[i];
    const float r0 = 4 * v0, r1 = 4 * d12 + 2 * d34 + 4 * d56 - 4 * v7, r2 = -21 * v0 - 4 * s12 + s34 + 8 * s56,
                r3 = -17 * d12 - 10 * d34 - 5 * d56 + 21 * v7, r4 = 21 * v0 + 17 * s12 - 5 * s34 - 10 * s56,
                r5 = 4 * d12 + 8 * d34 + d56 - 21 * v7, r6 = -4 * v0 - 4 * s12 + 4 * s34 + 2 * s56, r7 = 4 * v7;
    if (acc) {
      o0[i] += r0, o1[i] += r1, o2[i] += r2, o3[i] += r3, o4[i] += r4, o5[i] += r5, o6[i] += r6, o7[i] += r7;
    } else {
      o0[i] = r0, o1[i] = r1, o2[i] = r2, o3[i] = r3, o4[i] = r4, o5[i] = r5, o6[i] = r6, o7[i] = r7;
    }
  }
}

// A^T's rows (F(4, 5)), for the gradient tiles.
constexpr float kAT8[4][kA8] = {{1, 1, 1, 1, 1, 1, 1, 0},
                                {0, 1, -1, 2, -2, 0.5f, -0.5f, 0},
                                {0, 1, 1, 4, 4, 0.25f, 0.25f, 0},
                                {0, 1, -1, 8, -8, 0.125f, -0.125f, 1}};

// W[pos, row0 + t, co] = (A dY A^T)[pos] for one image's tiles, dY the 4x4
// tile's gradient: dout [ph, pw, c] at each window's winner (arg), 0
// elsewhere. dY has one non-zero per window, so W is the sum of four outer
// products (column i of A^T times g) x (column j of A^T). db += the gradients
// that pass the ReLU. tmp: 67 c floats.
SPARROW_SIMD_CLONES
void grad_tiles(const float* __restrict dout, const int32_t* __restrict arg, int64_t th, int64_t tw, int64_t ph,
                int64_t pw, int64_t c, float* __restrict w, int64_t wstride, int64_t row0, float* __restrict db,
                float* __restrict tmp) {
  for (int64_t ty = 0; ty < th; ++ty)
    for (int64_t tx = 0; tx < tw; ++tx) {
      for (int win = 0; win < 4; ++win) {  // ra [8, c] then rb [8, c] per window
        float* __restrict ra = tmp + win * 16 * c;
        float* __restrict rb = ra + 8 * c;
        const int pi = win / 2, pj = win % 2;
        const int64_t py = 2 * ty + pi, px = 2 * tx + pj;
        if (py >= ph || px >= pw) {  // the tiling's padding: no gradient
          std::fill(ra, ra + 16 * c, 0.0f);
          continue;
        }
        const float* __restrict d = dout + (py * pw + px) * c;
        const int32_t* __restrict q = arg + (py * pw + px) * c;
        const float* a0 = kAT8[2 * pi];
        const float* a1 = kAT8[2 * pi + 1];
        const float* b0 = kAT8[2 * pj];
        const float* b1 = kAT8[2 * pj + 1];
        float* __restrict gv = tmp + 64 * c;  // the gradient that passes, and the winner's row and column
        float* __restrict sv = gv + c;
        float* __restrict tv = sv + c;
        for (int64_t co = 0; co < c; ++co) {  // float selects only, so the loop vectorises
          const float qf = static_cast<float>(q[co]);
          const float dv = d[co];          // loaded unconditionally, so the select vectorises
          gv[co] = qf < 4.0f ? dv : 0.0f;  // a select, not a product: an Inf in a zeroed window stays out
          db[co] += gv[co];
          sv[co] = qf >= 2.0f ? 1.0f : 0.0f;
          tv[co] = qf == 1.0f || qf == 3.0f ? 1.0f : 0.0f;
        }
        for (int a = 0; a < kA8; ++a) {
          const float base = a0[a], step = a1[a] - a0[a];
          float* __restrict r = ra + a * c;
          for (int64_t co = 0; co < c; ++co) r[co] = gv[co] * (base + sv[co] * step);
        }
        for (int b = 0; b < kA8; ++b) {
          const float base = b0[b], step = b1[b] - b0[b];
          float* __restrict r = rb + b * c;
          for (int64_t co = 0; co < c; ++co) r[co] = base + tv[co] * step;
        }
      }
      float* tile = w + (row0 + ty * tw + tx) * c;
      for (int a = 0; a < kA8; ++a)
        for (int b = 0; b < kA8; ++b) {
          const float* __restrict x0 = tmp + a * c;
          const float* __restrict y0 = tmp + (8 + b) * c;
          float* __restrict out = tile + (a * kA8 + b) * wstride;
          for (int64_t co = 0; co < c; ++co)
            out[co] = x0[co] * y0[co] + x0[16 * c + co] * y0[16 * c + co] + x0[32 * c + co] * y0[32 * c + co] +
                      x0[48 * c + co] * y0[48 * c + co];
        }
    }
}

// dpad += B dV_t B^T on every 8x8 window of one image's pad (stride 4, the
// windows overlap); dV rows row0.., vstride = dV's rows per position times c.
// tmp: 64 c floats.
SPARROW_SIMD_CLONES
void input_grad_tiles(const float* dv, int64_t vstride, int64_t row0, int64_t c, int64_t th, int64_t tw, float* dpad,
                      float* tmp) {
  const int64_t cols = 4 * tw + 4;
  for (int64_t ty = 0; ty < th; ++ty)
    for (int64_t tx = 0; tx < tw; ++tx) {
      const float* in = dv + (row0 + ty * tw + tx) * c;
      for (int a = 0; a < kA8; ++a)  // tmp[a, l] = (dV B^T)[a, l]: along row a
        b8<false>(SPARROW_AT8(in + a * kA8 * vstride, vstride), SPARROW_AT8(tmp + a * kA8 * c, c), c);
      float* base = dpad + (4 * ty * cols + 4 * tx) * c;
      for (int l = 0; l < kA8; ++l)  // window += (B tmp)[k, l]: down column l
        b8<true>(SPARROW_AT8(tmp + l * c, kA8 * c), SPARROW_AT8(base + l * c, cols * c), c);
    }
}

// dst [n] = sum over k < terms of coef[k * cstride] * src[k * sstride .. + n]
// (the weight transforms' step; zero coefficients are skipped).
[[gnu::always_inline]] inline void lincomb(float* __restrict dst, int64_t n, const float* coef, int64_t cstride,
                                           int terms, const float* __restrict src, int64_t sstride) {
  std::fill(dst, dst + n, 0.0f);
  for (int k = 0; k < terms; ++k) {
    const float c = coef[k * cstride];
    const float* __restrict x = src + k * sstride;
    if (c != 0)
      for (int64_t i = 0; i < n; ++i) dst[i] += c * x[i];
  }
}

// U[a, b, ci, co] = (G g G^T)[a, b] for every 5x5 filter g = w[co, ci] and
// G [n, 5] (row-major): vectorised across the output channels, one input
// channel at a time. wt: 25 cout floats, r: 5 n cout floats of scratch.
SPARROW_SIMD_CLONES
void transform_weights(const float* __restrict w, int64_t cin, int64_t cout, const float* __restrict g, int n,
                       float* __restrict u, float* __restrict wt, float* __restrict r) {
  for (int64_t ci = 0; ci < cin; ++ci) {
    for (int64_t co = 0; co < cout; ++co)
      for (int t = 0; t < 25; ++t) wt[t * cout + co] = w[(co * cin + ci) * 25 + t];
    for (int a = 0; a < n; ++a)  // r[a, l] = (G g)[a, l] = sum_k G[a, k] g[k, l]
      for (int l = 0; l < 5; ++l) lincomb(r + (a * 5 + l) * cout, cout, g + a * 5, 1, 5, wt + l * cout, 5 * cout);
    for (int a = 0; a < n; ++a)  // U[a, b] = (r G^T)[a, b] = sum_l r[a, l] G[b, l]
      for (int b = 0; b < n; ++b)
        lincomb(u + ((a * n + b) * cin + ci) * cout, cout, g + b * 5, 1, 5, r + a * 5 * cout, cout);
  }
}

// The transpose of transform_weights for the weight gradient:
// gw[co, ci] = beta gw[co, ci] + alpha G^T dU[., ., ci, co] G for dU
// [n, n, cin, cout]. r: 5 n cout, res: 25 cout floats of scratch.
SPARROW_SIMD_CLONES
void untransform_grad(const float* __restrict du, int64_t cin, int64_t cout, const float* __restrict g, int n,
                      float* __restrict gw, float alpha, float beta, float* __restrict r, float* __restrict res) {
  for (int64_t ci = 0; ci < cin; ++ci) {
    for (int k = 0; k < 5; ++k)  // r[k, b] = (G^T dU)[k, b] = sum_a G[a, k] dU[a, b]
      for (int b = 0; b < n; ++b)
        lincomb(r + (k * n + b) * cout, cout, g + k, 5, n, du + (b * cin + ci) * cout, n * cin * cout);
    for (int k = 0; k < 5; ++k)  // res[k, l] = (r G)[k, l] = sum_b r[k, b] G[b, l]
      for (int l = 0; l < 5; ++l) lincomb(res + (k * 5 + l) * cout, cout, g + l, 5, n, r + k * n * cout, cout);
    for (int64_t co = 0; co < cout; ++co)
      for (int t = 0; t < 25; ++t) {
        float& dst = gw[(co * cin + ci) * 25 + t];
        const float v = alpha * res[t * cout + co];
        dst = beta == 0 ? v : beta * dst + v;
      }
  }
}

}  // namespace

void im2col5x5(const float* x, int64_t h, int64_t w, float* col) {
  for (int64_t ky = 0; ky < 5; ++ky)
    for (int64_t kx = 0; kx < 5; ++kx) {
      float* dst = col + (ky * 5 + kx) * h * w;  // x shifted by (ky - 2, kx - 2), zero outside
      for (int64_t y = 0; y < h; ++y) {
        const int64_t sy = y + ky - 2;
        float* row = dst + y * w;
        if (sy < 0 || sy >= h) {
          std::fill(row, row + w, 0.0f);
          continue;
        }
        // Columns [x0, x1) read the image; the rest are padding.
        const int64_t x0 = std::min<int64_t>(w, std::max<int64_t>(0, 2 - kx));
        const int64_t x1 = std::max<int64_t>(x0, std::min<int64_t>(w, w + 2 - kx));
        std::fill(row, row + x0, 0.0f);
        std::copy(x + sy * w + x0 + kx - 2, x + sy * w + x1 + kx - 2, row + x0);
        std::fill(row + x1, row + w, 0.0f);
      }
    }
}

void conv5x5_one_channel(const float* x, int64_t h, int64_t w, const float* weight, const float* bias, int64_t cout,
                         float* out, float* col) {
  const int64_t hw = h * w;
  im2col5x5(x, h, w, col);
  for (int64_t co = 0; co < cout; ++co) std::fill(out + co * hw, out + (co + 1) * hw, bias[co]);
  gemm_nn(cout, hw, 25, weight, col, out, true);
}

void conv5x5_one_channel_weight_grad(const float* x, int64_t h, int64_t w, const float* dy, int64_t cout, float* gw,
                                     float* gb, float* col, float* colt) {
  const int64_t hw = h * w;
  im2col5x5(x, h, w, col);
  transpose(col, 25, hw, colt);  // [hw, 25]
  gemm_nn(cout, 25, hw, dy, colt, gw, true);
  for (int64_t co = 0; co < cout; ++co) gb[co] += row_sum(dy + co * hw, hw);
}

void conv5x5_one_channel_relu_pool(const float* x, int64_t h, int64_t w, const float* weight, const float* bias,
                                   int64_t cout, float* out, int32_t* arg, float* scratch, bool simd) {
  SPARROW_CHECK(h % 2 == 0 && w % 2 == 0, "conv5x5_one_channel_relu_pool: " << h << "x" << w << " image (even sides)");
#ifdef SPARROW_POOL_AVX512
  if (simd && have_avx512() && w <= 32 && h <= kConv1MaxH && cout % 4 == 0)
    return conv1_relu_pool_avx512(x, h, w, weight, bias, cout, out, arg);
#endif
  float* conv = scratch + 25 * h * w;
  conv5x5_one_channel(x, h, w, weight, bias, cout, conv, scratch);
  relu_maxpool2(conv, cout, h, w, out, arg, simd);
}

void relu_maxpool2(const float* in, int64_t planes, int64_t h, int64_t w, float* out, int32_t* arg, bool simd) {
  SPARROW_CHECK(h % 2 == 0 && w % 2 == 0, "relu_maxpool2: " << h << "x" << w << " planes (even sides)");
  const int64_t oh = h / 2, ow = w / 2;
#ifdef SPARROW_POOL_AVX512
  if (simd && have_avx512()) return relu_maxpool2_avx512(in, planes * oh, ow, out, arg);
#else
  (void)simd;
#endif
  for (int64_t r = 0; r < planes * oh; ++r)
    relu_maxpool2_row(in + 2 * r * w, in + (2 * r + 1) * w, ow, out + r * ow, arg ? arg + r * ow : nullptr);
}

void relu_maxpool2_backward(const int32_t* arg, const float* dout, int64_t planes, int64_t h, int64_t w, float* din,
                            bool simd) {
  SPARROW_CHECK(h % 2 == 0 && w % 2 == 0, "relu_maxpool2_backward: " << h << "x" << w << " planes (even sides)");
  const int64_t oh = h / 2, ow = w / 2;
#ifdef SPARROW_POOL_AVX512
  if (simd && have_avx512()) return relu_maxpool2_backward_avx512(arg, dout, planes * oh, ow, din);
#else
  (void)simd;
#endif
  for (int64_t r = 0; r < planes * oh; ++r)
    relu_maxpool2_backward_row(arg + r * ow, dout + r * ow, ow, din + 2 * r * w, din + (2 * r + 1) * w);
}

WinogradConv5Pool::WinogradConv5Pool(int64_t cin, int64_t cout, int64_t h, int64_t w, int64_t group)
    : cin_(cin),
      cout_(cout),
      h_(h),
      w_(w),
      group_(group),
      th_((h + 3) / 4),
      tw_((w + 3) / 4),
      cols_(4 * tw_ + 4),
      pad_size_((4 * th_ + 4) * cols_ * cin) {
  SPARROW_CHECK(cin > 0 && cout > 0 && h > 0 && w > 0 && h % 2 == 0 && w % 2 == 0 && group > 0,
                "WinogradConv5Pool: " << cin << " -> " << cout << " channels of " << h << "x" << w << ", groups of "
                                      << group << " (positive, even sides)");
  const int64_t rows = group * th_ * tw_;
  u_.resize(kA8 * kA8 * cin * cout);
  ut_.resize(u_.size());
  du_.assign(u_.size(), 0.0f);
  bias_.assign(cout, 0.0f);
  db_.assign(cout, 0.0f);
  pad_.assign(pad_size_, 0.0f);  // the border stays zero
  dpad_.resize(pad_size_);
  pooled_.resize((h / 2) * (w / 2) * cout);
  // One position's rows, padded by a cache line: at whole multiples of 4 KiB
  // (16 tiles x 32 channels x 4 B x 2^k) the 64 positions' rows alias in the
  // L1 cache and the transforms, which write or read all 64, ran 3x slower.
  vstride_ = rows * cin + 16;
  mstride_ = rows * cout + 16;
  v_.resize(kA8 * kA8 * vstride_);
  m_.resize(kA8 * kA8 * mstride_);
  tmp_.resize(std::max(kA8 * cols_ * cin, 67 * cout));
  scratch_.resize((5 * kA8 + 25) * cout);
}

void WinogradConv5Pool::set_weights(const float* w, const float* bias) {
  transform_weights(w, cin_, cout_, &kG8[0][0], kA8, u_.data(), scratch_.data(), scratch_.data() + 25 * cout_);
  for (int p = 0; p < kA8 * kA8; ++p)
    transpose(u_.data() + p * cin_ * cout_, cin_, cout_, ut_.data() + p * cout_ * cin_);
  std::copy(bias, bias + cout_, bias_.begin());
}

void WinogradConv5Pool::input_transform(int64_t n, const float* x) {
  SPARROW_CHECK(n >= 1 && n <= group_, "WinogradConv5Pool: " << n << " images for groups of " << group_);
  const int64_t tiles = th_ * tw_;
  for (int64_t i = 0; i < n; ++i) {
    pad_channels_last(x + i * cin_ * h_ * w_, cin_, h_, w_, cols_, pad_.data());
    input_tiles(pad_.data(), cin_, th_, tw_, v_.data(), vstride_, i * tiles, tmp_.data());
  }
}

void WinogradConv5Pool::forward(int64_t n, const float* x, float* out, int32_t* arg) {
  input_transform(n, x);
  const int64_t tiles = th_ * tw_, pooled = (h_ / 2) * (w_ / 2) * cout_;
  for (int p = 0; p < kA8 * kA8; ++p)
    gemm_nn(n * tiles, cout_, cin_, v_.data() + p * vstride_, u_.data() + p * cin_ * cout_, m_.data() + p * mstride_,
            false);
  for (int64_t i = 0; i < n; ++i) {
    output_tiles(m_.data(), mstride_, i * tiles, bias_.data(), cout_, th_, tw_, h_ / 2, w_ / 2, pooled_.data(),
                 arg ? arg + i * pooled : nullptr, tmp_.data());
    transpose(pooled_.data(), (h_ / 2) * (w_ / 2), cout_, out + i * pooled);  // channels first
  }
}

void WinogradConv5Pool::zero_grad() {
  std::fill(du_.begin(), du_.end(), 0.0f);
  std::fill(db_.begin(), db_.end(), 0.0f);
}

void WinogradConv5Pool::backward(int64_t n, const float* x, const int32_t* arg, const float* dout, float* dx) {
  input_transform(n, x);  // checks n
  const int64_t tiles = th_ * tw_, ph = h_ / 2, pw = w_ / 2, pooled = ph * pw * cout_;
  float* w = m_.data();  // W [64, rows, cout]
  for (int64_t i = 0; i < n; ++i) {
    transpose(dout + i * pooled, cout_, ph * pw, pooled_.data());  // channels last
    grad_tiles(pooled_.data(), arg + i * pooled, th_, tw_, ph, pw, cout_, w, mstride_, i * tiles, db_.data(),
               tmp_.data());
  }
  for (int p = 0; p < kA8 * kA8; ++p)
    gemm_tn(cin_, cout_, n * tiles, v_.data() + p * vstride_, w + p * mstride_, du_.data() + p * cin_ * cout_, true);
  if (!dx) return;
  float* dv = v_.data();  // V is no longer needed: dV [64, rows, cin] takes its place
  for (int p = 0; p < kA8 * kA8; ++p)
    gemm_nn(n * tiles, cin_, cout_, w + p * mstride_, ut_.data() + p * cout_ * cin_, dv + p * vstride_, false);
  for (int64_t i = 0; i < n; ++i) {
    std::fill(dpad_.begin(), dpad_.end(), 0.0f);
    input_grad_tiles(dv, vstride_, i * tiles, cin_, th_, tw_, dpad_.data(), tmp_.data());
    unpad_channels_first(dpad_.data(), cin_, h_, w_, cols_, dx + i * cin_ * h_ * w_);
  }
}

void WinogradConv5Pool::weight_grad(float* gw, float* gb, float alpha, float beta) const {
  std::vector<float> scratch((5 * kA8 + 25) * cout_);
  untransform_grad(du_.data(), cin_, cout_, &kG8[0][0], kA8, gw, alpha, beta, scratch.data(),
                   scratch.data() + 5 * kA8 * cout_);
  for (int64_t co = 0; co < cout_; ++co) gb[co] = beta == 0 ? alpha * db_[co] : beta * gb[co] + alpha * db_[co];
}

}  // namespace sparrow::core::cpu
