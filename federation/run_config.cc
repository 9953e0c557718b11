#include "federation/run_config.h"

#include <algorithm>
#include <map>
#include <utility>

#include "aggregation/robust.h"
#include "aggregation/server_optimizer.h"
#include "compression/compressor.h"
#include "core/error.h"
#include "core/flat_config.h"
#include "core/spec.h"
#include "secagg/secagg.h"
#include "federation/sampler.h"
#include "federation/algorithms.h"
#include "federation/async_engine.h"
#include "federation/catchup.h"

namespace sparrow::federation {
namespace {

// The keys only one program uses, with their types (the owner checks their
// values; the other program only their types). tests/federation's config test
// fails when a program gains a key missing here.
enum class Type { kString, kDouble, kInt, kBool };
using KeyList = std::vector<std::pair<const char*, Type>>;

const KeyList& simulation_keys() {
  static const KeyList k = {{"dataset", Type::kString},
                            {"test_fraction", Type::kDouble},
                            {"validation", Type::kDouble},
                            {"partition", Type::kString},
                            {"adversaries", Type::kDouble},
                            {"attack", Type::kString},
                            {"client_batch", Type::kInt},
                            {"threads", Type::kInt},
                            {"device", Type::kString},
                            {"checkpoint_every", Type::kInt},
                            {"keep_client_state", Type::kBool},
                            {"state_encoding", Type::kString},
                            {"out", Type::kString},
                            {"deadline_s", Type::kDouble},
                            {"profiles.compute_speed", Type::kDouble},
                            {"profiles.uplink_mbps", Type::kDouble},
                            {"profiles.downlink_mbps", Type::kDouble},
                            {"profiles.availability", Type::kDouble},
                            {"alpha", Type::kDouble}};
  return k;
}

const KeyList& deployment_keys() {
  static const KeyList k = {{"listen", Type::kString},
                            {"key", Type::kString},
                            {"server_key", Type::kString},
                            {"allow", Type::kString},
                            {"max_message_mb", Type::kDouble},
                            {"heartbeat_ms", Type::kInt},
                            {"max_update_norm", Type::kDouble},
                            {"holdout_after", Type::kInt},
                            {"holdout_rounds", Type::kInt},
                            {"min_clients", Type::kInt},
                            {"quorum", Type::kInt},
                            {"round_deadline_s", Type::kDouble},
                            {"max_round_wait_s", Type::kDouble},
                            {"db", Type::kString},
                            {"keep_checkpoints", Type::kInt},
                            {"eval_data", Type::kString},
                            {"eval_batch", Type::kInt},
                            {"http", Type::kString},
                            {"http_token", Type::kString},
                            {"upstream", Type::kString},
                            {"upstream_server_key", Type::kString},
                            {"upstream_key", Type::kString},
                            {"upstream_id", Type::kString},
                            {"upstream_state_db", Type::kString}};
  return k;
}

const KeyList& other_keys(OtherProgramKeys::Program self) {
  return self == OtherProgramKeys::Program::kServer ? simulation_keys() : deployment_keys();
}

// Why a key of the other program changes nothing here, where a hint helps.
const std::map<std::string, std::string>& server_hints() {
  static const std::map<std::string, std::string> h = {
      {"dataset", "each client reads its own data"},
      {"partition", "each client reads its own data (sparrow-client's partition and index)"},
      {"alpha", "each client reads its own data (sparrow-client's partition and index)"},
      {"test_fraction", "each client reads its own data"},
      {"validation", "the service evaluates on data_dir or eval_data"},
      {"deadline_s", "the service's deadline is round_deadline_s, in real seconds"},
      {"out", "the service keeps its run in db"},
      {"checkpoint_every", "the service checkpoints every round (keep_checkpoints)"},
      {"adversaries", "the simulator's attack model"},
      {"attack", "the simulator's attack model"}};
  return h;
}

const std::map<std::string, std::string>& sim_hints() {
  static const std::map<std::string, std::string> h = {
      {"round_deadline_s", "the simulator's deadline is deadline_s, in simulated seconds"},
      {"db", "the simulator keeps its run in out"},
      {"keep_checkpoints", "the simulator checkpoints every checkpoint_every rounds"},
      {"min_clients", "a simulated round samples clients_per_round of the reachable clients"},
      {"quorum", "a simulated round samples clients_per_round of the reachable clients"},
      {"eval_data", "the simulator evaluates on the dataset's test split"},
      {"http", "sparrow-sim takes the dashboard as --http"},
      {"http_token", "sparrow-sim takes the dashboard as --http-token"}};
  return h;
}

}  // namespace

double RunConfig::scaffold_population(size_t seen) const {
  return static_cast<double>(std::max<size_t>({seen, static_cast<size_t>(std::max(clients, 0)), size_t{1}}));
}

void bind(core::FlatConfig& f, RunConfig& c) {
  f.bind("seed", &c.seed);
  f.bind("model", &c.model);
  f.bind("model_seed", &c.model_seed);
  f.bind("algorithm", &c.algorithm);
  f.bind("mu", &c.mu);
  f.bind("feddyn_alpha", &c.feddyn_alpha);
  f.bind("local_epochs", &c.local_epochs);
  f.bind("batch_size", &c.batch_size);
  f.bind("lr", &c.lr);
  f.bind("momentum", &c.momentum);
  f.bind("weight_decay", &c.weight_decay);
  f.bind("compression", &c.compression);
  f.bind("downlink", &c.downlink);
  f.bind("downlink_catchup", &c.downlink_catchup);
  f.bind("server_optimizer", &c.server_optimizer);
  f.bind("aggregator", &c.aggregator);
  f.bind("dp", &c.dp);
  f.bind("secagg", &c.secagg);
  f.bind("max_buffer_mb", &c.max_buffer_mb);
  f.bind("fold_buffer_mb", &c.fold_buffer_mb);
  f.bind("rounds", &c.rounds);
  f.bind("clients", &c.clients);
  f.bind("clients_per_round", &c.clients_per_round);
  f.bind("sampler", &c.sampler);
  f.bind("mode", &c.mode);
  f.bind("buffer", &c.buffer);
  f.bind("max_concurrency", &c.max_concurrency);
  f.bind("staleness", &c.staleness);
  f.bind("eval_every", &c.eval_every);
  f.bind("data_dir", &c.data_dir);
}

void validate(const RunConfig& c) {
  core::FlatConfig f("");
  bind(f, const_cast<RunConfig&>(c));  // read only
  validate(c, f);
}

// The ranges of docs/configuration.md's table: outside them a run cannot work
// (a step that overflows, a round that never fills). NaN fails every
// comparison below.
void validate(const RunConfig& c, const core::FlatConfig& f) {
  f.check_finite();
  f.check("model", !c.model.empty(), "must not be empty");
  f.check("algorithm",
          c.algorithm == "fedavg" || c.algorithm == "fedprox" || c.algorithm == "scaffold" ||
              c.algorithm == "fednova" || c.algorithm == "feddyn",
          "must be fedavg, fedprox, scaffold, fednova or feddyn (got '" + c.algorithm + "')");
  f.check("mu", c.mu >= 0 && c.mu <= 1000, "must be in [0, 1000]");
  f.check("mu", c.mu == 0 || c.algorithm == "fedprox",
          "has no effect unless algorithm = \"fedprox\" (the proximal term's weight)");
  for (const auto& [key, why] : check_algorithm(c)) f.fail(key, why);  // fednova, feddyn, feddyn_alpha
  f.check("local_epochs", c.local_epochs >= 1 && c.local_epochs <= 1000, "must be in [1, 1000]");
  f.check("batch_size", c.batch_size >= 1 && c.batch_size <= 1000000, "must be in [1, 1000000]");
  f.check("lr", c.lr > 0 && c.lr <= 10, "must be in (0, 10]");
  f.check("momentum", c.momentum >= 0 && c.momentum < 1, "must be in [0, 1)");
  f.check("weight_decay", c.weight_decay >= 0 && c.weight_decay <= 1, "must be in [0, 1]");
  f.check("rounds", c.rounds >= 1 && c.rounds <= 100000000, "must be in [1, 100000000]");
  f.check("clients", c.clients >= 0 && c.clients <= 10000000, "must be in [0, 10000000] (0 = not fixed)");
  f.check("clients_per_round", c.clients_per_round >= 1 && c.clients_per_round <= 1000000, "must be in [1, 1000000]");
  f.check("clients_per_round", c.clients <= 0 || c.clients_per_round <= c.clients,
          "must be in [1, clients = " + std::to_string(c.clients) + "]");
  f.check("eval_every", c.eval_every >= 0 && c.eval_every <= 100000000,
          "must be in [0, 100000000] (0 = no periodic evaluation)");
  f.check("max_buffer_mb", c.max_buffer_mb > 0 && c.max_buffer_mb <= 1048576, "must be in (0, 1048576]");
  f.check("fold_buffer_mb", c.fold_buffer_mb >= 0 && c.fold_buffer_mb <= 1048576,
          "must be in [0, 1048576] (0 = sum in arrival order)");

  f.check("sampler", c.sampler == "auto" || known_sampler(c.sampler), [&] {
    std::string known;
    for (const auto& n : sampler_names()) known += ", " + n;
    return "is not a selection rule (known: auto" + known + ")";
  }());
  // Spec strings: each built once, as the run builds it.
  compression::register_builtins();
  try {
    compression::make_compressor(c.compression);
  } catch (const ConfigError& e) {
    f.fail("compression", std::string("is not a valid compressor spec: ") + e.what());
  }
  if (c.downlink != "none") {
    std::string method;
    try {
      method = Spec::parse(c.downlink).method();
      compression::make_compressor(c.downlink);
    } catch (const ConfigError& e) {
      f.fail("downlink", std::string("is not a valid compressor spec: ") + e.what());
    }
    f.check("downlink", method != "acp",
            "cannot be acp (it needs a shared factor per round); use powersgd, topk, dgc, ...");
    f.check("downlink", method != "tcs",
            "cannot be tcs (it sends values on the server's mask); use stc, topk, dgc, ...");
  }
  try {
    parse_catchup(c.downlink_catchup);
  } catch (const ConfigError& e) {
    f.fail("downlink_catchup", std::string("is not a valid policy: ") + e.what());
  }
  try {
    aggregation::ServerOptimizer opt(c.server_optimizer);
  } catch (const ConfigError& e) {
    f.fail("server_optimizer", e.what());
  }
  aggregation::RobustSpec robust;
  try {
    robust = aggregation::RobustSpec::parse(c.aggregator);
  } catch (const ConfigError& e) {
    f.fail("aggregator", e.what());
  }
  try {
    const aggregation::DpSpec dp = aggregation::DpSpec::parse(c.dp);
    aggregation::check_combination(robust, dp, c.compression, c.algorithm);
    aggregation::Aggregator check(c.aggregator, c.dp, c.clients_per_round, 0);
  } catch (const ConfigError& e) {
    f.fail("dp", e.what());
  }
  f.check("aggregator", robust.min_updates() <= c.clients_per_round,
          "'" + c.aggregator + "' needs at least " + std::to_string(robust.min_updates()) +
              " updates per round; clients_per_round is " + std::to_string(c.clients_per_round) + " (lower f)");
  try {
    const secagg::Params sa = secagg::Params::parse(c.secagg);
    if (sa.enabled) {
      secagg::check_compatible(c.compression, c.aggregator, c.dp, c.algorithm);
      if (static_cast<uint32_t>(c.clients_per_round) < sa.min_clients())
        throw ConfigError("threshold " + std::to_string(sa.effective_threshold()) + " needs rounds of at least " +
                          std::to_string(sa.min_clients()) + " clients (clients_per_round is " +
                          std::to_string(c.clients_per_round) + ")");
    }
  } catch (const ConfigError& e) {
    f.fail("secagg", e.what());
  }
  for (const auto& [key, why] : check_async(c)) f.fail(key, why);
}

OtherProgramKeys::OtherProgramKeys(core::FlatConfig& f, Program self) {
  for (const auto& [key, type] : other_keys(self)) {
    keys_.push_back(key);
    switch (type) {
      case Type::kString:
        strings_.emplace_back();
        f.bind(key, &strings_.back());
        break;
      case Type::kDouble:
        doubles_.emplace_back();
        f.bind(key, &doubles_.back());
        break;
      case Type::kInt:
        ints_.emplace_back();
        f.bind(key, &ints_.back());
        break;
      case Type::kBool:
        bools_.emplace_back();
        f.bind(key, &bools_.back());
        break;
    }
  }
}

void OtherProgramKeys::collect(const core::FlatConfig& f, RunConfig& c) const {
  for (const std::string& key : keys_)
    if (f.has(key)) c.no_effect.push_back(key);
}

std::string OtherProgramKeys::note(const std::string& key, Program self) {
  const bool server = self == Program::kServer;
  const auto& hints = server ? server_hints() : sim_hints();
  const auto it = hints.find(key);
  return "config key '" + key + "' has no effect in " + (server ? "sparrow-server" : "sparrow-sim") + " (a " +
         (server ? "simulation" : "deployment") + " key" + (it == hints.end() ? "" : ": " + it->second) + ")";
}

std::vector<std::string> OtherProgramKeys::keys(Program self) {
  std::vector<std::string> out;
  for (const auto& kv : other_keys(self)) out.push_back(kv.first);
  return out;
}

}  // namespace sparrow::federation
