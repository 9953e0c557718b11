#include "client/data_folder.h"

#include <torch/torch.h>

#include "core/datasets.h"
#include "core/error.h"
#include "core/flat_config.h"
#include "core/idx.h"
#include "core/partition.h"
#include "core/spec.h"

namespace sparrow::client {
namespace {

constexpr const char* kSources = "fashion-mnist, synthetic[:alpha=A,beta=B], folder:PATH";

bool is_folder(const std::string& data) { return data.rfind("folder:", 0) == 0; }

// This client's shard of a folder: the partition every program computes
// (core::partition_folder), so shard `index` is the simulator's client `index`.
core::Dataset folder_shard(const DataConfig& cfg, const std::string& path, core::Dataset all) {
  const std::optional<at::Tensor> ids = core::load_client_ids(path, all.size());
  if (cfg.partition == "natural") {
    const auto parts = core::partition_folder(all.y, ids, 0, cfg.partition, 0);
    SPARROW_CHECK_T(ConfigError, cfg.index >= 0 && static_cast<size_t>(cfg.index) < parts.size(),
                    "index: must be in [0, " << parts.size() << "): " << path << "/" << core::kClientIdFile << " has "
                                             << parts.size() << " distinct client ids, got " << cfg.index);
    return core::select(all, parts[static_cast<size_t>(cfg.index)]);
  }
  if (cfg.clients == 1) return all;  // one shard: the whole folder, in its order
  SPARROW_CHECK_T(ConfigError, cfg.clients <= all.size(),
                  "clients: " << cfg.clients << " shards but " << path << " has " << all.size() << " samples");
  const auto parts = core::partition_folder(all.y, ids, cfg.clients, cfg.partition, cfg.partition_seed);
  return core::select(all, parts[static_cast<size_t>(cfg.index)]);
}

}  // namespace

void check_data_keys(const core::FlatConfig& f, DataConfig& d) {
  const bool folder = is_folder(d.data);
  std::string method;
  if (folder) {
    f.check("data", d.data.size() > 7, "'folder:PATH' needs a path");
  } else {
    try {
      method = Spec::parse(d.data).method();
    } catch (const ConfigError& e) {
      f.fail("data", std::string("is not a data source (") + kSources + "): " + e.what());
    }
    f.check("data", method == "fashion-mnist" || method == "synthetic",
            "has unknown source '" + d.data + "' (expected one of " + kSources + ")");
  }
  const bool synthetic = method == "synthetic";
  const std::string path = folder ? d.data.substr(7) : "";
  const std::string source = "data = \"" + d.data + "\"";
  f.check("data_dir", !f.has("data_dir") || method == "fashion-mnist",
          "has no effect with " + source + ": it is where the fashion-mnist files are read");
  f.check("partition", !(synthetic && f.has("partition")),
          "has no effect with synthetic data: LEAF Synthetic generates each client's own data "
          "(clients, index and partition_seed choose it)");
  const bool ids = folder && core::has_client_ids(path);
  if (ids && !f.has("partition")) d.partition = "natural";  // the folder's own clients
  const bool natural = d.partition == "natural";
  f.check("partition", !natural || ids,
          "\"natural\" needs a data folder with its own client ids (" + std::string(core::kClientIdFile) +
              ", one per sample)" + (folder ? "; " + path + " has none" : ""));
  if (natural) {
    const std::string why = "has no effect with the natural partition: " + path + "/" + core::kClientIdFile +
                            " decides the clients and index picks one (the index-th distinct id, ascending)";
    f.check("clients", !f.has("clients"), why);
    f.check("partition_seed", !f.has("partition_seed"), why);
    f.check("index", d.index >= 0, "must be >= 0");
    return;
  }
  f.check("clients", d.clients >= 1 && d.clients <= 10000000, "must be in [1, 10000000]");
  f.check("index", d.index >= 0 && d.index < d.clients, "must be in [0, clients = " + std::to_string(d.clients) + ")");
  if (synthetic) return;  // partition_seed seeds the generator, whatever clients
  // By value: "iid" and seed 0 (the defaults) are what one shard means anyway,
  // and generated configs (sparrow-server try, tests) write them for any clients.
  const std::string one = "has no effect with clients = 1: one shard is all the data (set clients to the shards)";
  f.check("partition", d.clients > 1 || d.partition == DataConfig{}.partition, one);
  f.check("partition_seed", d.clients > 1 || d.partition_seed == DataConfig{}.partition_seed, one);
  if (folder) {  // the partition spec, before any file is read
    try {
      Spec::parse(d.partition);
    } catch (const ConfigError& e) {
      f.fail("partition", std::string("is not a valid spec: ") + e.what());
    }
  }
}

core::Dataset load_client_data(const DataConfig& cfg, const std::string& model) {
  // "folder:PATH" first: a path is no spec (it may hold '=' or ',').
  if (is_folder(cfg.data)) {
    const std::string path = cfg.data.substr(7);
    SPARROW_CHECK_T(ConfigError, !path.empty(), "data: 'folder:PATH' needs a path");
    SPARROW_CHECK_T(ConfigError,
                    cfg.partition == "natural" || (cfg.clients >= 1 && cfg.index >= 0 && cfg.index < cfg.clients),
                    "index: must be in [0, clients = " << cfg.clients << "), got " << cfg.index);
    return folder_shard(cfg, path, check_data_for_model(load_data_folder(path), model));
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
    throw ConfigError("data: unknown source '" + cfg.data + "' (" + kSources + ")");
  }
  return check_data_for_model(std::move(d), model);
}

}  // namespace sparrow::client
