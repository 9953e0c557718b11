// kernels/batched_conv.h against ATen's conv2d and autograd, client by
// client: forward (with and without the fused ReLU), the input, weight and
// bias gradients, the alpha/beta accumulation and the fused SGD step.
#include "tests/sparrow_test.h"

#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/batched_conv.h"
#include "tests/kernels/variants.h"

namespace {

namespace kn = sparrow::kernels;
using sparrow::kernels::testing::for_each_variant;

double rel(const at::Tensor& got, const at::Tensor& want) {
  const double d = want.norm().item<double>();
  return (got - want).norm().item<double>() / (d > 0 ? d : 1.0);
}

void check_against_aten(const kn::ConvShape& s, bool relu, bool with_bias) {
  const int64_t k = s.clients, b = s.batch;
  torch::manual_seed(s.in_channels * 100 + s.kernel_h * 10 + s.width);
  const at::Tensor x = torch::randn({k, b, s.in_channels, s.height, s.width});
  const at::Tensor w = 0.3 * torch::randn({k, s.out_channels, s.in_channels, s.kernel_h, s.kernel_w});
  const at::Tensor bias = 0.1 * torch::randn({k, s.out_channels});
  const int64_t ho = s.out_height(), wo = s.out_width();
  const at::Tensor dy = torch::randn({k, b, s.out_channels, ho, wo});
  std::vector<at::Tensor> want_y, want_dx, want_gw, want_gb;
  for (int64_t c = 0; c < k; ++c) {
    const at::Tensor xc = x[c].clone().requires_grad_(), wc = w[c].clone().requires_grad_();
    const at::Tensor bc = bias[c].clone().requires_grad_();
    at::Tensor y = at::conv2d(xc, wc, with_bias ? bc : at::Tensor(), {s.stride_h, s.stride_w}, {s.pad_h, s.pad_w});
    if (relu) y = torch::relu(y);
    (y * dy[c]).sum().backward();
    want_y.push_back(y.detach());
    want_dx.push_back(xc.grad());
    want_gw.push_back(wc.grad());
    want_gb.push_back(with_bias ? bc.grad() : torch::zeros({s.out_channels}));
  }
  const at::Tensor wy = torch::stack(want_y), wdx = torch::stack(want_dx), wgw = torch::stack(want_gw);
  const at::Tensor wgb = torch::stack(want_gb);

  at::Tensor y = torch::full(wy.sizes(), 7.0f);
  kn::batched_conv2d_forward(s, x.data_ptr<float>(), w.data_ptr<float>(), with_bias ? bias.data_ptr<float>() : nullptr,
                             relu, y.data_ptr<float>());
  CHECK(rel(y, wy) < 1e-5);

  // alpha, beta accumulate onto what gw and gb held; the input gradient overwrites.
  at::Tensor dx = torch::full(x.sizes(), 9.0f), gw = torch::full(w.sizes(), 0.5f), gb = torch::full(bias.sizes(), 0.5f);
  kn::batched_conv2d_backward(s, x.data_ptr<float>(), w.data_ptr<float>(), relu ? y.data_ptr<float>() : nullptr,
                              dy.data_ptr<float>(), dx.data_ptr<float>(), gw.data_ptr<float>(),
                              with_bias ? gb.data_ptr<float>() : nullptr, -0.5f, 0.25f);
  CHECK(rel(dx, wdx) < 1e-5);
  CHECK(rel(gw, 0.125 - 0.5 * wgw) < 1e-5);
  CHECK(rel(gb, with_bias ? 0.125 - 0.5 * wgb : torch::full(bias.sizes(), 0.5f)) < 1e-5);

  // beta = 0 overwrites (NaN included); no input gradient wanted.
  gw.fill_(NAN);
  gb.fill_(NAN);
  kn::batched_conv2d_backward(s, x.data_ptr<float>(), w.data_ptr<float>(), relu ? y.data_ptr<float>() : nullptr,
                              dy.data_ptr<float>(), nullptr, gw.data_ptr<float>(),
                              with_bias ? gb.data_ptr<float>() : nullptr, 1.0f, 0.0f);
  CHECK(rel(gw, wgw) < 1e-5);
  if (with_bias) CHECK(rel(gb, wgb) < 1e-5);

  // The SGD step fused in: gw is the weight itself.
  at::Tensor wstep = w.clone();
  kn::batched_conv2d_backward(s, x.data_ptr<float>(), wstep.data_ptr<float>(), relu ? y.data_ptr<float>() : nullptr,
                              dy.data_ptr<float>(), dx.data_ptr<float>(), wstep.data_ptr<float>(), nullptr, -0.1f,
                              1.0f);
  CHECK(rel(wstep, w - 0.1 * wgw) < 1e-5);
  CHECK(rel(dx, wdx) < 1e-5);  // computed from the weight before the step
}

kn::ConvShape shape(int64_t k, int64_t b, int64_t c, int64_t h, int64_t w, int64_t o, int64_t kh, int64_t kw,
                    int64_t stride, int64_t pad) {
  kn::ConvShape s;
  s.clients = k;
  s.batch = b;
  s.in_channels = c;
  s.height = h;
  s.width = w;
  s.out_channels = o;
  s.kernel_h = kh;
  s.kernel_w = kw;
  s.stride_h = s.stride_w = stride;
  s.pad_h = s.pad_w = pad;
  return s;
}

}  // namespace

TEST_CASE("batched conv2d equals ATen's conv2d and autograd per client, every variant") {
  const kn::ConvShape shapes[] = {
      shape(3, 2, 3, 7, 5, 4, 3, 3, 1, 1),     // 3x3, odd non-square image
      shape(2, 3, 2, 9, 8, 5, 3, 3, 2, 1),     // stride 2
      shape(2, 2, 6, 5, 5, 3, 1, 1, 1, 0),     // 1x1: the image is its own im2col
      shape(2, 1, 3, 5, 6, 4, 1, 1, 2, 1),     // 1x1 with stride and padding
      shape(2, 2, 3, 10, 10, 4, 5, 5, 1, 2),   // 5x5
      shape(2, 2, 3, 12, 11, 2, 7, 7, 2, 3),   // 7x7, stride 2
      shape(1, 1, 2, 1, 1, 3, 3, 3, 2, 1),     // a 1x1 image under a 3x3 kernel, stride 2
      shape(2, 2, 16, 14, 14, 32, 3, 3, 1, 1)  // a 3x3 CNN's second stage
  };
  for_each_variant([&](kn::Isa) {
    for (const kn::ConvShape& s : shapes)
      for (const bool relu : {false, true})
        for (const bool with_bias : {true, false}) {
          INFO("K " << s.clients << " B " << s.batch << " " << s.in_channels << "x" << s.height << "x" << s.width
                    << " -> " << s.out_channels << ", kernel " << s.kernel_h << "x" << s.kernel_w << " stride "
                    << s.stride_h << " pad " << s.pad_h << ", relu " << relu << ", bias " << with_bias);
          check_against_aten(s, relu, with_bias);
        }
  });
  kn::ConvShape rect = shape(1, 2, 2, 6, 7, 3, 3, 5, 1, 0);  // a 3x5 kernel, different strides and paddings
  rect.stride_w = 2;
  rect.pad_w = 2;
  check_against_aten(rect, true, true);
}

TEST_CASE("batched conv2d refuses shapes without an output") {
  std::vector<float> buf(64);
  CHECK_THROWS_WITH(kn::batched_conv2d_forward(shape(1, 1, 1, 2, 2, 1, 3, 3, 1, 0), buf.data(), buf.data(), nullptr,
                                               false, buf.data()),
                    doctest::Contains("at least the kernel"));
  CHECK_THROWS_AS(kn::batched_conv2d_forward(shape(0, 1, 1, 4, 4, 1, 3, 3, 1, 0), buf.data(), buf.data(), nullptr,
                                             false, buf.data()),
                  sparrow::Error);
}
