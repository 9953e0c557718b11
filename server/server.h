#pragma once
// sparrow-server: the federated-learning aggregator as a service.
//
// A Server owns one transport::Listener on cfg.listen (transport/transport.h:
// ZeroMQ for tcp://, ipc:// and inproc://, CurveZMQ unless config.insecure;
// the in-process hub for mem://), runs the round state machine of docs/protocol.md / docs/server.md and keeps
// everything in SQLite (server/store.h) so that a restart with the same config
// resumes after the last completed round with the same global model bytes.
//
// Threads (docs/server.md, "Threading"):
//   - I/O thread: the only thread that touches the listener. Receives frames,
//     parses small ones itself (Hello, Heartbeat, Bye), hands ModelUpdates and
//     large frames to the worker pool, and sends whatever the other threads
//     queued in the outbox. It never blocks on aggregation or SQLite.
//   - Worker pool (config.workers threads): parse + verify large frames, check
//     the update against the open round, and decode_add it into the worker's
//     own partial StreamingAggregator (all-or-nothing), then queue Ack/Error.
//   - Round thread (the caller of run()): waits for clients, selects, sends
//     tasks, watches deadlines and liveness, closes the round, merges the
//     workers' partials, applies the server optimiser, checkpoints, evaluates.
//
// Usage:
//   ServerConfig cfg = load_server_config("server.toml");
//   Server server(cfg);            // opens the db (resumes), binds the listener
//   std::string ep = server.endpoint();   // e.g. "tcp://127.0.0.1:41234"
//   server.run();                  // blocks until cfg.rounds are done or stop()

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "compression/state.h"
#include "server/config.h"
#include "wire/wire.h"

namespace sparrow::server {

using Weights = std::map<std::string, at::Tensor>;

// A snapshot of the server's counters (monotonic since construction).
struct Counters {
  uint64_t updates_accepted = 0;  // ModelUpdates folded into a round's aggregate
  // Messages answered with an Error, by wire::ErrorCode (index = code value):
  // malformed/oversize frames, refused Hellos, updates rejected on verification.
  std::array<uint64_t, 8> rejected_by_code{};
  uint64_t stale = 0;      // updates for another round, from unselected clients or repeated (kRejected, never applied)
  uint64_t unknown = 0;    // messages from connections without a session ("unknown client")
  uint64_t bytes_in = 0;   // payload bytes of frames received
  uint64_t bytes_out = 0;  // payload bytes of frames sent
  uint64_t messages_in = 0, messages_out = 0;
  uint64_t send_failures = 0;      // frames the listener could not queue (peer gone or its queue full)
  uint64_t rounds_completed = 0;   // completed rounds of this run, including those before a restart
  uint64_t rounds_abandoned = 0;   // rounds restarted for lack of quorum (or a non-finite aggregate)
  uint64_t clients_connected = 0;  // live sessions now
  uint64_t rejected() const {
    uint64_t s = 0;
    for (uint64_t v : rejected_by_code) s += v;
    return s;
  }
};

class Server {
 public:
  // Validates cfg (ConfigError), builds the initial model with
  // core::make_model(cfg.model, cfg.model_seed), opens cfg.db (resuming from
  // its newest checkpoint when the run identity matches; ConfigError when the
  // database belongs to a run with another identity), loads keys and the
  // allow-list, binds cfg.listen. Throws on any failure; no thread runs yet.
  explicit Server(ServerConfig cfg);
  // Same, with the initial global model given (e.g. a benchmark's plain
  // 1M-parameter weight map): no model builder is involved; clients must
  // present cfg.model and the digest of these names and shapes. Evaluation
  // (eval_every > 0) still needs cfg.model to be buildable.
  Server(ServerConfig cfg, Weights initial_weights);
  // Closes the listener and the database. A run() on another thread must have
  // returned first (call stop() and join that thread).
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Runs rounds until cfg.rounds are completed (counting those of earlier
  // processes) or stop() is called. Starts the I/O thread and the pool, and
  // stops them before returning (after sending Bye to connected clients). An
  // unfinished round is dropped; the last checkpoint stands. Throws on fatal
  // errors (database write failure); peers' misbehaviour is never fatal.
  // Call at most once.
  void run();

  // ---- Gateway role (cfg.upstream set; server/gateway.h drives it) ----
  // What one relayed round gives the root: the weighted (by num_samples) mean
  // delta of the updates collected, their total weight, and the clients'
  // sample-weighted metrics (train_loss, ...).
  struct RelayResult {
    Weights delta;
    double weight = 0;
    std::map<std::string, double> metrics;
    size_t updates = 0;
  };
  // Starts the I/O thread and the pool (run() does this itself).
  void start();
  // Runs one round with this server's clients for the root's round `round`:
  // the clients train from `base` with `train` (the root's settings; the
  // uplink is this server's `compression`), the round closes by this server's
  // quorum and deadline, and is recorded and checkpointed as round `round`.
  // The whole round, the wait for enough live clients included, ends within
  // limit_s seconds (<= 0: max_round_wait_s): it closes then with quorum, or
  // is abandoned. nullopt when it was abandoned or stopped. `masks`: the
  // root's tcs masks of this round (parameter name -> ascending int64
  // positions, as compression::mask_positions gives), which this server's
  // clients then encode against; with a tcs uplink this server uses no mask of
  // its own, and a round without them sends none (the root's first round).
  std::optional<RelayResult> relay_round(uint64_t round, const Weights& base, const wire::TrainSettings& train,
                                         const Weights& masks = {}, double limit_s = 0);
  // Stops the threads started by start(), saying Bye to connected clients:
  // "run finished" when `run_over` (they exit), else "server shutting down".
  void finish(bool run_over);
  // Training samples of the live clients (their Hellos).
  uint64_t live_samples() const;

  // Asks run() to return soon. Thread-safe and async-signal-safe (it only
  // stores to a lock-free atomic flag), so a SIGINT/SIGTERM handler may call it.
  void stop() noexcept;

  // The bound endpoint with the port resolved (the listener's), e.g.
  // "tcp://127.0.0.1:41234" for listen = "tcp://127.0.0.1:*".
  const std::string& endpoint() const;
  // The run id clients see in Welcome.
  const std::string& run_id() const;
  // The live dashboard's URL ("http://127.0.0.1:8080/"); empty without `http`.
  const std::string& dashboard_url() const;
  // This server's CURVE public key (Z85); empty when insecure.
  const std::string& public_key() const;

  // Thread-safe snapshot.
  Counters counters() const;
  // Rounds completed (thread-safe).
  int64_t completed_rounds() const;
  // A deep copy of the global model W_r after the last completed round
  // (thread-safe).
  Weights global_weights() const;
  // The model digest clients must present (core/model_digest.h).
  uint64_t model_digest() const;
  const ServerConfig& config() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Least recently selected first: candidates sorted by (last_selected,
// rng::at(key, hash(client_id))) and the first k taken (all when fewer).
// last_selected 0 = never. Deterministic for a given key; `key` is derived
// from the run seed and the round.
struct Candidate {
  std::string client_id;
  int64_t last_selected = 0;
};
std::vector<std::string> select_clients(std::vector<Candidate> candidates, size_t k, uint64_t key);

// Serialisation of a weight map, the format of checkpoint blobs
// (compression/state.h: bit-exact fp32; FormatError on malformed bytes).
using compression::deserialize_weights;
using compression::serialize_weights;

}  // namespace sparrow::server
