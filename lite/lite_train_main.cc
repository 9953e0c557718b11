// sparrow-lite-train: trains a lite model file on synthetic data with the
// lite runtime alone (no LibTorch), and prints one JSON line: throughput and
// peak memory. What a device build is checked and measured with
// (docs/lite.md); the federated lite client comes later.
//   sparrow-lite-train MODEL.lite [--samples 600] [--epochs 1] [--batch 32]
//                      [--lr 0.01] [--momentum 0] [--seed 1] [-o TRAINED.lite]
// Exit status: 0 trained, 2 for a bad command line or model file, 1 when
// training failed.

#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <iostream>

#include "core/error_text.h"
#include "core/rng.h"
#include "kernels/gemm.h"
#include "lite/model_file.h"
#include "lite/trainer.h"

int main(int argc, char** argv) {
  CLI::App app{"sparrow-lite-train: trains a lite model file on synthetic data (LibTorch-free)"};
  std::string path, out;
  int64_t samples = 600;
  sparrow::lite::TrainConfig cfg;
  uint64_t seed = 1;
  app.add_option("model", path, "a lite model file (sparrow-lite-export)")->required();
  app.add_option("--samples", samples, "synthetic samples (uniform inputs, random labels)");
  app.add_option("--epochs", cfg.local_epochs, "local epochs");
  app.add_option("--batch", cfg.batch_size, "batch size");
  app.add_option("--lr", cfg.lr, "learning rate");
  app.add_option("--momentum", cfg.momentum, "momentum");
  app.add_option("--seed", seed, "data and order seed");
  app.add_option("-o,--output", out, "write the trained model here");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  std::shared_ptr<sparrow::lite::Model> model;
  try {
    model = sparrow::lite::load_model(path);
    sparrow::lite::validate(cfg);
    SPARROW_CHECK_T(sparrow::ConfigError, samples > 0, "--samples must be > 0");
  } catch (const std::exception& e) {
    std::cerr << "sparrow-lite-train: " << sparrow::core::peer_message(e) << "\n";
    return 2;
  }
  try {
    const int64_t d = model->input_size();
    std::vector<float> x(static_cast<size_t>(samples * d));
    std::vector<int64_t> y(static_cast<size_t>(samples));
    const uint64_t key = sparrow::rng::derive(seed, 0x64617461);
    for (size_t i = 0; i < x.size(); ++i) x[i] = sparrow::rng::uniform01(key, i);
    for (size_t i = 0; i < y.size(); ++i)
      y[i] = static_cast<int64_t>(sparrow::rng::below(key ^ 1, i, static_cast<uint64_t>(model->classes())));
    sparrow::lite::Trainer trainer(model, cfg);
    const std::vector<float> global = model->get_values();
    const auto t0 = std::chrono::steady_clock::now();
    sparrow::lite::TrainResult r = trainer.train(global, x, y, seed);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!out.empty()) {
      std::vector<float> trained = global;
      for (size_t i = 0; i < trained.size(); ++i) trained[i] += r.delta[i];
      sparrow::lite::save_model_file(out, model->spec(), trained);
    }
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    std::printf(
        "{\"program\": \"sparrow-lite-train\", \"model\": \"%s\", \"samples\": %lld, \"epochs\": %d, \"batch\": %d, "
        "\"steps\": %lld, \"mean_loss\": %.6f, \"seconds\": %.4f, \"samples_per_s\": %.1f, \"peak_rss_mb\": %.1f, "
        "\"simd\": \"%s\"}\n",
        path.c_str(), static_cast<long long>(samples), cfg.local_epochs, cfg.batch_size,
        static_cast<long long>(r.steps), r.mean_loss, secs, static_cast<double>(samples) * cfg.local_epochs / secs,
        static_cast<double>(ru.ru_maxrss) / 1024.0, sparrow::kernels::gemm_isa_name());
  } catch (const std::exception& e) {
    std::cerr << "sparrow-lite-train: " << sparrow::core::peer_message(e) << "\n";
    return 1;
  }
  return 0;
}
