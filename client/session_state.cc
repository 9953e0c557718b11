// ClientSession::Impl's local state (state/store.h, key 0): the database
// bound to one client id and model, the broadcast model B_h the client holds
// with its round and run (so the next Hello reports h and a Delta against B_h
// applies after a restart), the state from before an update the server has
// not answered yet (key 1), and W_0 built from the run's model_seed.
#include <spdlog/spdlog.h>

#include "client/session_impl.h"
#include "compression/state.h"
#include "core/error.h"

namespace sparrow::client {

using compression::deserialize_weights;
using compression::serialize_weights;

void ClientSession::Impl::open_state() {
  state::ClientStateStore::Options so;
  so.encoding = state::parse_encoding(cfg.state_encoding);  // rows of either encoding load
  store = state::ClientStateStore::open(cfg.state_db, so);
  const auto id = store->get_meta(kMetaClientId);
  SPARROW_CHECK_T(
      ConfigError, !id || *id == cfg.client_id,
      "state_db: '" << cfg.state_db << "' belongs to client '" << *id << "', not '" << cfg.client_id << "'");
  const auto dg = store->get_meta(kMetaDigest);
  SPARROW_CHECK_T(ConfigError, !dg || *dg == std::to_string(digest),
                  "state_db: '" << cfg.state_db << "' was written for another model than '" << cfg.model << "'");
  if (auto s = store->get(kStateKey)) st = std::move(*s);
  uint64_t round = 0;
  if (auto r = store->get_meta(kMetaHeldRound); r && !r->empty()) {
    try {
      round = std::stoull(*r);
    } catch (const std::exception&) {
      throw FormatError("state_db: bad held round '" + *r + "' in " + cfg.state_db);
    }
  }
  held_run_id = store->get_meta(kMetaHeldRun).value_or("");
  if (auto c = store->get_meta(kMetaCommitRound); c && !c->empty()) {
    try {
      committed_round = std::stoull(*c);
    } catch (const std::exception&) {
      throw FormatError("state_db: bad committed round '" + *c + "' in " + cfg.state_db);
    }
  }
  // A database without the flag (an older client's) has no kept state.
  committed_answered = store->get_meta(kMetaCommitAnswered).value_or("1") != "0";
  if (round > 0) {
    held = deserialize_weights(store->get_meta(kMetaHeldWeights).value_or(""));
    bool ok = held.size() == shapes.size();
    for (const auto& [k, v] : held) ok = ok && shapes.count(k) && shapes.at(k) == v.sizes().vec();
    if (!ok) {
      spdlog::warn("state_db: the held model of round {} does not match the model; reporting round 0", round);
      held.clear();
      round = 0;
    }
  }
  self.held_round_.store(round);
  store->set_meta(kMetaClientId, cfg.client_id);
  store->set_meta(kMetaDigest, std::to_string(digest));
  store->flush();
  if (round > 0) spdlog::info("state: holding the broadcast model of round {} (run '{}')", round, held_run_id);
}

void ClientSession::Impl::reset_state() {
  st = state::ClientState{};
  held.clear();
  self.held_round_.store(0);
  store->put(kStateKey, st);
  committed_round = 0;
  committed_answered = true;
  store->put(kKeptStateKey, state::ClientState{});
  store->set_meta(kMetaCommitRound, "0");
  store->set_meta(kMetaCommitAnswered, "1");
  store->set_meta(kMetaHeldRound, "0");
  store->set_meta(kMetaHeldWeights, "");
  store->set_meta(kMetaHeldRun, "");
  store->flush();
}

void ClientSession::Impl::persist_held(uint64_t round, const Weights& w) {
  held = w;
  self.held_round_.store(round);
  held_run_id = welcome.run_id;
  store->set_meta(kMetaHeldRound, std::to_string(round));
  store->set_meta(kMetaHeldRun, held_run_id);
  store->set_meta(kMetaHeldWeights, serialize_weights(w));
  store->flush();
}

void ClientSession::Impl::answered(uint64_t round) {
  if (committed_round != round || committed_answered) return;
  committed_answered = true;
  store->put(kKeptStateKey, state::ClientState{});
  store->set_meta(kMetaCommitAnswered, "1");
  store->flush();
}

const Weights& ClientSession::Impl::initial_model(uint64_t seed) {
  if (!initial_seed || *initial_seed != seed) {
    initial = get_weights(*core::make_model(cfg.model, seed));
    for (auto& [k, v] : initial) v = v.to(at::kCPU, at::kFloat).contiguous();
    initial_seed = seed;
  }
  return initial;
}

}  // namespace sparrow::client
