#pragma once
// sparrow-server configuration: a TOML file (toml++) read strictly. Every key
// must be known (an unknown key is a ConfigError naming it); values are
// type-checked and range-checked; `--set key=value` overrides apply on top.
// The keys shared with sparrow-sim are federation::RunConfig's
// (docs/configuration.md); the simulation-only keys are accepted, listed in
// `no_effect` and logged by load_server_config. docs/server.md has the
// deployment keys.

#include <cstdint>
#include <string>
#include <vector>

#include "federation/run_config.h"

namespace sparrow::server {

struct ServerConfig : federation::RunConfig {
  // Network and security.
  std::string listen = "tcp://*:7070";  // ZeroMQ endpoint the ROUTER binds
  std::string server_key;               // NAME.key_secret of the server (CURVE); required unless insecure
  std::string allow;                    // allow-list: a file of keys/paths or a directory of *.key files
  bool insecure = false;                // plain TCP (no CURVE); CLI --insecure only, never from TOML
  double max_message_mb = 256;          // largest frame accepted (MiB)
  int heartbeat_ms = 1000;              // clients heartbeat this often; gone after 3x silence

  // The keys shared with sparrow-sim (model, training, codecs, rounds,
  // clients, evaluation) are federation::RunConfig's: one declaration, one
  // default, one validation (docs/configuration.md).

  // Admission: an update whose decoded L2 norm exceeds this is refused before
  // its Ack (docs/server.md, "Admission"); [0, 1e18], 0 = no bound (an
  // update that is not finite, or whose low-rank product overflows, is still refused).
  double max_update_norm = 1e6;
  // Refused updates in a row after which a client sits out selection:
  // holdout_rounds rounds the first time, doubling each time after (at most 64x).
  int64_t holdout_after = 2;
  int64_t holdout_rounds = 4;

  // Rounds.
  int min_clients = 0;           // live clients needed to start a round; 0 = clients_per_round
  int quorum = 1;                // updates needed to close a round at its deadline
  double round_deadline_s = 60;  // seconds a round waits for its updates
  double max_round_wait_s = 0;   // a round without quorum after this long is restarted; 0 = 4 x deadline
  // Decode/aggregate pool threads. sparrow-sim's `workers` (its training
  // threads) is the same key with its own meaning and default: a simulation
  // file's value is a valid one here.
  int workers = 2;

  // Persistence.
  std::string db = "sparrow-server.db";
  int keep_checkpoints = 2;  // checkpoint rows kept (the newest ones); >= 1

  // Optional server-side evaluation (RunConfig's eval_every > 0): forward
  // passes on the Fashion-MNIST test split in data_dir, or on eval_data: a
  // folder in the format sparrow-client reads (x.npy + y.npy or MNIST-format
  // IDX); its test split (a test/ subfolder or t10k files) when it has one,
  // else every sample in it.
  std::string eval_data;
  int eval_batch = 1000;

  // Live dashboard (docs/monitoring.md): HOST:PORT of the HTTP endpoint; empty = off.
  std::string http;
  std::string http_token;  // file holding the bearer token; required unless `http` is a loopback address

  // Gateway role (docs/deploy.md, "Two levels"): serve this server's clients as
  // any server does, and forward one aggregate per round to a root server,
  // which sees the gateway as one client weighted by its clients' samples.
  // The root's Task sets the round, the model and the training settings; the
  // link is a client session (CURVE, heartbeats, reconnects).
  std::string upstream;                 // the root's endpoint; empty = not a gateway
  std::string upstream_server_key;      // the root's public key file (.key); required unless insecure
  std::string upstream_key;             // this gateway's key pair at the root (.key_secret); required unless insecure
  std::string upstream_id = "gateway";  // this gateway's client id at the root
  std::string upstream_state_db;        // the upstream session's state (SQLite); empty = db + "-upstream"
  bool gateway() const { return !upstream.empty(); }

  // Derived.
  int effective_min_clients() const { return min_clients > 0 ? min_clients : clients_per_round; }
  double effective_max_round_wait_s() const { return max_round_wait_s > 0 ? max_round_wait_s : 4 * round_deadline_s; }
  uint64_t max_message_bytes() const { return static_cast<uint64_t>(max_message_mb * 1024.0 * 1024.0); }
};

// Parses TOML text (source names it in errors) and applies "key=value"
// overrides: ConfigError naming the key (and file:line or --set) for an unknown
// key, a value of the wrong type or a shared key's bad value
// (federation::validate). The deployment keys' ranges are checked by
// validate(), which the Server constructor calls (after the CLI has set
// `insecure`). Simulation-only keys the text sets are listed in `no_effect`.
ServerConfig parse_server_config(const std::string& toml_text, const std::vector<std::string>& overrides = {},
                                 const std::string& source = "<string>");
// Reads and parses a file; ConfigError when unreadable. Logs one line per
// key in `no_effect` (event=config_no_effect key=K).
ServerConfig load_server_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Checks the shared keys (federation::validate), the deployment keys' ranges,
// what only a deployment refuses (local DP, a gateway's limits) and that
// server_key/allow are set unless insecure. ConfigError naming the key.
void validate(const ServerConfig& c);

// The keys that define a run's identity (the model, the training settings,
// the algorithm): a database holding a run with another identity is refused
// on start. rounds, deadlines, network, keys, workers and evaluation may change
// across restarts. model_seed is written as effective_model_seed(); keys added
// after runs existed only when set (so older databases keep their hash).
std::string identity_text(const ServerConfig& c);
// FNV-1a 64 of identity_text, as 16 hex digits.
std::string config_hash(const ServerConfig& c);

// The effective configuration as TOML (every key; `insecure` omitted).
std::string to_toml(const ServerConfig& c);

}  // namespace sparrow::server
