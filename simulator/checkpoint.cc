// Checkpoints and resume: the run state after a completed round (global
// model, server optimiser, SCAFFOLD's c, ACP's factors, the aggregator's
// state, the broadcast model) committed as meta of client_state.db together
// with the client states of the rounds since the last one, in one
// transaction; a resume loads it, after checking that the config is the one
// it was taken under, and the history up to it (run_folder.cc). Over MPI
// ranks the other ranks commit their clients' states first (ranks.cc).
#include <cstdlib>
#include <optional>

#include "core/error.h"
#include "simulator/impl.h"

namespace sparrow::simulator {
namespace {

using compression::deserialize_weights;

// The round of the checkpoint in a run's client-state store (nullopt: none
// written); `what` opens the message of a value that is not a round.
std::optional<int> checkpoint_round(state::ClientStateStore& store, const char* what) {
  const std::optional<std::string> saved = store.get_meta("checkpoint.round");
  if (!saved) return std::nullopt;
  try {
    return std::stoi(*saved);
  } catch (const std::exception&) {
    throw FormatError(std::string(what) + ": bad checkpoint round '" + *saved + "' in " + store.path());
  }
}

}  // namespace

std::unique_ptr<state::ClientStateStore> open_store(const std::string& path, const SimConfig& cfg) {
  state::ClientStateStore::Options so;
  so.background = true;
  so.explicit_flush = true;
  so.encoding = state::parse_encoding(cfg.state_encoding);
  return state::ClientStateStore::open(path, so);
}

void Simulator::Impl::checkpoint(int completed, bool wait) {
  // Over ranks, one coordinated checkpoint: every other rank commits its
  // clients' states at `completed` first (ranks.cc), then this commit names
  // the round. A crash between the two leaves ranks ahead of
  // client_state.db, which a resume refuses (join_ranks).
  checkpoint_ranks(completed);
  if (distributed()) store->set_meta("checkpoint.ranks", std::to_string(cluster->size()));
  store->set_meta("checkpoint.round", std::to_string(completed));
  // The whole effective config, so that a resume can refuse an edited
  // config.toml (check_resume_config); committed with the checkpoint.
  store->set_meta("checkpoint.config", to_toml(cfg));
  // The global side's pieces, as the round engine writes them (and as
  // sparrow-server writes them into its checkpoints table).
  federation::GlobalState st = engine->save();
  store->set_meta("checkpoint.global", st.weights);
  store->set_meta("checkpoint.server_opt", st.server_opt);
  store->set_meta("checkpoint.scaffold", st.control);
  store->set_meta("checkpoint.acp", st.shared);
  store->set_meta("checkpoint.aggregator", st.aggregator);
  if (gm->has_downlink()) {
    store->set_meta("checkpoint.broadcast", st.broadcast);
    store->set_meta("checkpoint.downlink_bytes", std::to_string(down_bytes));
  }
  if (async_mode()) store->set_meta("checkpoint.async", async_saved);  // round.cc
  if (wait)
    store->flush();
  else
    store->flush_async();
}

void Simulator::Impl::load_weights(const std::string& bytes, client::Weights& into, const char* what) {
  client::Weights g = deserialize_weights(bytes);
  SPARROW_CHECK_T(FormatError, g.size() == into.size(), "resume: " << what << " does not match the model");
  for (auto& [k, v] : into) {
    SPARROW_CHECK_T(FormatError, g.count(k) && g.at(k).sizes() == v.sizes(),
                    "resume: " << what << " does not match the model at '" << k << "'");
    v.copy_(g.at(k));
  }
}

void Simulator::Impl::copy_safe_keys(const SimConfig& from, SimConfig& to) {
  to.rounds = from.rounds;
  to.out = from.out;
  to.checkpoint_every = from.checkpoint_every;    // only changes when state is written
  to.threads = from.threads;                      // only changes the speed
  to.keep_client_state = from.keep_client_state;  // only changes what is kept after the last round
}

void Simulator::Impl::refuse_differences(const SimConfig& recorded, const SimConfig& now, const std::string& where) {
  std::string keys;
  for (const std::string& d : config_differences(recorded, now)) keys += (keys.empty() ? "" : ", ") + d;
  if (keys.empty()) keys = "(a key to_toml does not write)";
  throw ConfigError("resume: the config differs from " + where + " in " + keys +
                    "; a resumed run may change only rounds, checkpoint_every, threads and keep_client_state");
}

void Simulator::Impl::check_resume_config() {
  const std::optional<std::string> text = store->get_meta("checkpoint.config");
  if (!text) return;
  SimConfig recorded;
  try {
    recorded = parse_config_string(*text);
  } catch (const std::exception& e) {
    throw FormatError("resume: the config recorded in " + store->path() + " does not parse (" + e.what() +
                      "); restore the run folder from a backup or start the run again with --force");
  }
  copy_safe_keys(cfg, recorded);
  if (!(recorded == cfg))
    refuse_differences(recorded, cfg,
                       "the one its checkpoint was taken under (" + store->path() + "; config.toml was edited?)");
}

void Simulator::Impl::load_checkpoint() {
  const std::optional<int> saved = checkpoint_round(*store, "resume");
  SPARROW_CHECK_T(ConfigError, saved.has_value(),
                  "resume: no checkpoint in " << store->path() << " (none written yet, or a run folder of an older "
                                              << "sparrow)");
  auto blob = [&](const char* key) {
    std::optional<std::string> v = store->get_meta(std::string("checkpoint.") + key);
    SPARROW_CHECK_T(FormatError, v.has_value(), "resume: checkpoint in " << store->path() << " lacks '" << key << "'");
    return *v;
  };
  round = *saved;
  // Client states are sharded by owner rank (ranks.cc): a run continues on
  // the rank count it was checkpointed on.
  const std::optional<std::string> ranks_meta = store->get_meta("checkpoint.ranks");
  const int saved_ranks = ranks_meta ? std::atoi(ranks_meta->c_str()) : 1;
  const int ranks = distributed() ? cluster->size() : 1;
  if (saved_ranks != ranks) {
    const std::string how = saved_ranks > 1 ? "mpirun -np " + std::to_string(saved_ranks) + " sparrow-sim --resume"
                                            : std::string("sparrow-sim --resume, without mpirun (or with -np 1)");
    throw ConfigError(
        "resume: " + dir.string() + " was checkpointed " +
        (saved_ranks > 1 ? "on " + std::to_string(saved_ranks) + " MPI ranks" : std::string("in one process")) +
        (saved_ranks > 1 ? ", each keeping the client states it owns (client_state.db and client_state.rank<r>.db)"
                         : std::string()) +
        ", and its client states cannot move to " +
        (ranks > 1 ? std::to_string(ranks) + " ranks" : std::string("one process")) + ": continue it with " + how +
        " " + dir.string());
  }
  federation::GlobalState st;
  st.weights = blob("global");
  st.server_opt = blob("server_opt");
  st.control = blob("scaffold");
  st.shared = blob("acp");
  if (std::optional<std::string> a = store->get_meta("checkpoint.aggregator")) st.aggregator = std::move(*a);
  if (gm->has_downlink()) {
    st.broadcast = blob("broadcast");
    down_bytes = std::stoull(blob("downlink_bytes"));
  }
  engine->load(st, "resume: " + store->path());  // checked and restored as sparrow-server restores its own
  SPARROW_CHECK_T(ConfigError, round <= cfg.rounds,
                  "resume: the run already has " << round << " rounds, more than rounds = " << cfg.rounds);
  if (async_mode()) {
    // round.cc: tasks in flight, clock, participations. A stop before the
    // first step ended saved none: the run starts from its first step.
    const std::string saved = blob("async");
    if (round > 0 || !saved.empty()) async_load(saved);
  } else {
    for (int r0 = 0; r0 < round; ++r0) count_participations(select_clients(r0));
  }
  load_history(round);
}
std::pair<std::map<std::string, at::Tensor>, int> load_run_model(const std::string& run_dir) {
  const fs::path cs = fs::path(run_dir) / "client_state.db";
  SPARROW_CHECK_T(ConfigError, fs::exists(cs), "export: " << run_dir << " holds no run (no client_state.db)");
  auto store = state::ClientStateStore::open(cs.string());
  const std::optional<int> round = checkpoint_round(*store, "export");
  const std::optional<std::string> global = store->get_meta("checkpoint.global");
  SPARROW_CHECK_T(ConfigError, round && global, "export: " << run_dir << " has no checkpoint yet");
  return {deserialize_weights(*global), *round};
}

}  // namespace sparrow::simulator
