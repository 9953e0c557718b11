#include "liteedge/config.h"

#include <filesystem>

#include "core/error.h"
#include "core/flat_config.h"
#include "core/peer_text.h"
#include "edge/codec/act_codec_flat.h"
#include "lite/model.h"
#include "wire/net.h"

namespace sparrow::liteedge {
namespace {

namespace fs = std::filesystem;

void bind_all(core::FlatConfig& f, DeviceConfig& c) {
  f.bind("cloud", &c.cloud);
  f.bind("cloud_key", &c.cloud_key);
  f.bind("key", &c.key);
  f.bind("insecure", &c.insecure);
  f.bind("device_id", &c.device_id);
  f.bind("model", &c.model);
  f.bind("cut", &c.cut);
  f.bind("weights", &c.weights);
  f.bind("seed", &c.seed);
  f.bind("codec", &c.codec);
  f.bind("freeze", &c.freeze);
  f.bind("lr", &c.lr);
  f.bind("momentum", &c.momentum);
  f.bind("batch_size", &c.batch_size);
  f.bind("steps", &c.steps);
  f.bind("data", &c.data);
  f.bind("data_dir", &c.data_dir);
  f.bind("partition", &c.partition);
  f.bind("clients", &c.clients);
  f.bind("index", &c.index);
  f.bind("partition_seed", &c.partition_seed);
  f.bind("eval_samples", &c.eval_samples);
  f.bind("progress", &c.progress);
  f.bind("save_every", &c.save_every);
  f.bind("reply_timeout_ms", &c.reply_timeout_ms);
  f.bind("backoff_initial_ms", &c.backoff_initial_ms);
  f.bind("backoff_max_ms", &c.backoff_max_ms);
  f.bind("max_reconnects", &c.max_reconnects);
  f.bind("max_message_mb", &c.max_message_mb);
  f.bind("threads", &c.threads);
  f.bind("fedavg_every", &c.fedavg_every);
}

// The ranges of docs/split.md's key table (sparrow-edge's own checks).
void check_ranges(const core::FlatConfig& f, const DeviceConfig& c) {
  f.check("lr", c.lr > 0 && c.lr <= 10, "must be in (0, 10]");
  f.check("momentum", c.momentum >= 0 && c.momentum < 1, "must be in [0, 1)");
  f.check("batch_size", c.batch_size >= 1 && c.batch_size <= 65536, "must be in [1, 65536]");
  f.check("steps", c.steps >= 1 && c.steps <= 1000000000, "must be in [1, 1000000000]");
  f.check("eval_samples", c.eval_samples <= 10000000, "must be in [0, 10000000]");
  f.check("save_every", c.save_every >= 1 && c.save_every <= 1000000000, "must be in [1, 1000000000]");
  f.check("reply_timeout_ms", c.reply_timeout_ms >= 10 && c.reply_timeout_ms <= 3600000, "must be in [10, 3600000]");
  f.check("backoff_initial_ms", c.backoff_initial_ms >= 1 && c.backoff_initial_ms <= 600000, "must be in [1, 600000]");
  f.check("backoff_max_ms", c.backoff_max_ms >= c.backoff_initial_ms && c.backoff_max_ms <= 3600000,
          "must be in [backoff_initial_ms, 3600000]");
  f.check("max_reconnects", c.max_reconnects <= 1000000000, "must be in [0, 1000000000]");
  f.check("max_message_mb", c.max_message_mb >= 1 && c.max_message_mb <= 2047, "must be in [1, 2047]");
  f.check("fedavg_every", c.fedavg_every <= 1000000000, "must be in [0, 1000000000] (0 = off)");
  f.check("clients", c.clients >= 1 && c.clients <= 1000000, "must be in [1, 1000000]");
}

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
  for (const char* k : {"lr", "momentum"})
    f.check(k, !c.freeze || !f.has(k), "has no effect with freeze = true (the bottom does not train)");
  f.check("save_every", !c.progress.empty() || !f.has("save_every"),
          "has no effect with progress = \"\" (no progress file is written)");
  if (c.insecure && f.where("insecure") != "--set")  // --insecure on a secure file is the documented try-out
    for (const char* k : {"cloud_key", "key"})
      f.check(k, !f.has(k), "has no effect with insecure = true (plain TCP, no CURVE keys)");
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
  bind_all(f, c);
  f.read(toml_text, overrides);
  f.check_finite();
  check_ranges(f, c);
  check_cross_keys(f, c);
  check_lite_keys(f, c);
  return c;
}

DeviceConfig load_device_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_device_config(core::read_config_file(path), overrides, path);
}

}  // namespace sparrow::liteedge
