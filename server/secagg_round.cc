// Server::Impl's SecAgg+ orchestration (docs/security.md): the protocol state
// of a round over its chosen clients, the clients' SecAgg messages checked
// against the stage, the four exchanges with their deadlines, the offenders
// held out, and the unmasked sum folded into the aggregate.
#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "core/error.h"
#include "core/peer_text.h"
#include "core/rng.h"
#include "server/impl.h"
#include "wire/net.h"

namespace sparrow::server {
namespace {
constexpr uint64_t kSecAggTag = 0x73656361;  // "seca"
}  // namespace

void Server::Impl::handle_secagg(std::unique_lock<std::mutex>& g, const std::string& rid, Session& s,
                                 const wire::SecAgg& m, size_t frame_bytes) {
  ClientRow& row = clients[s.client_id];
  row.bytes_up += frame_bytes;
  dirty_clients.insert(s.client_id);
  std::string why;
  const auto it = sa_setup.find(s.client_id);
  if (m.client_id != s.client_id)
    why = "client_id '" + m.client_id + "' is not this connection's";
  else if (!sa || !round_open || m.round != round)
    why = "stale SecAgg message: round " + std::to_string(m.round) + ", server is in round " + std::to_string(round) +
          (round_open && sa ? "" : " (no secure aggregation open)");
  else if (it == sa_setup.end())
    why = "not selected for round " + std::to_string(round);
  if (!why.empty()) {
    n.stale++;
    round_stale++;
    g.unlock();
    spdlog::info("event=secagg_stale client={} round={} stage={} reason=\"{}\"", s.client_id, m.round,
                 wire::secagg_stage_name(m.stage), core::printable(why));
    reply(rid, net::error_message(ErrorCode::kRejected, why, m.round));
    return;
  }
  const uint32_t index = it->second.index;
  // A message of the open exchange that the protocol refuses is a breach
  // (an honest client never sends one): the client leaves the round and sits
  // out the next selections. Out of turn is a straggler, refused alone.
  const bool in_turn = sa->open_for(m.stage) && !sa->excluded(index);
  try {
    switch (m.stage) {
      case wire::SecAggStage::kKeys:
        sa->add_keys(index, m);
        break;
      case wire::SecAggStage::kShares:
        sa->add_shares(index, m);
        break;
      case wire::SecAggStage::kMasked:
        sa->add_masked(index, m);
        break;
      case wire::SecAggStage::kReveal:
        sa->add_reveal(index, m);
        break;
      default:
        throw Error(std::string("a client does not send ") + wire::secagg_stage_name(m.stage) + " messages");
    }
  } catch (const Error& e) {
    ++round_rejected;
    row.rejects++;
    const std::string cid = s.client_id;
    if (in_turn) {
      sa->exclude(index);
      secagg_offender(cid, row.public_key, m.round, wire::secagg_stage_name(m.stage), "broke the protocol");
    }
    g.unlock();
    spdlog::warn("event=secagg_rejected client={} round={} stage={} error=\"{}\"", cid, m.round,
                 wire::secagg_stage_name(m.stage), core::printable(e.what()));
    reply_error(rid, ErrorCode::kRejected, e.what(), m.round);
    cv.notify_all();
    return;
  }
  if (m.stage == wire::SecAggStage::kMasked) {
    selected[s.client_id] = Status::kDone;
    ++round_accepted;
    row.updates++;
    n.accepted++;
    sa_metrics[s.client_id] = m.metrics;
    board->update_progress([&](monitor::Progress& p) { p.received = round_accepted; });
    g.unlock();
    reply(rid, msg(wire::Ack{m.round}));
  }
  cv.notify_all();
}

void Server::Impl::secagg_offender(const std::string& cid, const std::string& key, uint64_t r, const char* stage,
                                   const std::string& why) {
  spdlog::warn("event=secagg_offender client={} key={} round={} stage={} reason=\"{}\"", core::printable(cid),
               key.empty() ? "-" : key, r, stage, core::printable(why));
  strike(cid, key, /*at_once=*/true);
}

void Server::Impl::setup_secagg(uint64_t r, const std::vector<std::string>& chosen) {
  const uint32_t n = static_cast<uint32_t>(chosen.size());
  const uint64_t seed = rng::derive(rng::derive(rng::derive(cfg.seed, kSecAggTag), r), sa_attempt++);
  sa = std::make_unique<secagg::Server>(sa_params, r, n, seed, static_cast<size_t>(numel));
  sa_setup.clear();
  sa_client.clear();
  sa_metrics.clear();
  double total = 0;
  for (const auto& cid : chosen) total += static_cast<double>(sessions.at(by_client.at(cid)).num_samples);
  for (uint32_t i = 0; i < n; ++i) {
    wire::SecAggSetup a;
    a.index = i + 1;
    a.clients = n;
    a.degree = sa->degree();
    a.threshold = sa->threshold();
    a.graph_seed = seed;
    a.clip = sa_params.clip;
    a.weight = static_cast<double>(sessions.at(by_client.at(chosen[i])).num_samples) / total;
    sa_setup[chosen[i]] = a;
    sa_client[a.index] = chosen[i];
  }
}

void Server::Impl::send_secagg(std::map<uint32_t, wire::SecAgg> out) {
  for (auto& [index, m] : out) {
    const std::string& cid = sa_client.at(index);
    m.client_id = cid;
    auto bit = by_client.find(cid);
    if (bit == by_client.end()) continue;  // gone: a dropout of this stage
    std::string bytes = wire::serialize(msg(std::move(m)));
    clients[cid].bytes_down += bytes.size();
    send_bytes(bit->second, std::move(bytes));
  }
}

template <class Done>
bool Server::Impl::wait_phase(std::unique_lock<std::mutex>& g, Clock::time_point until, Done done) {
  for (;;) {
    if (done()) return true;
    if (stop.load()) return false;
    if (Clock::now() >= until) return true;
    cv.wait_for(g, kRoundTick);
    sweep();
  }
}

Server::Impl::Collected Server::Impl::collect_secagg(std::unique_lock<std::mutex>& g, uint64_t r, Clock::time_point t0,
                                                     Clock::time_point hard) {
  const auto phase = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(sa_params.timeout_s));
  const auto period = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.round_deadline_s));
  const size_t need = std::max<size_t>(static_cast<size_t>(cfg.quorum), sa->threshold() + 1);
  const size_t n = selected.size();
  auto fail = [&](const char* stage, size_t got, size_t of) {
    spdlog::warn(
        "event=round_abandoned round={} secagg=1 stage={} received={} of={} need={} msg=\"too few clients for "
        "secure aggregation (threshold {}); restarting the round with a fresh selection\"",
        r, stage, got, of, need, sa->threshold());
    return Collected::kAbandon;
  };
  auto progress = [&](const char* p) { board->update_progress([&](monitor::Progress& pr) { pr.phase = p; }); };
  progress("secagg keys");
  if (!wait_phase(g, t0 + phase, [&] { return sa->stage_complete(); })) return Collected::kStopped;
  if (sa->keyed().size() < need) return fail("keys", sa->keyed().size(), n);
  send_secagg(sa->neighbour_messages());
  progress("secagg shares");
  if (!wait_phase(g, Clock::now() + phase, [&] { return sa->stage_complete(); })) return Collected::kStopped;
  if (sa->shared().size() < need) return fail("shares", sa->shared().size(), sa->keyed().size());
  send_secagg(sa->shares_in_messages());
  progress("training");
  auto deadline = t0 + period;
  for (;;) {
    if (!wait_phase(g, deadline, [&] { return sa->stage_complete(); })) return Collected::kStopped;
    if (sa->stage_complete() || sa->masked().size() >= need) break;
    if (Clock::now() >= hard) return fail("masked", sa->masked().size(), sa->shared().size());
    deadline = std::min(deadline + period, hard);
    spdlog::warn("event=deadline_extended round={} updates={} need={}", r, sa->masked().size(), need);
  }
  std::map<uint32_t, wire::SecAgg> unmask = sa->unmask_messages();
  // Every report came with evidence the protocol checked (secagg::Server::
  // add_masked): the sender of a bad pair or the maker of a false report is
  // proven, named and held out; an honest client is never held out on
  // another's word.
  std::set<uint32_t> named;
  auto name_offenders = [&] {
    for (const auto& [u, o] : sa->offenders()) {
      if (!named.insert(u).second) continue;
      const std::string& cid = sa_client.at(u);
      secagg_offender(cid, clients[cid].public_key, r, o.stage, o.text([&](uint32_t i) { return sa_client.at(i); }));
    }
  };
  name_offenders();
  if (sa->survivors().size() < need) return fail("masked", sa->survivors().size(), sa->shared().size());
  send_secagg(std::move(unmask));
  progress("secagg unmask");
  if (!wait_phase(g, Clock::now() + phase, [&] { return sa->stage_complete(); })) return Collected::kStopped;
  if (!sa->can_unmask()) {
    spdlog::warn(
        "event=round_abandoned round={} secagg=1 stage=reveal revealed={} of={} msg=\"cannot unmask: {}; "
        "restarting the round with a fresh selection\"",
        r, sa->revealed().size(), sa->survivors().size(), sa->missing());
    return Collected::kAbandon;
  }
  // A survivor that revealed a wrong share (well formed, not the one it was
  // dealt: it does not match its dealer's digest) is named and held out
  // either way; the round is unmasked only when every secret has t shares
  // that match and reconstructs to its commitment, never with a wrong one.
  const bool ok = sa->reconstruct();
  name_offenders();
  if (!ok) {
    spdlog::warn(
        "event=round_abandoned round={} secagg=1 stage=reveal msg=\"cannot unmask: {}; restarting the round with a "
        "fresh selection\"",
        r, sa->failure());
    return Collected::kAbandon;
  }
  return Collected::kOk;
}

size_t Server::Impl::fold_secagg(std::map<std::string, double>& metrics) {
  double wsum = 0, samples = 0;
  std::vector<std::pair<double, std::vector<std::pair<std::string, double>>>> client_metrics;
  {
    std::lock_guard<std::mutex> g(mu);
    for (uint32_t i : sa->survivors()) {
      const std::string& cid = sa_client.at(i);
      const double w = static_cast<double>(clients[cid].num_samples);
      wsum += sa_setup.at(cid).weight;
      samples += w;
      client_metrics.emplace_back(w, sa_metrics[cid]);
    }
  }
  const auto t0 = Clock::now();
  const std::vector<uint32_t> sum = sa->unmask();  // the round is closed: no handler touches sa now
  const double scale = secagg::ring_scale(static_cast<uint32_t>(sa_setup.size()), sa_params.clip);
  engine->add_secagg_sum(sum, scale, wsum, samples, client_metrics);
  metrics["secagg.keys"] = static_cast<double>(sa->keyed().size());
  metrics["secagg.shares"] = static_cast<double>(sa->shared().size());
  metrics["secagg.masked"] = static_cast<double>(sa->survivors().size());
  metrics["secagg.unmask_seconds"] = std::chrono::duration<double>(Clock::now() - t0).count();
  return sa->survivors().size();
}

bool Server::Impl::end_secagg(uint64_t r, bool abandon, std::map<std::string, double>& metrics) {
  if (!abandon) {
    try {
      const size_t survivors = fold_secagg(metrics);
      std::lock_guard<std::mutex> g(mu);
      round_accepted = static_cast<int64_t>(survivors);  // a rejected client's masked update is not in the sum
    } catch (const Error& e) {
      spdlog::error("event=round_abandoned round={} secagg=1 error=\"{}\"", r, e.what());
      abandon = true;
    }
  }
  std::lock_guard<std::mutex> g(mu);
  sa.reset();
  sa_setup.clear();
  sa_client.clear();
  sa_metrics.clear();
  return abandon;
}

}  // namespace sparrow::server
