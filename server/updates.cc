// Server::Impl's updates, on the worker threads: a ModelUpdate admitted into
// the open round (or refused as stale, its weight capped at the samples the
// client declared), folded into the worker's own partial all-or-nothing, and
// answered with an Ack or an Error (a refused update is a strike).
#include <spdlog/spdlog.h>

#include <chrono>

#include "compression/compressor.h"
#include "compression/encoded.h"
#include "core/error.h"
#include "core/peer_text.h"
#include "federation/algorithms.h"
#include "server/impl.h"
#include "wire/net.h"

namespace sparrow::server {

Session* Server::Impl::update_session(std::unique_lock<std::mutex>& g, const std::string& rid,
                                      const wire::ModelUpdate& u) {
  auto it = sessions.find(rid);
  if (it == sessions.end()) {
    n.unknown++;
    g.unlock();
    reply_error(rid, ErrorCode::kRejected, "unknown client: send Hello", u.round);
    return nullptr;
  }
  Session& s = it->second;
  s.last_seen = Clock::now();
  if (u.client_id != s.client_id) {
    g.unlock();
    reply_error(rid, ErrorCode::kRejected, "client_id '" + u.client_id + "' is not this connection's", u.round);
    return nullptr;
  }
  return &s;
}

void Server::Impl::handle_update(size_t w, const std::string& rid, wire::ModelUpdate u, size_t frame_bytes) {
  if (async_mode()) return handle_async_update(rid, std::move(u), frame_bytes);  // async_round.cc
  {
    std::unique_lock<std::mutex> g(mu);
    Session* sp = update_session(g, rid, u);
    if (!sp) return;
    Session& s = *sp;
    std::string why;
    auto sel = selected.find(s.client_id);
    if (!round_open || u.round != round)
      why = "stale update: round " + std::to_string(u.round) + ", server is in round " + std::to_string(round) +
            (round_open ? "" : " (closed)");
    else if (sel == selected.end())
      why = "not selected for round " + std::to_string(round);
    else if (sel->second != Status::kWaiting)
      why = "update for round " + std::to_string(round) + " already received";
    else if (sa)
      why = "round " + std::to_string(round) + " uses secure aggregation: send SecAgg messages, not a ModelUpdate";
    if (!why.empty()) {
      n.stale++;
      round_stale++;
      clients[s.client_id].rejects++;
      dirty_clients.insert(s.client_id);
      g.unlock();
      spdlog::info("event=update_stale client={} round={} reason=\"{}\"", u.client_id, u.round, why);
      reply(rid, net::error_message(ErrorCode::kRejected, why, u.round));
      return;
    }
    sel->second = Status::kInFlight;
    ++in_flight;
    // An update weighs at most the samples the client said it holds (at
    // Hello, or a gateway's latest Heartbeat): a claim above that is capped.
    if (u.num_samples > s.num_samples) {
      if (const auto k = mismatch_log.admit("samples:" + s.client_id))
        spdlog::warn("event=samples_capped client={} key={} round={} claimed={} capped_to={} since_last_warning={}",
                     core::printable(s.client_id), s.key, u.round, u.num_samples, s.num_samples, *k);
      u.num_samples = s.num_samples;
    }
  }
  std::string error;
  ErrorCode code = ErrorCode::kRejected;
  try {
    fold(w, u);
  } catch (const compression::NonFiniteError& e) {  // the value scan wire::parse deferred
    error = e.what();
    code = ErrorCode::kMalformed;
  } catch (const std::bad_alloc&) {
    error = "out of memory";
  } catch (const std::exception& e) {  // sparrow::Error, and anything LibTorch throws on odd input
    error = e.what();
  }
  {
    std::lock_guard<std::mutex> g(mu);
    auto sel = selected.find(u.client_id);
    ClientRow& row = clients[u.client_id];
    if (error.empty()) {
      holdouts[u.client_id].strikes = 0;
      if (sel != selected.end()) sel->second = Status::kDone;
      ++round_accepted;
      row.updates++;
      row.bytes_up += frame_bytes;
      n.accepted++;
      board->update_progress([&](monitor::Progress& p) { p.received = round_accepted; });
    } else {
      if (sel != selected.end()) sel->second = Status::kWaiting;  // it may send a good one
      ++round_rejected;
      row.rejects++;
      strike(u.client_id, row.public_key);
    }
    dirty_clients.insert(u.client_id);
    --in_flight;
  }
  // The reply is queued before the round thread is woken (it may close the round).
  if (error.empty()) {
    reply(rid, msg(wire::Ack{u.round}));
    spdlog::debug("event=update_accepted client={} round={}", u.client_id, u.round);
  } else {
    spdlog::warn("event=update_rejected client={} round={} error=\"{}\"", u.client_id, u.round, core::printable(error));
    reply_error(rid, code, "update rejected: " + error, u.round);
  }
  cv.notify_all();
}

void Server::Impl::fold(size_t w, wire::ModelUpdate& u) {
  // Summed in client-id order (an early one is checked now and held until
  // its turn): the round engine sparrow-sim folds with.
  engine->add(w, u.client_id, arrival_of(u));
}

federation::Arrival Server::Impl::arrival_of(wire::ModelUpdate& u) {
  SPARROW_CHECK_T(FormatError, u.num_samples > 0, "num_samples must be > 0");
  // SCAFFOLD control deltas: decoded and checked before anything is added.
  Weights cdelta;
  if (cfg.algorithm == "scaffold") {
    for (auto& nt : u.control_delta) {
      auto sh = gm->weights().find(nt.name);
      SPARROW_CHECK_T(FormatError, sh != gm->weights().end(), "control_delta: unknown tensor '" << nt.name << "'");
      at::Tensor d = compression::decode(nt.tensor);
      SPARROW_CHECK_T(FormatError, d.sizes() == sh->second.sizes(), "control_delta: shape of '" << nt.name << "'");
      SPARROW_CHECK_T(FormatError, compression::all_finite(d), "control_delta: '" << nt.name << "' is not finite");
      cdelta[nt.name] = d;
    }
  }
  federation::Arrival a;
  a.update.reserve(u.tensors.size());
  for (auto& nt : u.tensors) a.update.emplace_back(std::move(nt.name), std::move(nt.tensor));
  a.control_delta = std::move(cdelta);
  federation::fold_terms(cfg, u.num_samples, a);  // the weight (FedNova's n / a_i) and its sums
  for (const auto& [k, v] : u.metrics) a.metrics[k] += v;
  return a;
}

}  // namespace sparrow::server
