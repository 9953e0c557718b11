#include "batched/ops.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>

#include "core/models.h"

namespace sparrow::batched {
namespace {

// [K, B, ...] -> [K * B, ...] and back.
at::Tensor merge(const at::Tensor& x) { return x.flatten(0, 1); }
at::Tensor unmerge(const at::Tensor& y, int64_t k) {
  std::vector<int64_t> s{k, y.size(0) / k};
  s.insert(s.end(), y.sizes().begin() + 1, y.sizes().end());
  return y.view(s);
}

}  // namespace

at::Tensor linear_clients(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t k = x.size(0), in = x.size(-1);
  const bool flat = x.dim() == 3;
  const at::Tensor h = (flat ? x : x.reshape({k, -1, in})).transpose(1, 2);  // [K, in, rows]
  const at::Tensor z = bias.defined() ? core::linear_clients(h, weight, bias) : at::bmm(weight, h);
  const at::Tensor out = z.transpose(1, 2);  // [K, rows, out], a view
  if (flat) return out;
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = weight.size(1);
  return out.reshape(s);
}

at::Tensor conv2d_clients(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                          std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  const int64_t k = x.size(0);
  // One client at a time by default (ATen's grouped convolution was 3.5x
  // slower on the CPU for the built-in CNN, docs/architecture.md);
  // SPARROW_BATCHED_CONV=grouped runs one grouped convolution instead, to
  // measure both at a model's own shapes (not yet measured for users' models).
  static const char* mode = std::getenv("SPARROW_BATCHED_CONV");
  if (mode && std::strcmp(mode, "grouped") == 0) {
    // [K, B, C, H, W] -> [B, K * C, H, W], one convolution with groups = K.
    const int64_t b = x.size(1), c = x.size(2);
    const at::Tensor xg = x.transpose(0, 1).reshape({b, k * c, x.size(3), x.size(4)});
    const at::Tensor w = weight.flatten(0, 1);
    const at::Tensor y = at::conv2d(xg, w, bias.defined() ? bias.flatten() : at::Tensor(), {stride[0], stride[1]},
                                    {padding[0], padding[1]}, {1, 1}, k);
    return y.view({b, k, weight.size(1), y.size(2), y.size(3)}).transpose(0, 1);
  }
  std::vector<at::Tensor> ys;
  ys.reserve(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i)
    ys.push_back(at::conv2d(x[i], weight[i], bias.defined() ? bias[i] : at::Tensor(), {stride[0], stride[1]},
                            {padding[0], padding[1]}));
  return at::stack(ys);
}

at::Tensor batch_norm_clients(const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& beta, double eps,
                              const at::Tensor& mask, at::Tensor* mean_out, at::Tensor* var_out) {
  const int64_t k = x.size(0), b = x.size(1), c = x.size(2);
  const at::Tensor xv = x.reshape({k, b, c, -1});  // [K, B, C, S]
  const int64_t spatial = xv.size(3);
  at::Tensor mean, var, count;
  if (mask.defined()) {
    const at::Tensor m = mask.view({k, b, 1, 1}).to(x.scalar_type());
    count = m.sum({1, 2, 3}).mul_(static_cast<double>(spatial)).view({k, 1});  // real values per channel
    mean = (xv * m).sum({1, 3}) / count;
    const at::Tensor centred = xv - mean.view({k, 1, c, 1});
    var = (centred * centred * m).sum({1, 3}) / count;
  } else {
    count = at::full({k, 1}, static_cast<double>(b * spatial), x.options());
    mean = xv.mean({1, 3});
    const at::Tensor centred = xv - mean.view({k, 1, c, 1});
    var = (centred * centred).mean({1, 3});
  }
  at::Tensor y = (xv - mean.view({k, 1, c, 1})) * at::rsqrt(var + eps).view({k, 1, c, 1});
  if (gamma.defined()) y = y * gamma.view({k, 1, c, 1});
  if (beta.defined()) y = y + beta.view({k, 1, c, 1});
  if (mean_out) *mean_out = mean.detach();
  if (var_out) *var_out = (var.detach() * count / (count - 1));
  return y.view(x.sizes());
}

at::Tensor layer_norm_clients(const at::Tensor& x, const std::vector<int64_t>& shape, const at::Tensor& weight,
                              const at::Tensor& bias, double eps) {
  at::Tensor y = at::layer_norm(x, shape, {}, {}, eps);
  if (!weight.defined() && !bias.defined()) return y;
  // [K, ...shape] -> [K, 1, ..., 1, ...shape] against y [K, B, ..., ...shape].
  std::vector<int64_t> s{x.size(0)};
  for (int64_t i = 1; i < x.dim() - static_cast<int64_t>(shape.size()); ++i) s.push_back(1);
  s.insert(s.end(), shape.begin(), shape.end());
  if (weight.defined()) y = y * weight.view(s);
  if (bias.defined()) y = y + bias.view(s);
  return y;
}

at::Tensor embedding_clients(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t k = x.size(0), v = weight.size(1), d = weight.size(2);
  const at::Tensor offset = at::arange(k, x.options().dtype(at::kLong)).mul_(v);
  std::vector<int64_t> os{k};
  for (int64_t i = 1; i < x.dim(); ++i) os.push_back(1);
  const at::Tensor idx = x.to(at::kLong) + offset.view(os);
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.push_back(d);
  return weight.reshape({k * v, d}).index_select(0, idx.flatten()).view(s);
}

at::Tensor max_pool2d_clients(const at::Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                              std::array<int64_t, 2> padding, std::array<int64_t, 2> dilation, bool ceil_mode) {
  return unmerge(at::max_pool2d(merge(x), {kernel[0], kernel[1]}, {stride[0], stride[1]}, {padding[0], padding[1]},
                                {dilation[0], dilation[1]}, ceil_mode),
                 x.size(0));
}

at::Tensor avg_pool2d_clients(const at::Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                              std::array<int64_t, 2> padding, bool ceil_mode, bool count_include_pad) {
  return unmerge(at::avg_pool2d(merge(x), {kernel[0], kernel[1]}, {stride[0], stride[1]}, {padding[0], padding[1]},
                                ceil_mode, count_include_pad),
                 x.size(0));
}

at::Tensor adaptive_avg_pool2d_clients(const at::Tensor& x, std::array<int64_t, 2> out) {
  return unmerge(at::adaptive_avg_pool2d(merge(x), {out[0], out[1]}), x.size(0));
}

}  // namespace sparrow::batched
