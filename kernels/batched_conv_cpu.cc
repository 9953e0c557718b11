// The batched convolution (kernels/batched_conv.h): im2col + GEMM per image.
#include <algorithm>
#include <vector>

#include "core/error.h"
#include "kernels/batched_conv.h"
#include "kernels/linear.h"
#include "kernels/reduce.h"
#include "kernels/simd.h"

namespace sparrow::kernels {
namespace {

void check_shape(const ConvShape& s) {
  SPARROW_CHECK(
      s.clients > 0 && s.batch > 0 && s.in_channels > 0 && s.height > 0 && s.width > 0 && s.out_channels > 0 &&
          s.kernel_h > 0 && s.kernel_w > 0 && s.stride_h > 0 && s.stride_w > 0 && s.pad_h >= 0 && s.pad_w >= 0 &&
          s.height + 2 * s.pad_h >= s.kernel_h && s.width + 2 * s.pad_w >= s.kernel_w,
      "batched conv2d: " << s.clients << " clients x " << s.batch << " images of " << s.in_channels << "x" << s.height
                         << "x" << s.width << " -> " << s.out_channels << " channels, kernel " << s.kernel_h << "x"
                         << s.kernel_w << ", stride " << s.stride_h << "x" << s.stride_w << ", padding " << s.pad_h
                         << "x" << s.pad_w << " (sizes positive, the padded image at least the kernel)");
}

// A 1x1 kernel at stride 1 without padding reads the image as its own im2col.
bool direct(const ConvShape& s) {
  return s.kernel_h == 1 && s.kernel_w == 1 && s.stride_h == 1 && s.stride_w == 1 && s.pad_h == 0 && s.pad_w == 0;
}

// The outputs ox in [first_inside, end_inside) read inside the row: 0 <= ox
// stride + off < w.
int64_t first_inside(int64_t off, int64_t stride, int64_t wo) {
  return off >= 0 ? 0 : std::min(wo, (-off + stride - 1) / stride);
}
int64_t end_inside(int64_t off, int64_t stride, int64_t w, int64_t wo, int64_t x0) {
  return w - 1 - off < 0 ? x0 : std::max(x0, std::min(wo, (w - 1 - off) / stride + 1));
}

// col [C kh kw, Ho Wo] of one image x [C, H, W], rows ld floats apart: row
// (c, ky, kx) holds the input under kernel tap (ky, kx) for every output,
// zero in the padding.
void im2col(const ConvShape& s, const float* x, float* col, int64_t ld) {
  const int64_t ho = s.out_height(), wo = s.out_width(), h = s.height, w = s.width;
  for (int64_t c = 0; c < s.in_channels; ++c)
    for (int64_t ky = 0; ky < s.kernel_h; ++ky)
      for (int64_t kx = 0; kx < s.kernel_w; ++kx) {
        float* row = col + ((c * s.kernel_h + ky) * s.kernel_w + kx) * ld;
        const float* plane = x + c * h * w;
        const int64_t off = kx - s.pad_w;
        const int64_t x0 = first_inside(off, s.stride_w, wo), x1 = end_inside(off, s.stride_w, w, wo, x0);
        for (int64_t oy = 0; oy < ho; ++oy) {
          float* out = row + oy * wo;
          const int64_t iy = oy * s.stride_h - s.pad_h + ky;
          if (iy < 0 || iy >= h) {
            std::fill(out, out + wo, 0.0f);
            continue;
          }
          const float* in = plane + iy * w + off;
          std::fill(out, out + x0, 0.0f);
          if (s.stride_w == 1)
            std::copy(in + x0, in + x1, out + x0);
          else
            for (int64_t ox = x0; ox < x1; ++ox) out[ox] = in[ox * s.stride_w];
          std::fill(out + x1, out + wo, 0.0f);
        }
      }
}

// dx [C, H, W] += col2im(dcol) (rows ld floats apart): the transpose of im2col.
void col2im_add(const ConvShape& s, const float* dcol, int64_t ld, float* dx) {
  const int64_t ho = s.out_height(), wo = s.out_width(), h = s.height, w = s.width;
  for (int64_t c = 0; c < s.in_channels; ++c)
    for (int64_t ky = 0; ky < s.kernel_h; ++ky)
      for (int64_t kx = 0; kx < s.kernel_w; ++kx) {
        const float* row = dcol + ((c * s.kernel_h + ky) * s.kernel_w + kx) * ld;
        float* plane = dx + c * h * w;
        const int64_t off = kx - s.pad_w;
        const int64_t x0 = first_inside(off, s.stride_w, wo), x1 = end_inside(off, s.stride_w, w, wo, x0);
        for (int64_t oy = 0; oy < ho; ++oy) {
          const int64_t iy = oy * s.stride_h - s.pad_h + ky;
          if (iy < 0 || iy >= h) continue;
          const float* in = row + oy * wo;
          float* out = plane + iy * w + off;
          if (s.stride_w == 1)
            for (int64_t ox = x0; ox < x1; ++ox) out[ox] += in[ox];
          else
            for (int64_t ox = x0; ox < x1; ++ox) out[ox * s.stride_w] += in[ox];
        }
      }
}

// dst = src + bias, then max(., 0) when relu.
SPARROW_SIMD_CLONES
void bias_relu_copy(const float* __restrict src, float bias, bool relu, float* __restrict dst, int64_t n) {
  if (relu)
    for (int64_t i = 0; i < n; ++i) {
      const float v = src[i] + bias;
      dst[i] = v < 0.0f ? 0.0f : v;  // NaN passes, as in ATen's relu
    }
  else
    for (int64_t i = 0; i < n; ++i) dst[i] = src[i] + bias;
}

SPARROW_SIMD_CLONES
void relu_inplace(float* __restrict v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = v[i] < 0.0f ? 0.0f : v[i];
}

// out = y > 0 ? d : 0 (the fused ReLU's backward).
SPARROW_SIMD_CLONES
void relu_mask(const float* __restrict y, const float* __restrict d, float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = d[i];
    out[i] = y[i] > 0.0f ? v : 0.0f;
  }
}

// Per-thread scratch, grown to the largest call and then reused.
std::vector<float>& scratch(size_t n) {
  static thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf;
}

// Images per GEMM: enough that the GEMM's long side is long, few enough that
// their im2col (C kh kw x images Ho Wo floats) stays within ~1 MiB.
int64_t images_per_gemm(const ConvShape& s) {
  constexpr int64_t target = int64_t{1} << 18;
  const int64_t per_image = s.in_channels * s.kernel_h * s.kernel_w * s.out_height() * s.out_width();
  return std::max<int64_t>(1, std::min(s.batch, target / per_image));
}

}  // namespace

void batched_conv2d_forward(const ConvShape& s, const float* x, const float* weight, const float* bias, bool relu,
                            float* y) {
  check_shape(s);
  const int64_t hw = s.out_height() * s.out_width(), ckk = s.in_channels * s.kernel_h * s.kernel_w;
  const int64_t o = s.out_channels, in_size = s.in_channels * s.height * s.width;
  const int64_t group = images_per_gemm(s);
  // Scratch: col [ckk, group hw]; the GEMM's output [o, group hw] when group > 1.
  float* col = scratch(static_cast<size_t>(group * hw * (ckk + (group > 1 ? o : 0)))).data();
  float* out = col + group * hw * ckk;
  for (int64_t k = 0; k < s.clients; ++k) {
    const float* wk = weight + k * o * ckk;
    const float* bk = bias ? bias + k * o : nullptr;
    for (int64_t b0 = 0; b0 < s.batch; b0 += group) {
      const int64_t nb = std::min(group, s.batch - b0), ld = nb * hw;
      const float* xb = x + (k * s.batch + b0) * in_size;
      float* yb = y + (k * s.batch + b0) * o * hw;
      const bool no_col = nb == 1 && direct(s);
      if (!no_col)
        for (int64_t i = 0; i < nb; ++i) im2col(s, xb + i * in_size, col + i * hw, ld);
      if (nb == 1) {  // straight into y, onto the bias
        for (int64_t c = 0; c < o; ++c) std::fill(yb + c * hw, yb + (c + 1) * hw, bk ? bk[c] : 0.0f);
        gemm_nn(o, hw, ckk, wk, no_col ? xb : col, yb, true);
        if (relu) relu_inplace(yb, o * hw);
        continue;
      }
      gemm_nn(o, ld, ckk, wk, col, out, false);
      for (int64_t i = 0; i < nb; ++i)  // [o, nb hw] -> [nb, o, hw], + bias (+ ReLU)
        for (int64_t c = 0; c < o; ++c)
          bias_relu_copy(out + c * ld + i * hw, bk ? bk[c] : 0.0f, relu, yb + (i * o + c) * hw, hw);
    }
  }
}

void batched_conv2d_backward(const ConvShape& s, const float* x, const float* weight, const float* relu_y,
                             const float* dy, float* dx, float* gw, float* gb, float alpha, float beta) {
  check_shape(s);
  const int64_t hw = s.out_height() * s.out_width(), ckk = s.in_channels * s.kernel_h * s.kernel_w;
  const int64_t o = s.out_channels, in_size = s.in_channels * s.height * s.width;
  const int64_t group = images_per_gemm(s);
  // Scratch: col and dcol [ckk, group hw], dy gathered (and masked) [o, group
  // hw], the gradients' sums [o, ckk] and [o].
  const int64_t n_col = ckk * group * hw;
  float* col = scratch(static_cast<size_t>(2 * n_col + o * group * hw + o * ckk + o)).data();
  float* dcol = col + n_col;
  float* d2 = dcol + n_col;
  float* sw = d2 + o * group * hw;
  float* sb = sw + o * ckk;
  for (int64_t k = 0; k < s.clients; ++k) {
    const float* wk = weight + k * o * ckk;
    std::fill(sw, sw + o * ckk + o, 0.0f);
    for (int64_t b0 = 0; b0 < s.batch; b0 += group) {
      const int64_t nb = std::min(group, s.batch - b0), ld = nb * hw;
      const int64_t first = k * s.batch + b0;
      const float* xb = x + first * in_size;
      // d [o, nb hw]: dy's images side by side, where the ReLU passed.
      const float* d = dy + first * o * hw;
      if (nb > 1 || relu_y) {
        for (int64_t i = 0; i < nb; ++i)
          for (int64_t c = 0; c < o; ++c) {
            const float* src = dy + ((first + i) * o + c) * hw;
            float* dst = d2 + c * ld + i * hw;
            if (relu_y)
              relu_mask(relu_y + ((first + i) * o + c) * hw, src, dst, hw);
            else
              std::copy(src, src + hw, dst);
          }
        d = d2;
      }
      for (int64_t c = 0; c < o; ++c) sb[c] += detail::sum(d + c * ld, ld);
      const bool no_col = nb == 1 && direct(s);
      if (!no_col)
        for (int64_t i = 0; i < nb; ++i) im2col(s, xb + i * in_size, col + i * hw, ld);
      gemm_nt(o, ckk, ld, d, no_col ? xb : col, sw, true);  // dW += d col^T
      if (!dx) continue;
      float* dxb = dx + first * in_size;
      if (no_col) {
        gemm_tn(ckk, hw, o, wk, d, dxb, false);  // dx = W^T d
        continue;
      }
      gemm_tn(ckk, ld, o, wk, d, dcol, false);
      std::fill(dxb, dxb + nb * in_size, 0.0f);
      for (int64_t i = 0; i < nb; ++i) col2im_add(s, dcol + i * hw, ld, dxb + i * in_size);
    }
    // The weight is read for the last time above: gw may be it.
    float* gwk = gw + k * o * ckk;
    for (int64_t i = 0; i < o * ckk; ++i) gwk[i] = beta == 0.0f ? alpha * sw[i] : beta * gwk[i] + alpha * sw[i];
    if (gb) {
      float* gbk = gb + k * o;
      for (int64_t c = 0; c < o; ++c) gbk[c] = beta == 0.0f ? alpha * sb[c] : beta * gbk[c] + alpha * sb[c];
    }
  }
}

bool batched_conv2d_preferred(const ConvShape& s) {
  check_shape(s);
  // Measured (docs/performance.md, sparrow-bench kernels, one thread, K 10 x
  // B 32): with one input channel this kernel is 1.9-8.4x ATen's grouped
  // convolution (3x3 and 5x5, forward and training); from 16 input channels
  // on, oneDNN's direct convolution is faster (0.53-0.83x).
  return s.in_channels == 1;
}

}  // namespace sparrow::kernels
