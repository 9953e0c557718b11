// Conv2d (im2col + one GEMM per sample) and the 2-D pools.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/gemm.h"
#include "lite/layers.h"

namespace sparrow::lite {
namespace {

using kernels::gemm;

struct Geometry {
  int64_t c, h, w, ho, wo;
};

Geometry geometry(const LayerSpec& s, const Shape& in, int64_t channels) {
  const std::string name = kind_name(s.kind);
  SPARROW_LITE_CHECK(in.size() == 3 && (channels == 0 || in[0] == channels),
                     name << " layer takes [" << (channels ? std::to_string(channels) : std::string("C"))
                          << ", H, W] per sample, its input is " << shape_str(in));
  Geometry g{in[0], in[1], in[2], (in[1] + 2 * s.ph - s.kh) / s.sh + 1, (in[2] + 2 * s.pw - s.kw) / s.sw + 1};
  SPARROW_LITE_CHECK(in[1] + 2 * s.ph >= s.kh && in[2] + 2 * s.pw >= s.kw && g.ho > 0 && g.wo > 0,
                     name << " layer: kernel " << s.kh << "x" << s.kw << " does not fit input " << shape_str(in));
  return g;
}

// im2col + one GEMM per sample: a sample's patches (C kh kw x Ho Wo floats,
// 627 KB for the CNN's conv2) stay in cache between im2col and the GEMM,
// which runs at 100 GFLOP/s there against 70-90 for one GEMM over the whole
// batch's patches (measured on the CNN's conv2, AVX2+FMA, one core).
// The backward runs im2col again rather than keeping every sample's patches
// from the forward (20 MB for the CNN's conv2 at batch 32): the copy costs
// less than the GEMMs lose reading patches that have left the cache.
class Conv2d final : public Layer {
 public:
  using Layer::Layer;
  Shape out_shape(const Shape& in) const override {
    const Geometry g = geometry(spec_, in, spec_.in);
    return {spec_.out, g.ho, g.wo};
  }
  void forward(const Tensor& x, Tensor& y, const ForwardContext&) override {
    const int64_t b = x.shape[0];
    const Geometry g = geometry(spec_, Shape(x.shape.begin() + 1, x.shape.end()), spec_.in);
    const int64_t ck = spec_.in * spec_.kh * spec_.kw, hw = g.ho * g.wo, chw = spec_.in * g.h * g.w;
    y.resize({b, spec_.out, g.ho, g.wo});
    if (!pointwise()) col_.resize(static_cast<size_t>(ck * hw));
    const float* bias = spec_.bias ? params_[1].value.data() : nullptr;
    for (int64_t n = 0; n < b; ++n) {
      float* yn = y.ptr() + n * spec_.out * hw;
      const float* cols = patches(x.ptr() + n * chw, g);
      gemm(false, false, spec_.out, hw, ck, 1.0f, params_[0].value.data(), cols, 0.0f, yn);
      if (!bias) continue;
      for (int64_t o = 0; o < spec_.out; ++o) {
        float* row = yn + o * hw;
        for (int64_t i = 0; i < hw; ++i) row[i] += bias[o];
      }
    }
  }
  void backward(const Tensor& x, const Tensor&, const Tensor& dy, Tensor* dx) override {
    const int64_t b = x.shape[0];
    const Geometry g = geometry(spec_, Shape(x.shape.begin() + 1, x.shape.end()), spec_.in);
    const int64_t ck = spec_.in * spec_.kh * spec_.kw, hw = g.ho * g.wo, chw = spec_.in * g.h * g.w;
    Param& w = params_[0];
    std::fill(w.grad.begin(), w.grad.end(), 0.0f);
    if (spec_.bias) std::fill(params_[1].grad.begin(), params_[1].grad.end(), 0.0f);
    if (dx) dx->resize(x.shape);
    if (!pointwise()) col_.resize(static_cast<size_t>(ck * hw));
    for (int64_t n = 0; n < b; ++n) {
      const float* dyn = dy.ptr() + n * spec_.out * hw;
      const float* cols = patches(x.ptr() + n * chw, g);
      gemm(false, true, spec_.out, ck, hw, 1.0f, dyn, cols, 1.0f, w.grad.data());
      if (spec_.bias) {
        float* gb = params_[1].grad.data();
        for (int64_t o = 0; o < spec_.out; ++o) {
          const float* row = dyn + o * hw;
          float s = 0;
          for (int64_t i = 0; i < hw; ++i) s += row[i];
          gb[o] += s;
        }
      }
      if (!dx) continue;
      float* dxn = dx->ptr() + n * chw;
      if (pointwise()) {
        gemm(true, false, ck, hw, spec_.out, 1.0f, w.value.data(), dyn, 0.0f, dxn);
      } else {
        dcol_.resize(static_cast<size_t>(ck * hw));
        gemm(true, false, ck, hw, spec_.out, 1.0f, w.value.data(), dyn, 0.0f, dcol_.data());
        col2im(dxn, g);
      }
    }
  }

 private:
  bool pointwise() const {
    return spec_.kh == 1 && spec_.kw == 1 && spec_.sh == 1 && spec_.sw == 1 && spec_.ph == 0 && spec_.pw == 0;
  }
  // The output columns ox whose input column ox * sw - pw + j is inside [0, w).
  std::pair<int64_t, int64_t> valid_cols(int64_t j, const Geometry& g) const {
    int64_t lo = 0;
    while (lo < g.wo && lo * spec_.sw - spec_.pw + j < 0) ++lo;
    int64_t hi = g.wo;
    while (hi > lo && (hi - 1) * spec_.sw - spec_.pw + j >= g.w) --hi;
    return {lo, hi};
  }
  // A sample's patches: the input itself for a 1x1 convolution, else im2col
  // into col_: col[(c, i, j), (oy, ox)] = x[c, oy * sh - ph + i, ox * sw - pw + j], 0 outside.
  const float* patches(const float* x, const Geometry& g) {
    if (pointwise()) return x;
    float* const start = col_.data();
    float* col = start;
    for (int64_t c = 0; c < g.c; ++c)
      for (int64_t i = 0; i < spec_.kh; ++i)
        for (int64_t j = 0; j < spec_.kw; ++j) {
          const auto [lo, hi] = valid_cols(j, g);
          for (int64_t oy = 0; oy < g.ho; ++oy) {
            const int64_t iy = oy * spec_.sh - spec_.ph + i;
            float* out = col + oy * g.wo;
            if (iy < 0 || iy >= g.h) {
              std::fill(out, out + g.wo, 0.0f);
              continue;
            }
            const float* row = x + (c * g.h + iy) * g.w - spec_.pw + j;
            std::fill(out, out + lo, 0.0f);
            if (spec_.sw == 1) {
              std::copy(row + lo, row + hi, out + lo);
            } else {
              for (int64_t ox = lo; ox < hi; ++ox) out[ox] = row[ox * spec_.sw];
            }
            std::fill(out + hi, out + g.wo, 0.0f);
          }
          col += g.ho * g.wo;
        }
    return start;
  }
  // The adjoint of im2col: dx[c, iy, ix] = sum of the dcol_ cells it was copied to.
  void col2im(float* dx, const Geometry& g) const {
    std::fill(dx, dx + g.c * g.h * g.w, 0.0f);
    const float* col = dcol_.data();
    for (int64_t c = 0; c < g.c; ++c)
      for (int64_t i = 0; i < spec_.kh; ++i)
        for (int64_t j = 0; j < spec_.kw; ++j) {
          const auto [lo, hi] = valid_cols(j, g);
          for (int64_t oy = 0; oy < g.ho; ++oy) {
            const int64_t iy = oy * spec_.sh - spec_.ph + i;
            if (iy < 0 || iy >= g.h) continue;
            float* row = dx + (c * g.h + iy) * g.w - spec_.pw + j;
            const float* in = col + oy * g.wo;
            if (spec_.sw == 1) {
              for (int64_t ox = lo; ox < hi; ++ox) row[ox] += in[ox];
            } else {
              for (int64_t ox = lo; ox < hi; ++ox) row[ox * spec_.sw] += in[ox];
            }
          }
          col += g.ho * g.wo;
        }
  }

  std::vector<float> col_, dcol_;
};

class Pool2d final : public Layer {
 public:
  using Layer::Layer;
  Shape out_shape(const Shape& in) const override {
    const Geometry g = geometry(spec_, in, 0);
    return {g.c, g.ho, g.wo};
  }
  void forward(const Tensor& x, Tensor& y, const ForwardContext&) override {
    const Geometry g = geometry(spec_, Shape(x.shape.begin() + 1, x.shape.end()), 0);
    const int64_t planes = x.shape[0] * g.c;
    y.resize({x.shape[0], g.c, g.ho, g.wo});
    const bool max = spec_.kind == LayerKind::kMaxPool2d;
    if (max) argmax_.resize(static_cast<size_t>(y.numel()));
    if (max && spec_.kh == 2 && spec_.kw == 2 && spec_.sh == 2 && spec_.sw == 2 && spec_.ph == 0 && spec_.pw == 0) {
      max2x2(x.ptr(), y.ptr(), planes, g);
      return;
    }
    const float inv = 1.0f / static_cast<float>(spec_.kh * spec_.kw);
    for (int64_t p = 0; p < planes; ++p) {
      const float* in = x.ptr() + p * g.h * g.w;
      float* out = y.ptr() + p * g.ho * g.wo;
      for (int64_t oy = 0; oy < g.ho; ++oy)
        for (int64_t ox = 0; ox < g.wo; ++ox) {
          const int64_t y0 = oy * spec_.sh - spec_.ph, x0 = ox * spec_.sw - spec_.pw;
          float best = -std::numeric_limits<float>::infinity(), sum = 0;
          int32_t at = -1;
          for (int64_t i = std::max<int64_t>(0, y0); i < std::min(g.h, y0 + spec_.kh); ++i)
            for (int64_t j = std::max<int64_t>(0, x0); j < std::min(g.w, x0 + spec_.kw); ++j) {
              const float v = in[i * g.w + j];
              sum += v;
              // '>' keeps the first maximum, as LibTorch; NaN wins, as LibTorch.
              if (at < 0 || v > best || (std::isnan(v) && !std::isnan(best))) {
                best = v;
                at = static_cast<int32_t>(i * g.w + j);
              }
            }
          const int64_t o = oy * g.wo + ox;
          if (max) {
            out[o] = best;
            argmax_[static_cast<size_t>(p * g.ho * g.wo + o)] = at;
          } else {
            out[o] = sum * inv;
          }
        }
    }
  }
  void backward(const Tensor& x, const Tensor&, const Tensor& dy, Tensor* dx) override {
    if (!dx) return;
    const Geometry g = geometry(spec_, Shape(x.shape.begin() + 1, x.shape.end()), 0);
    const int64_t planes = x.shape[0] * g.c;
    dx->resize(x.shape);
    std::fill(dx->data.begin(), dx->data.end(), 0.0f);
    const bool max = spec_.kind == LayerKind::kMaxPool2d;
    const float inv = 1.0f / static_cast<float>(spec_.kh * spec_.kw);
    for (int64_t p = 0; p < planes; ++p) {
      float* gin = dx->ptr() + p * g.h * g.w;
      const float* gout = dy.ptr() + p * g.ho * g.wo;
      for (int64_t o = 0; o < g.ho * g.wo; ++o) {
        if (max) {
          gin[argmax_[static_cast<size_t>(p * g.ho * g.wo + o)]] += gout[o];
          continue;
        }
        const int64_t y0 = (o / g.wo) * spec_.sh - spec_.ph, x0 = (o % g.wo) * spec_.sw - spec_.pw;
        for (int64_t i = std::max<int64_t>(0, y0); i < std::min(g.h, y0 + spec_.kh); ++i)
          for (int64_t j = std::max<int64_t>(0, x0); j < std::min(g.w, x0 + spec_.kw); ++j)
            gin[i * g.w + j] += gout[o] * inv;
      }
    }
  }

 private:
  // MaxPool2d(2) (the built-in CNN's), the general loop's result without its
  // bounds and window loops: 9% of the CNN's step was the general loop.
  void max2x2(const float* x, float* y, int64_t planes, const Geometry& g) {
    for (int64_t p = 0; p < planes; ++p) {
      const float* in = x + p * g.h * g.w;
      float* out = y + p * g.ho * g.wo;
      int32_t* arg = argmax_.data() + p * g.ho * g.wo;
      for (int64_t oy = 0; oy < g.ho; ++oy) {
        const float* r0 = in + 2 * oy * g.w;
        const float* r1 = r0 + g.w;
        for (int64_t ox = 0; ox < g.wo; ++ox) {
          const int32_t at = static_cast<int32_t>(2 * oy * g.w + 2 * ox);
          float best = r0[2 * ox];
          int32_t where = at;
          // The window in row-major order, as the general loop: '>' keeps the first maximum, the first NaN wins.
          const float rest[3] = {r0[2 * ox + 1], r1[2 * ox], r1[2 * ox + 1]};
          const int32_t rest_at[3] = {at + 1, at + static_cast<int32_t>(g.w), at + static_cast<int32_t>(g.w) + 1};
          for (int i = 0; i < 3; ++i)
            if (rest[i] > best || (std::isnan(rest[i]) && !std::isnan(best))) {
              best = rest[i];
              where = rest_at[i];
            }
          out[oy * g.wo + ox] = best;
          arg[oy * g.wo + ox] = where;
        }
      }
    }
  }

  std::vector<int32_t> argmax_;
};

}  // namespace

std::unique_ptr<Layer> make_conv2d(const LayerSpec& spec) { return std::make_unique<Conv2d>(spec); }
std::unique_ptr<Layer> make_pool2d(const LayerSpec& spec) { return std::make_unique<Pool2d>(spec); }

}  // namespace sparrow::lite
