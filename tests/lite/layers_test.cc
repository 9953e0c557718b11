// Every lite layer against LibTorch: forward, input gradient and parameter
// gradients on random inputs, within 1e-5 relative (largest difference over
// the largest reference value).
#include "tests/sparrow_test.h"
// sparrow_test.h first: it drops glog's CHECK macros before doctest's.
#include "lite/layer_specs.h"
#include "lite/layers.h"
#include "tests/lite/lite_test_util.h"

namespace {

using namespace sparrow::lite;
using sparrow::lite::testing::from_torch;
using sparrow::lite::testing::rel_diff;
using sparrow::lite::testing::to_torch;
using sparrow::lite::testing::to_vec;

constexpr double kTol = 1e-5;

// The reference: LibTorch's op on x and the parameters, with autograd.
using TorchOp = std::function<at::Tensor(const at::Tensor& x, const std::vector<at::Tensor>& params)>;

// Runs `spec` in lite and `op` in LibTorch on the same random x, parameters
// and upstream gradient; checks y, dx and every parameter gradient.
void check_layer(const LayerSpec& spec, const Shape& x_shape, const TorchOp& op, uint64_t seed,
                 bool input_grad = true) {
  torch::manual_seed(seed);
  auto layer = make_layer(spec);
  std::vector<at::Tensor> tp;
  for (Param& p : layer->params()) {
    at::Tensor v = at::randn(p.shape);
    p.value = to_vec(v);
    tp.push_back(v.clone().requires_grad_(true));
  }
  at::Tensor xt = at::randn(x_shape);
  Tensor x = from_torch(xt);
  Tensor y;
  ForwardContext ctx;
  ctx.train = true;
  layer->forward(x, y, ctx);
  Shape per_sample(x_shape.begin() + 1, x_shape.end());
  Shape expect{x_shape[0]};
  for (int64_t d : layer->out_shape(per_sample)) expect.push_back(d);
  CHECK(y.shape == expect);

  at::Tensor xr = xt.clone().requires_grad_(input_grad);
  at::Tensor yr = op(xr, tp);
  REQUIRE(yr.sizes().vec() == y.shape);
  at::Tensor dyt = at::randn(yr.sizes());
  (yr * dyt).sum().backward();
  Tensor dy = from_torch(dyt);
  Tensor dx;
  layer->backward(x, y, dy, input_grad ? &dx : nullptr);

  INFO("layer " << kind_name(spec.kind) << ", input " << shape_str(x_shape));
  CHECK(rel_diff(y.data, to_vec(yr)) <= kTol);
  if (input_grad) CHECK(rel_diff(dx.data, to_vec(xr.grad())) <= kTol);
  for (size_t i = 0; i < tp.size(); ++i) {
    INFO("parameter " << layer->params()[i].name);
    CHECK(rel_diff(layer->params()[i].grad, to_vec(tp[i].grad())) <= kTol);
  }
}

LayerSpec linear(int64_t in, int64_t out, bool bias) { return spec::linear("fc", in, out, bias); }

LayerSpec conv(int64_t c, int64_t o, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
               bool bias) {
  return spec::conv2d("conv", c, o, kh, kw, sh, sw, ph, pw, bias);
}

using spec::plain;
using spec::pool;

}  // namespace

TEST_CASE("lite linear matches LibTorch") {
  struct Case {
    int64_t in, out;
    bool bias;
    Shape x;
  };
  for (const Case& c : {Case{7, 3, true, {5, 7}}, Case{784, 200, true, {32, 784}}, Case{6, 4, false, {3, 6}},
                        Case{6, 5, true, {2, 4, 6}}}) {
    check_layer(
        linear(c.in, c.out, c.bias), c.x,
        [&](const at::Tensor& x, const std::vector<at::Tensor>& p) {
          return at::linear(x, p[0], c.bias ? p[1] : at::Tensor());
        },
        c.in * 31 + c.out);
  }
}

TEST_CASE("lite conv2d matches LibTorch over kernel, stride and padding combinations") {
  struct Case {
    int64_t c, o, kh, kw, sh, sw, ph, pw;
    bool bias;
    Shape x;
  };
  const std::vector<Case> cases = {
      {3, 4, 3, 3, 1, 1, 1, 1, true, {2, 3, 8, 8}},  {1, 32, 5, 5, 1, 1, 2, 2, true, {4, 1, 28, 28}},
      {2, 3, 5, 5, 2, 2, 2, 2, true, {2, 2, 11, 9}}, {3, 2, 3, 2, 2, 1, 0, 1, true, {2, 3, 7, 6}},
      {4, 5, 1, 1, 1, 1, 0, 0, true, {3, 4, 5, 5}},  {2, 3, 3, 3, 3, 3, 0, 0, false, {2, 2, 10, 10}},
      {3, 2, 4, 4, 1, 2, 3, 1, true, {1, 3, 6, 7}}};
  uint64_t seed = 1;
  for (const Case& c : cases) {
    check_layer(
        conv(c.c, c.o, c.kh, c.kw, c.sh, c.sw, c.ph, c.pw, c.bias), c.x,
        [&](const at::Tensor& x, const std::vector<at::Tensor>& p) {
          return at::conv2d(x, p[0], c.bias ? p[1] : at::Tensor(), {c.sh, c.sw}, {c.ph, c.pw});
        },
        seed++);
  }
  SUBCASE("a kernel larger than the padded input is refused at build") {
    auto l = make_layer(conv(1, 1, 5, 5, 1, 1, 0, 0, true));
    CHECK_THROWS_AS(l->out_shape({1, 3, 3}), sparrow::Error);
    CHECK_THROWS_AS(l->out_shape({2, 8, 8}), sparrow::Error);  // wrong channel count
  }
}

TEST_CASE("lite activations, flatten and pools match LibTorch") {
  check_layer(
      plain(LayerKind::kRelu), {4, 3, 5},
      [](const at::Tensor& x, const std::vector<at::Tensor>&) { return at::relu(x); }, 11);
  LayerSpec gelu = plain(LayerKind::kGelu);
  check_layer(
      gelu, {4, 17}, [](const at::Tensor& x, const std::vector<at::Tensor>&) { return at::gelu(x); }, 12);
  gelu.flag = 1;
  check_layer(
      gelu, {4, 17}, [](const at::Tensor& x, const std::vector<at::Tensor>&) { return at::gelu(x, "tanh"); }, 13);
  check_layer(
      plain(LayerKind::kFlatten), {3, 2, 4, 5},
      [](const at::Tensor& x, const std::vector<at::Tensor>&) { return x.flatten(1); }, 14);
  struct Pool {
    int64_t k, s, p;
    Shape x;
  };
  for (const Pool& c : {Pool{2, 2, 0, {2, 3, 8, 8}}, Pool{3, 2, 1, {2, 2, 9, 7}}, Pool{2, 1, 0, {1, 2, 5, 6}},
                        Pool{3, 3, 0, {2, 1, 10, 11}}}) {
    check_layer(
        pool(LayerKind::kMaxPool2d, c.k, c.s, c.p), c.x,
        [&](const at::Tensor& x, const std::vector<at::Tensor>&) {
          return at::max_pool2d(x, {c.k, c.k}, {c.s, c.s}, {c.p, c.p});
        },
        20 + static_cast<uint64_t>(c.k * 7 + c.s));
    check_layer(
        pool(LayerKind::kAvgPool2d, c.k, c.s, c.p), c.x,
        [&](const at::Tensor& x, const std::vector<at::Tensor>&) {
          return at::avg_pool2d(x, {c.k, c.k}, {c.s, c.s}, {c.p, c.p});
        },
        40 + static_cast<uint64_t>(c.k * 7 + c.s));
  }
}

TEST_CASE("lite layer norm matches LibTorch") {
  LayerSpec ln = plain(LayerKind::kLayerNorm);
  ln.in = 16;
  ln.param_names = {"ln.weight", "ln.bias"};
  ln.param_shapes = {{16}, {16}};
  check_layer(
      ln, {5, 16},
      [](const at::Tensor& x, const std::vector<at::Tensor>& p) { return at::layer_norm(x, {16}, p[0], p[1], 1e-5); },
      51);
  check_layer(
      ln, {3, 4, 16},
      [](const at::Tensor& x, const std::vector<at::Tensor>& p) { return at::layer_norm(x, {16}, p[0], p[1], 1e-5); },
      52);
  // Over the last two dimensions, without affine parameters.
  LayerSpec bare = plain(LayerKind::kLayerNorm);
  bare.in = 12;
  bare.bias = 0;
  bare.eps = 1e-3f;
  check_layer(
      bare, {4, 3, 4},
      [](const at::Tensor& x, const std::vector<at::Tensor>&) {
        return at::layer_norm(x, {3, 4}, {}, {}, 1e-3);
      },
      53);
}

TEST_CASE("lite embedding matches LibTorch and refuses a bad index") {
  LayerSpec e = plain(LayerKind::kEmbedding);
  e.in = 10;
  e.out = 6;
  e.param_names = {"emb.weight"};
  e.param_shapes = {{10, 6}};
  auto layer = make_layer(e);
  torch::manual_seed(3);
  at::Tensor w = at::randn({10, 6}).requires_grad_(true);
  layer->params()[0].value = to_vec(w);
  at::Tensor idx = at::randint(0, 10, {4, 5}, at::kLong);
  idx[0][0] = 3;
  idx[1][0] = 3;  // a repeated index accumulates its gradient
  Tensor x = from_torch(idx.to(at::kFloat));
  Tensor y, dx;
  layer->forward(x, y, ForwardContext{});
  at::Tensor yr = at::embedding(w, idx);
  at::Tensor dyt = at::randn(yr.sizes());
  (yr * dyt).sum().backward();
  layer->backward(x, y, from_torch(dyt), &dx);
  CHECK(y.shape == Shape{4, 5, 6});
  CHECK(rel_diff(y.data, to_vec(yr)) <= kTol);
  CHECK(rel_diff(layer->params()[0].grad, to_vec(w.grad())) <= kTol);
  x.data[2] = 10.0f;
  CHECK_THROWS_AS(layer->forward(x, y, ForwardContext{}), sparrow::Error);
  x.data[2] = 1.5f;
  CHECK_THROWS_AS(layer->forward(x, y, ForwardContext{}), sparrow::Error);
}

TEST_CASE("lite dropout scales kept elements, is seeded, and is the identity in evaluation") {
  LayerSpec d = plain(LayerKind::kDropout);
  d.p = 0.25f;
  auto layer = make_layer(d);
  torch::manual_seed(4);
  Tensor x = from_torch(at::randn({8, 1000}).abs() + 0.1);
  Tensor y, y2, dx;
  ForwardContext ctx;
  ctx.train = true;
  ctx.dropout_key = 99;
  layer->forward(x, y, ctx);
  // The reference: LibTorch's inverted dropout with this mask.
  std::vector<float> mask(x.data.size());
  int64_t dropped = 0;
  for (size_t i = 0; i < mask.size(); ++i) {
    mask[i] = y.data[i] == 0.0f ? 0.0f : 1.0f;
    dropped += y.data[i] == 0.0f;
  }
  const double frac = static_cast<double>(dropped) / static_cast<double>(mask.size());
  CHECK(frac > 0.22);
  CHECK(frac < 0.28);
  at::Tensor xr = sparrow::lite::testing::to_torch(x).requires_grad_(true);
  at::Tensor yr = xr * to_torch({8, 1000}, mask) / (1.0 - 0.25);
  CHECK(rel_diff(y.data, to_vec(yr)) <= kTol);
  at::Tensor dyt = at::randn(yr.sizes());
  (yr * dyt).sum().backward();
  layer->backward(x, y, from_torch(dyt), &dx);
  CHECK(rel_diff(dx.data, to_vec(xr.grad())) <= kTol);
  layer->forward(x, y2, ctx);  // same key, same mask
  CHECK(y2.data == y.data);
  ctx.dropout_key = 100;
  layer->forward(x, y2, ctx);
  CHECK(y2.data != y.data);
  layer->forward(x, y2, ForwardContext{});
  CHECK(y2.data == x.data);
}

TEST_CASE("lite softmax cross-entropy matches LibTorch") {
  torch::manual_seed(5);
  at::Tensor z = (at::randn({9, 10}) * 4).requires_grad_(true);
  at::Tensor yl = at::randint(0, 10, {9}, at::kLong);
  at::Tensor loss = at::cross_entropy_loss(z, yl);
  loss.backward();
  std::vector<int64_t> labels(yl.data_ptr<int64_t>(), yl.data_ptr<int64_t>() + 9);
  Tensor dz;
  const float l = softmax_cross_entropy(from_torch(z), labels.data(), &dz);
  CHECK(std::fabs(l - loss.item<float>()) <= kTol * std::fabs(loss.item<float>()));
  CHECK(rel_diff(dz.data, to_vec(z.grad())) <= kTol);
  labels[3] = 10;
  CHECK_THROWS_AS(softmax_cross_entropy(from_torch(z), labels.data(), &dz), sparrow::Error);
}

TEST_CASE("lite layers refuse parameters that do not fit them") {
  LayerSpec l = linear(4, 3, true);
  l.param_shapes[0] = {4, 3};
  CHECK_THROWS_AS(make_layer(l), sparrow::Error);
  l = linear(4, 3, true);
  l.param_names.pop_back();
  CHECK_THROWS_AS(make_layer(l), sparrow::Error);
  LayerSpec d = plain(LayerKind::kDropout);
  d.p = 1.0f;
  CHECK_THROWS_AS(make_layer(d), sparrow::Error);
  LayerSpec bad = plain(static_cast<LayerKind>(77));
  CHECK_THROWS_WITH_AS(make_layer(bad), doctest::Contains("layer kind 77"), sparrow::Error);
}
