#include "server/config.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>

#include "aggregation/robust.h"
#include "core/error.h"
#include "core/flat_config.h"
#include "core/peer_text.h"
#include "core/rng.h"
#include "monitor/http.h"
#include "secagg/secagg.h"
#include "wire/net.h"

namespace sparrow::server {
namespace {

// One table of keys drives reading, overriding, writing and the run identity:
// the deployment keys here, the shared ones from federation::bind.
void bind_all(core::FlatConfig& f, ServerConfig& c) {
  f.bind("listen", &c.listen);
  f.bind("key", &c.server_key);  // this server's own .key_secret (as `key` in the client and edge configs)
  f.bind("allow", &c.allow);
  f.bind("max_message_mb", &c.max_message_mb);
  f.bind("heartbeat_ms", &c.heartbeat_ms);
  federation::bind(f, c);
  f.bind("max_update_norm", &c.max_update_norm);
  f.bind("holdout_after", &c.holdout_after);
  f.bind("holdout_rounds", &c.holdout_rounds);
  f.bind("min_clients", &c.min_clients);
  f.bind("quorum", &c.quorum);
  f.bind("round_deadline_s", &c.round_deadline_s);
  f.bind("max_round_wait_s", &c.max_round_wait_s);
  f.bind("workers", &c.workers);
  f.bind("db", &c.db);
  f.bind("keep_checkpoints", &c.keep_checkpoints);
  f.bind("eval_data", &c.eval_data);
  f.bind("eval_batch", &c.eval_batch);
  f.bind("http", &c.http);
  f.bind("http_token", &c.http_token);
  f.bind("upstream", &c.upstream);
  f.bind("upstream_server_key", &c.upstream_server_key);
  f.bind("upstream_key", &c.upstream_key);
  f.bind("upstream_id", &c.upstream_id);
  f.bind("upstream_state_db", &c.upstream_state_db);
}

// The keys of the run identity (identity_text), in the order the text writes
// them: a database's stored hash is of this text, so the order never changes
// and a new key goes last.
const std::vector<std::string> kIdentityKeys = {"model",
                                                "model_seed",
                                                "seed",
                                                "algorithm",
                                                "mu",
                                                "local_epochs",
                                                "batch_size",
                                                "lr",
                                                "momentum",
                                                "weight_decay",
                                                "compression",
                                                "downlink",
                                                "server_optimizer",
                                                "aggregator",
                                                "dp",
                                                "secagg",
                                                "clients_per_round",
                                                "clients",
                                                "sampler",
                                                "feddyn_alpha",
                                                "mode",
                                                "buffer",
                                                "staleness"};  // (*)

// Identity keys added after runs existed: part of the identity only when set,
// so databases of earlier versions keep their hash.
bool default_identity(const std::string& key, const std::string& value) {
  return (key == "aggregator" && value == "\"mean\"") || (key == "dp" && value == "\"none\"") ||
         (key == "secagg" && value == "\"none\"") || (key == "clients" && value == "0") ||
         (key == "sampler" && value == "\"auto\"") || (key == "feddyn_alpha" && (value == "0" || value == "0.0")) ||
         (key == "mode" && value == "\"sync\"") || (key == "buffer" && value == "0") ||
         (key == "staleness" && value == "\"poly:a=0.5\"");
}

// "key = value" lines of `c`: every key in bind order, or the identity keys.
std::string toml_lines(const ServerConfig& c, bool identity_only) {
  core::FlatConfig f("");
  bind_all(f, const_cast<ServerConfig&>(c));  // read only
  std::string out;
  if (!identity_only) {
    for (const std::string& key : f.keys()) out += key + " = " + f.toml_value(key) + "\n";
    return out;
  }
  for (const std::string& key : kIdentityKeys) {
    // The model the run starts from (0 = seed was written as the seed before
    // model_seed could follow it).
    const std::string value = key == "model_seed" ? std::to_string(c.effective_model_seed()) : f.toml_value(key);
    if (!default_identity(key, value)) out += key + " = " + value + "\n";
  }
  return out;
}

[[noreturn]] void bad(const std::string& key, const std::string& msg) {
  throw ConfigError("config key '" + key + "' " + msg);
}

}  // namespace

void validate(const ServerConfig& c) {
  core::FlatConfig f("");
  bind_all(f, const_cast<ServerConfig&>(c));  // read only
  federation::validate(c, f);                 // the shared keys, every double's finiteness
  if (c.listen.empty()) bad("listen", "must not be empty");
  try {
    net::check_endpoint("listen", c.listen, /*for_bind=*/true);
  } catch (const ConfigError& e) {
    bad("listen", e.what());
  }
  if (!c.http.empty()) {
    monitor::HttpAddress a;
    try {
      a = monitor::parse_http_address(c.http);
    } catch (const ConfigError& e) {
      bad("http", e.what());
    }
    if (!a.loopback && c.http_token.empty())
      bad("http", "is not a loopback address: set http_token to a file holding the dashboard's bearer token");
  }
  // The ranges of docs/server.md's key table: outside them a run cannot work
  // (a frame too small for any model, a heartbeat ZeroMQ refuses). NaN fails
  // every comparison below.
  if (!(c.max_message_mb >= 1 && c.max_message_mb <= 2047)) bad("max_message_mb", "must be in [1, 2047]");
  // ZeroMQ keeps the heartbeat TTL (3 x heartbeat_ms) in deciseconds below 2^16.
  if (c.heartbeat_ms < 10 || c.heartbeat_ms > 600000) bad("heartbeat_ms", "must be in [10, 600000]");
  // What a deployment refuses that a simulation takes.
  // mode = "async" (docs/async.md): what the shared engine refuses is
  // federation::validate's (check_async, as in sparrow-sim); these are the
  // service's own. round_deadline_s is each task's deadline there.
  if (c.mode == "async") {
    const char* why =
        "has no effect with mode = \"async\" (there are no rounds to close: a step is taken every "
        "`buffer` updates)";
    if (c.quorum != ServerConfig{}.quorum) bad("quorum", why);
    if (c.max_round_wait_s != 0) bad("max_round_wait_s", why);
    if (c.gateway()) bad("upstream", "a gateway relays synchronous rounds of its root; it cannot run mode = \"async\"");
  }
  if (aggregation::DpSpec::parse(c.dp).mode == aggregation::DpSpec::Mode::kLocal)
    bad("dp", "local DP is each client's own setting (sparrow-client's `dp` key); the server takes none or central");
  const secagg::Params sa = secagg::Params::parse(c.secagg);
  if (sa.enabled && static_cast<uint32_t>(c.effective_min_clients()) < sa.min_clients())
    bad("secagg", "threshold " + std::to_string(sa.effective_threshold()) + " needs rounds of at least " +
                      std::to_string(sa.min_clients()) + " clients: raise min_clients (now " +
                      std::to_string(c.effective_min_clients()) + ") or lower the threshold");
  if (!(c.max_update_norm >= 0 && c.max_update_norm <= 1e18))
    bad("max_update_norm", "must be in [0, 1e18] (0 = no bound)");
  if (c.holdout_after < 1 || c.holdout_after > 1000) bad("holdout_after", "must be in 1..1000");
  if (c.holdout_rounds < 0 || c.holdout_rounds > 10000) bad("holdout_rounds", "must be in 0..10000 (0 = never)");
  // More live clients than a round selects is a pool to sample from (Flower's
  // min_available_clients >= min_fit_clients); fewer starts smaller rounds.
  if (c.min_clients < 0 || c.min_clients > 1000000)
    bad("min_clients", "must be in [0, 1000000] (0 = clients_per_round)");
  const int most = std::min(c.clients_per_round, c.effective_min_clients());
  if (c.quorum < 1 || c.quorum > most)
    bad("quorum", "must be in [1, " + std::to_string(most) +
                      "] (no more than the clients a round may select: min(clients_per_round, min_clients))");
  if (const aggregation::RobustSpec robust = aggregation::RobustSpec::parse(c.aggregator);
      c.mode != "async" && robust.min_updates() > c.quorum)  // async: check_async holds it against `buffer`
    bad("aggregator", "'" + c.aggregator + "' needs at least " + std::to_string(robust.min_updates()) +
                          " updates per round: raise quorum (now " + std::to_string(c.quorum) + ") or lower f");
  // Below 0.1 s no client can train and answer: every round would be abandoned.
  if (!(c.round_deadline_s >= 0.1 && c.round_deadline_s <= 604800))
    bad("round_deadline_s", "must be in [0.1, 604800] seconds");
  if (!(c.max_round_wait_s >= 0 && c.max_round_wait_s <= 2419200))
    bad("max_round_wait_s", "must be in [0, 2419200] seconds (0 = 4 x round_deadline_s)");
  if (c.max_round_wait_s > 0 && c.max_round_wait_s < c.round_deadline_s)
    bad("max_round_wait_s", "must be >= round_deadline_s");
  // [1, 1024] as sparrow-sim's workers, so a simulation's value runs here.
  if (c.workers < 1 || c.workers > 1024) bad("workers", "must be in [1, 1024]");
  if (c.db.empty()) bad("db", "must not be empty");
  if (c.keep_checkpoints < 1 || c.keep_checkpoints > 1000000) bad("keep_checkpoints", "must be in [1, 1000000]");
  if (c.eval_batch < 1 || c.eval_batch > 1000000) bad("eval_batch", "must be in [1, 1000000]");
  if (c.gateway()) {
    try {
      net::check_endpoint("upstream", c.upstream, /*for_bind=*/false);
    } catch (const ConfigError& e) {
      bad("upstream", e.what());
    }
    if (!core::valid_client_id(c.upstream_id)) bad("upstream_id", core::client_id_problem(c.upstream_id));
    if (!c.insecure && (c.upstream_server_key.empty() || c.upstream_key.empty()))
      bad("upstream",
          "needs upstream_server_key (the root's .key) and upstream_key (this gateway's .key_secret) "
          "unless --insecure");
    // A gateway forwards the plain weighted mean of its clients' deltas: the
    // root applies its optimiser, its aggregator, DP and downlink once.
    const char* why = "a gateway forwards the weighted mean of its clients' updates; set it on the root";
    if (c.algorithm == "scaffold") bad("algorithm", "scaffold cannot be relayed by a gateway (control variates)");
    if (c.algorithm == "fednova" || c.algorithm == "feddyn")
      bad("algorithm", c.algorithm + " cannot be relayed by a gateway (the root needs each client's update)");
    if (c.secagg != "none") bad("secagg", "is not available on a gateway (its aggregate would be unmasked there)");
    if (c.downlink != "none") bad("downlink", why);
    if (c.aggregator != "mean") bad("aggregator", why);
    if (c.dp != "none") bad("dp", why);
    if (c.server_optimizer != "fedavg") bad("server_optimizer", why);
  }
  // No key without an effect (docs/server.md): refused where it would change nothing.
  if (!c.http_token.empty() && c.http.empty()) bad("http_token", "has no effect without http (the dashboard is off)");
  if (c.eval_every == 0 && !c.eval_data.empty())
    bad("eval_data", "has no effect with eval_every = 0 (the server evaluates nothing; set eval_every)");
  if (c.eval_every == 0 && c.eval_batch != ServerConfig{}.eval_batch)
    bad("eval_batch", "has no effect with eval_every = 0 (the server evaluates nothing; set eval_every)");
  if (!c.gateway()) {
    const char* why = "has no effect without upstream (this server is no gateway)";
    if (!c.upstream_server_key.empty()) bad("upstream_server_key", why);
    if (!c.upstream_key.empty()) bad("upstream_key", why);
    if (c.upstream_id != ServerConfig{}.upstream_id) bad("upstream_id", why);
    if (!c.upstream_state_db.empty()) bad("upstream_state_db", why);
  }
  if (!c.insecure && c.server_key.empty())
    bad("key", "is required (the server's .key_secret file; `sparrow-server keygen`) unless --insecure");
  if (!c.insecure && c.allow.empty())
    bad("allow", "is required (allow-list file or directory of client .key files) unless --insecure");
}

ServerConfig parse_server_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                                 const std::string& source) {
  ServerConfig c;
  core::FlatConfig f(source);
  bind_all(f, c);
  // `server_key` is the old name of `key` (configs written before the key
  // names were made the same in every program keep working).
  std::string old_name;
  f.bind("server_key", &old_name);
  // A simulation's own keys: accepted, reported, unused.
  const federation::OtherProgramKeys sim_keys(f, federation::OtherProgramKeys::Program::kServer);
  f.read(toml_text, overrides);
  if (!old_name.empty()) {
    f.check("server_key", c.server_key.empty() || c.server_key == old_name,
            "is the old name of `key`, which is also set: keep only `key`");
    c.server_key = old_name;
  }
  sim_keys.collect(f, c);
  federation::validate(c, f);  // the shared keys, with where each value came from
  return c;
}

ServerConfig load_server_config(const std::string& path, const std::vector<std::string>& overrides) {
  ServerConfig c = parse_server_config(core::read_config_file(path), overrides, path);
  for (const std::string& key : c.no_effect)
    spdlog::info("event=config_no_effect key={} msg=\"{}\"", key,
                 federation::OtherProgramKeys::note(key, federation::OtherProgramKeys::Program::kServer));
  return c;
}

std::string identity_text(const ServerConfig& c) { return toml_lines(c, true); }

std::string config_hash(const ServerConfig& c) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng::hash_name(identity_text(c))));
  return buf;
}

std::string to_toml(const ServerConfig& c) {
  return "# sparrow-server effective configuration\n" + toml_lines(c, false);
}

}  // namespace sparrow::server
