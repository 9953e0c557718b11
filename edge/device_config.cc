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
#include "edge/device/config_keys.h"

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
  device::check_keys_without_effect(f, c);
}

}  // namespace

DeviceConfig parse_device_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                                 const std::string& source) {
  DeviceConfig c;
  core::FlatConfig f(source);
  device::bind_device_keys(f, c);
  f.read(toml_text, overrides);
  // The ranges of docs/split.md's key table, before anything is loaded;
  // validate() adds the cross-key checks.
  for (const device::KeyRange& r : device::device_key_ranges(c))
    SPARROW_CHECK_T(ConfigError, r.ok, source << ": " << r.key << ": must be " << r.what);
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
