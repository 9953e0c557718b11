#pragma once
// sparrow-edge-lite's configuration: the split device's TOML file, the very
// keys of `sparrow-edge` (edge/device.h, DeviceConfig; docs/split.md), read
// without LibTorch. A key the lite device cannot honour is a ConfigError
// naming the key and why, never silently ignored: a model other than the
// built-in "mlp" and "cnn", data other than a folder of x.npy + y.npy or
// fashion-mnist, a partition of the data (clients > 1), compute threads
// beyond one, and no `weights` (the lite runtime cannot draw LibTorch's
// initial weights from `seed`). An unknown key is an error too.

#include <cstdint>
#include <string>
#include <vector>

namespace sparrow::liteedge {

// The fields and defaults of edge::DeviceConfig (edge/device.h says what each does).
struct DeviceConfig {
  std::string cloud = "tcp://127.0.0.1:7080";
  std::string cloud_key;
  std::string key;
  bool insecure = false;
  std::string device_id = "device1";
  std::string model = "mlp";
  std::string cut = "fc1";
  // The bottom's initial weights (required): a weights file as sparrow-edge
  // takes (the whole model's tensors by name, compression::State bytes), or
  // a lite model file of the whole model (sparrow-lite-export --model M --seed S).
  std::string weights;
  uint64_t seed = 0;  // batch order (initialisation: see weights)
  std::string codec = "none";
  bool freeze = false;
  double lr = 0.05;
  double momentum = 0.0;
  uint64_t batch_size = 32;
  uint64_t steps = 100;
  std::string data = "fashion-mnist";  // "fashion-mnist" or "folder:PATH"
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string partition = "iid";
  int64_t clients = 1;
  int64_t index = 0;
  uint64_t partition_seed = 0;
  uint64_t eval_samples = 1000;
  std::string progress = "edge_progress.bin";
  uint64_t save_every = 10;
  uint64_t reply_timeout_ms = 10000;
  uint64_t backoff_initial_ms = 200;
  uint64_t backoff_max_ms = 10000;
  uint64_t max_reconnects = 20;
  uint64_t max_message_mb = 64;
  int64_t threads = 0;  // 0 or 1: the lite runtime computes on the calling thread
  uint64_t fedavg_every = 0;
};

// ConfigError "<where>: config key 'k' ..." for a bad or unsupported value.
DeviceConfig parse_device_config(const std::string& toml_text, const std::vector<std::string>& overrides = {},
                                 const std::string& source = "<string>");
DeviceConfig load_device_config(const std::string& path, const std::vector<std::string>& overrides = {});

}  // namespace sparrow::liteedge
