#include "liteedge/config.h"

#include <filesystem>

#include "core/error.h"
#include "core/flat_config.h"
#include "core/peer_text.h"
#include "edge/device/config_keys.h"
#include "edge/codec/act_codec_flat.h"
#include "lite/model.h"
#include "wire/net.h"

namespace sparrow::liteedge {
namespace {

namespace fs = std::filesystem;

// The keys sparrow-edge checks across each other (edge/device_config.cc).
void check_cross_keys(const core::FlatConfig& f, const DeviceConfig& c) {
  f.check("cloud", !c.cloud.empty(), "must not be empty");
  try {
    net::check_endpoint("cloud", c.cloud, /*for_bind=*/false);
  } catch (const ConfigError& e) {
    f.fail("cloud", e.what());
  }
  f.check("device_id", core::valid_client_id(c.device_id), core::client_id_problem(c.device_id));
  if (!c.insecure) {
    f.check("cloud_key", !c.cloud_key.empty(), "must be set (or insecure = true)");
    f.check("key", !c.key.empty(), "must be set (or insecure = true)");
  }
  edge::device::check_keys_without_effect(f, c);
}

// What the lite runtime cannot do, refused by key.
void check_lite_keys(const core::FlatConfig& f, const DeviceConfig& c) {
  try {
    lite::builtin_stages(c.model);
  } catch (const Error& e) {
    f.fail("model", std::string("is not supported by sparrow-edge-lite: ") + e.what());
  }
  try {
    lite::builtin_cut(c.model, c.cut);
  } catch (const Error& e) {
    f.fail("cut", e.what());
  }
  try {
    edge::flat::ActCodec codec(c.codec);
  } catch (const Error& e) {
    f.fail("codec", e.what());
  }
  f.check("weights", !c.weights.empty(),
          "must be set for sparrow-edge-lite: the lite runtime cannot draw LibTorch's initial weights from `seed`; "
          "give the cloud's weights file, or write the model's initial weights with `sparrow-lite-export --model " +
              c.model + " --seed " + std::to_string(c.seed) + " -o FILE`");
  f.check("threads", c.threads == 0 || c.threads == 1,
          "must be 0 or 1: sparrow-edge-lite computes on one thread (the lite runtime)");
  const bool folder = c.data.rfind("folder:", 0) == 0;
  f.check("data", folder ? c.data.size() > 7 : c.data == "fashion-mnist",
          "must be \"folder:PATH\" (x.npy + y.npy) or \"fashion-mnist\" for sparrow-edge-lite");
  f.check("data_dir", !f.has("data_dir") || !folder, "has no effect with data = \"" + c.data + "\"");
  const std::string whole =
      "is not supported by sparrow-edge-lite: it trains on all of its data (clients = 1; give each device a "
      "data folder of its own)";
  f.check("clients", c.clients == 1, whole);
  f.check("index", c.index == 0, whole);
  f.check("partition", c.partition == "iid", whole);
  f.check("partition_seed", c.partition_seed == 0, whole);
  if (!folder) return;
  const fs::path dir = c.data.substr(7);
  f.check("data", !fs::exists(dir / "client_id.npy"),
          "holds client_id.npy (its own partition), which sparrow-edge-lite does not read: give the device a "
          "folder of its own data");
  // The folder's test split: sparrow-edge-lite reads test/x.npy + test/y.npy.
  const bool npy_test = fs::exists(dir / "test" / "x.npy") && fs::exists(dir / "test" / "y.npy");
  const bool other_test = !npy_test && (fs::exists(dir / "test") || fs::exists(dir / "t10k-images-idx3-ubyte") ||
                                        fs::exists(dir / "t10k-images-idx3-ubyte.gz"));
  if (c.eval_samples > 0 && other_test)
    f.fail("eval_samples",
           "cannot be honoured: sparrow-edge-lite reads a folder's test split from test/x.npy + "
           "test/y.npy only, and " +
               dir.string() +
               " has another form; convert it or set "
               "eval_samples = 0");
  if (c.eval_samples > 0 && f.has("eval_samples") && fs::is_directory(dir))
    f.check("eval_samples", npy_test,
            "has nothing to evaluate: " + dir.string() +
                " has no test split (test/x.npy + test/y.npy); add one or set eval_samples = 0");
}

}  // namespace

DeviceConfig parse_device_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                                 const std::string& source) {
  DeviceConfig c;
  core::FlatConfig f(source);
  edge::device::bind_device_keys(f, c);
  f.read(toml_text, overrides);
  f.check_finite();
  // The ranges of docs/split.md's key table (sparrow-edge's own).
  for (const edge::device::KeyRange& r : edge::device::device_key_ranges(c)) f.check(r.key, r.ok, "must be " + r.what);
  check_cross_keys(f, c);
  check_lite_keys(f, c);
  return c;
}

DeviceConfig load_device_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_device_config(core::read_config_file(path), overrides, path);
}

}  // namespace sparrow::liteedge
