#pragma once
// The cloud side of networked split fine-tuning (docs/split.md, "Networked
// device and cloud"): `sparrow-edge serve`. One ROUTER socket (CurveZMQ with
// the ZAP allow-list unless insecure), one top model with one optimiser, and
// one CloudHalf (per-device codec state) per device session.
//
// Per SplitActivation with train = true (exactly-once):
//   step == last + 1  verify (wire::parse, ActPacket::deserialize/validate and
//                     CloudHalf::step's own checks, all before any change), top
//                     step, optimiser step; the SplitGradient is cached as the
//                     session's last reply;
//   step == last      the cached reply again, nothing applied (a device retry);
//   otherwise         Error{Rejected, "expected step N"}.
// SplitFed (fedavg_devices > 0): a ModelUpdate{round r} with the device's dense
// bottom is checked and folded into a StreamingAggregator (all or nothing) and
// answered with Ack{r}; when fedavg_devices distinct sessions have sent round
// r, every one of them gets Task{r, Full, the weighted mean}. A repeat of a
// pending round gets Ack again, a repeat of the last completed round its Task
// again; any other round is refused.
// A bad activation gets Error{code} and changes nothing (weights, optimiser
// state, the session's basis and step). train = false (evaluation) is answered
// with loss and correct only; it changes nothing, so it is not sequenced.
//
// Threads: run() is the only user of the socket and the model; stop() may be
// called from any thread (and a signal handler). Steps of all devices are
// serialised on the one top model.
//
// Also here (shared with edge/device.h): the strict flat-TOML config reader,
// the plain SGD both sides use, and weight files.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "core/flat_config.h"
#include "core/models.h"

namespace sparrow::edge {

// ---- shared helpers ------------------------------------------------------------

// One config key and where it is stored.
using ConfigSlot = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*>;
struct ConfigField {
  const char* key;
  ConfigSlot slot;
};

// Reads a flat TOML document into `fields`, then applies `overrides` ("key=value",
// as --set). ConfigError for a syntax error, an unknown key, a wrong type or an
// unparsable override; the message names the key and where it came from. The
// binder is returned for the checks across keys (which were set, and where).
core::FlatConfig read_flat_config(const std::string& toml_text, const std::string& source,
                                  const std::vector<ConfigField>& fields, const std::vector<std::string>& overrides);
// The file's text; ConfigError when it cannot be read.
std::string read_text_file(const std::string& path);

// SGD as torch::optim::SGD computes it (no dampening, no Nesterov): v = m v + g,
// p -= lr v (v = g on the first step). Parameters without a gradient are skipped.
// Its momentum buffers are plain tensors so a device can save and restore them.
class Sgd {
 public:
  Sgd(std::vector<at::Tensor> params, double lr, double momentum);
  void zero_grad();
  void step();
  std::vector<at::Tensor>& buffers() { return buffers_; }  // same order as the parameters

 private:
  std::vector<at::Tensor> params_, buffers_;
  double lr_, momentum_;
};

// A weights file: compression::State bytes (name -> fp32 tensor), as the client's
// state database stores models. load_weights copies the named tensors into
// `model`'s parameters: every tensor must name a parameter of that shape
// (FormatError otherwise, nothing copied); parameters the file lacks are left.
void save_weights(const std::map<std::string, at::Tensor>& weights, const std::string& path);
void load_weights(core::Model& model, const std::string& path);
// The model's parameters as contiguous fp32 CPU copies.
std::map<std::string, at::Tensor> copy_weights(const std::vector<std::string>& names,
                                               const std::vector<at::Tensor>& params);
// The identity of a split's bottom on the wire: model_digest over the bottom's
// parameter names and shapes (Hello.model_digest).
uint64_t bottom_digest(const std::vector<std::string>& names, const std::vector<at::Tensor>& params);
// Hello.model for a split: "MODEL;cut=CUT".
std::string split_model_label(const std::string& model, const std::string& cut);

// ---- the cloud -------------------------------------------------------------------

// Which training steps of one device may touch the top all devices share (one
// device with a valid key must not poison it for the others). A step is refused
// when its loss or the L2 norm of its top gradient is not finite, when the norm
// exceeds `max_norm`, or, once kWarmup steps of this device were accepted, when
// it exceeds `factor` x the median norm of its last kWindow accepted steps
// (factor 0: no such rule). One per device session, so that no device's steps
// move another's bound. Pure bookkeeping, no locking: the cloud's I/O loop is
// its only user.
class StepGuard {
 public:
  static constexpr size_t kWindow = 64;
  static constexpr size_t kWarmup = 16;

  StepGuard(double max_norm, double factor) : max_norm_(max_norm), factor_(factor) {}
  // "" when the step may be applied, otherwise why not (for the device and the log).
  std::string refusal(double loss, double grad_norm) const;
  // The bound on the norm now: max_norm, or less once the history is long enough.
  double bound() const;
  // An applied step's norm joins the history (the oldest leaves after kWindow).
  void accepted(double grad_norm);
  // The history, oldest first (the cloud's snapshot keeps it across restarts).
  const std::vector<double>& history() const { return history_; }
  void restore(std::vector<double> h);

 private:
  double max_norm_, factor_;
  std::vector<double> history_;
};

struct CloudConfig {
  std::string listen = "tcp://*:7080";  // ROUTER endpoint ("tcp://127.0.0.1:*" picks a port)
  std::string key;                      // own key pair (.key_secret)
  std::string allow;                    // allow-list: directory of .key files or list file
  bool insecure = false;                // plain TCP, no CURVE (logs a warning)
  std::string model = "mlp";            // core::make_model name
  std::string cut = "fc1";              // split_model cut; devices must use the same
  std::string weights;                  // optional weights file (save_weights format) for the whole model
  uint64_t seed = 0;                    // model initialisation (when no weights file, or for what it lacks)
  std::string grad_codec = "none";      // CloudHalf gradient codec for non-lowrank activations
  double lr = 0.05;                     // top optimiser (Sgd)
  double momentum = 0.0;
  // Step guard (StepGuard below, docs/split.md "Step guard"): a training step
  // whose top-gradient L2 norm exceeds max_grad_norm, or (after the warm-up)
  // grad_norm_factor x the median of the last accepted norms, is refused
  // before it changes anything. grad_norm_factor = 0: the absolute bound only.
  double max_grad_norm = 1e4;
  double grad_norm_factor = 20;
  // SplitFed: devices averaged per round (every device sends its bottom every
  // fedavg_every steps as a dense ModelUpdate; when this many have arrived for a
  // round, each gets the weighted mean as a Task). 0: off (ModelUpdate refused).
  uint64_t fedavg_devices = 0;
  // State file (SQLite; edge/cloud_store.h): the top, its optimiser, the
  // sessions and their codec state survive a restart or a kill -9 with no
  // acknowledged step lost. "" = in memory only (a restart starts the top afresh).
  std::string state = "edge_cloud.db";
  uint64_t checkpoint_every = 200;  // log entries between snapshots (a restart replays at most this many)
  bool fsync = false;               // true: every step also survives power loss (one fsync per step)
  uint64_t heartbeat_ms = 1000;     // Welcome.heartbeat_ms and ZeroMQ heartbeats
  uint64_t max_message_mb = 64;     // largest frame accepted
  // Compute threads (ATen intra-op and the BLAS); 0 = one per core. Set 1 when
  // the cloud and devices share a machine: spinning threads of two processes
  // on the same cores slow both several times over.
  int64_t threads = 0;
};

// Strict TOML (keys as CloudConfig's fields); ConfigError for anything wrong.
CloudConfig load_cloud_config(const std::string& path, const std::vector<std::string>& overrides = {});
CloudConfig parse_cloud_config(const std::string& toml_text, const std::vector<std::string>& overrides = {},
                               const std::string& source = "<string>");

class CloudServer {
 public:
  struct Counters {
    uint64_t hellos = 0, steps_applied = 0, duplicates = 0, evals = 0, errors_sent = 0, out_of_order = 0;
    uint64_t fed_rounds = 0;  // SplitFed averaging rounds completed
    uint64_t replayed = 0;    // log entries applied again at start-up
    uint64_t snapshots = 0;   // snapshots written by this process
    uint64_t bytes_in = 0, bytes_out = 0;
  };

  // Builds the model and its split, loads keys and the allow-list (ConfigError),
  // binds the socket (ConfigError when the endpoint cannot be bound), then opens
  // the state file and restores from it: the snapshot, then the log applied
  // again in order (ConfigError/FormatError for a file it cannot use).
  explicit CloudServer(CloudConfig cfg);
  ~CloudServer();
  CloudServer(const CloudServer&) = delete;
  CloudServer& operator=(const CloudServer&) = delete;

  // The bound endpoint (the real port for "tcp://...:*"), for devices to connect to.
  std::string endpoint() const;
  // Serves until stop(), then writes a snapshot. Never throws for what a peer sends.
  void run();
  void stop() { stop_.store(true); }

  // Safe to call from another thread (atomic snapshot of plain counters).
  Counters counters() const;
  // The top model's parameters (fp32 CPU copies). Call when run() is not running.
  std::map<std::string, at::Tensor> top_weights() const;
  // ZAP refusals so far (CURVE only).
  uint64_t refused() const;

 private:
  struct Impl;
  std::atomic<bool> stop_{false};
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparrow::edge
