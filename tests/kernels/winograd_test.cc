#include "tests/sparrow_test.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/models.h"
#include "kernels/conv5x5.h"
#include "kernels/pool.h"
#include "kernels/winograd.h"
#include "tests/kernels/variants.h"

using sparrow::kernels::WinogradConv5Pool;
using sparrow::kernels::testing::for_each_variant;
namespace kn = sparrow::kernels;

namespace {

double rel(const at::Tensor& got, const at::Tensor& want) {
  return (got - want).norm().item<double>() / want.norm().item<double>();
}

// maxpool(relu(conv5x5(x) + bias)) by ATen and autograd, and by
// WinogradConv5Pool, `group` images at a time: forward, winners, weight,
// bias and input gradients.
void check_against_aten(int64_t n, int64_t cin, int64_t cout, int64_t h, int64_t w, int64_t group) {
  CAPTURE(cin);
  CAPTURE(cout);
  CAPTURE(h);
  CAPTURE(w);
  CAPTURE(group);
  torch::manual_seed(cin * 10 + w);
  const at::Tensor x = torch::randn({n, cin, h, w}).requires_grad_();
  const at::Tensor weight = (0.1 * torch::randn({cout, cin, 5, 5})).requires_grad_();
  const at::Tensor bias = (0.1 * torch::randn({cout})).requires_grad_();
  const at::Tensor ref = torch::max_pool2d(torch::relu(at::conv2d(x, weight, bias, 1, 2)), 2);
  const at::Tensor dout = torch::randn(ref.sizes());
  (ref * dout).sum().backward();
  WinogradConv5Pool conv(cin, cout, h, w, group);
  REQUIRE(conv.pooled_size() == cout * (h / 2) * (w / 2));
  conv.set_weights(weight.detach().contiguous().data_ptr<float>(), bias.detach().contiguous().data_ptr<float>());
  conv.zero_grad();
  const at::Tensor xd = x.detach().contiguous();
  const int64_t pooled = conv.pooled_size(), in_size = cin * h * w;
  at::Tensor out = torch::full(ref.sizes(), 9.0f), out2 = torch::full(ref.sizes(), 9.0f);
  at::Tensor dx = torch::full(x.sizes(), 9.0f);
  std::vector<int32_t> arg(static_cast<size_t>(n * pooled));
  for (int64_t g0 = 0; g0 < n; g0 += group) {
    const int64_t k = std::min(group, n - g0);
    const float* xg = xd.data_ptr<float>() + g0 * in_size;
    conv.forward(k, xg, out.data_ptr<float>() + g0 * pooled, arg.data() + g0 * pooled);
    conv.forward(k, xg, out2.data_ptr<float>() + g0 * pooled);  // inference: no winners kept
    conv.backward(k, xg, arg.data() + g0 * pooled, dout.data_ptr<float>() + g0 * pooled,
                  dx.data_ptr<float>() + g0 * in_size);
  }
  at::Tensor gw = torch::full(weight.sizes(), 7.0f), gb = torch::full(bias.sizes(), 7.0f);
  conv.weight_grad(gw.data_ptr<float>(), gb.data_ptr<float>(), 1.0f, 0.0f);  // 7s overwritten
  const at::Tensor want = ref.detach();
  CHECK(rel(out, want) < 2e-6);
  CHECK((out - want).abs().max().item<double>() < 1e-4 * want.abs().max().item<double>());
  CHECK(torch::equal(out, out2));
  CHECK(rel(dx, x.grad()) < 1e-5);
  CHECK(rel(gw, weight.grad()) < 1e-4);
  CHECK(rel(gb, bias.grad()) < 1e-5);
  at::Tensor acc = torch::ones(weight.sizes()), accb = torch::ones(bias.sizes());
  conv.weight_grad(acc.data_ptr<float>(), accb.data_ptr<float>(), -0.5f, 0.25f);
  CHECK(rel(acc, 0.25 - 0.5 * weight.grad()) < 1e-4);
  CHECK(rel(accb, 0.25 - 0.5 * bias.grad()) < 1e-5);
  conv.zero_grad();
  conv.weight_grad(gw.data_ptr<float>(), gb.data_ptr<float>(), 1.0f, 0.0f);
  CHECK(gw.abs().max().item<float>() == 0.0f);
  CHECK(gb.abs().max().item<float>() == 0.0f);
}

}  // namespace

TEST_CASE("winograd F(4x4, 5x5) conv5x5 + relu + maxpool equals ATen and autograd") {
  // Every variant: the reference runs its GEMMs on the portable Eigen build.
  for_each_variant([](kn::Isa) {
    check_against_aten(11, 32, 64, 14, 14, 4);  // the CNN's conv2, a last group of 3
    check_against_aten(3, 3, 5, 8, 6, 2);       // odd channel counts, non-square
    check_against_aten(2, 1, 17, 2, 2, 1);      // one tile, mostly padding
    check_against_aten(2, 4, 3, 10, 18, 5);     // one group larger than the batch
  });
  CHECK_THROWS_WITH(WinogradConv5Pool(1, 1, 4, 3, 1), doctest::Contains("even"));
  WinogradConv5Pool conv(1, 1, 4, 4, 2);
  std::vector<float> in(48), out(12);
  CHECK_THROWS_WITH(conv.forward(3, in.data(), out.data()), doctest::Contains("3 images for groups of 2"));
}

TEST_CASE("winograd: a window the ReLU zeroes passes no gradient, ties go to the first") {
  WinogradConv5Pool conv(1, 1, 2, 2, 1);
  std::vector<float> w(25, 0.0f), b{0.0f}, x(4);
  w[12] = 1.0f;  // the centre tap: conv(x) = x
  conv.set_weights(w.data(), b.data());
  float out = 0, dx[4];
  int32_t arg = -1;
  x = {-1, -2, -3, -4};
  conv.forward(1, x.data(), &out, &arg);
  CHECK(out == 0.0f);
  const float d = 1.0f;
  conv.zero_grad();
  conv.backward(1, x.data(), &arg, &d, dx);
  for (float v : dx) CHECK(v == doctest::Approx(0.0).epsilon(1e-6));
  x = {1, 3, 3, 2};
  conv.forward(1, x.data(), &out, &arg);
  CHECK(out == doctest::Approx(3.0f));
  conv.backward(1, x.data(), &arg, &d, dx);
  CHECK(dx[1] == doctest::Approx(1.0));
  CHECK(dx[2] == doctest::Approx(0.0).epsilon(1e-6));
  CHECK_THROWS_WITH(WinogradConv5Pool(1, 1, 3, 4, 1), doctest::Contains("even"));
}

TEST_CASE("cnn inference on the CPU (Winograd) equals the training-mode forward") {
  auto m = sparrow::core::make_model("cnn", 3);
  torch::manual_seed(4);
  const at::Tensor x = torch::rand({37, 1, 28, 28});
  const at::Tensor with_grad = m->forward(x).detach();
  at::Tensor no_grad;
  {
    torch::NoGradGuard guard;
    no_grad = m->forward(x);
  }
  CHECK(rel(no_grad, with_grad) < 1e-5);
  CHECK(torch::equal(no_grad.argmax(1), with_grad.argmax(1)));
}

TEST_CASE("relu + 2x2 max pooling equals ATen and autograd") {
  // 6x8: windows narrower than a vector; 30x36: a row of 18 windows, more than
  // one step of 16; 28x28: the CNN's. Every variant (the intrinsics, the
  // portable loop).
  for (const auto& hw : {std::pair<int64_t, int64_t>{6, 8}, {30, 36}, {28, 28}})
    for_each_variant([&](kn::Isa) {
      CAPTURE(hw.second);
      torch::manual_seed(12);
      const int64_t h = hw.first, w = hw.second;
      at::Tensor x = torch::randn({3, 4, h, w});
      x.view(-1).slice(0, 0, 40).fill_(0.5f);  // ties: the first of equal ones wins, as in ATen
      // One NaN in each of a few windows, at each of the four places (a
      // negative neighbour too): it wins and passes the ReLU, as in ATen.
      for (const auto& yx : {std::pair<int64_t, int64_t>{0, 0}, {0, 3}, {3, 0}, {3, 3}})
        x[1][2][yx.first][yx.second] = NAN;
      x[2][1][h - 1][w - 1] = NAN;
      x[2][1][h - 1][w - 2] = -1.0f;
      x.requires_grad_();
      const at::Tensor ref = torch::max_pool2d(torch::relu(x), 2);
      const at::Tensor dout = torch::randn(ref.sizes());
      (ref * dout).sum().backward();
      const at::Tensor xd = x.detach().contiguous();
      at::Tensor out = torch::empty(ref.sizes()), din = torch::full(x.sizes(), 5.0f);
      std::vector<int32_t> arg(static_cast<size_t>(ref.numel()));
      kn::relu_maxpool2(xd.data_ptr<float>(), 12, h, w, out.data_ptr<float>(), arg.data());
      CHECK(torch::allclose(out, ref.detach(), 0, 0, /*equal_nan=*/true));
      CHECK(out.isnan().sum().item<int64_t>() == 5);
      kn::relu_maxpool2_backward(arg.data(), dout.data_ptr<float>(), 12, h, w, din.data_ptr<float>());
      CHECK(torch::equal(din, x.grad()));
      at::Tensor out2 = torch::empty(ref.sizes());
      kn::relu_maxpool2(xd.data_ptr<float>(), 12, h, w, out2.data_ptr<float>(), nullptr);
      CHECK(torch::allclose(out2, out, 0, 0, /*equal_nan=*/true));
    });
  at::Tensor out2 = torch::empty({1});
  const at::Tensor xd = torch::zeros({6});
  CHECK_THROWS_WITH(kn::relu_maxpool2(xd.data_ptr<float>(), 1, 3, 2, out2.data_ptr<float>(), nullptr),
                    doctest::Contains("even"));
}

TEST_CASE("conv5x5 of one channel: weight and bias gradients equal autograd's, accumulated") {
  torch::manual_seed(22);
  for (const auto& hw : {std::pair<int64_t, int64_t>{28, 28}, {3, 7}, {1, 1}}) {
    CAPTURE(hw.second);
    const at::Tensor x = torch::randn({1, 1, hw.first, hw.second});
    const at::Tensor w = torch::randn({5, 1, 5, 5}).requires_grad_(), b = torch::randn({5}).requires_grad_();
    const at::Tensor dy = torch::randn({1, 5, hw.first, hw.second});
    (at::conv2d(x, w, b, 1, 2) * dy).sum().backward();
    at::Tensor gw = torch::full({5, 25}, 0.5f), gb = torch::full({5}, 0.5f);  // accumulated onto
    std::vector<float> col(static_cast<size_t>(25 * hw.first * hw.second)), colt(col.size());
    kn::conv5x5_one_channel_weight_grad(x.data_ptr<float>(), hw.first, hw.second, dy.data_ptr<float>(), 5,
                                        gw.data_ptr<float>(), gb.data_ptr<float>(), col.data(), colt.data());
    CHECK(rel(gw - 0.5, w.grad().view({5, 25})) < 1e-5);
    CHECK(rel(gb - 0.5, b.grad()) < 1e-5);
  }
}

TEST_CASE("conv5x5 of one channel equals ATen") {
  torch::manual_seed(21);
  for (const auto& hw : {std::pair<int64_t, int64_t>{28, 28}, {3, 7}, {1, 1}}) {
    const at::Tensor x = torch::randn({1, 1, hw.first, hw.second});
    const at::Tensor w = torch::randn({5, 1, 5, 5}), b = torch::randn({5});
    const at::Tensor ref = at::conv2d(x, w, b, 1, 2);
    at::Tensor out = torch::full(ref.sizes(), 3.0f);
    std::vector<float> col(static_cast<size_t>(25 * hw.first * hw.second), 9.0f);
    kn::conv5x5_one_channel(x.data_ptr<float>(), hw.first, hw.second, w.data_ptr<float>(), b.data_ptr<float>(), 5,
                            out.data_ptr<float>(), col.data());
    CHECK(rel(out, ref) < 1e-6);
  }
}

TEST_CASE("conv5x5 of one channel + ReLU + pooling, fused, equals ATen and autograd") {
  // 28x28 with 32 channels: the CNN's conv1, on the fused AVX-512 kernel; 6x8:
  // rows narrower than a vector; 8x36 (wider than 32), 62x4 (taller than 60)
  // and 5 channels (not a multiple of 4): the two kernels. Every variant; a NaN
  // pixel makes its 5x5 neighbourhood NaN in every channel, which must pass.
  for (const auto& hw : {std::pair<int64_t, int64_t>{28, 28}, {6, 8}, {8, 36}, {62, 4}})
    for (const int64_t cout : {32, 5})
      for_each_variant([&](kn::Isa) {
        for (const bool nan : {false, true}) {
          CAPTURE(hw.first);
          CAPTURE(hw.second);
          CAPTURE(cout);
          CAPTURE(nan);
          torch::manual_seed(31);
          const int64_t h = hw.first, w = hw.second;
          at::Tensor x = torch::randn({1, 1, h, w});
          if (nan) x[0][0][h / 2][w - 1] = NAN;
          const at::Tensor wt = 0.3 * torch::randn({cout, 1, 5, 5}), b = 0.1 * torch::randn({cout});
          const at::Tensor y = at::conv2d(x, wt, b, 1, 2).requires_grad_();
          const at::Tensor ref = torch::max_pool2d(torch::relu(y), 2);
          const at::Tensor dout = torch::randn(ref.sizes());
          (ref * dout).sum().backward();
          at::Tensor out = torch::full(ref.sizes(), 7.0f), din = torch::full(y.sizes(), 5.0f);
          std::vector<int32_t> arg(static_cast<size_t>(ref.numel()), -1);
          std::vector<float> scratch(static_cast<size_t>((25 + cout) * h * w), 9.0f);
          kn::conv5x5_one_channel_relu_pool(x.data_ptr<float>(), h, w, wt.data_ptr<float>(), b.data_ptr<float>(), cout,
                                            out.data_ptr<float>(), arg.data(), scratch.data());
          const at::Tensor finite = ref.isfinite();
          CHECK(torch::equal(out.isnan(), ref.isnan()));
          CHECK(out.isnan().any().item<bool>() == nan);
          CHECK(rel(out.masked_select(finite), ref.detach().masked_select(finite)) < 1e-6);
          // The winners give autograd's gradient (no ties in random data).
          kn::relu_maxpool2_backward(arg.data(), dout.data_ptr<float>(), cout, h, w, din.data_ptr<float>());
          CHECK(torch::equal(din, y.grad()));
          at::Tensor out2 = torch::empty(ref.sizes());  // without winners: the same outputs
          kn::conv5x5_one_channel_relu_pool(x.data_ptr<float>(), h, w, wt.data_ptr<float>(), b.data_ptr<float>(), cout,
                                            out2.data_ptr<float>(), nullptr, scratch.data());
          CHECK(torch::allclose(out2, out, 0, 0, /*equal_nan=*/true));
        }
      });
  std::vector<float> scratch(57 * 9), out(32);
  const std::vector<float> x(9), wt(32 * 25), b(32);
  CHECK_THROWS_WITH(
      kn::conv5x5_one_channel_relu_pool(x.data(), 3, 3, wt.data(), b.data(), 32, out.data(), nullptr, scratch.data()),
      doctest::Contains("even"));
}
