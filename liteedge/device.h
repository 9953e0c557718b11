#pragma once
// The split fine-tuning device without LibTorch: sparrow-edge's device role
// (edge/device.h says the protocol; docs/split.md, "A device without
// LibTorch") on the lite runtime. The same Hello (model "MODEL;cut=CUT", the
// bottom's digest, the last completed step), Welcome, SplitActivation /
// SplitGradient exchange with resends after reply_timeout_ms and a capped
// exponential backoff, progress file (the same tensors as sparrow-edge's:
// "w/", "m/", "fedavg_round", "codec/") and step log, SplitFed rounds
// (fedavg_every), evaluation at the end and the summary line. A
// `sparrow-edge serve` cloud serves both alike (Hello's `software` differs).
//
// Threads: run() on one thread; stop() from any thread or a signal handler.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "compression/flat_codec.h"
#include "core/error.h"
#include "liteedge/config.h"
#include "liteedge/data.h"

namespace sparrow::liteedge {

// Rows of minibatch `step` (1-based), as edge::batch_indices: the same batches
// as sparrow-edge for the same seed.
std::vector<int64_t> batch_indices(int64_t n, int64_t batch, uint64_t seed, uint64_t step);

class EdgeDevice {
 public:
  // edge::EdgeDevice::Summary's fields and JSON line.
  struct Summary {
    uint64_t steps = 0;
    uint64_t bytes_up = 0, bytes_down = 0;
    double accuracy = -1;  // -1 when nothing was evaluated
    uint64_t eval_samples = 0;
    uint64_t reconnects = 0, resent = 0, skipped = 0;
    uint64_t fed_rounds = 0;
    std::string json() const;
  };

  // Builds the bottom (ConfigError / FormatError, bottom.h), loads keys and
  // the progress file when present (FormatError when it does not fit the
  // bottom) and replays the step log. Connects nothing yet.
  EdgeDevice(DeviceConfig cfg, DeviceData data);
  ~EdgeDevice();
  EdgeDevice(const EdgeDevice&) = delete;
  EdgeDevice& operator=(const EdgeDevice&) = delete;

  // Trains to cfg.steps, evaluates, saves progress. sparrow::Error when the
  // cloud refuses the device or stays unreachable for max_reconnects
  // attempts; Stopped when stop() was called.
  Summary run();
  void stop() { stop_.store(true); }

  // Test hook: called after each training activation is sent; returning true
  // drops the connection before the reply is read.
  void set_drop_hook(std::function<bool(uint64_t step)> hook);

  uint64_t completed_steps() const;
  // The bottom's parameters by name.
  std::map<std::string, compression::flat::Tensor> bottom_weights() const;

 private:
  struct Impl;
  std::atomic<bool> stop_{false};
  std::unique_ptr<Impl> impl_;
};

// run() after stop().
class Stopped : public Error {
 public:
  using Error::Error;
};

}  // namespace sparrow::liteedge
