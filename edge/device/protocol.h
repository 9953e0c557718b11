#pragma once
// The device side of networked split fine-tuning (docs/split.md, "Networked
// device and cloud"), written once for sparrow-edge and sparrow-edge-lite
// over a device::Bottom (bottom.h).
//
// One DEALER socket (CURVE unless insecure). run():
//   connect -> Hello{client_id = device_id, model = "MODEL;cut=CUT", digest of
//   the bottom, last_round = last completed step} -> Welcome{round = the cloud's
//   last applied step for this device} -> for each step n: bottom forward on
//   minibatch n (batch_indices), SplitActivation{step n} -> SplitGradient ->
//   bottom backward and optimiser step -> ... -> evaluation (the test rows) ->
//   summary.
// Resume: no reply within reply_timeout_ms -> the socket is closed and reopened
// after an exponential, capped backoff, Hello again, and the SAME bytes are sent
// again (the cloud applies a step once and answers a repeat from its cache).
// Progress (last completed step, bottom weights "w/", momentum "m/", buffers
// "b/" such as BatchNorm running statistics, "fedavg_round", the codec state
// "codec/") goes to `progress` every save_every steps and at the end, as
// compression::State bytes; a restarted device loads it and continues after
// its last completed step. Between saves, a step log (progress + ".log") keeps
// each acknowledged gradient, so a kill -9 loses no step the cloud applied.
// If the cloud has applied steps the device's files do not hold, the device
// continues after the cloud's step: the top keeps those steps, the bottom
// loses their updates (logged).
// SplitFed (fedavg_every = K): after every K-th step the bottom goes up as a
// ModelUpdate{round = step / K} and the averaged bottom comes back as a Task
// (the device waits, sending Heartbeats, until all the cloud's devices sent
// theirs); the round is saved with the progress and redone after a restart.
//
// Threads: run() on one thread; the stop flag may be set from any thread or a
// signal handler.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "edge/device/bottom.h"

namespace sparrow::edge::device {

// The step log's record format. Each device kind keeps its own, so that files
// written before the protocol was shared stay readable; neither replays the
// other's (the magic differs).
enum class StepLog {
  kFramed,  // "SPLG", CRC-32 of (8 zero bytes, then step text and payload each after its u64 length): sparrow-edge
  kPlain,   // "SPLC", CRC-32 of (step text, payload): sparrow-edge-lite
};

// A step log record's checksum over (step, payload) in `format`. Stored in
// files: never change how either is computed.
uint32_t step_log_checksum(StepLog format, uint64_t step, const std::string& payload);

// What the protocol reads of a device config (edge::DeviceConfig and
// liteedge::DeviceConfig both have these keys; edge/device.h says what each does).
struct Config {
  std::string cloud, cloud_key, key;
  bool insecure = false;
  std::string device_id;
  std::string label;     // Hello.model: "MODEL;cut=CUT"
  std::string software;  // Hello.software
  StepLog step_log = StepLog::kFramed;
  uint64_t seed = 0, batch_size = 32, steps = 100;
  std::string progress;
  uint64_t save_every = 10, reply_timeout_ms = 10000, backoff_initial_ms = 200, backoff_max_ms = 10000;
  uint64_t max_reconnects = 20, max_message_mb = 64, fedavg_every = 0;
};

// The protocol's fields of a device config `c` (either kind).
template <class C>
Config config_of(const C& c) {
  Config p;
  p.cloud = c.cloud;
  p.cloud_key = c.cloud_key;
  p.key = c.key;
  p.insecure = c.insecure;
  p.device_id = c.device_id;
  p.label = c.model + ";cut=" + c.cut;
  p.seed = c.seed;
  p.batch_size = c.batch_size;
  p.steps = c.steps;
  p.progress = c.progress;
  p.save_every = c.save_every;
  p.reply_timeout_ms = c.reply_timeout_ms;
  p.backoff_initial_ms = c.backoff_initial_ms;
  p.backoff_max_ms = c.backoff_max_ms;
  p.max_reconnects = c.max_reconnects;
  p.max_message_mb = c.max_message_mb;
  p.fedavg_every = c.fedavg_every;
  return p;
}

// Rows of minibatch `step` (1-based): epochs of floor(n / batch) batches (at
// least one), each epoch a permutation drawn from (seed, epoch) with core/rng.
// A pure function, so a resumed device and a test replay the same batches.
std::vector<int64_t> batch_indices(int64_t n, int64_t batch, uint64_t seed, uint64_t step);

struct Summary {
  uint64_t steps = 0;                     // completed training steps (total, including before a restart)
  uint64_t bytes_up = 0, bytes_down = 0;  // every frame this process sent / received
  double accuracy = -1;                   // on the evaluated test samples; -1 when none
  uint64_t eval_samples = 0;
  uint64_t reconnects = 0, resent = 0, skipped = 0;  // skipped: steps the cloud had, the bottom lost
  uint64_t fed_rounds = 0;                           // SplitFed averages applied by this process
  std::string json() const;                          // one line: {"steps":..,"bytes_up":..,...}
};

// run() after the stop flag was set.
class Stopped : public Error {
 public:
  using Error::Error;
};

// The codec state as progress-file tensors under `prefix` (edge::codec_state_tensors'
// layout): "basis", "sketch", "tracker" when set and "meta" (basis_id as two
// 16-bit halves, refresh_next, steps as four 16-bit pieces).
void put_codec_state(const flat::CodecState& s, const std::string& prefix, compression::flat::State& out);
// FormatError when "meta" is missing or malformed.
flat::CodecState get_codec_state(const compression::flat::State& st, const std::string& prefix);

class Protocol {
 public:
  // Loads keys (ConfigError), the progress file when present (FormatError
  // when it does not fit the bottom) and replays the step log into `bottom`.
  // Connects nothing yet. `bottom` and `stop` outlive the protocol.
  Protocol(Config cfg, Bottom& bottom, const std::atomic<bool>& stop);
  ~Protocol();
  Protocol(const Protocol&) = delete;
  Protocol& operator=(const Protocol&) = delete;

  // Trains to cfg.steps, evaluates, saves progress. sparrow::Error when the
  // cloud refuses the device (Hello refused, step sequence broken) or stays
  // unreachable for max_reconnects attempts; Stopped when `stop` was set.
  Summary run();
  // Test hook: called after each training activation is sent; returning true
  // drops the connection before the reply is read (a link failure mid-step).
  void set_drop_hook(std::function<bool(uint64_t step)> hook);
  uint64_t completed_steps() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparrow::edge::device
