#include "client/data_folder.h"

#include <torch/torch.h>

#include "core/datasets.h"
#include "core/error.h"
#include "core/idx.h"
#include "core/partition.h"
#include "core/spec.h"

namespace sparrow::client {

core::Dataset load_client_data(const DataConfig& cfg, const std::string& model) {
  // "folder:PATH" first: a path is no spec (it may hold '=' or ',').
  if (cfg.data.rfind("folder:", 0) == 0) {
    const std::string path = cfg.data.substr(7);
    SPARROW_CHECK_T(ConfigError, !path.empty(), "data: 'folder:PATH' needs a path");
    return check_data_for_model(load_data_folder(path), model);
  }
  Spec spec = Spec::parse(cfg.data);
  SPARROW_CHECK_T(ConfigError, cfg.clients >= 1, "clients: must be >= 1");
  SPARROW_CHECK_T(ConfigError, cfg.index >= 0 && cfg.index < cfg.clients,
                  "index: must be in [0, clients = " << cfg.clients << "), got " << cfg.index);
  core::Dataset d;
  if (spec.method() == "fashion-mnist") {
    spec.check_all_consumed();
    // Only this client's share becomes floats (600 samples are 1.9 MB; the
    // whole split would be 188 MB of fresh pages at every start).
    const core::ImageSplit raw = core::load_mnist_bytes(cfg.data_dir, "train");
    const auto parts = core::partition(raw.labels, cfg.clients, cfg.partition, cfg.partition_seed);
    const core::Dataset mine =
        core::select(core::Dataset{raw.images, raw.labels}, parts[static_cast<size_t>(cfg.index)]);
    d = core::Dataset{core::normalize_bytes(mine.x, core::kFashionMnistMean, core::kFashionMnistStd), mine.y};
  } else if (spec.method() == "synthetic") {
    const double a = spec.get_double("alpha", 1.0), b = spec.get_double("beta", 1.0);
    spec.check_all_consumed();
    core::FederatedData fd = core::make_synthetic(a, b, cfg.clients, cfg.partition_seed);
    d = fd.train[static_cast<size_t>(cfg.index)];
  } else {
    throw ConfigError("data: unknown source '" + cfg.data +
                      "' (fashion-mnist, synthetic[:alpha=A,beta=B], folder:PATH)");
  }
  return check_data_for_model(std::move(d), model);
}

}  // namespace sparrow::client
