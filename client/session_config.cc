// SessionConfig (client/session.h): its TOML keys, the checks across them
// (errors name the key and where it was set) and the loader.
#include <cmath>
#include <string>

#include "aggregation/robust.h"
#include "client/data_folder.h"
#include "client/session.h"
#include "core/error.h"
#include "core/flat_config.h"
#include "core/peer_text.h"
#include "state/encoding.h"
#include "wire/net.h"

namespace sparrow::client {
namespace {

void bind_all(core::FlatConfig& f, SessionConfig& c) {
  f.bind("server", &c.server);
  f.bind("server_key", &c.server_key);
  f.bind("key", &c.key);
  f.bind("insecure", &c.insecure);
  f.bind("client_id", &c.client_id);
  f.bind("model", &c.model);
  f.bind("data", &c.data.data);
  f.bind("data_dir", &c.data.data_dir);
  f.bind("partition", &c.data.partition);
  f.bind("clients", &c.data.clients);
  f.bind("index", &c.data.index);
  f.bind("partition_seed", &c.data.partition_seed);
  f.bind("state_db", &c.state_db);
  f.bind("state_encoding", &c.state_encoding);
  f.bind("heartbeat_ms", &c.heartbeat_ms);
  f.bind("max_message_mb", &c.max_message_mb);
  f.bind("device", &c.device);
  f.bind("backoff_initial_ms", &c.backoff_initial_ms);
  f.bind("backoff_max_ms", &c.backoff_max_ms);
  f.bind("give_up_s", &c.give_up_s);
  f.bind("holdout", &c.holdout);
  f.bind("dp", &c.dp);
}

// Cross-key checks, after the file and the overrides; errors name where the key was set.
// Resolves partition = "natural" for a folder with its own client ids.
void check_session_config(const core::FlatConfig& f, SessionConfig& c) {
  f.check("server", !c.server.empty(), "must not be empty");
  try {
    net::check_endpoint("server", c.server, /*for_bind=*/false);
  } catch (const ConfigError& e) {
    f.fail("server", e.what());
  }
  // The server refuses other ids at Hello (docs/security.md): said here, before any connection.
  f.check("client_id", core::valid_client_id(c.client_id), core::client_id_problem(c.client_id));
  f.check("model", !c.model.empty(), "must not be empty");
  f.check("data", !c.data.data.empty(), "must not be empty");
  check_data_keys(f, c.data);  // clients, index, partition, ...: each must have an effect with this data
  f.check("state_db", !c.state_db.empty(), "must not be empty");
  f.check("state_encoding", state::valid_encoding(c.state_encoding), "must be \"fp32\" or \"bf16\"");
  // The ranges of docs/client.md's key table. ZeroMQ keeps the heartbeat TTL
  // (3 x heartbeat_ms) in deciseconds below 2^16.
  f.check("heartbeat_ms", c.heartbeat_ms >= 10 && c.heartbeat_ms <= 600000, "must be in [10, 600000]");
  f.check("max_message_mb", c.max_message_mb >= 1 && c.max_message_mb <= 2047, "must be in [1, 2047]");
  f.check("backoff_initial_ms", c.backoff_initial_ms >= 1 && c.backoff_initial_ms <= 600000, "must be in [1, 600000]");
  f.check("backoff_max_ms", c.backoff_max_ms >= c.backoff_initial_ms && c.backoff_max_ms <= 3600000,
          "must be in [backoff_initial_ms, 3600000]");
  f.check("give_up_s", std::isfinite(c.give_up_s) && c.give_up_s >= 0 && c.give_up_s <= 1e7,
          "must be in [0, 1e7] (0 = never give up)");
  f.check("holdout", std::isfinite(c.holdout) && c.holdout >= 0 && c.holdout <= 0.5, "must be in [0, 0.5] (0 = off)");
  try {
    const aggregation::DpSpec d = aggregation::DpSpec::parse(c.dp);
    f.check("dp", d.mode != aggregation::DpSpec::Mode::kCentral,
            "central DP is the server's setting (its `dp` key); a client takes \"none\" or \"local:clip=,noise=\"");
  } catch (const ConfigError& e) {
    f.fail("dp", e.what());
  }
  if (!c.insecure) {
    f.check("server_key", !c.server_key.empty(), "must name the server's public key file (or set insecure = true)");
    f.check("key", !c.key.empty(), "must name this client's .key_secret file (or set insecure = true)");
  } else if (f.where("insecure") != "--set") {
    // A file that says both is contradictory; --insecure (or --set) on a
    // secure file is the documented way to try it without CURVE.
    for (const char* k : {"server_key", "key"})
      f.check(k, !f.has(k), "has no effect with insecure = true (plain TCP, no CURVE keys)");
  }
}

}  // namespace

SessionConfig parse_session_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                                   const std::string& source) {
  SessionConfig c;
  core::FlatConfig f(source);
  bind_all(f, c);
  f.read(toml_text, overrides);
  check_session_config(f, c);
  return c;
}

SessionConfig load_session_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_session_config(core::read_config_file(path), overrides, path);
}

}  // namespace sparrow::client
