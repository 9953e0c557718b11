// The Winograd F(4x4, 5x5) convolution + ReLU + pooling (kernels/winograd.h).
// The transforms are vectorised across channels and compiled per ISA
// (kernels/simd.h); the GEMMs are kernels/linear.h's.
#include "kernels/winograd.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "kernels/linear.h"
#include "kernels/pool_math.h"
#include "kernels/simd.h"

namespace sparrow::kernels {
namespace {

using detail::relu_max4;

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

// F(4, 5) (kernels/winograd.h), derived with exact
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

}  // namespace sparrow::kernels
