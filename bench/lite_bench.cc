// sparrow-lite-bench: the lite runtime (lite/) against the LibTorch client's
// LocalTrainer on the same model, data and config, one thread, in the same
// run; and the lite device binary's footprint. One JSON line per figure.
//   sparrow-lite-bench [--samples 600] [--repeat 5] [--epochs 1] [--batch 32]
// Peak RSS comes from sparrow-lite-train (next to this binary), a process
// that loads no LibTorch, training the same model on as many samples.

#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "client/trainer.h"
#include "core/json.h"
#include "core/models.h"
#include "lite/export/exporter.h"
#include "kernels/gemm.h"
#include "lite/model_file.h"
#include "lite/trainer.h"

namespace {

namespace fs = std::filesystem;
using namespace sparrow;

template <typename F>
double median_s(int repeat, F&& f) {
  f();  // warm-up: buffers, caches, JIT kernels
  std::vector<double> t;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::string run(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  pclose(p);
  return out;
}

// The number after "key": in a JSON line (the tool's own output).
double field(const std::string& line, const std::string& key) {
  const auto at = line.find("\"" + key + "\":");
  return at == std::string::npos ? -1 : std::atof(line.c_str() + at + key.size() + 3);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sparrow-lite-bench: lite runtime vs LibTorch LocalTrainer, one thread"};
  int64_t samples = 600;
  int repeat = 5;
  client::TrainConfig cfg;
  cfg.lr = 0.01;
  app.add_option("--samples", samples, "training samples per train() call");
  app.add_option("--repeat", repeat, "timed train() calls per runtime (median)");
  app.add_option("--epochs", cfg.local_epochs, "local epochs");
  app.add_option("--batch", cfg.batch_size, "batch size");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  at::set_num_threads(1);
  const fs::path bin = fs::canonical(fs::path(argv[0])).parent_path();
  const std::string lite_train = (bin / "sparrow-lite-train").string();
  for (const std::string name : {"mlp", "cnn"}) {
    auto model = core::make_model(name, 1);
    client::Weights global = client::get_weights(*model);
    lite::Exported e = lite::export_builtin(name, global);
    torch::manual_seed(2);
    const std::vector<int64_t> shape =
        name == "mlp" ? std::vector<int64_t>{samples, 784} : std::vector<int64_t>{samples, 1, 28, 28};
    at::Tensor x = at::rand(shape), y = at::randint(0, 10, {samples}, at::kLong);
    std::vector<float> xv(x.data_ptr<float>(), x.data_ptr<float>() + x.numel());
    std::vector<int64_t> yv(y.data_ptr<int64_t>(), y.data_ptr<int64_t>() + samples);

    client::LocalTrainer torch_trainer(model, cfg);
    const double torch_s = median_s(repeat, [&] { torch_trainer.train(global, x, y, 3); });
    lite::TrainConfig lc;
    lc.local_epochs = cfg.local_epochs;
    lc.batch_size = cfg.batch_size;
    lc.lr = cfg.lr;
    lite::Trainer lite_trainer(std::make_shared<lite::Model>(e.spec), lc);
    const double lite_s = median_s(repeat, [&] { lite_trainer.train(e.values, xv, yv, 3); });

    const std::string file = (fs::temp_directory_path() / ("sparrow-lite-bench-" + name + ".lite")).string();
    lite::save_model_file(file, e.spec, e.values);
    std::ostringstream cmd;
    cmd << lite_train << " " << file << " --samples " << samples << " --epochs " << cfg.local_epochs << " --batch "
        << cfg.batch_size;
    const std::string line = run(cmd.str());
    fs::remove(file);
    const double n = static_cast<double>(samples) * cfg.local_epochs;
    std::cout << "{\"bench\":\"lite\",\"model\":" << json_string(name) << ",\"samples\":" << samples
              << ",\"epochs\":" << cfg.local_epochs << ",\"batch\":" << cfg.batch_size << ",\"threads\":1"
              << ",\"libtorch_samples_per_s\":" << json_number(n / torch_s)
              << ",\"lite_samples_per_s\":" << json_number(n / lite_s)
              << ",\"lite_vs_libtorch\":" << json_number(torch_s / lite_s)
              << ",\"lite_peak_rss_mb\":" << json_number(field(line, "peak_rss_mb"))
              << ",\"lite_simd\":" << json_string(kernels::gemm_isa_name()) << "}" << std::endl;
  }
  // Footprint: the lite binary and every shared library it needs beyond
  // libc, libstdc++, libm (and the dynamic loader and vDSO, part of libc).
  const auto binary_bytes = static_cast<double>(fs::file_size(lite_train));
  double extra = 0;
  std::string libs;
  std::istringstream ldd(run("ldd " + lite_train));
  for (std::string l; std::getline(ldd, l);) {
    const auto arrow = l.find("=> ");
    if (arrow == std::string::npos) continue;
    std::string path = l.substr(arrow + 3);
    path = path.substr(0, path.find(' '));
    const std::string base = fs::path(path).filename().string();
    if (base.rfind("libc.so", 0) == 0 || base.rfind("libstdc++", 0) == 0 || base.rfind("libm.so", 0) == 0) continue;
    if (!fs::exists(path)) continue;
    extra += static_cast<double>(fs::file_size(fs::canonical(path)));
    libs += (libs.empty() ? "" : ",") + json_string(base);
  }
  std::cout << "{\"bench\":\"lite_footprint\",\"binary\":\"sparrow-lite-train\",\"binary_mb\":"
            << json_number(binary_bytes / 1e6) << ",\"extra_libs\":[" << libs
            << "],\"extra_libs_mb\":" << json_number(extra / 1e6)
            << ",\"total_mb\":" << json_number((binary_bytes + extra) / 1e6) << "}" << std::endl;
  return 0;
}
