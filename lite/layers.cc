#include "lite/layers.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "core/rng.h"
#include "kernels/gemm.h"

namespace sparrow::lite {

using kernels::gemm;

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

std::string kind_name(LayerKind kind) {
  switch (kind) {
    case LayerKind::kLinear:
      return "linear";
    case LayerKind::kConv2d:
      return "conv2d";
    case LayerKind::kRelu:
      return "relu";
    case LayerKind::kGelu:
      return "gelu";
    case LayerKind::kMaxPool2d:
      return "max_pool2d";
    case LayerKind::kAvgPool2d:
      return "avg_pool2d";
    case LayerKind::kFlatten:
      return "flatten";
    case LayerKind::kDropout:
      return "dropout";
    case LayerKind::kLayerNorm:
      return "layer_norm";
    case LayerKind::kEmbedding:
      return "embedding";
    case LayerKind::kLoraLinear:
      return "lora_linear";
  }
  return "layer kind " + std::to_string(static_cast<uint32_t>(kind));
}

namespace {

// Rows of a [..., width] array: everything but the last dimension.
int64_t rows_of(const Tensor& x, int64_t width) { return width == 0 ? 0 : x.numel() / width; }

class Linear final : public Layer {
 public:
  using Layer::Layer;
  Shape out_shape(const Shape& in) const override {
    SPARROW_LITE_CHECK(!in.empty() && in.back() == spec_.in,
                       kind_name(spec_.kind) << " layer '" << spec_.param_names[0] << "' takes " << spec_.in
                                             << " features, its input is " << shape_str(in));
    Shape s = in;
    s.back() = spec_.out;
    return s;
  }
  void forward(const Tensor& x, Tensor& y, const ForwardContext&) override {
    Shape s = x.shape;
    s.back() = spec_.out;
    y.resize(s);
    const int64_t rows = rows_of(x, spec_.in);
    gemm(false, true, rows, spec_.out, spec_.in, 1.0f, x.ptr(), params_[0].value.data(), 0.0f, y.ptr());
    if (spec_.bias) {
      const float* b = params_[1].value.data();
      for (int64_t r = 0; r < rows; ++r) {
        float* yr = y.ptr() + r * spec_.out;
        for (int64_t j = 0; j < spec_.out; ++j) yr[j] += b[j];
      }
    }
  }
  void backward(const Tensor& x, const Tensor&, const Tensor& dy, Tensor* dx) override {
    const int64_t rows = rows_of(x, spec_.in);
    Param& w = params_[0];
    gemm(true, false, spec_.out, spec_.in, rows, 1.0f, dy.ptr(), x.ptr(), 0.0f, w.grad.data());
    if (spec_.bias) {
      float* gb = params_[1].grad.data();
      std::fill(gb, gb + spec_.out, 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const float* d = dy.ptr() + r * spec_.out;
        for (int64_t j = 0; j < spec_.out; ++j) gb[j] += d[j];
      }
    }
    if (dx) {
      dx->resize(x.shape);
      gemm(false, false, rows, spec_.in, spec_.out, 1.0f, dy.ptr(), w.value.data(), 0.0f, dx->ptr());
    }
  }
};

// LoRA on a frozen Linear (Hu et al., 2021), as PyTorch computes
//   F.linear(x, W, b) + (x @ A.t() @ B.t()) * scale,  scale = alpha / r.
// Only A and B are parameters; W and b come from the spec (frozen). The
// rank-r activation h = x A^T is kept for the backward.
class LoraLinear final : public Layer {
 public:
  explicit LoraLinear(LayerSpec spec)
      : Layer(std::move(spec)), r_(spec_.flag), scale_(spec_.p / static_cast<float>(spec_.flag)) {}
  Shape out_shape(const Shape& in) const override {
    SPARROW_LITE_CHECK(!in.empty() && in.back() == spec_.in,
                       kind_name(spec_.kind) << " layer '" << spec_.param_names[0] << "' takes " << spec_.in
                                             << " features, its input is " << shape_str(in));
    Shape s = in;
    s.back() = spec_.out;
    return s;
  }
  void forward(const Tensor& x, Tensor& y, const ForwardContext&) override {
    Shape s = x.shape;
    s.back() = spec_.out;
    y.resize(s);
    const int64_t rows = rows_of(x, spec_.in);
    gemm(false, true, rows, spec_.out, spec_.in, 1.0f, x.ptr(), weight(), 0.0f, y.ptr());
    if (spec_.bias) {
      const float* b = spec_.frozen[1].value->data();
      for (int64_t i = 0; i < rows; ++i) {
        float* yr = y.ptr() + i * spec_.out;
        for (int64_t j = 0; j < spec_.out; ++j) yr[j] += b[j];
      }
    }
    h_.resize(static_cast<size_t>(rows * r_));
    gemm(false, true, rows, r_, spec_.in, 1.0f, x.ptr(), params_[0].value.data(), 0.0f, h_.data());
    gemm(false, true, rows, spec_.out, r_, scale_, h_.data(), params_[1].value.data(), 1.0f, y.ptr());
  }
  void backward(const Tensor& x, const Tensor&, const Tensor& dy, Tensor* dx) override {
    const int64_t rows = rows_of(x, spec_.in);
    Param& a = params_[0];
    Param& b = params_[1];
    // dB = scale dy^T h; dh = scale dy B; dA = dh^T x.
    gemm(true, false, spec_.out, r_, rows, scale_, dy.ptr(), h_.data(), 0.0f, b.grad.data());
    dh_.resize(static_cast<size_t>(rows * r_));
    gemm(false, false, rows, r_, spec_.out, scale_, dy.ptr(), b.value.data(), 0.0f, dh_.data());
    gemm(true, false, r_, spec_.in, rows, 1.0f, dh_.data(), x.ptr(), 0.0f, a.grad.data());
    if (dx) {  // dx = dy W + dh A
      dx->resize(x.shape);
      gemm(false, false, rows, spec_.in, spec_.out, 1.0f, dy.ptr(), weight(), 0.0f, dx->ptr());
      gemm(false, false, rows, spec_.in, r_, 1.0f, dh_.data(), a.value.data(), 1.0f, dx->ptr());
    }
  }

 private:
  const float* weight() const { return spec_.frozen[0].value->data(); }
  const int64_t r_;
  const float scale_;
  std::vector<float> h_, dh_;
};

class Elementwise : public Layer {
 public:
  using Layer::Layer;
  Shape out_shape(const Shape& in) const override { return in; }
};

class Relu final : public Elementwise {
 public:
  using Elementwise::Elementwise;
  void forward(const Tensor& x, Tensor& y, const ForwardContext&) override {
    y.resize(x.shape);
    const float* a = x.ptr();
    float* b = y.ptr();
    for (int64_t i = 0, n = x.numel(); i < n; ++i) b[i] = a[i] > 0.0f ? a[i] : 0.0f;
  }
  void backward(const Tensor&, const Tensor& y, const Tensor& dy, Tensor* dx) override {
    if (!dx) return;
    dx->resize(y.shape);
    const float* o = y.ptr();
    const float* d = dy.ptr();
    float* g = dx->ptr();
    for (int64_t i = 0, n = y.numel(); i < n; ++i) g[i] = o[i] > 0.0f ? d[i] : 0.0f;
  }
};

class Gelu final : public Elementwise {
 public:
  using Elementwise::Elementwise;
  void forward(const Tensor& x, Tensor& y, const ForwardContext&) override {
    y.resize(x.shape);
    const float* a = x.ptr();
    float* b = y.ptr();
    const int64_t n = x.numel();
    if (spec_.flag) {
      for (int64_t i = 0; i < n; ++i) {
        const float v = a[i];
        b[i] = 0.5f * v * (1.0f + std::tanh(kBeta * (v + kKappa * v * v * v)));
      }
    } else {
      for (int64_t i = 0; i < n; ++i) b[i] = 0.5f * a[i] * (1.0f + std::erf(a[i] * kSqrtHalf));
    }
  }
  void backward(const Tensor& x, const Tensor&, const Tensor& dy, Tensor* dx) override {
    if (!dx) return;
    dx->resize(x.shape);
    const float* a = x.ptr();
    const float* d = dy.ptr();
    float* g = dx->ptr();
    const int64_t n = x.numel();
    if (spec_.flag) {
      for (int64_t i = 0; i < n; ++i) {
        const float v = a[i];
        const float inner = kBeta * (v + kKappa * v * v * v);
        const float t = std::tanh(inner);
        const float dinner = kBeta * (1.0f + 3.0f * kKappa * v * v);
        g[i] = d[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * dinner);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const float v = a[i];
        const float cdf = 0.5f * (1.0f + std::erf(v * kSqrtHalf));
        const float pdf = kInvSqrt2Pi * std::exp(-0.5f * v * v);
        g[i] = d[i] * (cdf + v * pdf);
      }
    }
  }

 private:
  static constexpr float kSqrtHalf = 0.70710678118654752f;
  static constexpr float kInvSqrt2Pi = 0.39894228040143268f;
  static constexpr float kBeta = 0.79788456080286536f;  // sqrt(2 / pi)
  static constexpr float kKappa = 0.044715f;
};

class Flatten final : public Layer {
 public:
  using Layer::Layer;
  Shape out_shape(const Shape& in) const override { return {numel(in)}; }
  void forward(const Tensor& x, Tensor& y, const ForwardContext&) override {
    y.shape = {x.shape[0], x.shape[0] == 0 ? 0 : x.numel() / x.shape[0]};
    y.data = x.data;
  }
  void backward(const Tensor& x, const Tensor&, const Tensor& dy, Tensor* dx) override {
    if (!dx) return;
    dx->shape = x.shape;
    dx->data = dy.data;
  }
};

// Inverted dropout as torch's: kept elements scaled by 1 / (1 - p). The mask
// is a pure function of (key, element index), so a step is reproducible.
class Dropout final : public Elementwise {
 public:
  using Elementwise::Elementwise;
  void forward(const Tensor& x, Tensor& y, const ForwardContext& ctx) override {
    y.resize(x.shape);
    const int64_t n = x.numel();
    active_ = ctx.train && spec_.p > 0.0f;
    if (!active_) {
      std::copy(x.data.begin(), x.data.end(), y.data.begin());
      return;
    }
    mask_.resize(static_cast<size_t>(n));
    const float scale = 1.0f / (1.0f - spec_.p);
    for (int64_t i = 0; i < n; ++i) {
      mask_[static_cast<size_t>(i)] = rng::uniform01(ctx.dropout_key, static_cast<uint64_t>(i)) >= spec_.p ? scale : 0;
      y.data[static_cast<size_t>(i)] = x.data[static_cast<size_t>(i)] * mask_[static_cast<size_t>(i)];
    }
  }
  void backward(const Tensor& x, const Tensor&, const Tensor& dy, Tensor* dx) override {
    if (!dx) return;
    dx->resize(x.shape);
    if (!active_) {
      dx->data = dy.data;
      return;
    }
    for (size_t i = 0; i < dy.data.size(); ++i) dx->data[i] = dy.data[i] * mask_[i];
  }
  // The mask of the last training forward (scale or 0 per element), for tests.
  const std::vector<float>& mask() const { return mask_; }

 private:
  bool active_ = false;
  std::vector<float> mask_;
};

class LayerNorm final : public Elementwise {
 public:
  using Elementwise::Elementwise;
  Shape out_shape(const Shape& in) const override {
    SPARROW_LITE_CHECK(numel(in) % spec_.in == 0,
                       "layer_norm over " << spec_.in << " elements does not fit input " << shape_str(in));
    return in;
  }
  void forward(const Tensor& x, Tensor& y, const ForwardContext&) override {
    y.resize(x.shape);
    const int64_t d = spec_.in, rows = rows_of(x, d);
    mean_.resize(static_cast<size_t>(rows));
    rstd_.resize(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      const float* a = x.ptr() + r * d;
      float* b = y.ptr() + r * d;
      double s = 0;
      for (int64_t j = 0; j < d; ++j) s += a[j];
      const float mu = static_cast<float>(s / static_cast<double>(d));
      double v = 0;
      for (int64_t j = 0; j < d; ++j) v += static_cast<double>(a[j] - mu) * (a[j] - mu);
      const float rstd = 1.0f / std::sqrt(static_cast<float>(v / static_cast<double>(d)) + spec_.eps);
      mean_[static_cast<size_t>(r)] = mu;
      rstd_[static_cast<size_t>(r)] = rstd;
      for (int64_t j = 0; j < d; ++j) b[j] = (a[j] - mu) * rstd;
      if (spec_.bias) {
        const float* g = params_[0].value.data();
        const float* be = params_[1].value.data();
        for (int64_t j = 0; j < d; ++j) b[j] = b[j] * g[j] + be[j];
      }
    }
  }
  void backward(const Tensor& x, const Tensor&, const Tensor& dy, Tensor* dx) override {
    const int64_t d = spec_.in, rows = rows_of(x, d);
    float* gw = spec_.bias ? params_[0].grad.data() : nullptr;
    float* gb = spec_.bias ? params_[1].grad.data() : nullptr;
    if (gw) {
      std::fill(gw, gw + d, 0.0f);
      std::fill(gb, gb + d, 0.0f);
    }
    if (dx) dx->resize(x.shape);
    std::vector<float>& dxh = scratch_;
    dxh.resize(static_cast<size_t>(d));
    for (int64_t r = 0; r < rows; ++r) {
      const float* a = x.ptr() + r * d;
      const float* g = dy.ptr() + r * d;
      const float mu = mean_[static_cast<size_t>(r)], rstd = rstd_[static_cast<size_t>(r)];
      double s1 = 0, s2 = 0;
      for (int64_t j = 0; j < d; ++j) {
        const float xh = (a[j] - mu) * rstd;
        if (gw) {
          gw[j] += g[j] * xh;
          gb[j] += g[j];
        }
        const float v = gw ? g[j] * params_[0].value[static_cast<size_t>(j)] : g[j];
        dxh[static_cast<size_t>(j)] = v;
        s1 += v;
        s2 += static_cast<double>(v) * xh;
      }
      if (!dx) continue;
      const float m1 = static_cast<float>(s1 / static_cast<double>(d));
      const float m2 = static_cast<float>(s2 / static_cast<double>(d));
      float* o = dx->ptr() + r * d;
      for (int64_t j = 0; j < d; ++j) o[j] = rstd * (dxh[static_cast<size_t>(j)] - m1 - (a[j] - mu) * rstd * m2);
    }
  }

 private:
  std::vector<float> mean_, rstd_, scratch_;
};

class Embedding final : public Layer {
 public:
  using Layer::Layer;
  Shape out_shape(const Shape& in) const override {
    Shape s = in;
    s.push_back(spec_.out);
    return s;
  }
  void forward(const Tensor& x, Tensor& y, const ForwardContext&) override {
    Shape s = x.shape;
    s.push_back(spec_.out);
    y.resize(s);
    const float* w = params_[0].value.data();
    for (int64_t i = 0, n = x.numel(); i < n; ++i) {
      const int64_t id = index(x.data[static_cast<size_t>(i)]);
      std::copy(w + id * spec_.out, w + (id + 1) * spec_.out, y.ptr() + i * spec_.out);
    }
  }
  void backward(const Tensor& x, const Tensor&, const Tensor& dy, Tensor* dx) override {
    std::vector<float>& g = params_[0].grad;
    std::fill(g.begin(), g.end(), 0.0f);
    for (int64_t i = 0, n = x.numel(); i < n; ++i) {
      const int64_t id = index(x.data[static_cast<size_t>(i)]);
      const float* d = dy.ptr() + i * spec_.out;
      float* gr = g.data() + id * spec_.out;
      for (int64_t j = 0; j < spec_.out; ++j) gr[j] += d[j];
    }
    if (dx) {  // indices have no gradient
      dx->resize(x.shape);
      std::fill(dx->data.begin(), dx->data.end(), 0.0f);
    }
  }

 private:
  int64_t index(float v) const {
    const auto id = static_cast<int64_t>(v);
    SPARROW_LITE_CHECK(
        static_cast<float>(id) == v && id >= 0 && id < spec_.in,
        "embedding '" << spec_.param_names[0] << "': index " << v << " is not an integer in [0, " << spec_.in << ")");
    return id;
  }
};

void check_params(const LayerSpec& s, const std::vector<Shape>& want) {
  const std::string name = kind_name(s.kind);
  SPARROW_LITE_CHECK(s.param_names.size() == want.size() && s.param_shapes.size() == want.size(),
                     name << " layer needs " << want.size() << " parameters, the spec names " << s.param_names.size()
                          << " with " << s.param_shapes.size() << " shapes");
  for (size_t i = 0; i < want.size(); ++i) {
    SPARROW_LITE_CHECK(!s.param_names[i].empty(), name << " layer: parameter " << i << " has no name");
    SPARROW_LITE_CHECK(
        numel(s.param_shapes[i]) == numel(want[i]) && (s.kind == LayerKind::kLayerNorm || s.param_shapes[i] == want[i]),
        name << " layer: '" << s.param_names[i] << "' has shape " << shape_str(s.param_shapes[i])
             << ", the layer needs " << shape_str(want[i]));
  }
}

// The frozen tensors against the shapes the layer needs.
void check_frozen(const LayerSpec& s, const std::vector<Shape>& want) {
  const std::string name = kind_name(s.kind);
  SPARROW_LITE_CHECK(s.frozen.size() == want.size(),
                     name << " layer needs " << want.size() << " frozen tensors, the spec has " << s.frozen.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const FrozenTensor& f = s.frozen[i];
    SPARROW_LITE_CHECK(!f.name.empty(), name << " layer: frozen tensor " << i << " has no name");
    SPARROW_LITE_CHECK(f.shape == want[i], name << " layer: frozen '" << f.name << "' has shape " << shape_str(f.shape)
                                                << ", the layer needs " << shape_str(want[i]));
    SPARROW_LITE_CHECK(f.value && static_cast<int64_t>(f.value->size()) == numel(f.shape),
                       name << " layer: frozen '" << f.name << "' holds " << (f.value ? f.value->size() : 0)
                            << " values for shape " << shape_str(f.shape));
  }
}

}  // namespace

size_t frozen_count(LayerKind kind, int64_t bias) {
  if (kind == LayerKind::kLoraLinear) return bias ? 2 : 1;
  return 0;
}

std::unique_ptr<Layer> make_layer(const LayerSpec& s) {
  const std::string name = kind_name(s.kind);
  std::unique_ptr<Layer> layer;
  std::vector<Shape> want;
  switch (s.kind) {
    case LayerKind::kLinear:
      SPARROW_LITE_CHECK(s.in > 0 && s.out > 0, name << " layer needs in, out > 0, got " << s.in << ", " << s.out);
      want = {{s.out, s.in}};
      if (s.bias) want.push_back({s.out});
      layer = std::make_unique<Linear>(s);
      break;
    case LayerKind::kConv2d:
    case LayerKind::kMaxPool2d:
    case LayerKind::kAvgPool2d:
      SPARROW_LITE_CHECK(s.kh > 0 && s.kw > 0 && s.sh > 0 && s.sw > 0 && s.ph >= 0 && s.pw >= 0,
                         name << " layer needs kernel, stride > 0 and padding >= 0");
      if (s.kind == LayerKind::kConv2d) {
        SPARROW_LITE_CHECK(s.in > 0 && s.out > 0, name << " layer needs in, out channels > 0");
        want = {{s.out, s.in, s.kh, s.kw}};
        if (s.bias) want.push_back({s.out});
        layer = make_conv2d(s);
      } else {
        SPARROW_LITE_CHECK(s.ph * 2 <= s.kh && s.pw * 2 <= s.kw,
                           name << " layer: padding must be at most half the kernel (as torch requires)");
        layer = make_pool2d(s);
      }
      break;
    case LayerKind::kRelu:
      layer = std::make_unique<Relu>(s);
      break;
    case LayerKind::kGelu:
      SPARROW_LITE_CHECK(s.flag == 0 || s.flag == 1, name << " layer: flag must be 0 (erf) or 1 (tanh)");
      layer = std::make_unique<Gelu>(s);
      break;
    case LayerKind::kFlatten:
      layer = std::make_unique<Flatten>(s);
      break;
    case LayerKind::kDropout:
      SPARROW_LITE_CHECK(s.p >= 0.0f && s.p < 1.0f, name << " layer: p must be in [0, 1), got " << s.p);
      layer = std::make_unique<Dropout>(s);
      break;
    case LayerKind::kLayerNorm:
      SPARROW_LITE_CHECK(s.in > 0 && std::isfinite(s.eps) && s.eps > 0, name << " layer needs size > 0 and eps > 0");
      if (s.bias) want = {{s.in}, {s.in}};
      layer = std::make_unique<LayerNorm>(s);
      break;
    case LayerKind::kEmbedding:
      SPARROW_LITE_CHECK(s.in > 0 && s.out > 0, name << " layer needs count, dim > 0");
      want = {{s.in, s.out}};
      layer = std::make_unique<Embedding>(s);
      break;
    case LayerKind::kLoraLinear: {
      SPARROW_LITE_CHECK(s.in > 0 && s.out > 0, name << " layer needs in, out > 0, got " << s.in << ", " << s.out);
      SPARROW_LITE_CHECK(s.flag > 0, name << " layer: rank (flag) must be > 0, got " << s.flag);
      SPARROW_LITE_CHECK(std::isfinite(s.p), name << " layer: alpha must be finite");
      std::vector<Shape> frozen = {{s.out, s.in}};
      if (s.bias) frozen.push_back({s.out});
      check_frozen(s, frozen);
      want = {{s.flag, s.in}, {s.out, s.flag}};
      layer = std::make_unique<LoraLinear>(s);
      break;
    }
    default:
      SPARROW_LITE_CHECK(false, "unknown " << name);
  }
  if (s.kind != LayerKind::kLoraLinear) check_frozen(s, {});
  check_params(s, want);
  for (size_t i = 0; i < want.size(); ++i) {
    Param p;
    p.name = s.param_names[i];
    p.shape = s.param_shapes[i];
    p.value.assign(static_cast<size_t>(numel(p.shape)), 0.0f);
    p.grad.assign(p.value.size(), 0.0f);
    layer->params().push_back(std::move(p));
  }
  return layer;
}

float softmax_cross_entropy(const Tensor& logits, const int64_t* labels, Tensor* dlogits) {
  SPARROW_LITE_CHECK(logits.shape.size() == 2,
                     "the model's output must be [batch, classes] logits, got " << shape_str(logits.shape));
  const int64_t b = logits.shape[0], c = logits.shape[1];
  if (dlogits) dlogits->resize(logits.shape);
  double total = 0;
  const float inv_b = 1.0f / static_cast<float>(b);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t y = labels[i];
    SPARROW_LITE_CHECK(y >= 0 && y < c, "class label " << y << " but the model has " << c << " outputs");
    const float* z = logits.ptr() + i * c;
    const float mx = *std::max_element(z, z + c);
    float s = 0;
    for (int64_t j = 0; j < c; ++j) s += std::exp(z[j] - mx);
    const float lse = mx + std::log(s);
    total += static_cast<double>(lse - z[y]);
    if (dlogits) {
      float* g = dlogits->ptr() + i * c;
      for (int64_t j = 0; j < c; ++j) g[j] = std::exp(z[j] - lse) * inv_b;
      g[y] -= inv_b;
    }
  }
  return static_cast<float>(total / static_cast<double>(b));
}

}  // namespace sparrow::lite
