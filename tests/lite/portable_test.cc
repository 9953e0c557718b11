// The lite runtime's LibTorch-free tests: what can run where LibTorch is not,
// on an arm64 build under qemu-user included (docs/lite.md, "arm64").
// Gradients against central finite differences of the loss, a model file
// round trip, numbers the runtime promises to be the same on every platform,
// and training that learns. tests/lite/*_test.cc hold the comparisons with
// LibTorch, which need it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "lite/layer_specs.h"
#include "lite/model_file.h"
#include "lite/trainer.h"

namespace {

using namespace sparrow::lite;

using spec::embedding;
using spec::gelu;
using spec::layer_norm;
using spec::linear;
using spec::plain;
using spec::pool;

LayerSpec conv(const std::string& name, int64_t in, int64_t out, int64_t kh, int64_t kw, int64_t stride, int64_t pad) {
  return spec::conv2d(name, in, out, kh, kw, stride, stride, pad, pad);
}

// Deterministic values in [-scale, scale) from the project's counter-based
// RNG: the same inputs on every platform.
std::vector<float> uniform(size_t n, uint64_t key, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = (static_cast<float>(sparrow::rng::uniform01(key, i)) * 2 - 1) * scale;
  return v;
}

float loss_of(Model& m, const std::vector<float>& x, const std::vector<int64_t>& y, Tensor* dlogits) {
  Tensor& in = m.input(static_cast<int64_t>(y.size()));
  std::copy(x.begin(), x.end(), in.data.begin());
  const Tensor& logits = m.forward(ForwardContext{});
  return softmax_cross_entropy(logits, y.data(), dlogits);
}

// Every parameter's analytic gradient against the central difference of the
// loss (in float32, so bounded relative to the largest gradient). `x` is the
// batch's input, or null for random inputs in [-1, 1).
void check_gradients(const ModelSpec& spec, int64_t batch, const std::vector<float>* x_given = nullptr) {
  Model m(spec);
  m.set_values(uniform(static_cast<size_t>(m.num_values()), 11, 0.5f));
  const std::vector<float> x = x_given ? *x_given : uniform(static_cast<size_t>(batch * m.input_size()), 12, 1.0f);
  std::vector<int64_t> y(static_cast<size_t>(batch));
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int64_t>(i % static_cast<size_t>(m.classes()));

  Tensor dlogits;
  loss_of(m, x, y, &dlogits);
  m.backward(dlogits);
  std::vector<float> analytic;
  for (Param* p : m.params()) analytic.insert(analytic.end(), p->grad.begin(), p->grad.end());

  const std::vector<float> base = m.get_values();
  // The central difference of the loss at step h (float32 loss, double quotient).
  auto central = [&](size_t i, float h) {
    std::vector<float> w = base;
    w[i] = base[i] + h;
    m.set_values(w);
    const double up = loss_of(m, x, y, nullptr);
    w[i] = base[i] - h;
    m.set_values(w);
    const double down = loss_of(m, x, y, nullptr);
    return (up - down) / (2.0 * static_cast<double>(h));
  };
  double max_grad = 0;
  for (float g : analytic) max_grad = std::max(max_grad, std::fabs(static_cast<double>(g)));
  const double tol = 1e-2 * max_grad + 2e-4;
  const float eps = 2e-3f;
  double max_err = 0;
  size_t worst = 0, checked = 0, kinks = 0;
  // Every element of small models; a stride through large ones.
  const size_t step = std::max<size_t>(1, base.size() / 400);
  for (size_t i = 0; i < base.size(); i += step) {
    const double fd = central(i, eps);
    // A ReLU or max-pool switch inside [w - eps, w + eps] makes the loss
    // non-differentiable there: the two steps disagree. Skip such values.
    if (std::fabs(fd - central(i, eps / 2)) > tol / 2) {
      ++kinks;
      continue;
    }
    ++checked;
    const double err = std::fabs(fd - analytic[i]);
    if (err > max_err) {
      max_err = err;
      worst = i;
    }
  }
  INFO("largest |finite difference - gradient| " << max_err << " at value " << worst << " (analytic " << analytic[worst]
                                                 << "), largest gradient " << max_grad << "; " << checked
                                                 << " values checked, " << kinks << " at a kink");
  CHECK(max_grad > 1e-3);        // the check sees gradients, not zeros
  CHECK(kinks * 20 <= checked);  // and most values
  CHECK(max_err <= tol);
}

}  // namespace

TEST_CASE("lite gradients equal finite differences: linear, relu, gelu, layer norm") {
  ModelSpec s;
  s.input_shape = {2, 6};
  s.layers = {
      linear("fc1", 6, 8),        gelu(false),          layer_norm("ln", 8),     linear("fc2", 8, 8), gelu(true),
      plain(LayerKind::kFlatten), linear("fc3", 16, 8), plain(LayerKind::kRelu), linear("fc4", 8, 4)};
  check_gradients(s, 5);
}

TEST_CASE("lite gradients equal finite differences: conv2d, max and average pools") {
  ModelSpec s;
  s.input_shape = {2, 9, 8};
  s.layers = {conv("c1", 2, 4, 3, 2, 1, 1),
              plain(LayerKind::kRelu),
              pool(LayerKind::kMaxPool2d, 2, 2, 0),
              conv("c2", 4, 3, 3, 3, 2, 1),
              pool(LayerKind::kAvgPool2d, 2, 1, 1),
              plain(LayerKind::kFlatten),
              linear("fc", 27, 3)};
  check_gradients(s, 4);
}

TEST_CASE("lite gradients equal finite differences: embedding") {
  ModelSpec s;
  s.input_shape = {5};
  s.layers = {embedding("emb", 7, 3), plain(LayerKind::kFlatten), linear("fc", 15, 4)};
  std::vector<float> x(15);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 5 + 2) % 7);
  check_gradients(s, 3, &x);
}

TEST_CASE("lite gradients equal finite differences: LoRA linear") {
  // A and B by finite differences; fc1's gradients come through the LoRA
  // layer's dL/dx (its frozen base and its update both).
  ModelSpec s;
  s.input_shape = {6};
  s.layers = {linear("fc1", 6, 8), gelu(false),
              spec::lora_linear("fc2", 8, 4, 3, 6.0f, uniform(32, 31, 0.5f), uniform(4, 32, 0.5f))};
  check_gradients(s, 5);
  // The frozen base survives a model file: the same logits after a load.
  Model a(s);
  const std::vector<float> values = uniform(static_cast<size_t>(a.num_values()), 33, 0.5f);
  a.set_values(values);
  const std::string path = "lite_portable_lora.lite";
  sparrow::lite::save_model_file(path, s, values);
  std::unique_ptr<Model> b = load_model(path);
  std::remove(path.c_str());
  CHECK(b->get_values() == values);
  CHECK(b->num_values() == 6 * 8 + 8 + 3 * 8 + 4 * 3);  // the frozen 8 x 4 + 4 are not parameters
  const std::vector<float> x = uniform(12, 34, 1.0f);
  std::copy(x.begin(), x.end(), a.input(2).data.begin());
  std::copy(x.begin(), x.end(), b->input(2).data.begin());
  CHECK(a.forward(ForwardContext{}).data == b->forward(ForwardContext{}).data);
}

TEST_CASE("lite model file round trip on this platform") {
  const ModelSpec spec = builtin_spec("cnn");
  Model a(spec);
  const std::vector<float> values = uniform(static_cast<size_t>(a.num_values()), 21, 0.05f);
  a.set_values(values);
  const std::string path = "lite_portable_roundtrip.lite";
  sparrow::lite::save_model_file(path, spec, values);
  std::unique_ptr<Model> b = load_model(path);
  CHECK(b->get_values() == values);
  CHECK(b->param_names() == a.param_names());
  CHECK(b->input_shape() == a.input_shape());

  // The same logits from the loaded model, bit for bit (same binary, same input).
  const std::vector<float> x = uniform(static_cast<size_t>(2 * a.input_size()), 22, 1.0f);
  std::copy(x.begin(), x.end(), a.input(2).data.begin());
  std::copy(x.begin(), x.end(), b->input(2).data.begin());
  CHECK(a.forward(ForwardContext{}).data == b->forward(ForwardContext{}).data);

  // The encoding is the file, byte for byte; one flipped bit is refused, naming the file.
  std::vector<uint8_t> bytes = encode_model_file(spec, values);
  ModelFile decoded = decode_model_file(bytes.data(), bytes.size(), "memory");
  CHECK(decoded.values == values);
  bytes[bytes.size() / 2] ^= 0x10;
  std::string message;
  try {
    decode_model_file(bytes.data(), bytes.size(), "flipped.lite");
  } catch (const sparrow::Error& e) {
    message = e.what();
  }
  CHECK(message.find("flipped.lite") != std::string::npos);
  std::remove(path.c_str());
}

TEST_CASE("lite minibatch order and RNG are the same numbers on every platform") {
  // Computed on x86-64; an arm64 build must print the same (the trainer's
  // order and dropout masks depend on them, whatever the float arithmetic).
  const std::vector<int64_t> order = epoch_order(10, 7, 1);
  const std::vector<int64_t> expected_order = {6, 8, 0, 5, 9, 1, 3, 2, 4, 7};
  CHECK(order == expected_order);
  CHECK(sparrow::rng::derive(1, 0x64617461) == 13029168821049334453ULL);
  CHECK(sparrow::rng::below(13029168821049334453ULL, 3, 10) == 9);
}

TEST_CASE("lite training learns a separable data set") {
  // Four classes, each a cluster around its own corner in 8 dimensions.
  const int64_t n = 256, d = 8, classes = 4;
  std::vector<float> x = uniform(static_cast<size_t>(n * d), 31, 0.6f);
  std::vector<int64_t> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    y[static_cast<size_t>(i)] = i % classes;
    x[static_cast<size_t>(i * d + (i % classes))] += 1.5f;
  }
  ModelSpec s;
  s.input_shape = {d};
  s.layers = {linear("fc1", d, 16), plain(LayerKind::kRelu), linear("fc2", 16, classes)};
  auto model = std::make_shared<Model>(s);
  const std::vector<float> init = uniform(static_cast<size_t>(model->num_values()), 32, 0.3f);
  TrainConfig cfg;
  cfg.lr = 0.05;
  cfg.momentum = 0.9;
  cfg.local_epochs = 5;
  cfg.batch_size = 16;
  Trainer trainer(model, cfg);
  const auto before = trainer.evaluate(init, x, y);
  TrainResult r = trainer.train(init, x, y, 5);
  std::vector<float> trained = init;
  for (size_t i = 0; i < trained.size(); ++i) trained[i] += r.delta[i];
  const auto after = trainer.evaluate(trained, x, y);
  INFO("loss " << before.first << " -> " << after.first << ", accuracy " << before.second << " -> " << after.second);
  CHECK(r.steps == 5 * 16);
  CHECK(after.first < 0.25 * before.first);
  CHECK(after.second > 0.95);
}
