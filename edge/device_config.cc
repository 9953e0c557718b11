// DeviceConfig's TOML keys and their checks across keys, and the device's
// data (edge/device.h): the same data keys and shards as sparrow-client's
// (client/data_folder.h), plus the test split the device evaluates on.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "client/data_folder.h"
#include "core/data_folder.h"
#include "core/datasets.h"
#include "core/error.h"
#include "core/flat_config.h"
#include "core/spec.h"
#include "edge/cloud.h"
#include "edge/device.h"

namespace sparrow::edge {

namespace {

// The device's data as client::DataConfig (the same keys as sparrow-client's).
client::DataConfig data_config(const DeviceConfig& cfg) {
  client::DataConfig dc;
  dc.data = cfg.data;
  dc.data_dir = cfg.data_dir;
  dc.partition = cfg.partition;
  dc.clients = static_cast<int>(cfg.clients);
  dc.index = static_cast<int>(cfg.index);
  dc.partition_seed = cfg.partition_seed;
  return dc;
}

// No key without an effect (docs/split.md): the data keys as sparrow-client
// checks them, and the keys a mode makes meaningless.
void check_device_keys(const core::FlatConfig& f, DeviceConfig& c) {
  client::DataConfig dc = data_config(c);
  client::check_data_keys(f, dc);
  c.partition = dc.partition;  // "natural" for a folder with its own client ids
  const bool folder = c.data.rfind("folder:", 0) == 0;
  if (folder && c.eval_samples > 0 && f.has("eval_samples") && std::filesystem::is_directory(c.data.substr(7)))
    f.check("eval_samples", core::has_data_folder_test(c.data.substr(7)),
            "has nothing to evaluate: " + c.data.substr(7) +
                " has no test split (a test/ folder, or t10k-*-ubyte files); add one or set eval_samples = 0");
  for (const char* k : {"lr", "momentum"})
    f.check(k, !c.freeze || !f.has(k), "has no effect with freeze = true (the bottom does not train)");
  f.check("save_every", !c.progress.empty() || !f.has("save_every"),
          "has no effect with progress = \"\" (no progress file is written)");
  if (c.insecure && f.where("insecure") != "--set")  // --insecure on a secure file is the documented try-out
    for (const char* k : {"cloud_key", "key"})
      f.check(k, !f.has(k), "has no effect with insecure = true (plain TCP, no CURVE keys)");
}

}  // namespace

DeviceConfig parse_device_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                                 const std::string& source) {
  DeviceConfig c;
  const core::FlatConfig f = read_flat_config(toml_text, source,
                                              {{"cloud", &c.cloud},
                                               {"cloud_key", &c.cloud_key},
                                               {"key", &c.key},
                                               {"insecure", &c.insecure},
                                               {"device_id", &c.device_id},
                                               {"model", &c.model},
                                               {"cut", &c.cut},
                                               {"weights", &c.weights},
                                               {"seed", &c.seed},
                                               {"codec", &c.codec},
                                               {"freeze", &c.freeze},
                                               {"lr", &c.lr},
                                               {"momentum", &c.momentum},
                                               {"batch_size", &c.batch_size},
                                               {"steps", &c.steps},
                                               {"data", &c.data},
                                               {"data_dir", &c.data_dir},
                                               {"partition", &c.partition},
                                               {"clients", &c.clients},
                                               {"index", &c.index},
                                               {"partition_seed", &c.partition_seed},
                                               {"eval_samples", &c.eval_samples},
                                               {"progress", &c.progress},
                                               {"save_every", &c.save_every},
                                               {"reply_timeout_ms", &c.reply_timeout_ms},
                                               {"backoff_initial_ms", &c.backoff_initial_ms},
                                               {"backoff_max_ms", &c.backoff_max_ms},
                                               {"max_reconnects", &c.max_reconnects},
                                               {"max_message_mb", &c.max_message_mb},
                                               {"threads", &c.threads},
                                               {"fedavg_every", &c.fedavg_every}},
                                              overrides);
  // The ranges of docs/split.md's key table, before anything is loaded (NaN
  // fails every comparison); validate() adds the cross-key checks.
  auto range = [&](const char* key, bool ok, const std::string& what) {
    SPARROW_CHECK_T(ConfigError, ok, source << ": " << key << ": must be " << what);
  };
  range("lr", c.lr > 0 && c.lr <= 10, "in (0, 10]");
  range("momentum", c.momentum >= 0 && c.momentum < 1, "in [0, 1)");
  range("batch_size", c.batch_size >= 1 && c.batch_size <= 65536, "in [1, 65536]");
  range("steps", c.steps >= 1 && c.steps <= 1000000000, "in [1, 1000000000]");
  range("eval_samples", c.eval_samples <= 10000000, "in [0, 10000000]");
  range("save_every", c.save_every >= 1 && c.save_every <= 1000000000, "in [1, 1000000000]");
  range("reply_timeout_ms", c.reply_timeout_ms >= 10 && c.reply_timeout_ms <= 3600000, "in [10, 3600000]");
  range("backoff_initial_ms", c.backoff_initial_ms >= 1 && c.backoff_initial_ms <= 600000, "in [1, 600000]");
  range("backoff_max_ms", c.backoff_max_ms >= c.backoff_initial_ms && c.backoff_max_ms <= 3600000,
        "in [backoff_initial_ms, 3600000]");
  range("max_reconnects", c.max_reconnects <= 1000000000, "in [0, 1000000000]");
  range("max_message_mb", c.max_message_mb >= 1 && c.max_message_mb <= 2047, "in [1, 2047]");
  range("threads", c.threads >= 0 && c.threads <= 1024, "in [0, 1024] (0 = one per core)");
  range("clients", c.clients >= 1 && c.clients <= 1000000, "in [1, 1000000]");
  range("fedavg_every", c.fedavg_every <= 1000000000, "in [0, 1000000000] (0 = off)");
  check_device_keys(f, c);
  return c;
}

DeviceConfig load_device_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_device_config(core::read_config_file(path), overrides, path);
}

DeviceData load_device_data(const DeviceConfig& cfg) {
  DeviceData d;
  d.train = client::load_client_data(data_config(cfg), cfg.model);
  if (cfg.eval_samples == 0) return d;
  core::Dataset test;
  if (cfg.data.rfind("folder:", 0) == 0) {  // the folder's own test split, as the simulator's
    const std::string path = cfg.data.substr(7);
    std::optional<core::Dataset> t = client::load_data_folder_test(path);
    if (!t) {
      spdlog::info("event=no_eval msg=\"{} has no test split (test/ or t10k files): no evaluation\"", path);
      return d;
    }
    test = std::move(*t);
  } else if (Spec spec = Spec::parse(cfg.data); spec.method() == "fashion-mnist") {
    test = core::load_fashion_mnist(cfg.data_dir, "test");
  } else {
    const double a = spec.get_double("alpha", 1.0), b = spec.get_double("beta", 1.0);
    test = core::make_synthetic(a, b, static_cast<int>(cfg.clients), cfg.partition_seed).test[cfg.index];
  }
  const int64_t n = std::min<int64_t>(test.size(), static_cast<int64_t>(cfg.eval_samples));
  if (n == 0) return d;
  test.x = test.x.slice(0, 0, n).contiguous();
  test.y = test.y.slice(0, 0, n).contiguous();
  d.test = client::check_data_for_model(std::move(test), cfg.model);
  return d;
}

}  // namespace sparrow::edge
