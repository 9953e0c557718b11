// Server::Impl's sessions: Hello and Welcome (identity and key binding, the
// task resent to a reconnected client), heartbeats, Bye and the other control
// messages, the liveness sweep, and the strikes that hold a client out of
// selection.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>

#include "core/peer_text.h"
#include "server/impl.h"
#include "wire/net.h"

namespace sparrow::server {

void Server::Impl::handle_control(const std::string& rid, const std::string& key, const wire::Message& m,
                                  size_t frame_bytes) {
  if (const auto* h = std::get_if<wire::Hello>(&m.body)) return handle_hello(rid, key, *h, m.minor);
  std::unique_lock<std::mutex> g(mu);
  auto it = sessions.find(rid);
  if (std::holds_alternative<wire::ErrorBody>(m.body)) {
    const auto& e = std::get<wire::ErrorBody>(m.body);
    spdlog::warn("event=client_error client={} code={} msg=\"{}\"",
                 it == sessions.end() ? "?" : core::printable(it->second.client_id), wire::error_code_name(e.code),
                 core::printable(e.message));
    return;  // never answer an Error with an Error
  }
  if (it == sessions.end()) {
    n.unknown++;
    g.unlock();
    reply_error(rid, ErrorCode::kRejected, "unknown client: send Hello");
    return;
  }
  Session& s = it->second;
  s.last_seen = Clock::now();
  touch(s.client_id);
  if (const auto* hb = std::get_if<wire::Heartbeat>(&m.body)) {
    if (hb->num_samples > 0) s.num_samples = hb->num_samples;  // a gateway's clients changed
    const uint64_t r = round;
    g.unlock();
    reply(rid, msg(wire::Heartbeat{r}));
  } else if (const auto* sm = std::get_if<wire::SecAgg>(&m.body)) {
    handle_secagg(g, rid, s, *sm, frame_bytes);
  } else if (const auto* b = std::get_if<wire::Bye>(&m.body)) {
    spdlog::info("event=client_bye client={} reason=\"{}\"", core::printable(s.client_id), core::printable(b->reason));
    by_client.erase(s.client_id);
    sessions.erase(it);
    n_connected_changed();
  } else {
    g.unlock();
    reply_error(rid, ErrorCode::kUnsupported, std::string("unexpected message ") + wire::body_name(m.body));
  }
}

void Server::Impl::n_connected_changed() { cv.notify_all(); }

void Server::Impl::touch(const std::string& client_id) {
  auto it = clients.find(client_id);
  if (it == clients.end()) return;
  it->second.last_seen = static_cast<int64_t>(unix_now());
  dirty_clients.insert(client_id);
}

void Server::Impl::handle_hello(const std::string& rid, const std::string& key, const wire::Hello& h, uint16_t minor) {
  auto refuse = [&](const std::string& why) {
    spdlog::warn("event=hello_refused client=\"{}\" key={} reason=\"{}\"", core::printable(h.client_id), key,
                 core::printable(why));
    reply_error(rid, ErrorCode::kRejected, why);
  };
  // Ids are shown in logs, status output and the dashboard (docs/security.md).
  if (const std::string why = core::client_id_problem(h.client_id); !why.empty()) return refuse(why);
  if (h.num_samples == 0) return refuse("num_samples must be > 0");
  if (h.model != cfg.model)
    return refuse("model mismatch: server runs '" + cfg.model + "', client has '" + h.model + "'");
  if (h.model_digest != digest) return refuse("model digest mismatch (different parameter names or shapes)");
  std::unique_lock<std::mutex> g(mu);
  auto cit = clients.find(h.client_id);
  if (cit != clients.end() && !cit->second.public_key.empty() && cit->second.public_key != key) {
    g.unlock();
    return refuse("client id '" + h.client_id + "' is bound to another key");
  }
  // One key is one client: a key that registered an id cannot open
  // sessions under other ids (which would multiply its selection chances
  // and its weight in the average). Without CURVE there is no key.
  if (!key.empty()) {
    auto kit = id_of_key.find(key);
    if (kit != id_of_key.end() && kit->second != h.client_id) {
      const std::string bound = kit->second;
      g.unlock();
      return refuse("this key is bound to client id '" + bound + "': one key is one client");
    }
    id_of_key.emplace(key, h.client_id);
  }
  const int64_t now = static_cast<int64_t>(unix_now());
  if (cit == clients.end()) {
    ClientRow row;
    row.client_id = h.client_id;
    row.public_key = key;
    row.first_seen = now;
    cit = clients.emplace(h.client_id, row).first;
  }
  ClientRow& row = cit->second;
  if (row.public_key.empty()) row.public_key = key;
  row.last_seen = now;
  row.num_samples = h.num_samples;
  row.software = h.software;
  dirty_clients.insert(h.client_id);
  // The same client on a new connection replaces its old session.
  auto bit = by_client.find(h.client_id);
  if (bit != by_client.end() && bit->second != rid) sessions.erase(bit->second);
  // A connection that changes identity drops its old binding.
  auto sit = sessions.find(rid);
  if (sit != sessions.end() && sit->second.client_id != h.client_id) by_client.erase(sit->second.client_id);
  Session& s = sessions[rid];
  s.client_id = h.client_id;
  s.key = key;
  s.last_seen = Clock::now();
  s.last_round = h.last_round;
  s.minor = minor;
  s.num_samples = h.num_samples;
  by_client[h.client_id] = rid;
  wire::Welcome w;
  w.run_id = run_id;
  w.heartbeat_ms = static_cast<uint32_t>(cfg.heartbeat_ms);
  w.round = round;
  w.max_message_bytes = cfg.max_message_bytes();
  w.model_seed = cfg.effective_model_seed();
  reply(rid, msg(w));
  spdlog::info("event=hello client={} samples={} last_round={} software=\"{}\" sessions={}", h.client_id, h.num_samples,
               h.last_round ? std::to_string(*h.last_round) : "none", core::printable(h.software), sessions.size());
  // Async: a task out to this client is given up (it restarted, or its
  // connection did); the next hand-out gives it the current version.
  if (async_mode()) {
    auto t = async_tasks.find(h.client_id);
    if (t != async_tasks.end() && !t->second.folding) {
      async_tasks.erase(t);
      async_last.erase(h.client_id);
    }
  }
  // Selected in the open round and still owing its update: (re)send the task.
  if (round_open) {
    auto sel = selected.find(h.client_id);
    // Under secure aggregation only before its keys: a client that lost its
    // round keys (it restarted) is a dropout of this round.
    const bool keyed = sa && sa_setup.count(h.client_id) && sa->keyed().count(sa_setup.at(h.client_id).index);
    if (sel != selected.end() && sel->second == Status::kWaiting && !keyed) send_task(rid, s, *round_ctx);
  }
  cv.notify_all();
}

void Server::Impl::strike(const std::string& cid, const std::string& key, bool at_once) {
  Holdout& h = holdouts[cid];
  if (at_once) h.strikes = std::max<int64_t>(h.strikes, cfg.holdout_after - 1);
  if (++h.strikes < cfg.holdout_after || cfg.holdout_rounds == 0) return;
  h.strikes = 0;
  const uint64_t rounds = static_cast<uint64_t>(cfg.holdout_rounds) << std::min<uint64_t>(h.holds, 6);
  ++h.holds;
  h.until = round + rounds;
  spdlog::warn("event=client_held_out client={} key={} refused_in_a_row={} until_round={}", core::printable(cid),
               key.empty() ? "-" : key, cfg.holdout_after, h.until);
}

void Server::Impl::sweep() {
  const auto now = Clock::now();
  const auto limit = std::chrono::milliseconds(3 * cfg.heartbeat_ms);
  for (auto it = sessions.begin(); it != sessions.end();) {
    const Session& s = it->second;
    // A client training an async task sends nothing until its update: the
    // task's deadline governs it.
    bool owes = async_tasks.count(s.client_id) > 0;
    if (round_open) {
      auto sel = selected.find(s.client_id);
      owes = sel != selected.end() && sel->second != Status::kDone;
    }
    if (!owes && now - s.last_seen > limit) {
      spdlog::info("event=client_gone client={} silent_ms={}", s.client_id,
                   std::chrono::duration_cast<std::chrono::milliseconds>(now - s.last_seen).count());
      by_client.erase(s.client_id);
      it = sessions.erase(it);
    } else {
      ++it;
    }
  }
  n_connected = sessions.size();
  publish_clients();
}

}  // namespace sparrow::server
