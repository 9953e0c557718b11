#pragma once
// The split fine-tuning device without LibTorch: sparrow-edge's device role
// (docs/split.md, "A device without LibTorch") on the lite runtime, running
// the one device protocol (edge/device/protocol.h) over the lite bottom. The
// same Hello (model "MODEL;cut=CUT", the bottom's digest, the last completed
// step), Welcome, SplitActivation / SplitGradient exchange with resends after
// reply_timeout_ms and a capped exponential backoff, progress file (the same
// tensors as sparrow-edge's: "w/", "m/", "fedavg_round", "codec/") and step
// log, SplitFed rounds (fedavg_every), evaluation at the end and the summary
// line. A
// `sparrow-edge serve` cloud serves both alike (Hello's `software` differs;
// the step log has its own record format, StepLog::kPlain).
//
// Threads: run() on one thread; stop() from any thread or a signal handler.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "compression/flat_codec.h"
#include "edge/device/protocol.h"
#include "liteedge/config.h"
#include "liteedge/data.h"

namespace sparrow::liteedge {

// Rows of minibatch `step` (1-based): the same batches as sparrow-edge for the same seed.
using edge::device::batch_indices;

class EdgeDevice {
 public:
  // edge::EdgeDevice::Summary: the same fields and JSON line.
  using Summary = edge::device::Summary;

  // Builds the bottom (ConfigError / FormatError, bottom.h), loads keys and
  // the progress file when present (FormatError when it does not fit the
  // bottom) and replays the step log. Connects nothing yet.
  EdgeDevice(DeviceConfig cfg, DeviceData data);
  ~EdgeDevice();
  EdgeDevice(const EdgeDevice&) = delete;
  EdgeDevice& operator=(const EdgeDevice&) = delete;

  // run(), stop(), set_drop_hook() and completed_steps() are the protocol's
  // (edge/device/protocol.h: Protocol::run, the stop flag, the test hook).
  Summary run();
  void stop() { stop_.store(true); }
  void set_drop_hook(std::function<bool(uint64_t step)> hook);
  uint64_t completed_steps() const;
  // The bottom's parameters by name.
  std::map<std::string, compression::flat::Tensor> bottom_weights() const;

 private:
  struct Impl;
  std::atomic<bool> stop_{false};
  std::unique_ptr<Impl> impl_;
};

// run() after stop() (edge::Stopped: one exception type for both devices).
using Stopped = edge::device::Stopped;

}  // namespace sparrow::liteedge
