// sparrow-bench split: split fine-tuning of the FedAvg CNN on Fashion-MNIST, cut
// after the convolutions (stage "conv2", activation 64x7x7 per image), with each
// activation codec against the uncompressed split in the same run.
//
// Protocol: the full CNN is pre-trained on classes 0-4 only; then, from those
// weights, every case fine-tunes the split model on all ten classes for the same
// steps, on the same batches, with the same optimiser (SGD, momentum 0.9; one
// optimiser per half, as a device and a cloud would hold). The bottom trains too
// (unless --freeze-bottom), so gradients travel back and their codec matters.
// Accuracy is measured through the same compressed path the model was trained
// with (a deployed split model infers that way). Bytes are ActPacket::wire_bytes()
// (payload + header) of the activation and the gradient of every step; labels
// (one byte per sample at most) are not counted, in any case. The uncompressed
// line also reports the fraction of exact zeros in the activation (ReLU + pool).
#include "bench/split_bench.h"

#include <torch/torch.h>

#include <chrono>
#include <iostream>

#include "core/datasets.h"
#include "core/error.h"
#include "core/json.h"
#include "core/models.h"
#include "core/rng.h"
#include "edge/act_codec.h"
#include "edge/split.h"

namespace sparrow::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kSeed = 1;
constexpr const char* kCut = "conv2";

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Batch `step` of `pool` (row indices into d): uniform draws keyed by (key, step),
// identical for every case.
core::Dataset batch_of(const core::Dataset& d, const std::vector<int64_t>& pool, uint64_t key, int64_t step,
                       int64_t batch) {
  std::vector<int64_t> idx(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i)
    idx[static_cast<size_t>(i)] =
        pool[rng::below(key, static_cast<uint64_t>(step * batch + i), static_cast<uint64_t>(pool.size()))];
  return core::select(d, idx);
}

std::vector<at::Tensor> snapshot(const core::Model& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

void restore(core::Model& m, const std::vector<at::Tensor>& w) {
  torch::NoGradGuard no_grad;
  auto params = m.parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(w[i]);
}

struct CaseResult {
  double bytes_per_step = 0;
  double accuracy = 0;
  double seconds = 0;
  double final_loss = 0;
  double zero_fraction = 0;  // of the activation values as the bottom produced them (dense packets only)
};

// Accuracy of a split model through its codec path, in batches of `batch`.
double split_accuracy(edge::EdgeHalf& e, edge::CloudHalf& c, const core::Dataset& test, int64_t batch) {
  e.bottom().train(false);
  int64_t correct = 0;
  for (int64_t i = 0; i < test.size(); i += batch) {
    const int64_t n = std::min(batch, test.size() - i);
    const at::Tensor logits = c.predict(e.infer(test.x.narrow(0, i, n)));
    correct += logits.argmax(1).eq(test.y.narrow(0, i, n)).sum().item<int64_t>();
  }
  e.bottom().train(true);
  return static_cast<double>(correct) / static_cast<double>(test.size());
}

CaseResult run_case(const std::string& act_spec, const std::string& grad_spec, const std::vector<at::Tensor>& init,
                    const core::Dataset& train, const std::vector<int64_t>& all, const core::Dataset& test,
                    const SplitBenchOptions& o) {
  auto model = core::make_model("cnn", kSeed);
  restore(*model, init);
  edge::Split split = edge::split_model(model, kCut);
  edge::EdgeHalf device(split.bottom, act_spec, o.freeze_bottom);
  edge::CloudHalf cloud(split.top, grad_spec);
  auto sgd = [&](const std::vector<at::Tensor>& params) {
    return torch::optim::SGD(params, torch::optim::SGDOptions(o.lr).momentum(0.9));
  };
  torch::optim::SGD device_opt = sgd(split.bottom.parameters());
  torch::optim::SGD cloud_opt = sgd(split.top.parameters());
  CaseResult r;
  double bytes = 0;
  const auto t0 = Clock::now();
  for (int64_t step = 0; step < o.steps; ++step) {
    const core::Dataset b = batch_of(train, all, rng::derive(kSeed, 2), step, o.batch);
    device_opt.zero_grad();
    cloud_opt.zero_grad();
    const edge::ActPacket act = device.forward(b.x);
    bytes += static_cast<double>(act.wire_bytes());
    if (act.format == edge::ActFormat::kDense)
      r.zero_fraction += edge::decode(act).eq(0).to(at::kDouble).mean().item<double>() / static_cast<double>(o.steps);
    edge::CloudHalf::Result res = cloud.step(act, b.y);
    cloud_opt.step();
    if (res.gradient) {
      bytes += static_cast<double>(res.gradient->wire_bytes());
      device.backward(*res.gradient);
      device_opt.step();
    }
    r.final_loss = res.loss;
  }
  r.seconds = seconds_since(t0);
  r.bytes_per_step = bytes / static_cast<double>(std::max<int64_t>(o.steps, 1));
  r.accuracy = split_accuracy(device, cloud, test, o.batch);
  return r;
}

// Gradients go back with the activation's codec, except after lowrank
// activations, which always get the projected gradient.
std::string grad_spec_for(const std::string& act_spec) {
  return edge::ActCodec(act_spec).lowrank() ? "none" : act_spec;
}

}  // namespace

std::vector<std::string> split_bench_default_cases() {
  return {"lowrank:rank=256,beta=0.9,refresh=75,bits=8",
          "lowrank:rank=256,beta=0.9,refresh=50,bits=8",
          "lowrank:rank=384,beta=0.9,refresh=100,bits=4",
          "lowrank:rank=64,beta=0.9,refresh=50",
          "q8",
          "q4"};
}

int bench_split(const SplitBenchOptions& o) {
  SPARROW_CHECK_T(ConfigError, o.steps >= 1 && o.batch >= 2 && o.pretrain_steps >= 0 && o.eval_samples >= 1,
                  "split bench: steps >= 1, batch >= 2, pretrain-steps >= 0, eval-samples >= 1");
  for (const std::string& c : o.cases) edge::ActCodec check(c);  // ConfigError before any work
  const std::string dir = o.data_dir.empty() ? std::string(core::kFashionMnistDir) : o.data_dir;
  const core::Dataset train = core::load_fashion_mnist(dir, "train");
  core::Dataset test = core::load_fashion_mnist(dir, "test");
  if (o.eval_samples < test.size()) {
    std::vector<int64_t> idx(static_cast<size_t>(o.eval_samples));
    for (int64_t i = 0; i < o.eval_samples; ++i) idx[static_cast<size_t>(i)] = i;
    test = core::select(test, idx);
  }
  std::vector<int64_t> half, all;
  const auto labels = train.y.accessor<int64_t, 1>();
  for (int64_t i = 0; i < train.size(); ++i) {
    all.push_back(i);
    if (labels[i] < 5) half.push_back(i);
  }

  // Pre-train the whole model on classes 0-4.
  auto model = core::make_model("cnn", kSeed);
  const auto t0 = Clock::now();
  {
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(o.lr).momentum(0.9));
    for (int64_t step = 0; step < o.pretrain_steps; ++step) {
      const core::Dataset b = batch_of(train, half, rng::derive(kSeed, 1), step, o.batch);
      opt.zero_grad();
      torch::nn::functional::cross_entropy(model->forward(b.x), b.y).backward();
      opt.step();
    }
  }
  const std::vector<at::Tensor> init = snapshot(*model);
  double pre_acc = 0;
  {
    torch::NoGradGuard no_grad;
    model->eval();
    int64_t correct = 0;
    for (int64_t i = 0; i < test.size(); i += o.batch) {
      const int64_t n = std::min(o.batch, test.size() - i);
      correct += model->forward(test.x.narrow(0, i, n)).argmax(1).eq(test.y.narrow(0, i, n)).sum().item<int64_t>();
    }
    pre_acc = static_cast<double>(correct) / static_cast<double>(test.size());
  }
  std::cout << "{\"bench\":\"split\",\"case\":\"pretrain\",\"classes\":\"0-4\",\"steps\":" << o.pretrain_steps
            << ",\"accuracy_all_classes\":" << json_number(pre_acc) << ",\"seconds\":" << json_number(seconds_since(t0))
            << "}" << std::endl;

  const CaseResult base = run_case("none", "none", init, train, all, test, o);
  auto line = [&](const std::string& act, const std::string& grad, const CaseResult& r) {
    std::cout << "{\"bench\":\"split\",\"case\":\"" << act << "\",\"grad_codec\":\"" << grad << "\",\"cut\":\"" << kCut
              << "\",\"steps\":" << o.steps << ",\"batch\":" << o.batch << ",\"bottom\":\""
              << (o.freeze_bottom ? "frozen" : "trained") << "\",\"bytes_per_step\":" << json_number(r.bytes_per_step)
              << ",\"reduction\":" << json_number(base.bytes_per_step / r.bytes_per_step)
              << ",\"accuracy\":" << json_number(r.accuracy)
              << ",\"accuracy_uncompressed\":" << json_number(base.accuracy)
              << ",\"accuracy_drop_points\":" << json_number(100.0 * (base.accuracy - r.accuracy))
              << ",\"final_loss\":" << json_number(r.final_loss) << ",\"seconds\":" << json_number(r.seconds);
    if (act == "none") std::cout << ",\"activation_zero_fraction\":" << json_number(r.zero_fraction);
    std::cout << "}" << std::endl;
  };
  line("none", o.freeze_bottom ? "none (frozen bottom)" : "none", base);
  for (const std::string& act : o.cases) {
    const std::string grad = grad_spec_for(act);
    const CaseResult r = run_case(act, grad, init, train, all, test, o);
    line(act, o.freeze_bottom ? "none (frozen bottom)" : edge::ActCodec(act).lowrank() ? "projected" : grad, r);
  }
  return 0;
}

}  // namespace sparrow::bench
