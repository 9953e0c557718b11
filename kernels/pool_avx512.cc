// The AVX-512 variants of the pooling and conv1 kernels (kernels/pool.h,
// kernels/conv5x5.h), with intrinsics in functions compiled for AVX-512 by
// attribute (the rest of the file stays baseline, so no inline function
// shared with other files is emitted with AVX-512 code). Called only where
// kernels/cpu.h enables avx512; results are identical to the reference loops.
#include "kernels/pool_avx512.h"

#ifdef SPARROW_KERNELS_POOL_AVX512
#include <immintrin.h>

#include <algorithm>

namespace sparrow::kernels::avx512 {
namespace {

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
}  // namespace

__attribute__((target("avx512f"))) void relu_maxpool2(const float* in, int64_t rows, int64_t ow, float* out,
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

__attribute__((target("avx512f"))) void relu_maxpool2_backward(const int32_t* arg, const float* dout, int64_t rows,
                                                               int64_t ow, float* din) {
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
namespace {
constexpr int64_t kConv1Stride = 48;  // a padded row: columns -2 .. 45 (loads reach column kx + 31 <= 35)
}  // namespace
__attribute__((target("avx512f"))) void conv5x5_one_channel_relu_pool(const float* x, int64_t h, int64_t w,
                                                                      const float* weight, const float* bias,
                                                                      int64_t cout, float* out, int32_t* arg) {
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

}  // namespace sparrow::kernels::avx512
#endif
