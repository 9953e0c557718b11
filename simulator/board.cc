#include "simulator/board.h"

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "simulator/config.h"
#include "simulator/simulator.h"

namespace sparrow::simulator {
namespace {

monitor::RoundPoint point(const RoundMetrics& m, double now) {
  monitor::RoundPoint p;
  p.round = m.round;
  p.finished = now;
  p.duration_s = m.real_s;
  p.accuracy = m.accuracy;
  p.loss = m.loss;
  p.train_loss = m.train_loss;
  p.bytes_up = m.bytes_up;
  p.bytes_down = m.bytes_down;
  p.selected = m.clients;
  p.accepted = m.clients - m.dropped;
  p.dropped = m.dropped;
  p.epsilon = m.epsilon;
  return p;
}

}  // namespace

void SimBoard::start(const Simulator& sim) {
  const auto& cfg = sim.config();
  monitor::RunInfo info;
  info.program = "sparrow-sim";
  info.run_id = std::filesystem::path(cfg.out).filename().string();
  info.model = cfg.model;
  info.config = to_toml(cfg);  // what the run folder's config.toml holds
  info.rounds_total = cfg.rounds;
  info.started = monitor::unix_now();
  board_->set_run(std::move(info));
  for (const auto& m : sim.history()) board_->add_round(point(m, 0));
  board_->update_progress([&](monitor::Progress& p) {
    p.round = p.rounds_completed = sim.completed_rounds();
    p.phase = sim.done() ? "done" : "waiting";
  });
}

void SimBoard::round_started(int round, int selected) {
  board_->update_progress([&](monitor::Progress& p) {
    p.round = round;
    p.phase = "training";
    p.selected = p.clients_connected = selected;
    p.received = 0;
    p.started = monitor::unix_now();
    p.deadline = NAN;
  });
}

void SimBoard::received(int64_t n) {
  board_->update_progress([&](monitor::Progress& p) {
    if (p.phase == "training") p.received = n;
  });
}

void SimBoard::round_done(const RoundMetrics& m, bool last) {
  const double now = monitor::unix_now();
  board_->add_round(point(m, now));
  const uint64_t down_each = m.clients > 0 ? m.bytes_down / static_cast<uint64_t>(m.clients) : 0;
  for (auto& [id, c] : clients_) c.connected = false;
  for (const auto& p : m.participants) {
    monitor::ClientInfo& c = clients_[p.client];
    c.id = "client-" + std::to_string(p.client);
    c.connected = true;  // in this round
    c.last_seen = now;
    c.rounds += p.kept ? 1 : 0;
    c.bytes_up += p.bytes_up;
    c.bytes_down += down_each;
    c.samples = static_cast<uint64_t>(p.samples);
  }
  std::vector<monitor::ClientInfo> v;
  v.reserve(clients_.size());
  for (const auto& [id, c] : clients_) v.push_back(c);
  board_->set_clients(std::move(v));
  board_->update_progress([&](monitor::Progress& p) {
    p.rounds_completed = m.round;
    p.received = m.clients - m.dropped;
    p.phase = last ? "done" : "waiting";
  });
}

void SimBoard::stopped() {
  board_->update_progress([](monitor::Progress& p) { p.phase = "stopped"; });
}

}  // namespace sparrow::simulator
