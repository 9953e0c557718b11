#pragma once
// ClientSession: the deployed client's side of the session protocol
// (docs/protocol.md, docs/client.md; the contract is the server's too).
//
// One ClientSession owns one transport::Connection to the server
// (transport/transport.h: ZeroMQ for tcp:// and ipc://, CURVE unless
// insecure; the in-process hub for mem://, a server in the same process), a
// LocalTrainer replica of the model, the client's training data and its local
// state database (state/store.h, key 0). run() is a single-threaded loop:
//   connect -> Hello -> Welcome -> { Heartbeat while idle | Task -> train ->
//   compress -> ModelUpdate -> Ack/Error } -> Bye "run finished".
// What survives a restart (the state database): per-tensor compressor state
// (error feedback), SCAFFOLD's c_i, and the broadcast model B_h the client last
// held with its round h, so the next Hello reports last_round = h honestly and
// a Delta against B_h can be applied after a restart.
//
// Reconnect: when the server is silent for 3 * heartbeat_ms (it answers every
// Heartbeat), or says Bye with any reason but "run finished", the connection is
// closed and reopened after an exponential backoff (capped, jittered), then
// Hello again. An Error whose message starts with "unknown client" is answered
// with a Hello on the same connection.
//
// Threads: run() is called by one thread; stop() and counters() may be called
// from any thread, stop() also from a signal handler (it only stores an atomic).

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/trainer.h"
#include "core/datasets.h"

namespace sparrow::wire {
struct Task;
}

namespace sparrow::client {

// Where the client's training data comes from (data_folder.h loads it).
struct DataConfig {
  // "fashion-mnist"              the built-in Fashion-MNIST train split from data_dir,
  //                              partitioned, this client's shard;
  // "synthetic[:alpha=A,beta=B]" LEAF Synthetic(A, B) client `index` of `clients`
  //                              (60 features: needs a model that takes them);
  // "folder:PATH"                the user's own data (IDX or x.npy + y.npy) in PATH,
  //                              partitioned as fashion-mnist, or by its own
  //                              client_id.npy (partition "natural").
  std::string data = "fashion-mnist";
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string partition = "iid";  // core/partition.h spec, or "natural" (a folder's client_id.npy)
  int clients = 1;                // how many shards the partition makes (not for "natural")
  int index = 0;                  // this client's shard, in [0, clients); "natural": the index-th client id
  uint64_t partition_seed = 0;    // every client of a run must use the same
};

struct SessionConfig {
  std::string server = "tcp://127.0.0.1:7070";  // the server's endpoint (tcp://, ipc://, mem://)
  std::string server_key;                       // server public key file (.key or .key_secret)
  std::string key;                              // own key pair file (.key_secret)
  bool insecure = false;                        // plain TCP (no CURVE); logs a warning
  std::string client_id;                        // 1..256 bytes; the server binds it to `key`
  std::string model = "mlp";                    // core::make_model spec; must equal the server's
  DataConfig data;
  std::string state_db = "client_state.db";  // local SQLite state (created when missing)
  std::string state_encoding = "fp32";       // "fp32" | "bf16": how state_db stores residuals (state/encoding.h)
  uint32_t heartbeat_ms = 1000;              // until Welcome says otherwise; also the Hello timeout base
  uint64_t max_message_mb = 256;             // largest frame accepted and sent
  std::string device = "cpu";                // "cpu" or "cuda[:N]" (training only)
  uint32_t backoff_initial_ms = 200;         // first reconnect delay
  uint32_t backoff_max_ms = 30000;           // cap of the exponential backoff
  // Give up (an Error naming the likely cause) when every handshake with the
  // server has failed for this long: a refused key, a wrong server_key, plain
  // TCP against CURVE. 0 = retry forever. An unreachable server is retried.
  double give_up_s = 60;
  // Share of this client's samples held out of training (chosen once, from the
  // client_id): before training each task the client evaluates the model it
  // received on them and reports eval_loss / eval_accuracy. 0 = off.
  double holdout = 0;
  std::string dp = "none";  // local DP: "none" or "local:clip=C,noise=Z[,delta=]" (docs/aggregation.md)
  // Testing aid, never read from TOML (sparrow-client --fault): exit at once,
  // as a crash would, at "secagg-keys" (a SecAgg Task arrived), "secagg-shares"
  // (Neighbours), "secagg-masked" (SharesIn) or "secagg-reveal" (Unmask).
  std::string fault;
  // Testing aid, never read from TOML (sparrow-client --update-delay-ms): wait
  // this long after training before sending the update, so that a test can
  // order the updates' arrival (tests/integration/parity_test.cc).
  int update_delay_ms = 0;
};

// Reads a client TOML file (strict keys: an unknown key is a ConfigError naming
// it) and applies `overrides` ("key=value", as --set). Keys are SessionConfig's
// and DataConfig's field names (flat), with max_message_mb, heartbeat_ms, ...;
// relative paths stay relative to the working directory. ConfigError for a bad
// value (the message names the key and its origin).
SessionConfig load_session_config(const std::string& path, const std::vector<std::string>& overrides = {});
SessionConfig parse_session_config(const std::string& toml_text, const std::vector<std::string>& overrides = {},
                                   const std::string& source = "<string>");

// What a session does with a Task instead of training on local data: a
// gateway (sparrow-server with `upstream`, docs/deploy.md) runs a round with
// its own clients and answers with their weighted mean delta.
struct TaskRunner {
  // B_{r-1} and the Task in; the update's delta (dense, the model's names and
  // shapes), num_samples (> 0: its FedAvg weight upstream) and mean_loss out.
  // Throw to refuse the task (answered with an Error naming the round).
  std::function<TrainResult(const wire::Task&, const std::map<std::string, at::Tensor>&)> run;
  // What Hello reports as num_samples (at least 1 is sent).
  std::function<uint64_t()> samples;
};

class ClientSession {
 public:
  struct Counters {
    uint64_t hellos = 0;            // Hello messages sent
    uint64_t welcomes = 0;          // Welcome messages received
    uint64_t tasks_done = 0;        // Tasks trained and answered with a ModelUpdate
    uint64_t tasks_refused = 0;     // Tasks answered with an Error or a re-Hello
    uint64_t updates_acked = 0;     // Ack for an update this session sent
    uint64_t updates_rejected = 0;  // Error naming the round of an update this session sent
    uint64_t reconnects = 0;        // connections reopened (silence, Bye, failed send)
    uint64_t heartbeats = 0;        // Heartbeats sent
    uint64_t errors_received = 0;   // any Error from the server
  };

  // Validates cfg (ConfigError), builds the model replica, checks `data`
  // (float [N, ...] and int64 [N], N >= 1, shapes fit the model: ConfigError),
  // loads the key files (ConfigError) and opens the state database (its
  // client_id and model digest must match: ConfigError). Connects nothing yet.
  ClientSession(SessionConfig cfg, core::Dataset data);
  // A session whose Tasks `runner` answers (no data; cfg.data and holdout are
  // not used, holdout must be 0).
  ClientSession(SessionConfig cfg, TaskRunner runner);
  ~ClientSession();
  ClientSession(const ClientSession&) = delete;
  ClientSession& operator=(const ClientSession&) = delete;

  // Runs until the server says Bye "run finished" (returns true) or stop() is
  // called (returns false; a Bye is sent first). Throws sparrow::Error when
  // the server refuses the Hello (e.g. digest mismatch, id bound to another
  // key): retrying could not help.
  bool run();
  // Asks run() to return within ~100 ms (after the current training step
  // finishes when a task is being trained). Async-signal-safe.
  void stop() { stop_.store(true); }

  Counters counters() const;
  // The round of the broadcast model the client holds (what its next Hello
  // reports): 0 before any Task (the seed-built model).
  uint64_t last_round() const { return held_round_.load(); }
  uint64_t digest() const;
  uint64_t num_samples() const;

 private:
  struct Impl;
  // Before impl_: Impl's constructor sets held_round_.
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> held_round_{0};
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparrow::client
