// ClientSession::Impl's side of a SecAgg+ round (docs/security.md): the keys
// sent for a SecAgg Task, the shares for the neighbours, the masked update
// after training (quantised into the ring), the reveal; the fault points the
// integration tests crash a client at.
#include <spdlog/spdlog.h>

#include <cstdlib>

#include "client/session_impl.h"
#include "core/error.h"
#include "federation/client_pipeline.h"

namespace sparrow::client {

void ClientSession::Impl::fault_point(const char* where) {
  if (cfg.fault == where) {
    spdlog::warn("fault injection: exiting at {}", where);
    std::_Exit(3);
  }
}

void ClientSession::Impl::start_secagg(const wire::Task& task, const Weights& base) {
  fault_point("secagg-keys");
  auto round = std::make_unique<SecAggRound>();
  round->prepared = prepare(task, base);
  round->task = task;
  round->task.weights.clear();  // the decoded base is kept instead
  round->base = clone_weights(base);
  round->party = std::make_unique<secagg::Client>(*task.secagg, task.round, cfg.client_id);
  const wire::SecAgg keys = round->party->keys();
  sa = std::move(round);
  spdlog::info("round {}: secure aggregation as client {} of {} (degree {}, threshold {}): keys sent", task.round,
               task.secagg->index, task.secagg->clients, task.secagg->degree, task.secagg->threshold);
  send(message(keys));
}

void ClientSession::Impl::on_secagg(const wire::SecAgg& m) {
  if (!sa || sa->task.round != m.round) {
    spdlog::warn("secure aggregation: {} message for round {} without that round open here: ignored",
                 wire::secagg_stage_name(m.stage), m.round);
    return;
  }
  const uint64_t r = m.round;
  try {
    switch (m.stage) {
      case wire::SecAggStage::kNeighbours:
        fault_point("secagg-shares");
        send(message(sa->party->shares(m)));
        return;
      case wire::SecAggStage::kSharesIn: {
        fault_point("secagg-masked");
        // A neighbour whose pair is bad counts as dropped: the Masked
        // message names it and the server takes it out of the round.
        for (const auto& [v, why] : sa->party->receive_shares(m))
          spdlog::warn("round {}: secure aggregation: {}: client {} treated as dropped and reported to the server", r,
                       why, v);
        masked_update();
        return;
      }
      case wire::SecAggStage::kUnmask:
        fault_point("secagg-reveal");
        send(message(sa->party->reveal(m)));
        spdlog::info("round {}: secure aggregation: shares revealed", r);
        sa.reset();
        return;
      default:
        throw Error(std::string("a server does not send ") + wire::secagg_stage_name(m.stage) + " messages");
    }
  } catch (const std::exception& e) {
    spdlog::warn("round {}: secure aggregation: {}", r, e.what());
    wire::Message reply;
    reply.body = wire::error_for(e, r);
    send(reply);
    // A refused unmask request leaves the round open here: the client
    // answers no other request of it, but the server may still finish
    // without this client's reveal.
    if (m.stage != wire::SecAggStage::kUnmask) sa.reset();
  }
}

void ClientSession::Impl::masked_update() {
  const wire::SecAggSetup& a = *sa->task.secagg;
  const uint64_t r = sa->task.round;
  Trained t = train(sa->task, sa->base, sa->prepared);
  const double scale = secagg::ring_scale(a.clients, a.clip);
  const uint64_t key = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();  // rounding: this device's own
  // The client pipeline the simulator's clients run too (federation/client_pipeline.h).
  federation::RingUpdate q = federation::quantise_update(names, t.outgoing, a.weight, a.clip, scale, key);
  if (q.clipped)
    spdlog::warn("round {}: secure aggregation clipped {} of {} coordinates to +-{}", r, q.clipped, q.x.size(), a.clip);
  std::vector<std::pair<std::string, double>> metrics = t.metrics;
  metrics.emplace_back("secagg_clipped", static_cast<double>(q.clipped));
  commit_and_send(r, t, wire::serialize(message(sa->party->masked(std::move(q.x), std::move(metrics)))));
}

}  // namespace sparrow::client
