#pragma once
// The device side of networked split fine-tuning (docs/split.md, "Networked
// device and cloud"): `sparrow-edge --config edge.toml`.
//
// The protocol (Hello / Welcome, SplitActivation / SplitGradient with resends
// and backoff, the progress file and step log, SplitFed rounds, evaluation)
// is edge/device/protocol.h, written once and shared with the torch-free
// sparrow-edge-lite; this is its LibTorch bottom (the model's bottom split at
// `cut`, EdgeHalf and the bottom's Sgd) and the device's config and data.
//
// Threads: run() on one thread; stop() from any thread or a signal handler.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/datasets.h"
#include "core/error.h"
#include "edge/device/protocol.h"

namespace sparrow::edge {

struct DeviceConfig {
  std::string cloud = "tcp://127.0.0.1:7080";  // the cloud's ROUTER endpoint
  std::string cloud_key;                       // cloud public key file (.key or .key_secret)
  std::string key;                             // own key pair (.key_secret)
  bool insecure = false;                       // plain TCP (logs a warning)
  std::string device_id = "device1";           // Hello.client_id: 1..256 bytes, bound to `key` by the cloud
  std::string model = "mlp";                   // must equal the cloud's model and cut
  std::string cut = "fc1";
  std::string weights;         // optional weights file (cloud.h save_weights) for the whole model
  uint64_t seed = 0;           // model initialisation and batch order
  std::string codec = "none";  // ActCodec spec of the activation
  bool freeze = false;         // frozen bottom: no gradient comes back
  double lr = 0.05;            // bottom optimiser (Sgd)
  double momentum = 0.0;
  uint64_t batch_size = 32;
  uint64_t steps = 100;  // total training steps of the run (a resumed device does the rest)
  // Data (client/data_folder.h): "fashion-mnist", "synthetic[:alpha=A,beta=B]", "folder:PATH".
  std::string data = "fashion-mnist";
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string partition = "iid";
  int64_t clients = 1;
  int64_t index = 0;
  uint64_t partition_seed = 0;
  uint64_t eval_samples = 1000;                // test samples evaluated at the end (0: none)
  std::string progress = "edge_progress.bin";  // local progress file ("" = none)
  uint64_t save_every = 10;                    // steps between progress saves (>= 1)
  uint64_t reply_timeout_ms = 10000;           // no reply within this: reconnect and resend
  uint64_t backoff_initial_ms = 200;
  uint64_t backoff_max_ms = 10000;
  uint64_t max_reconnects = 20;  // consecutive failed attempts before giving up (Error)
  uint64_t max_message_mb = 64;
  // Compute threads (ATen intra-op and the BLAS); 0 = one per core. Set 1 when
  // the cloud and devices share a machine: spinning threads of two processes
  // on the same cores slow both several times over.
  int64_t threads = 0;
  // SplitFed: every fedavg_every steps the bottom is sent (dense ModelUpdate,
  // weight = training samples) and replaced by the cloud's average over its
  // fedavg_devices devices. 0: off. The cloud must have SplitFed on.
  uint64_t fedavg_every = 0;
};

DeviceConfig load_device_config(const std::string& path, const std::vector<std::string>& overrides = {});
DeviceConfig parse_device_config(const std::string& toml_text, const std::vector<std::string>& overrides = {},
                                 const std::string& source = "<string>");

// The train and test data the config names (test: the first eval_samples of the
// dataset's test split; empty for "folder:" data). ConfigError/FormatError.
struct DeviceData {
  core::Dataset train, test;
};
DeviceData load_device_data(const DeviceConfig& cfg);

// Rows of minibatch `step` (1-based): epochs of floor(n / batch) batches (at
// least one), each epoch a permutation drawn from (seed, epoch) with core/rng.
// A pure function, so a resumed device and a test replay the same batches.
using device::batch_indices;

class EdgeDevice {
 public:
  // steps, bytes_up / bytes_down, accuracy (-1 when nothing was evaluated),
  // eval_samples, reconnects, resent, skipped, fed_rounds; json() is one line.
  using Summary = device::Summary;

  // Validates the config, builds the model and the split, loads keys
  // (ConfigError) and the progress file when present (FormatError when it does
  // not fit the bottom). Connects nothing yet.
  EdgeDevice(DeviceConfig cfg, DeviceData data);
  ~EdgeDevice();
  EdgeDevice(const EdgeDevice&) = delete;
  EdgeDevice& operator=(const EdgeDevice&) = delete;

  // Trains to cfg.steps, evaluates, saves progress. Throws sparrow::Error when
  // the cloud refuses the device (Hello refused, step sequence broken) or stays
  // unreachable for max_reconnects attempts; Stopped when stop() was called.
  Summary run();
  void stop() { stop_.store(true); }

  // Test hook: called after each training activation is sent; returning true
  // drops the connection before the reply is read (a link failure mid-step).
  void set_drop_hook(std::function<bool(uint64_t step)> hook);

  uint64_t completed_steps() const;
  // The bottom's parameters (fp32 CPU copies).
  std::map<std::string, at::Tensor> bottom_weights() const;
  // The model's buffers (BatchNorm running statistics; CPU copies), which the
  // progress file keeps with the weights.
  std::map<std::string, at::Tensor> model_buffers() const;

 private:
  struct Impl;
  std::atomic<bool> stop_{false};
  std::unique_ptr<Impl> impl_;
};

// run() after stop() (one type for both device kinds).
using Stopped = device::Stopped;

}  // namespace sparrow::edge
