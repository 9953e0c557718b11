#include "bench/kernel_bench.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/json.h"
#include "core/models.h"
#include "kernels/batched_conv.h"
#include "kernels/conv5x5.h"
#include "kernels/cpu.h"
#include "kernels/linear.h"
#include "kernels/pool.h"
#include "kernels/winograd.h"

namespace sparrow::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Median milliseconds of `repeat` calls of f, after one untimed call.
double median_ms(int repeat, const std::function<void()>& f) {
  f();
  std::vector<double> t;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = Clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Milliseconds per floating-point operation of one large at::mm (timed once
// per run; each line scales it by its FLOPs).
double mm_ms_per_flop(int repeat) {
  const int64_t n = 1024;
  const at::Tensor a = at::randn({n, n}), b = at::randn({n, n});
  at::Tensor c = at::empty({n, n});
  return median_ms(repeat, [&] { at::mm_out(c, a, b); }) / (2.0 * n * n * n);
}

void print(const std::string& kernel, const std::string& setting, int images, double sparrow_ms, double aten_ms,
           double direct_flops, double limit_ms) {
  std::cout << "{\"bench\":\"kernels\",\"kernel\":" << json_string(kernel) << ",\"setting\":" << json_string(setting)
            << ",\"images\":" << images << ",\"sparrow_ms\":" << json_number(sparrow_ms)
            << ",\"aten_ms\":" << json_number(aten_ms) << ",\"speedup_vs_aten\":" << json_number(aten_ms / sparrow_ms)
            << ",\"direct_gflop\":" << json_number(direct_flops / 1e9) << ",\"mm_ms\":" << json_number(limit_ms) << "}"
            << std::endl;
}

// kernels/batched_conv.h for K = 10 stacked clients of b images against
// ATen's grouped convolution (groups = K over [b, K C, H, W], oneDNN), each
// given its own layout ready-made: forward with bias + ReLU, and forward +
// backward (weight and bias gradients; the input gradient except for a first
// layer's one-channel images), at a 3x3 CNN's shapes and the built-in CNN's
// 5x5 ones.
void bench_batched_conv(const KernelBenchOptions& o, int64_t b) {
  struct Case {
    const char* name;
    int64_t c, h, out, k, pad;
  };
  const Case cases[] = {{"3x3 1->16 @28x28", 1, 28, 16, 3, 1},
                        {"3x3 16->32 @14x14", 16, 14, 32, 3, 1},
                        {"3x3 32->64 @7x7", 32, 7, 64, 3, 1},
                        {"5x5 1->32 @28x28", 1, 28, 32, 5, 2},
                        {"5x5 32->64 @14x14", 32, 14, 64, 5, 2}};
  const int64_t k = 10;
  for (const Case& c : cases) {
    kernels::ConvShape s;
    s.clients = k;
    s.batch = b;
    s.in_channels = c.c;
    s.height = s.width = c.h;
    s.out_channels = c.out;
    s.kernel_h = s.kernel_w = c.k;
    s.pad_h = s.pad_w = c.pad;
    const int64_t ho = s.out_height(), wo = s.out_width();
    const bool want_dx = c.c > 1;
    const at::Tensor x = at::rand({k, b, c.c, c.h, c.h}), w = 0.1 * at::randn({k, c.out, c.c, c.k, c.k});
    const at::Tensor bias = 0.1 * at::randn({k, c.out}), dy = at::randn({k, b, c.out, ho, wo});
    at::Tensor y = at::empty({k, b, c.out, ho, wo}), dx = at::empty_like(x), gw = at::empty_like(w);
    at::Tensor gb = at::empty_like(bias);
    const double flops = 2.0 * k * b * c.out * c.c * c.k * c.k * ho * wo;
    const std::string setting = std::string(c.name) + ", K " + std::to_string(k) + " x B " + std::to_string(b);
    const double fwd = median_ms(o.repeat, [&] {
      kernels::batched_conv2d_forward(s, x.data_ptr<float>(), w.data_ptr<float>(), bias.data_ptr<float>(), true,
                                      y.data_ptr<float>());
    });
    const double train = median_ms(o.repeat, [&] {
      kernels::batched_conv2d_forward(s, x.data_ptr<float>(), w.data_ptr<float>(), bias.data_ptr<float>(), true,
                                      y.data_ptr<float>());
      kernels::batched_conv2d_backward(s, x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(),
                                       dy.data_ptr<float>(), want_dx ? dx.data_ptr<float>() : nullptr,
                                       gw.data_ptr<float>(), gb.data_ptr<float>(), 1.0f, 0.0f);
    });
    // ATen's layout: images [b, K C, H, W], weights [K O, C, k, k], groups K.
    const at::Tensor xa = x.permute({1, 0, 2, 3, 4}).reshape({b, k * c.c, c.h, c.h}).contiguous();
    const at::Tensor wa = w.reshape({k * c.out, c.c, c.k, c.k}).contiguous(), ba = bias.reshape({k * c.out});
    const at::Tensor dya = dy.permute({1, 0, 2, 3, 4}).reshape({b, k * c.out, ho, wo}).contiguous();
    const double fwd_aten = median_ms(o.repeat, [&] {
      at::NoGradGuard guard;
      at::relu(at::conv2d(xa, wa, ba, 1, c.pad, 1, k));
    });
    const at::Tensor xg = xa.clone().requires_grad_(want_dx), wg = wa.clone().requires_grad_();
    const at::Tensor bg = ba.clone().requires_grad_();
    const double train_aten = median_ms(o.repeat, [&] {
      at::relu(at::conv2d(xg, wg, bg, 1, c.pad, 1, k)).backward(dya);
      wg.mutable_grad().reset();
      bg.mutable_grad().reset();
      if (want_dx) xg.mutable_grad().reset();
    });
    print("batched_conv2d", setting + ", forward + bias + relu", static_cast<int>(k * b), fwd, fwd_aten, flops, 0);
    print("batched_conv2d",
          setting + (want_dx ? ", training (forward, backward)" : ", training (forward, backward; no input grad)"),
          static_cast<int>(k * b), train, train_aten, (want_dx ? 3 : 2) * flops, 0);
  }
}

}  // namespace

int bench_kernels(const KernelBenchOptions& o) {
  at::set_num_threads(1);
  torch::manual_seed(1);
  const int64_t n = o.images;
  std::cout << "{\"bench\":\"kernels\",\"case\":\"machine\",\"threads\":1,\"small_gemm\":"
            << json_string(kernels::gemm_backend())
            << ",\"kernel_isa\":" << json_string(kernels::isa_name(kernels::max_isa())) << "}" << std::endl;
  const double mm_rate = mm_ms_per_flop(o.repeat);
  auto mm_ms = [&](double flops) { return mm_rate * flops; };

  // conv2: 32 -> 64 channels, 14x14, 5x5, padding 2, then bias, ReLU, 2x2 max pooling.
  const at::Tensor x = at::rand({n, 32, 14, 14}), w = 0.05 * at::randn({64, 32, 5, 5}), b = 0.1 * at::randn({64});
  const double conv2_flops = 2.0 * n * 64 * 32 * 25 * 14 * 14;
  kernels::WinogradConv5Pool conv(32, 64, 14, 14, 4);
  at::Tensor out = at::empty({n, 64, 7, 7}), dout = at::randn({n, 64, 7, 7}), dx = at::empty_like(x);
  std::vector<int32_t> arg(static_cast<size_t>(n * conv.pooled_size()));
  const int64_t in_size = 32 * 14 * 14, pooled = conv.pooled_size();
  auto forward = [&](bool keep) {
    for (int64_t i = 0; i < n; i += 4)
      conv.forward(std::min<int64_t>(4, n - i), x.data_ptr<float>() + i * in_size, out.data_ptr<float>() + i * pooled,
                   keep ? arg.data() + i * pooled : nullptr);
  };
  const double fwd = median_ms(o.repeat, [&] {
    conv.set_weights(w.data_ptr<float>(), b.data_ptr<float>());
    forward(false);
  });
  const double fwd_aten = median_ms(o.repeat, [&] {
    at::NoGradGuard guard;
    at::max_pool2d(at::relu(at::conv2d(x, w, b, 1, 2)), 2);
  });
  print("conv2_relu_pool", "forward (inference)", static_cast<int>(n), fwd, fwd_aten, conv2_flops, mm_ms(conv2_flops));
  std::vector<float> gw(64 * 32 * 25), gb(64);
  const double train = median_ms(o.repeat, [&] {
    conv.set_weights(w.data_ptr<float>(), b.data_ptr<float>());
    conv.zero_grad();
    forward(true);
    for (int64_t i = 0; i < n; i += 4)
      conv.backward(std::min<int64_t>(4, n - i), x.data_ptr<float>() + i * in_size, arg.data() + i * pooled,
                    dout.data_ptr<float>() + i * pooled, dx.data_ptr<float>() + i * in_size);
    conv.weight_grad(gw.data(), gb.data(), 1.0f, 0.0f);
  });
  const at::Tensor xg = x.clone().requires_grad_(), wg = w.clone().requires_grad_(), bg = b.clone().requires_grad_();
  const double train_aten = median_ms(o.repeat, [&] {
    const at::Tensor y = at::max_pool2d(at::relu(at::conv2d(xg, wg, bg, 1, 2)), 2);
    y.backward(dout);
  });
  print("conv2_relu_pool", "forward + backward (training)", static_cast<int>(n), train, train_aten, 3 * conv2_flops,
        mm_ms(3 * conv2_flops));

  // conv1's ReLU + max pooling (32 planes of 28x28 per image) and its backward.
  const at::Tensor r = at::randn({n, 32, 28, 28}), dp = at::randn({n, 32, 14, 14});
  at::Tensor p = at::empty({n, 32, 14, 14}), dr = at::empty_like(r);
  std::vector<int32_t> win(static_cast<size_t>(p.numel()));
  const double pool = median_ms(o.repeat, [&] {
    kernels::relu_maxpool2(r.data_ptr<float>(), n * 32, 28, 28, p.data_ptr<float>(), win.data());
    kernels::relu_maxpool2_backward(win.data(), dp.data_ptr<float>(), n * 32, 28, 28, dr.data_ptr<float>());
  });
  const at::Tensor rg = r.clone().requires_grad_();
  const double pool_aten = median_ms(o.repeat, [&] { at::max_pool2d(at::relu(rg), 2).backward(dp); });
  print("relu_maxpool2", "forward + backward", static_cast<int>(n), pool, pool_aten, 0, 0);

  // conv1 (1 -> 32 channels, 28x28, 5x5) + bias + ReLU + 2x2 max pooling, as
  // training runs it (the winners kept for the backward).
  const at::Tensor img = at::rand({n, 1, 28, 28}), dy = at::randn({n, 32, 28, 28}), w1 = at::randn({32, 1, 5, 5});
  const at::Tensor bias1 = at::randn({32});
  const double conv1_flops = 2.0 * n * 32 * 25 * 28 * 28;
  std::vector<float> scratch(57 * 28 * 28);
  at::Tensor p1 = at::empty({n, 32, 14, 14});
  const double c1 = median_ms(o.repeat, [&] {
    for (int64_t i = 0; i < n; ++i)
      kernels::conv5x5_one_channel_relu_pool(img.data_ptr<float>() + i * 784, 28, 28, w1.data_ptr<float>(),
                                             bias1.data_ptr<float>(), 32, p1.data_ptr<float>() + i * 32 * 196,
                                             win.data() + i * 32 * 196, scratch.data());
  });
  const double c1_aten =
      median_ms(o.repeat, [&] { at::max_pool2d_with_indices(at::relu(at::conv2d(img, w1, bias1, 1, 2)), 2); });
  print("conv1_relu_pool", "forward (training: winners kept)", static_cast<int>(n), c1, c1_aten, conv1_flops,
        mm_ms(conv1_flops));

  // conv1's weight and bias gradients.
  std::vector<float> g1(32 * 25), b1(32), col(25 * 28 * 28), colt(col.size());
  const double wgrad = median_ms(o.repeat, [&] {
    std::fill(g1.begin(), g1.end(), 0.0f);
    std::fill(b1.begin(), b1.end(), 0.0f);
    for (int64_t i = 0; i < n; ++i)
      kernels::conv5x5_one_channel_weight_grad(img.data_ptr<float>() + i * 784, 28, 28,
                                               dy.data_ptr<float>() + i * 32 * 784, 32, g1.data(), b1.data(),
                                               col.data(), colt.data());
  });
  const double wgrad_aten = median_ms(o.repeat, [&] {
    at::convolution_backward(dy, img, w1, at::IntArrayRef{32}, {1, 1}, {2, 2}, {1, 1}, false, {0, 0}, 1,
                             {false, true, true});
  });
  print("conv1_weight_grad", "weight + bias gradients", static_cast<int>(n), wgrad, wgrad_aten, conv1_flops,
        mm_ms(conv1_flops));

  bench_batched_conv(o, std::min<int64_t>(32, n));

  // The whole CNN's inference (evaluation), each at its evaluation batch:
  // Sparrow's model's own (Model::eval_batch: 256), ATen's 64 (LibTorch
  // 1.13's oneDNN convolutions fall off a cliff above it), as
  // LocalTrainer::evaluate runs them.
  const std::shared_ptr<core::Model> cnn = core::make_model("cnn", 1);
  const int64_t eb = cnn->eval_batch(at::Device(at::kCPU));
  const at::Tensor imgs = at::rand({n, 784});
  std::map<std::string, at::Tensor> par;
  for (const auto& kv : cnn->named_parameters()) par[kv.key()] = kv.value();
  const double cnn_flops = conv1_flops + conv2_flops + 2.0 * n * (3136 * 512 + 512 * 10);
  at::NoGradGuard no_grad;
  cnn->eval();
  const double infer = median_ms(o.repeat, [&] {
    for (int64_t i = 0; i < n; i += eb) cnn->forward(imgs.narrow(0, i, std::min<int64_t>(eb, n - i)));
  });
  const double infer_aten = median_ms(o.repeat, [&] {
    for (int64_t i = 0; i < n; i += 64) {
      at::Tensor h = imgs.narrow(0, i, std::min<int64_t>(64, n - i)).view({-1, 1, 28, 28});
      h = at::max_pool2d(at::relu(at::conv2d(h, par["conv1.weight"], par["conv1.bias"], 1, 2)), 2);
      h = at::max_pool2d(at::relu(at::conv2d(h, par["conv2.weight"], par["conv2.bias"], 1, 2)), 2);
      h = at::relu(at::linear(h.flatten(1), par["fc1.weight"], par["fc1.bias"]));
      at::linear(h, par["fc2.weight"], par["fc2.bias"]);
    }
  });
  print("cnn", "inference (evaluation batches: " + std::to_string(eb) + ", ATen 64)", static_cast<int>(n), infer,
        infer_aten, cnn_flops, mm_ms(cnn_flops));
  return 0;
}

}  // namespace sparrow::bench
