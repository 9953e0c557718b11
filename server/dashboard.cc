// Server::Impl's publishing to the live dashboard (monitor::Board,
// docs/monitoring.md): the run and its history, each completed round's point,
// the client table and the counters. The HTTP threads only read the board.
#include <algorithm>
#include <chrono>
#include <cmath>

#include "server/impl.h"

namespace sparrow::server {

monitor::RoundPoint Server::Impl::point_of(const RoundRow& row, double seconds, double epsilon) {
  monitor::RoundPoint p;
  p.round = row.round;
  p.finished = row.finished;
  p.duration_s = std::isnan(seconds) ? row.finished - row.started : seconds;
  p.accuracy = row.eval_accuracy;
  p.loss = row.eval_loss;
  p.train_loss = row.train_loss;
  p.bytes_up = row.bytes_in;
  p.bytes_down = row.bytes_out;
  p.selected = row.selected;
  p.accepted = row.updates;
  p.rejected = row.rejected;
  p.stale = row.stale;
  p.dropped =
      std::max<int64_t>(0, row.selected - row.updates);  // selected, no update aggregated (late, missing, rejected)
  p.epsilon = epsilon;
  return p;
}

void Server::Impl::publish_history() {
  monitor::RunInfo info;
  info.program = "sparrow-server";
  info.run_id = run_id;
  info.model = cfg.model;
  info.config = to_toml(cfg);
  info.rounds_total = cfg.rounds;
  info.started = static_cast<double>(run_created);  // the run's, not this process's
  info.min_clients = cfg.effective_min_clients();   // the progress line's "needed to start"
  info.quorum = cfg.quorum;
  info.clients_per_round = cfg.clients_per_round;
  board->set_run(std::move(info));
  // Two queries for the whole history, not one per round.
  const std::map<int64_t, double> seconds = store->metric_series("round.seconds");
  const std::map<int64_t, double> epsilon = store->metric_series("dp.epsilon");
  for (const RoundRow& row : store->rounds())
    if (row.round <= completed.load())
      board->add_round(point_of(row, value_or_nan(seconds, row.round), value_or_nan(epsilon, row.round)));
  board->update_progress([&](monitor::Progress& p) {
    p.round = completed.load();
    p.rounds_completed = completed.load();
  });
  std::lock_guard<std::mutex> g(mu);
  publish_clients(true);
}

void Server::Impl::publish_clients(bool force) {
  const auto now = Clock::now();
  if (!force && now - clients_published < std::chrono::milliseconds(500)) return;
  clients_published = now;
  std::vector<monitor::ClientInfo> v;
  v.reserve(clients.size());
  for (const auto& [id, row] : clients)
    v.push_back({id, by_client.count(id) > 0, static_cast<double>(row.last_seen), row.updates, row.bytes_up,
                 row.bytes_down, row.num_samples, row.software});
  board->set_clients(std::move(v));
  monitor::Totals t;
  t.bytes_in = n.bytes_in.load();
  t.bytes_out = n.bytes_out.load();
  t.messages_in = n.messages_in.load();
  t.messages_out = n.messages_out.load();
  t.updates_accepted = n.accepted.load();
  t.stale = n.stale.load();
  t.unknown = n.unknown.load();
  t.send_failures = n.send_failures.load();
  t.rounds_abandoned = n.abandoned.load();
  for (size_t i = 0; i < n.rejected.size(); ++i)
    if (const uint64_t v = n.rejected[i].load()) t.rejected[wire::error_code_name(static_cast<ErrorCode>(i))] = v;
  board->set_totals(t);
  const int64_t live = static_cast<int64_t>(sessions.size());
  board->update_progress([&](monitor::Progress& p) { p.clients_connected = live; });
}

}  // namespace sparrow::server
