#include "liteclient/config.h"

#include <cmath>

#include "core/error.h"
#include "core/flat_config.h"
#include "core/peer_text.h"
#include "liteclient/local_dp.h"
#include "wire/net.h"

namespace sparrow::liteclient {
namespace {

void bind_all(core::FlatConfig& f, Config& c) {
  f.bind("server", &c.server);
  f.bind("server_key", &c.server_key);
  f.bind("key", &c.key);
  f.bind("insecure", &c.insecure);
  f.bind("client_id", &c.client_id);
  f.bind("model", &c.model);
  f.bind("model_file", &c.model_file);
  f.bind("data", &c.data);
  f.bind("data_dir", &c.data_dir);
  f.bind("partition", &c.partition);
  f.bind("clients", &c.clients);
  f.bind("index", &c.index);
  f.bind("partition_seed", &c.partition_seed);
  f.bind("state_file", &c.state_file);
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

void check(const core::FlatConfig& f, const Config& c) {
  f.check("server", !c.server.empty(), "must not be empty");
  try {
    net::check_endpoint("server", c.server, /*for_bind=*/false);
  } catch (const ConfigError& e) {
    f.fail("server", e.what());
  }
  f.check("client_id", core::valid_client_id(c.client_id), core::client_id_problem(c.client_id));
  f.check("model", !c.model.empty(), "must not be empty (the model the server runs, e.g. \"mlp\")");
  f.check("model_file", !c.model_file.empty(),
          "must name the lite model file (written by sparrow-lite-export for the server's model)");
  f.check("data", c.data.rfind("folder:", 0) == 0 && c.data.size() > 7,
          "must be \"folder:PATH\" (x.npy + y.npy): sparrow-client-lite reads no built-in data set");
  const std::string whole =
      "is not supported by sparrow-client-lite: it trains on the whole data folder "
      "(give each client a folder of its own)";
  f.check("data_dir", !f.has("data_dir"), "has no effect with data = \"folder:PATH\"");
  f.check("partition", c.partition == "iid", whole);
  f.check("clients", c.clients == 1, whole);
  f.check("index", c.index == 0, whole);
  f.check("partition_seed", c.partition_seed == 0, whole);
  f.check("state_db", !f.has("state_db"),
          "is sparrow-client's SQLite database; sparrow-client-lite keeps its state in `state_file`");
  f.check("state_file", !c.state_file.empty(), "must not be empty");
  f.check("state_encoding", c.state_encoding == "fp32",
          "must be \"fp32\": sparrow-client-lite keeps its state in float32 only");
  f.check("device", c.device == "cpu", "must be \"cpu\": the lite runtime trains on the CPU only");
  f.check("holdout", c.holdout == 0, "is not supported by sparrow-client-lite (federated evaluation): must be 0");
  try {
    parse_local_dp(c.dp);
  } catch (const ConfigError& e) {
    f.fail("dp", e.what());
  }
  f.check("heartbeat_ms", c.heartbeat_ms >= 10 && c.heartbeat_ms <= 600000, "must be in [10, 600000]");
  f.check("max_message_mb", c.max_message_mb >= 1 && c.max_message_mb <= 2047, "must be in [1, 2047]");
  f.check("backoff_initial_ms", c.backoff_initial_ms >= 1 && c.backoff_initial_ms <= 600000, "must be in [1, 600000]");
  f.check("backoff_max_ms", c.backoff_max_ms >= c.backoff_initial_ms && c.backoff_max_ms <= 3600000,
          "must be in [backoff_initial_ms, 3600000]");
  f.check("give_up_s", std::isfinite(c.give_up_s) && c.give_up_s >= 0 && c.give_up_s <= 1e7,
          "must be in [0, 1e7] (0 = never give up)");
  if (!c.insecure) {
    f.check("server_key", !c.server_key.empty(), "must name the server's public key file (or set insecure = true)");
    f.check("key", !c.key.empty(), "must name this client's .key_secret file (or set insecure = true)");
  } else if (f.where("insecure") != "--set") {
    for (const char* k : {"server_key", "key"})
      f.check(k, !f.has(k), "has no effect with insecure = true (plain TCP, no CURVE keys)");
  }
}

}  // namespace

Config parse_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                    const std::string& source) {
  Config c;
  core::FlatConfig f(source);
  bind_all(f, c);
  f.read(toml_text, overrides);
  check(f, c);
  return c;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_config(core::read_config_file(path), overrides, path);
}

}  // namespace sparrow::liteclient
