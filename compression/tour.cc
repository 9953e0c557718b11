#include "compression/tour.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>

#include "compression/compressor.h"
#include "core/idx.h"
#include "core/models.h"
#include "wire/roundtrip.h"

namespace sparrow::compression {

// The specs the tour (and the README) shows: every method, with the parameters
// the papers use.
static const char* const kTourSpecs[] = {
    "none",
    "fp16",
    "bf16",
    "topk:ratio=0.01",
    "topk:ratio=0.01,values=fp16",
    "topk:ratio=0.01,ef=1",
    "randomk:ratio=0.01",
    "randomk:ratio=0.01,ef=1",
    "threshold:tau=0.001",
    "dgc:ratio=0.001",
    "dgc:ratio=0.01",
    "qsgd:levels=16",
    "qsgd:levels=4",
    "terngrad",
    "sign",
    "powersgd:rank=4",
    "acp:rank=4",
};

constexpr int kTourSteps = 20;

static double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

int run_tour(const std::string& data_dir, int batch, uint64_t seed, std::ostream& out) {
  core::ImageSplit train = core::load_mnist_format(data_dir, "train");
  auto model = core::make_model("mlp", seed);
  const int64_t n = std::min<int64_t>(batch, train.images.size(0));
  at::Tensor x = train.images.narrow(0, 0, n);
  at::Tensor y = train.labels.narrow(0, 0, n);
  at::Tensor loss = torch::nn::functional::cross_entropy(model->forward(x), y);
  loss.backward();

  std::vector<std::pair<std::string, at::Tensor>> grads;
  int64_t elements = 0;
  for (const auto& p : model->named_parameters()) {
    grads.emplace_back(p.key(), p.value().grad().detach().clone());
    elements += p.value().numel();
  }
  at::Tensor flat = at::cat([&] {
    std::vector<at::Tensor> v;
    for (auto& g : grads) v.push_back(g.second.reshape(-1));
    return v;
  }());
  const double gnorm = flat.norm().item<double>();

  char line[256];
  std::snprintf(line, sizeof(line),
                "Sparrow codec tour: MLP 784-200-200-10, %lld parameters in %zu tensors,\n"
                "gradient of one Fashion-MNIST batch of %lld (loss %.4f). Bytes are whole wire messages.\n\n",
                static_cast<long long>(elements), grads.size(), static_cast<long long>(n), loss.item<double>());
  out << line;
  std::snprintf(line, sizeof(line), "%-30s %11s %8s %10s %10s %9s %9s\n", "method", "wire bytes", "ratio", "rel error",
                "mean err", "encode ms", "decode ms");
  out << line << std::string(93, '-') << "\n";
  for (const char* spec : kTourSpecs) {
    auto compressor = make_compressor(spec);
    wire::RoundTrip trip(*compressor, seed);
    // Step 1 from fresh state gives the one-shot error and the timings; the
    // same gradient sent kTourSteps times shows what error feedback and
    // unbiasedness buy: the mean of the decoded updates approaches g.
    wire::RoundTripResult r = trip.step(grads);
    std::vector<at::Tensor> first, sum;
    for (const at::Tensor& d : r.decoded) {
      first.push_back(d.clone());  // the next step reuses r's buffers
      sum.push_back(d.clone());
    }
    const size_t wire_bytes = r.wire_bytes;
    std::vector<double> enc = {r.encode_ms}, dec = {r.decode_ms};
    for (int s = 1; s < kTourSteps; ++s) {
      r = trip.step(grads);
      enc.push_back(r.encode_ms);
      dec.push_back(r.decode_ms);
      for (size_t i = 0; i < grads.size(); ++i) sum[i] += r.decoded[i];
    }
    double err2 = 0, mean2 = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      err2 += (first[i] - grads[i].second).pow(2).sum().item<double>();
      mean2 += (sum[i] / kTourSteps - grads[i].second).pow(2).sum().item<double>();
    }
    std::snprintf(line, sizeof(line), "%-30s %11zu %8.1f %10.4f %10.4f %9.3f %9.3f\n", spec, wire_bytes,
                  4.0 * static_cast<double>(elements) / static_cast<double>(wire_bytes), std::sqrt(err2) / gnorm,
                  std::sqrt(mean2) / gnorm, median(enc), median(dec));
    out << line;
  }
  out << "\nrel error = ||decoded - g|| / ||g|| for one step from fresh state. mean err = the same for the\n"
         "mean of "
      << kTourSteps
      << " decoded updates of the same g with persistent state: error feedback and\n"
         "unbiased quantisers drive it towards 0, one-step error understates them. dgc sends momentum-\n"
         "corrected velocity (momentum 0.9), so its mean exceeds g by design. Times: median of the steps.\n";
  return 0;
}

}  // namespace sparrow::compression
