// Session::Impl's side of a SecAgg+ round (docs/security.md), as
// sparrow-client's (client/session_secagg.cc): the keys sent for a SecAgg
// Task, the shares for the neighbours, the masked update after training
// (quantised into the ring by ring.h, the same bytes as
// federation::quantise_update), the reveal.
#include <spdlog/spdlog.h>

#include "core/error.h"
#include "liteclient/ring.h"
#include "liteclient/session_impl.h"

namespace sparrow::liteclient {

void Session::Impl::start_secagg(const wire::Task& task, std::vector<float> base) {
  auto round = std::make_unique<SecAggRound>();
  round->prepared = prepare(task, base);  // the held model may move on before the round ends: a copy of its own
  round->task = task;
  round->task.weights.clear();  // the decoded base is kept instead (on_task() cleared them already)
  round->base = std::move(base);
  round->party = std::make_unique<secagg::Client>(*task.secagg, task.round, cfg.client_id);
  const wire::SecAgg keys = round->party->keys();
  sa = std::move(round);
  spdlog::info("round {}: secure aggregation as client {} of {} (degree {}, threshold {}): keys sent", task.round,
               task.secagg->index, task.secagg->clients, task.secagg->degree, task.secagg->threshold);
  send(message(keys));
}

void Session::Impl::on_secagg(const wire::SecAgg& m) {
  if (!sa || sa->task.round != m.round) {
    spdlog::warn("secure aggregation: {} message for round {} without that round open here: ignored",
                 wire::secagg_stage_name(m.stage), m.round);
    return;
  }
  const uint64_t r = m.round;
  try {
    switch (m.stage) {
      case wire::SecAggStage::kNeighbours:
        send(message(sa->party->shares(m)));
        return;
      case wire::SecAggStage::kSharesIn:
        for (const auto& [v, why] : sa->party->receive_shares(m))
          spdlog::warn("round {}: secure aggregation: {}: client {} treated as dropped and reported to the server", r,
                       why, v);
        masked_update();
        return;
      case wire::SecAggStage::kUnmask:
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
    if (m.stage != wire::SecAggStage::kUnmask) sa.reset();
  }
}

void Session::Impl::masked_update() {
  const wire::SecAggSetup& a = *sa->task.secagg;
  const uint64_t r = sa->task.round;
  Trained t = train(sa->task, sa->base, sa->prepared);
  const double scale = secagg::ring_scale(a.clients, a.clip);
  const uint64_t key = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();  // rounding: this device's own
  RingUpdate q = quantise_update(layout, t.update.delta, a.weight, a.clip, scale, key);
  if (q.clipped)
    spdlog::warn("round {}: secure aggregation clipped {} of {} coordinates to +-{}", r, q.clipped, q.x.size(), a.clip);
  std::vector<std::pair<std::string, double>> metrics = t.metrics;
  metrics.emplace_back("secagg_clipped", static_cast<double>(q.clipped));
  commit_and_send(r, t, wire::serialize(message(sa->party->masked(std::move(q.x), std::move(metrics)))));
}

}  // namespace sparrow::liteclient
