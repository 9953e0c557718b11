#include "core/models.h"

#include <torch/script.h>
#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>

#include "core/error.h"
#include "core/error_text.h"
#include "core/registry.h"
#include "core/spec.h"
#include "core/threads.h"
#include "kernels/conv5x5.h"
#include "kernels/linear.h"
#include "kernels/pool.h"
#include "kernels/winograd.h"

namespace sparrow::core {
namespace {

namespace cpu = ::sparrow::kernels;  // the CPU kernels (kernels/)

constexpr const char* kTorchScriptPrefix = "torchscript:";

// forward_clients' argument checks: `count` stacked parameters with one
// leading client dimension, and x [K, B, ...] with the same K.
void check_clients(const std::vector<at::Tensor>& p, size_t count, const at::Tensor& x) {
  SPARROW_CHECK(p.size() == count, "forward_clients: " << p.size() << " parameters, the model has " << count);
  SPARROW_CHECK(x.dim() >= 3, "forward_clients: x must be [clients, batch, ...], got " << x.sizes());
  for (const auto& t : p)
    SPARROW_CHECK(t.dim() >= 2 && t.size(0) == x.size(0),
                  "forward_clients: parameters " << t.sizes() << " do not stack " << x.size(0) << " clients");
}

// loss_backward_clients' gradient buffers: one per parameter, same shape, contiguous.
void check_grads(const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& g) {
  SPARROW_CHECK(g.size() == p.size(),
                "loss_backward_clients: " << g.size() << " gradient buffers for " << p.size() << " parameters");
  for (size_t i = 0; i < p.size(); ++i)
    SPARROW_CHECK(g[i].sizes() == p[i].sizes() && g[i].is_contiguous(), "loss_backward_clients: gradient buffer "
                                                                            << i << " is " << g[i].sizes()
                                                                            << ", parameter " << p[i].sizes());
}

// dst = beta dst + alpha grad, as loss_backward_clients accumulates (beta = 0
// overwrites whatever dst held).
void accumulate(at::Tensor dst, const at::Tensor& grad, double alpha, double beta) {
  if (beta == 0)
    dst.copy_(grad).mul_(alpha);
  else
    (beta == 1 ? dst : dst.mul_(beta)).add_(grad, alpha);
}

// The raw CPU path (kernels/linear.h) applies to float32 CPU tensors whose
// stacks are contiguous (BatchedTrainer's are).
bool cpu_fast_path(const std::vector<at::Tensor>& p, const at::Tensor& x) {
  if (!x.device().is_cpu() || x.scalar_type() != at::kFloat) return false;
  for (const auto& t : p)
    if (!t.device().is_cpu() || t.scalar_type() != at::kFloat || !t.is_contiguous()) return false;
  return true;
}

// Client c's Linear layer whose weight is p[i] and bias p[i + 1].
cpu::LinearRef linear_ref(const std::vector<at::Tensor>& p, std::vector<at::Tensor>& g, size_t i, int64_t c) {
  cpu::LinearRef r;
  r.out = p[i].size(1);
  r.in = p[i].size(2);
  r.w = p[i].data_ptr<float>() + c * r.out * r.in;
  r.b = p[i + 1].data_ptr<float>() + c * r.out;
  r.gw = g[i].data_ptr<float>() + c * r.out * r.in;
  r.gb = g[i + 1].data_ptr<float>() + c * r.out;
  return r;
}

// Accepts [N, 1, 28, 28], [N, 28, 28] and [N, 784] for the 28x28 grey-scale models.
at::Tensor as_image28(const at::Tensor& x) { return x.reshape({x.size(0), 1, 28, 28}); }

void check_stage_range(size_t begin, size_t end, size_t n) {
  SPARROW_CHECK_T(ConfigError, begin <= end && end <= n,
                  "model stages [" << begin << ", " << end << ") are not within [0, " << n << ")");
}

// The stage `name` made of the built-in submodules `modules` (parameter names
// "<module>.<...>").
ModelStage stage_of(const torch::nn::Module& m, const std::string& name, const std::vector<std::string>& modules) {
  ModelStage s{name, {}};
  for (const auto& p : m.named_parameters(/*recurse=*/true))
    for (const std::string& mod : modules)
      if (p.key().rfind(mod + ".", 0) == 0) s.params.push_back(p.key());
  return s;
}

class Mlp final : public Model {
 public:
  Mlp() {
    fc1_ = register_module("fc1", torch::nn::Linear(784, 200));
    fc2_ = register_module("fc2", torch::nn::Linear(200, 200));
    fc3_ = register_module("fc3", torch::nn::Linear(200, 10));
  }
  at::Tensor forward(const at::Tensor& x) override {
    at::Tensor h = x.reshape({x.size(0), -1});
    h = torch::relu(fc1_->forward(h));
    h = torch::relu(fc2_->forward(h));
    return fc3_->forward(h);
  }
  std::vector<ModelStage> stages() const override {
    return {stage_of(*this, "fc1", {"fc1"}), stage_of(*this, "fc2", {"fc2"}), stage_of(*this, "fc3", {"fc3"})};
  }
  bool can_forward_clients() const override { return true; }
  // params: fc1.weight, fc1.bias, fc2.weight, fc2.bias, fc3.weight, fc3.bias.
  at::Tensor forward_clients(const std::vector<at::Tensor>& p, const at::Tensor& x) override {
    check_clients(p, 6, x);
    at::Tensor h = x.reshape({x.size(0), x.size(1), -1}).transpose(1, 2);  // feature-major [K, 784, B]
    h = torch::relu(linear_clients(h, p[0], p[1]));
    h = torch::relu(linear_clients(h, p[2], p[3]));
    return linear_clients(h, p[4], p[5]).transpose(1, 2);
  }
  at::Tensor loss_backward_clients(const std::vector<at::Tensor>& p, const at::Tensor& x, const at::Tensor& y,
                                   const at::Tensor& w, std::vector<at::Tensor>& g, double alpha,
                                   double beta) override {
    check_clients(p, 6, x);
    check_grads(p, g);
    const int64_t k = x.size(0), b = x.size(1);
    if (cpu_fast_path(p, x)) {
      const at::Tensor xc = x.reshape({k, b, 784}).contiguous();
      const at::Tensor yc = y.contiguous(), wc = w.contiguous();
      at::Tensor loss = at::empty({k}, x.options());
      parallel_for_single_blas(k, 1, [&](int64_t c0, int64_t c1) {  // each client's arithmetic on any thread
        for (int64_t c = c0; c < c1; ++c) {
          std::vector<cpu::LinearRef> layers;
          for (int l = 0; l < 3; ++l) layers.push_back(linear_ref(p, g, 2 * l, c));
          loss.data_ptr<float>()[c] = static_cast<float>(cpu::linear_chain_step(
              b, xc[c].data_ptr<float>(), layers, yc.data_ptr<int64_t>() + c * b, wc.data_ptr<float>() + c * b, nullptr,
              static_cast<float>(alpha), static_cast<float>(beta)));
        }
      });
      return loss;
    }
    const at::Tensor xt = x.reshape({k, b, 784});  // batch-major: the transpose of the feature-major input
    const at::Tensor a1 = linear_clients(xt.transpose(1, 2), p[0], p[1]).relu_();  // [K, 200, B]
    const at::Tensor a2 = linear_clients(a1, p[2], p[3]).relu_();
    at::Tensor dz3 = linear_clients(a2, p[4], p[5]);  // logits [K, 10, B]
    const at::Tensor loss = softmax_xent_backward_clients(dz3, y, w);
    // Each layer's input gradient before its weights' (which may be the weights).
    const at::Tensor dz2 = at::threshold_backward(at::bmm(p[4].transpose(1, 2), dz3), a2, 0);
    linear_clients_backward(dz3, a2.transpose(1, 2), g[4], g[5], alpha, beta);
    const at::Tensor dz1 = at::threshold_backward(at::bmm(p[2].transpose(1, 2), dz2), a1, 0);
    linear_clients_backward(dz2, a1.transpose(1, 2), g[2], g[3], alpha, beta);
    linear_clients_backward(dz1, xt, g[0], g[1], alpha, beta);
    return loss;
  }
  at::Tensor forward_stages(const at::Tensor& x, size_t begin, size_t end) override {
    check_stage_range(begin, end, 3);
    at::Tensor h = x;
    for (size_t i = begin; i < end; ++i) {
      if (i == 0)
        h = torch::relu(fc1_->forward(h.reshape({h.size(0), -1})));
      else if (i == 1)
        h = torch::relu(fc2_->forward(h));
      else
        h = fc3_->forward(h);
    }
    return h;
  }

 private:
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr}, fc3_{nullptr};
};

class Cnn final : public Model {
 public:
  Cnn() {
    conv1_ = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 5).padding(2)));
    conv2_ = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 5).padding(2)));
    fc1_ = register_module("fc1", torch::nn::Linear(7 * 7 * 64, 512));
    fc2_ = register_module("fc2", torch::nn::Linear(512, 10));
  }
  at::Tensor forward(const at::Tensor& x) override {
    // Inference on the CPU (evaluation): both convolutions, ReLUs and
    // poolings by kernels/winograd.h (as in training).
    if (!at::GradMode::is_enabled() && cpu_fast_path(parameters(), x)) return inference(as_image28(x).contiguous());
    at::Tensor h = torch::max_pool2d(torch::relu(conv1_->forward(as_image28(x))), 2);
    h = torch::max_pool2d(torch::relu(conv2_->forward(h)), 2);
    h = torch::relu(fc1_->forward(h.flatten(1)));
    return fc2_->forward(h);
  }
  std::vector<ModelStage> stages() const override {
    return {stage_of(*this, "conv1", {"conv1"}), stage_of(*this, "conv2", {"conv2"}), stage_of(*this, "fc1", {"fc1"}),
            stage_of(*this, "fc2", {"fc2"})};
  }
  bool can_forward_clients() const override { return true; }
  // Batches of 256 evaluate 8-10% faster than 64 on the CPU kernels (the
  // Linear layers' GEMMs and conv2's weight transform amortised over more
  // images; sparrow-sim on the 2-vCPU machine).
  int64_t eval_batch(const at::Device& device) const override {
    return device.is_cpu() ? 256 : Model::eval_batch(device);
  }
  // On CUDA the K clients' convolutions are one grouped convolution: the
  // batch is laid out [B, K * channels, H, W] with client k's channels in
  // group k (max pooling is per channel anyway). On the CPU, oneDNN's grouped
  // convolution (LibTorch 1.13) trains 3.5x slower than the K convolutions
  // one after another (docs/performance.md), so there each client's
  // convolutions run on its own slice and the batching is in the Linear
  // layers and the optimizer step.
  // params: conv1.weight, conv1.bias, conv2.weight, conv2.bias, fc1.weight,
  // fc1.bias, fc2.weight, fc2.bias.
  at::Tensor forward_clients(const std::vector<at::Tensor>& p, const at::Tensor& x) override {
    check_clients(p, 8, x);
    const int64_t k = x.size(0), b = x.size(1);
    at::Tensor h;  // [K, 3136, B], feature-major for the Linear layers
    if (x.is_cuda()) {
      h = x.reshape({k, b, 28 * 28}).transpose(0, 1).reshape({b, k, 28, 28});
      h = at::conv2d(h, p[0].reshape({k * 32, 1, 5, 5}), p[1].reshape({k * 32}), 1, 2, 1, k);
      h = torch::max_pool2d(torch::relu(h), 2);
      h = at::conv2d(h, p[2].reshape({k * 64, 32, 5, 5}), p[3].reshape({k * 64}), 1, 2, 1, k);
      h = torch::max_pool2d(torch::relu(h), 2);  // [B, K * 64, 7, 7]
      h = h.reshape({b, k, 64 * 7 * 7}).permute({1, 2, 0});
    } else {
      // unbind: one backward node stacks the K gradients (indexing would
      // give each client a zero-filled [K, ...] gradient).
      const std::vector<at::Tensor> w1 = p[0].unbind(0), b1 = p[1].unbind(0), w2 = p[2].unbind(0), b2 = p[3].unbind(0),
                                    xs = x.unbind(0);
      std::vector<at::Tensor> per_client;
      for (int64_t c = 0; c < k; ++c) {
        at::Tensor hc = torch::max_pool2d(torch::relu(at::conv2d(as_image28(xs[c]), w1[c], b1[c], 1, 2)), 2);
        hc = torch::max_pool2d(torch::relu(at::conv2d(hc, w2[c], b2[c], 1, 2)), 2);
        per_client.push_back(hc.reshape({b, 64 * 7 * 7}));
      }
      h = at::stack(per_client).transpose(1, 2);
    }
    h = torch::relu(linear_clients(h, p[4], p[5]));
    return linear_clients(h, p[6], p[7]).transpose(1, 2);
  }
  // CPU: the hand-written backward, one client after another. CUDA: autograd
  // over the grouped forward_clients.
  at::Tensor loss_backward_clients(const std::vector<at::Tensor>& p, const at::Tensor& x, const at::Tensor& y,
                                   const at::Tensor& w, std::vector<at::Tensor>& g, double alpha,
                                   double beta) override {
    if (!cpu_fast_path(p, x)) return Model::loss_backward_clients(p, x, y, w, g, alpha, beta);
    check_clients(p, 8, x);
    check_grads(p, g);
    // Each client through its whole step (its activations stay in cache):
    // conv1 + ReLU + pooling by a fused direct kernel, its weight gradient as
    // im2col + GEMM, conv2 + ReLU + pooling by Winograd (kernels/winograd.h),
    // the Linear head by the raw path of kernels/linear.h, which also hands
    // back the head's input gradient. The clients are shared out over the
    // intra-op threads (each client's arithmetic is the same on any thread).
    const int64_t k = x.size(0), b = x.size(1);
    const at::Tensor yc = y.contiguous(), wc = w.contiguous(), xcont = x.contiguous();
    at::Tensor loss = at::empty({k}, x.options());
    parallel_for_single_blas(k, 1, [&](int64_t c0, int64_t c1) {
      at::Tensor m2 = at::empty({b, 64, 7, 7}, x.options()), dh = at::empty_like(m2);
      at::Tensor m1 = at::empty({b, 32, 14, 14}, x.options()), dm1 = at::empty({kTrainGroup, 32, 14, 14}, x.options());
      at::Tensor dr1 = at::empty({32, 28, 28}, x.options()), scratch = at::empty({(25 + 32) * 28 * 28}, x.options());
      at::Tensor col = at::empty({25 * 28 * 28}, x.options()), colt = at::empty_like(col);
      at::Tensor gw1 = at::empty({32, 25}, x.options()), gb1 = at::empty({32}, x.options());
      at::Tensor win = at::empty({b, 64 * 7 * 7}, x.options().dtype(at::kInt));
      at::Tensor win1 = at::empty({b, 32 * 14 * 14}, x.options().dtype(at::kInt));
      for (int64_t c = c0; c < c1; ++c)
        loss.data_ptr<float>()[c] =
            cnn_client_step(p, g, as_image28(xcont[c]).data_ptr<float>(), b, yc.data_ptr<int64_t>() + c * b,
                            wc.data_ptr<float>() + c * b, c, alpha, beta,
                            {m1, m2, dh, dm1, dr1, scratch, col, colt, gw1, gb1, win, win1});
    });
    return loss;
  }
  at::Tensor forward_stages(const at::Tensor& x, size_t begin, size_t end) override {
    check_stage_range(begin, end, 4);
    at::Tensor h = x;
    for (size_t i = begin; i < end; ++i) {
      if (i == 0)
        h = torch::max_pool2d(torch::relu(conv1_->forward(as_image28(h))), 2);
      else if (i == 1)
        h = torch::max_pool2d(torch::relu(conv2_->forward(h)), 2);
      else if (i == 2)
        h = torch::relu(fc1_->forward(h.flatten(1)));
      else
        h = fc2_->forward(h);
    }
    return h;
  }

 private:
  // One client's scratch for cnn_client_step (b images).
  struct StepScratch {
    at::Tensor m1, m2, dh, dm1, dr1, scratch, col, colt, gw1, gb1, win, win1;
  };
  // Client c's training step on its b images xp [b, 28, 28] (labels y, loss
  // weights wt): its loss, its gradients into g[.][c] (alpha, beta as
  // loss_backward_clients).
  static float cnn_client_step(const std::vector<at::Tensor>& p, std::vector<at::Tensor>& g, const float* xp, int64_t b,
                               const int64_t* y, const float* wt, int64_t c, double alpha, double beta,
                               const StepScratch& s) {
    cpu::WinogradConv5Pool& conv2 = winograd_train();
    const int64_t in2 = 32 * 14 * 14, out2 = 64 * 7 * 7;
    float* m1 = s.m1.data_ptr<float>();
    int32_t* win1 = s.win1.data_ptr<int32_t>();
    for (int64_t i = 0; i < b; ++i)  // pooled image by image, while conv1's output is in cache
      cpu::conv5x5_one_channel_relu_pool(xp + i * 28 * 28, 28, 28, p[0][c].data_ptr<float>(), p[1][c].data_ptr<float>(),
                                         32, m1 + i * in2, win1 + i * in2, s.scratch.data_ptr<float>());
    conv2.set_weights(p[2][c].data_ptr<float>(), p[3][c].data_ptr<float>());
    conv2.zero_grad();
    const int64_t group = conv2.group();
    float* m2 = s.m2.data_ptr<float>();
    int32_t* win = s.win.data_ptr<int32_t>();
    for (int64_t i = 0; i < b; i += group)
      conv2.forward(std::min(group, b - i), m1 + i * in2, m2 + i * out2, win + i * out2);
    // m2 [B, 64, 7, 7] is the head's batch-major input [B, 3136].
    const std::vector<cpu::LinearRef> head{linear_ref(p, g, 4, c), linear_ref(p, g, 6, c)};
    float* dh = s.dh.data_ptr<float>();
    const auto loss = static_cast<float>(
        cpu::linear_chain_step(b, m2, head, y, wt, dh, static_cast<float>(alpha), static_cast<float>(beta)));
    // Image by image back to conv1's weights, each image's gradients in cache.
    s.gw1.zero_();
    s.gb1.zero_();
    for (int64_t i0 = 0; i0 < b; i0 += group) {
      const int64_t n = std::min(group, b - i0);
      conv2.backward(n, m1 + i0 * in2, win + i0 * out2, dh + i0 * out2, s.dm1.data_ptr<float>());
      for (int64_t i = i0; i < i0 + n; ++i) {
        cpu::relu_maxpool2_backward(win1 + i * in2, s.dm1.data_ptr<float>() + (i - i0) * in2, 32, 28, 28,
                                    s.dr1.data_ptr<float>());
        cpu::conv5x5_one_channel_weight_grad(xp + i * 28 * 28, 28, 28, s.dr1.data_ptr<float>(), 32,
                                             s.gw1.data_ptr<float>(), s.gb1.data_ptr<float>(), s.col.data_ptr<float>(),
                                             s.colt.data_ptr<float>());
      }
    }
    conv2.weight_grad(g[2][c].data_ptr<float>(), g[3][c].data_ptr<float>(), static_cast<float>(alpha),
                      static_cast<float>(beta));
    accumulate(g[0][c], s.gw1.view_as(g[0][c]), alpha, beta);
    accumulate(g[1][c], s.gb1, alpha, beta);
    return loss;
  }

  // This thread's conv2 (workers train on threads of their own), for
  // evaluation and for training: the GEMMs' fastest groupings on the 2-vCPU
  // machine were one image in evaluation (its transformed tiles stay in L2)
  // and four in training (the weight gradient's GEMMs reduce over 64 rows).
  static cpu::WinogradConv5Pool& winograd() {
    static thread_local cpu::WinogradConv5Pool conv(32, 64, 14, 14, 1);
    return conv;
  }
  static constexpr int64_t kTrainGroup = 4;
  static cpu::WinogradConv5Pool& winograd_train() {
    static thread_local cpu::WinogradConv5Pool conv(32, 64, 14, 14, kTrainGroup);
    return conv;
  }
  // The logits [N, 10] of images x [N, 1, 28, 28] (contiguous), without
  // gradient, in blocks of kInferenceBlock images, each block through the
  // whole model on one thread: the blocks are shared out over the intra-op
  // threads, and the same blocks on any number of threads give the same bits
  // (the Linear layers' GEMMs see the same shapes).
  static constexpr int64_t kInferenceBlock = 128;
  at::Tensor inference(const at::Tensor& x) {
    const at::Tensor w1 = conv1_->weight.contiguous(), b1 = conv1_->bias.contiguous();
    const at::Tensor w2 = conv2_->weight.contiguous(), b2 = conv2_->bias.contiguous();
    const int64_t n = x.size(0), blocks = (n + kInferenceBlock - 1) / kInferenceBlock;
    at::Tensor feat = at::empty({n, 64 * 7 * 7}, x.options());
    at::Tensor logits = at::empty({n, fc2_->weight.size(0)}, x.options());
    const float* in = x.data_ptr<float>();
    float* o = feat.data_ptr<float>();
    parallel_for_single_blas(blocks, 1, [&](int64_t block0, int64_t block1) {
      cpu::WinogradConv5Pool& conv = winograd();
      conv.set_weights(w2.data_ptr<float>(), b2.data_ptr<float>());
      std::vector<float> scratch((25 + 32) * 28 * 28), m1(32 * 14 * 14);
      for (int64_t block = block0; block < block1; ++block) {
        const int64_t begin = block * kInferenceBlock, end = std::min(n, begin + kInferenceBlock);
        for (int64_t i = begin; i < end; ++i) {
          cpu::conv5x5_one_channel_relu_pool(in + i * 28 * 28, 28, 28, w1.data_ptr<float>(), b1.data_ptr<float>(), 32,
                                             m1.data(), nullptr, scratch.data());
          conv.forward(1, m1.data(), o + i * 64 * 7 * 7);
        }
        const at::Tensor h = at::relu(fc1_->forward(feat.narrow(0, begin, end - begin)));
        logits.narrow(0, begin, end - begin).copy_(fc2_->forward(h));
      }
    });
    return logits;
  }

  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
};

torch::nn::Conv2d conv3x3(int64_t in, int64_t out, int64_t stride) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false));
}

// He et al. 2016's basic block: two 3x3 convs with BN, identity or 1x1-conv shortcut.
class BasicBlock final : public torch::nn::Module {
 public:
  BasicBlock(int64_t in, int64_t out, int64_t stride) {
    conv1_ = register_module("conv1", conv3x3(in, out, stride));
    bn1_ = register_module("bn1", torch::nn::BatchNorm2d(out));
    conv2_ = register_module("conv2", conv3x3(out, out, 1));
    bn2_ = register_module("bn2", torch::nn::BatchNorm2d(out));
    if (stride != 1 || in != out) {
      downsample_ = register_module(
          "downsample",
          torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)),
                                torch::nn::BatchNorm2d(out)));
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::relu(bn1_->forward(conv1_->forward(x)));
    h = bn2_->forward(conv2_->forward(h));
    return torch::relu(h + (downsample_ ? downsample_->forward(x) : x));
  }

 private:
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr};
  torch::nn::BatchNorm2d bn1_{nullptr}, bn2_{nullptr};
  torch::nn::Sequential downsample_{nullptr};
};

class ResNet8 final : public Model {
 public:
  explicit ResNet8(int64_t in_channels) : in_channels_(in_channels) {
    conv1_ = register_module("conv1", conv3x3(in_channels, 16, 1));
    bn1_ = register_module("bn1", torch::nn::BatchNorm2d(16));
    layer1_ = register_module("layer1", std::make_shared<BasicBlock>(16, 16, 1));
    layer2_ = register_module("layer2", std::make_shared<BasicBlock>(16, 32, 2));
    layer3_ = register_module("layer3", std::make_shared<BasicBlock>(32, 64, 2));
    fc_ = register_module("fc", torch::nn::Linear(64, 10));
  }
  at::Tensor forward(const at::Tensor& x) override {
    at::Tensor h = (in_channels_ == 1 && x.dim() == 2) ? as_image28(x) : x;
    h = torch::relu(bn1_->forward(conv1_->forward(h)));
    h = layer3_->forward(layer2_->forward(layer1_->forward(h)));
    return fc_->forward(torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1));
  }
  std::vector<ModelStage> stages() const override {
    return {stage_of(*this, "stem", {"conv1", "bn1"}), stage_of(*this, "layer1", {"layer1"}),
            stage_of(*this, "layer2", {"layer2"}), stage_of(*this, "layer3", {"layer3"}),
            stage_of(*this, "head", {"fc"})};
  }
  at::Tensor forward_stages(const at::Tensor& x, size_t begin, size_t end) override {
    check_stage_range(begin, end, 5);
    at::Tensor h = x;
    for (size_t i = begin; i < end; ++i) {
      if (i == 0) {
        h = (in_channels_ == 1 && h.dim() == 2) ? as_image28(h) : h;
        h = torch::relu(bn1_->forward(conv1_->forward(h)));
      } else if (i == 1) {
        h = layer1_->forward(h);
      } else if (i == 2) {
        h = layer2_->forward(h);
      } else if (i == 3) {
        h = layer3_->forward(h);
      } else {
        h = fc_->forward(torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1));
      }
    }
    return h;
  }

 private:
  int64_t in_channels_;
  torch::nn::Conv2d conv1_{nullptr};
  torch::nn::BatchNorm2d bn1_{nullptr};
  std::shared_ptr<BasicBlock> layer1_, layer2_, layer3_;
  torch::nn::Linear fc_{nullptr};
};

std::string flat_name(std::string name) {
  for (char& c : name)
    if (c == '.') c = '_';
  return name;
}

class ScriptedModel final : public Model {
 public:
  ScriptedModel(torch::jit::Module module, const std::string& path) : module_(std::move(module)), path_(path) {
    std::set<std::string> seen;
    auto claim = [&](const std::string& scripted) {
      std::string name = flat_name(scripted);
      SPARROW_CHECK_T(ConfigError, seen.insert(name).second,
                      "TorchScript model '" << path << "': '" << scripted << "' maps to '" << name
                                            << "', which another parameter or buffer already uses");
      return name;
    };
    for (const auto& p : module_.named_parameters(/*recurse=*/true))
      register_parameter(claim(p.name), p.value, p.value.requires_grad());
    for (const auto& b : module_.named_buffers(/*recurse=*/true)) register_buffer(claim(b.name), b.value);
    train(module_.is_training());
  }
  at::Tensor forward(const at::Tensor& x) override {
    c10::IValue out = module_.forward({x});
    SPARROW_CHECK_T(ConfigError, out.isTensor(), "TorchScript model: forward must return a tensor");
    return out.toTensor();
  }
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    module_.train(on);
  }
  // One stage per direct child, parameters mapped to the Model's flat names.
  std::vector<ModelStage> stages() const override {
    std::vector<ModelStage> out;
    for (const auto& child : module_.named_children()) {
      ModelStage s{child.name, {}};
      for (const auto& p : child.value.named_parameters(/*recurse=*/true))
        s.params.push_back(flat_name(child.name + "." + p.name));
      out.push_back(std::move(s));
    }
    return out;
  }
  at::Tensor forward_stages(const at::Tensor& x, size_t begin, size_t end) override {
    std::vector<torch::jit::Module> children;
    for (const auto& child : module_.named_children()) children.push_back(child.value);
    check_stage_range(begin, end, children.size());
    at::Tensor h = x;
    for (size_t i = begin; i < end; ++i) {
      SPARROW_CHECK_T(ConfigError, children[i].find_method("forward").has_value(),
                      "TorchScript model: child module " << i << " has no forward method");
      c10::IValue out = children[i].forward({h});
      SPARROW_CHECK_T(ConfigError, out.isTensor(), "TorchScript model: child module " << i << " must return a tensor");
      h = out.toTensor();
    }
    return h;
  }
  const torch::jit::Module& module() const { return module_; }
  const std::string& path() const { return path_; }

 private:
  torch::jit::Module module_;
  std::string path_;
};

std::shared_ptr<Model> load_torchscript(const std::string& path) {
  SPARROW_CHECK_T(ConfigError, !path.empty(), "model 'torchscript:' needs a file path");
  SPARROW_CHECK_T(ConfigError, std::ifstream(path).good(), "TorchScript model file '" << path << "' cannot be opened");
  torch::jit::Module module;
  try {
    module = torch::jit::load(path, torch::kCPU);
  } catch (const std::exception& e) {
    throw ConfigError("TorchScript model file '" + path + "' could not be loaded: " + error_text(e));
  }
  SPARROW_CHECK_T(ConfigError, module.find_method("forward").has_value(),
                  "TorchScript model '" << path << "' has no forward method");
  return std::make_shared<ScriptedModel>(std::move(module), path);
}

struct ModelEntry {
  ModelFactory make;
  ModelShapeFn input_shape;  // empty: not known
};

// "model": the message reads "unknown model 'x' (known: ...)".
Registry<ModelEntry>& registry() {
  static Registry<ModelEntry> r("model");
  return r;
}

std::vector<int64_t> image28(Spec&) { return {1, 28, 28}; }

// resnet's in_channels key, checked.
int64_t resnet_channels(Spec& s) {
  const int64_t in = s.get_int("in_channels", 1);
  SPARROW_CHECK_T(ConfigError, in == 1 || in == 3, "model '" << s.text() << "': in_channels must be 1 or 3");
  return in;
}

bool is_torchscript(const std::string& name) { return name.rfind(kTorchScriptPrefix, 0) == 0; }

// The entry of a built-in or registered name; the unknown-name error also
// lists the TorchScript form, which is not a registry entry (its FILE is not
// a key=value spec).
ModelEntry entry_of(const Spec& s) {
  register_builtin_models();
  std::optional<ModelEntry> e = registry().find(s.method());
  if (!e) throw registry().unknown(s.text(), "torchscript:FILE");
  return std::move(*e);
}

}  // namespace

const torch::jit::Module* scripted_module(const Model& model) {
  const auto* s = dynamic_cast<const ScriptedModel*>(&model);
  return s ? &s->module() : nullptr;
}

std::string scripted_path(const Model& model) {
  const auto* s = dynamic_cast<const ScriptedModel*>(&model);
  return s ? s->path() : std::string();
}

at::Tensor Model::forward_stages(const at::Tensor&, size_t, size_t) {
  throw ConfigError("this model does not list stages, so it cannot be cut");
}

at::Tensor Model::forward_clients(const std::vector<at::Tensor>&, const at::Tensor&) {
  throw ConfigError("this model cannot train several clients in one pass");
}

at::Tensor Model::loss_backward_clients(const std::vector<at::Tensor>& p, const at::Tensor& x, const at::Tensor& y,
                                        const at::Tensor& w, std::vector<at::Tensor>& g, double alpha, double beta) {
  check_grads(p, g);
  std::vector<at::Tensor> leaves(p.size());
  for (size_t i = 0; i < p.size(); ++i) leaves[i] = p[i].detach().requires_grad_(true);
  at::AutoGradMode grad_on(true);
  const at::Tensor logits = forward_clients(leaves, x);  // [K, B, C]
  const int64_t k = x.size(0), b = x.size(1);
  SPARROW_CHECK(logits.dim() == 3 && logits.size(0) == k && logits.size(1) == b,
                "forward_clients must return {clients, batch, classes}, got " << logits.sizes());
  const at::Tensor ce = at::cross_entropy_loss(logits.reshape({k * b, logits.size(2)}), y, {}, at::Reduction::None);
  const at::Tensor loss = (ce * w).view({k, b}).sum(1);
  const std::vector<at::Tensor> grads = torch::autograd::grad({loss.sum()}, leaves, {}, false, false, true);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < p.size(); ++i)  // undefined: an unused parameter, gradient zero
    accumulate(g[i], grads[i].defined() ? grads[i] : at::zeros_like(g[i]), alpha, beta);
  return loss.detach();
}

int64_t Model::eval_batch(const at::Device&) const { return 64; }

at::Tensor linear_clients(const at::Tensor& h, const at::Tensor& weight, const at::Tensor& bias) {
  return at::baddbmm(bias.unsqueeze(2), weight, h);
}

at::Tensor softmax_xent_backward_clients(at::Tensor& z, const at::Tensor& y, const at::Tensor& w) {
  const int64_t k = z.size(0), b = z.size(2);
  const at::Tensor yv = y.view({k, 1, b});
  const at::Tensor wv = w.view({k, 1, b});
  z = at::log_softmax(z, 1);
  const at::Tensor picked = z.gather(1, yv);           // log p(y) [K, 1, B]
  const at::Tensor loss = -(picked * wv).sum({1, 2});  // [K]
  z.exp_();                                            // softmax
  z.scatter_(1, yv, picked.exp() - 1);                 // softmax - onehot(y)
  z.mul_(wv);
  return loss;
}

void linear_clients_backward(const at::Tensor& dz, const at::Tensor& ht, at::Tensor& gw, at::Tensor& gb, double alpha,
                             double beta) {
  if (beta == 0 && alpha == 1) {
    at::bmm_out(gw, dz, ht);
    at::sum_out(gb, dz, {2});
  } else {
    gw.baddbmm_(dz, ht, beta, alpha);
    accumulate(gb, dz.sum(2), alpha, beta);
  }
}

void register_builtin_models() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& r = registry();
    r.add("mlp", {[](Spec&, const ModelArgs&) { return std::make_shared<Mlp>(); }, image28},
          "784-200-200-10 with ReLU (McMahan et al. 2017's 2NN)");
    r.add("cnn", {[](Spec&, const ModelArgs&) { return std::make_shared<Cnn>(); }, image28},
          "the FedAvg CNN for 1x28x28 (two 5x5 convolutions, fc 512, fc 10)");
    r.add("resnet",
          {[](Spec& s, const ModelArgs&) { return std::make_shared<ResNet8>(resnet_channels(s)); },
           [](Spec& s) {
             const int64_t in = resnet_channels(s);
             return in == 3 ? std::vector<int64_t>{3, 32, 32} : std::vector<int64_t>{1, 28, 28};
           }},
          "[in_channels=1|3] ResNet-8 with BatchNorm (16/32/64 channels)");
  });
}

void register_model(const std::string& name, ModelFactory make, const std::string& description,
                    ModelShapeFn input_shape) {
  register_builtin_models();  // first, so that a name clashing with a built-in fails here
  SPARROW_CHECK(make, "register_model: '" << name << "' has no factory");
  SPARROW_CHECK(name + ":" != kTorchScriptPrefix, "register_model: 'torchscript' is reserved for TorchScript files");
  registry().add(name, ModelEntry{std::move(make), std::move(input_shape)}, description);
}

std::shared_ptr<Model> make_model(const std::string& name, uint64_t seed) {
  ModelArgs args;
  args.seed = seed;
  return make_model(name, args);
}

std::shared_ptr<Model> make_model(const std::string& name, const ModelArgs& args) {
  if (is_torchscript(name)) return load_torchscript(name.substr(std::string(kTorchScriptPrefix).size()));
  Spec s = Spec::parse(name);
  const ModelEntry e = entry_of(s);
  std::shared_ptr<Model> model;
  {
    // manual_seed + construction must not interleave; recursive, so that a
    // factory may build another registered model.
    static std::recursive_mutex init_mutex;
    std::lock_guard<std::recursive_mutex> lock(init_mutex);
    torch::manual_seed(args.seed);
    model = e.make(s, args);
  }
  SPARROW_CHECK(model, "model '" << s.method() << "': its factory returned no model");
  s.check_all_consumed();
  return model;
}

std::vector<std::string> model_names() {
  register_builtin_models();
  return registry().names();
}

bool known_model(const std::string& name) {
  register_builtin_models();
  return registry().contains(name);
}

std::string model_description(const std::string& name) {
  register_builtin_models();
  return registry().description(name);
}

std::vector<int64_t> model_input_shape(const std::string& name) {
  SPARROW_CHECK_T(ConfigError, !is_torchscript(name),
                  "model '" << name << "': the input shape of a TorchScript model is not known");
  Spec s = Spec::parse(name);
  const ModelEntry e = entry_of(s);
  SPARROW_CHECK_T(ConfigError, e.input_shape, "model '" << name << "': its input shape is not known");
  std::vector<int64_t> shape = e.input_shape(s);
  s.check_all_consumed();
  return shape;
}

}  // namespace sparrow::core
