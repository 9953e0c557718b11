// sparrow-lite-export: writes a lite model file (docs/lite.md) for the lite
// runtime from a model Sparrow trains with LibTorch.
//   sparrow-lite-export --model mlp|cnn|logreg|torchscript:FILE [--weights DIR]
//                       [--seed N] [--input-shape 1,28,28] [--input-dim D --classes C]
//                       -o model.lite
// Exit status: 0 written, 2 for a bad command line, model or weights, 1 when
// the file cannot be written.

#include <torch/script.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "core/error.h"
#include "core/error_text.h"
#include "core/models.h"
#include "core/npy.h"
#include "lite/export/exporter.h"
#include "lite/model_file.h"

namespace {

sparrow::lite::Shape parse_shape(const std::string& text) {
  sparrow::lite::Shape s;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    try {
      size_t used = 0;
      const int64_t d = std::stoll(part, &used);
      SPARROW_CHECK_T(sparrow::ConfigError, used == part.size() && d > 0, "");
      s.push_back(d);
    } catch (const std::exception&) {
      throw sparrow::ConfigError("--input-shape: '" + text + "' is not a list of positive integers (e.g. 1,28,28)");
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sparrow-lite-export: converts a Sparrow model to a lite model file for LibTorch-free devices"};
  std::string model, weights_dir, out, input_shape;
  uint64_t seed = 0;
  int64_t input_dim = 0, classes = 10;
  app.add_option("--model", model, "mlp, cnn, logreg or torchscript:FILE")->required();
  app.add_option("--weights", weights_dir,
                 "a folder of NAME.npy per parameter (sparrow-sim/sparrow-server export's weights/); "
                 "default: the model's initial weights for --seed (the file's own for torchscript)");
  app.add_option("--seed", seed, "initialisation seed of a built-in model without --weights");
  app.add_option("--input-shape", input_shape, "per-sample input shape of a TorchScript model, e.g. 1,28,28");
  app.add_option("--input-dim", input_dim, "logreg: features per sample (without --weights)");
  app.add_option("--classes", classes, "logreg: classes (without --weights)");
  app.add_option("-o,--output", out, "the lite model file to write")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  sparrow::lite::Exported e;
  try {
    const bool script = model.rfind("torchscript:", 0) == 0;
    std::map<std::string, at::Tensor> weights;
    std::vector<std::string> names;
    if (script) {
      torch::jit::Module m;
      try {
        m = torch::jit::load(model.substr(12), torch::kCPU);
      } catch (const std::exception&) {
        throw sparrow::ConfigError("TorchScript model file '" + model.substr(12) + "' could not be loaded");
      }
      for (const auto& p : m.named_parameters(true)) names.push_back(p.name);
      if (!weights_dir.empty()) {
        torch::NoGradGuard g;
        for (const auto& p : m.named_parameters(true)) {
          std::string key = p.name;
          std::replace(key.begin(), key.end(), '.', '_');
          const auto a = sparrow::npy::read(weights_dir + "/" + key + ".npy");
          p.value.copy_(at::from_blob(const_cast<float*>(a.data.data()), a.shape, at::kFloat));
        }
      }
      e = sparrow::lite::export_torchscript(m, input_shape.empty() ? sparrow::lite::Shape{} : parse_shape(input_shape));
    } else {
      SPARROW_CHECK_T(sparrow::ConfigError, input_shape.empty(), "--input-shape is for TorchScript models only");
      if (!weights_dir.empty()) {
        for (const auto& f : std::filesystem::directory_iterator(weights_dir)) {
          if (f.path().extension() != ".npy") continue;
          const auto a = sparrow::npy::read(f.path().string());
          weights[f.path().stem().string()] =
              at::from_blob(const_cast<float*>(a.data.data()), a.shape, at::kFloat).clone();
        }
      } else if (model == "logreg") {
        SPARROW_CHECK_T(sparrow::ConfigError, input_dim > 0 && classes > 0,
                        "logreg without --weights needs --input-dim and --classes");
        weights["fc.weight"] = at::zeros({classes, input_dim});
        weights["fc.bias"] = at::zeros({classes});
      } else {
        auto m = sparrow::core::make_model(model, seed);
        for (const auto& p : m->named_parameters()) weights[p.key()] = p.value().detach().clone();
      }
      e = sparrow::lite::export_builtin(model, weights);
    }
  } catch (const std::exception& err) {
    std::cerr << "sparrow-lite-export: " << sparrow::core::peer_message(err) << "\n";
    return 2;
  }
  try {
    sparrow::lite::save_model_file(out, e.spec, e.values);
  } catch (const std::exception& err) {
    std::cerr << "sparrow-lite-export: " << sparrow::core::peer_message(err) << "\n";
    return 1;
  }
  std::cout << out << ": " << e.spec.layers.size() << " layers, " << e.values.size() << " parameter values\n";
  return 0;
}
