#include "monitor/board.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <sstream>

#include "core/json.h"
#include "core/peer_text.h"

namespace sparrow::monitor {

double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

namespace {

std::string time_json(double t) { return json_number(t, 13); }  // millisecond resolution for unix seconds

// A Prometheus label value: \ " and newline escaped.
std::string label(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

// A sample value: Prometheus spells non-finite values NaN, +Inf, -Inf.
std::string sample(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return json_number(v, 12);
}

struct Metrics {
  std::ostringstream out;
  void family(const char* name, const char* type, const char* help) {
    out << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
  }
  void one(const char* name, const char* type, const char* help, double v) {
    family(name, type, help);
    out << name << ' ' << sample(v) << '\n';
  }
};

}  // namespace

void Board::set_run(RunInfo run) {
  std::lock_guard<std::mutex> g(mu_);
  run_ = std::move(run);
}

void Board::add_round(const RoundPoint& p) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = std::lower_bound(rounds_.begin(), rounds_.end(), p.round,
                             [](const RoundPoint& a, int64_t r) { return a.round < r; });
  if (it != rounds_.end() && it->round == p.round)
    *it = p;
  else
    rounds_.insert(it, p);
}

void Board::set_progress(const Progress& p) {
  std::lock_guard<std::mutex> g(mu_);
  progress_ = p;
}

void Board::set_clients(std::vector<ClientInfo> clients) {
  std::sort(clients.begin(), clients.end(), [](const ClientInfo& a, const ClientInfo& b) {
    return a.last_seen != b.last_seen ? a.last_seen > b.last_seen : a.id < b.id;
  });
  size_t connected = 0;
  for (const auto& c : clients) connected += c.connected;
  auto snapshot = std::make_shared<const std::vector<ClientInfo>>(std::move(clients));
  std::lock_guard<std::mutex> g(mu_);
  clients_.swap(snapshot);
  clients_connected_ = connected;
}

void Board::set_totals(const Totals& t) {
  std::lock_guard<std::mutex> g(mu_);
  totals_ = t;
  have_totals_ = true;
}

std::string Board::run_json(const RunInfo& r, double now) {
  std::ostringstream o;
  o << "{\"program\":" << json_string(r.program) << ",\"run_id\":" << json_string(r.run_id)
    << ",\"model\":" << json_string(r.model) << ",\"rounds_total\":" << r.rounds_total
    << ",\"started\":" << time_json(r.started) << ",\"now\":" << time_json(now) << ",\"min_clients\":" << r.min_clients
    << ",\"quorum\":" << r.quorum << ",\"clients_per_round\":" << r.clients_per_round
    << ",\"config\":" << json_string(r.config) << '}';
  return o.str();
}

std::string Board::run_json() const { return run_json(run(), unix_now()); }

RunInfo Board::run() const {
  std::lock_guard<std::mutex> g(mu_);
  return run_;
}

std::string Board::progress_json() const {
  Progress p;
  int64_t total, min_clients, quorum;
  uint64_t up = 0, down = 0;
  double accuracy = NAN, recent_s = 0;
  int64_t accuracy_round = 0, last_round = 0, recent = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    p = progress_;
    total = run_.rounds_total;
    min_clients = run_.min_clients;
    quorum = run_.quorum;
    for (size_t i = 0; i < rounds_.size(); ++i) {
      const RoundPoint& r = rounds_[i];
      up += r.bytes_up;
      down += r.bytes_down;
      if (std::isfinite(r.accuracy)) accuracy = r.accuracy, accuracy_round = r.round;
      if (i + 10 >= rounds_.size() && std::isfinite(r.duration_s)) recent_s += r.duration_s, ++recent;
    }
    if (!rounds_.empty()) last_round = rounds_.back().round;
  }
  const bool over = p.phase == "done" || p.phase == "stopped";
  const int64_t completed = std::max(p.rounds_completed, last_round);
  double eta = NAN;
  if (p.phase == "done")
    eta = 0;
  else if (recent > 0 && total > 0 && p.phase != "stopped")
    eta = recent_s / static_cast<double>(recent) * static_cast<double>(std::max<int64_t>(0, total - completed));
  std::ostringstream o;
  o << "{\"round\":" << p.round << ",\"phase\":" << json_string(p.phase) << ",\"selected\":" << p.selected
    << ",\"received\":" << p.received << ",\"started\":" << time_json(p.started)
    << ",\"deadline\":" << time_json(over ? NAN : p.deadline) << ",\"rounds_completed\":" << p.rounds_completed
    << ",\"rounds_total\":" << total << ",\"clients_connected\":" << p.clients_connected
    << ",\"min_clients\":" << min_clients << ",\"quorum\":" << quorum << ",\"accuracy\":" << json_number(accuracy, 9)
    << ",\"accuracy_round\":" << accuracy_round << ",\"bytes_up_total\":" << up << ",\"bytes_down_total\":" << down
    << ",\"eta_s\":" << json_number(eta, 9) << ",\"now\":" << time_json(unix_now());
  if (p.async)
    o << ",\"async\":{\"version\":" << p.version << ",\"staleness_max\":" << json_number(p.staleness_max, 9)
      << ",\"staleness_mean\":" << json_number(p.staleness_mean, 9)
      << ",\"updates_per_min\":" << json_number(p.updates_per_min, 9) << ",\"in_flight\":" << p.in_flight
      << ",\"tasks_expired\":" << p.tasks_expired << '}';
  o << '}';
  return o.str();
}

std::string Board::round_json(const RoundPoint& p) {
  std::ostringstream o;
  o << "{\"round\":" << p.round << ",\"finished\":" << time_json(p.finished)
    << ",\"duration_s\":" << json_number(p.duration_s, 9) << ",\"accuracy\":" << json_number(p.accuracy, 9)
    << ",\"loss\":" << json_number(p.loss, 9) << ",\"train_loss\":" << json_number(p.train_loss, 9)
    << ",\"bytes_up\":" << p.bytes_up << ",\"bytes_down\":" << p.bytes_down << ",\"selected\":" << p.selected
    << ",\"accepted\":" << p.accepted << ",\"rejected\":" << p.rejected << ",\"stale\":" << p.stale
    << ",\"dropped\":" << p.dropped << ",\"epsilon\":" << json_number(p.epsilon, 9) << '}';
  return o.str();
}

std::vector<RoundPoint> Board::rounds() const {
  std::lock_guard<std::mutex> g(mu_);
  return rounds_;
}

std::string Board::rounds_json(int64_t since) const {
  std::vector<RoundPoint> rs;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto it = std::upper_bound(rounds_.begin(), rounds_.end(), since,
                               [](int64_t r, const RoundPoint& a) { return r < a.round; });
    rs.assign(it, rounds_.end());
  }
  std::string out = "{\"rounds\":[";
  for (size_t i = 0; i < rs.size(); ++i) out += (i ? "," : "") + round_json(rs[i]);
  return out + "]}";
}

std::string Board::clients_json(size_t limit) const {
  std::shared_ptr<const std::vector<ClientInfo>> all;
  size_t connected;
  {
    std::lock_guard<std::mutex> g(mu_);
    all = clients_;
    connected = clients_connected_;
  }
  const size_t total = all->size();
  const std::vector<ClientInfo> cs(all->begin(), all->begin() + static_cast<std::ptrdiff_t>(std::min(limit, total)));
  std::ostringstream o;
  o << "{\"total\":" << total << ",\"connected\":" << connected << ",\"clients\":[";
  for (size_t i = 0; i < cs.size(); ++i) {
    const ClientInfo& c = cs[i];
    o << (i ? "," : "") << "{\"id\":" << json_string(core::printable(c.id))
      << ",\"connected\":" << (c.connected ? "true" : "false") << ",\"last_seen\":" << time_json(c.last_seen)
      << ",\"rounds\":" << c.rounds << ",\"bytes_up\":" << c.bytes_up << ",\"bytes_down\":" << c.bytes_down
      << ",\"samples\":" << c.samples << ",\"software\":" << json_string(core::printable(c.software)) << '}';
  }
  o << "]}";
  return o.str();
}

std::string Board::prometheus() const {
  RunInfo run;
  Progress p;
  Totals t;
  bool totals;
  size_t known, connected = 0;
  // Per-round figures summed over the history (copied: a few numbers per round).
  uint64_t up = 0, down = 0;
  int64_t accepted = 0, stale = 0, dropped = 0, selected = 0, rejected = 0;
  double accuracy = NAN, loss = NAN, train_loss = NAN, epsilon = NAN, duration = NAN, ingest = NAN;
  int64_t last_round = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    run = run_;
    p = progress_;
    t = totals_;
    totals = have_totals_;
    known = clients_->size();
    connected = clients_connected_;
    for (const auto& r : rounds_) {
      up += r.bytes_up;
      down += r.bytes_down;
      accepted += r.accepted;
      stale += r.stale;
      dropped += r.dropped;
      selected += r.selected;
      rejected += r.rejected;
      if (std::isfinite(r.accuracy)) accuracy = r.accuracy;
      if (std::isfinite(r.loss)) loss = r.loss;
      if (std::isfinite(r.train_loss)) train_loss = r.train_loss;
      if (std::isfinite(r.epsilon)) epsilon = r.epsilon;
    }
    if (!rounds_.empty()) {
      const RoundPoint& r = rounds_.back();
      last_round = r.round;
      duration = r.duration_s;
      ingest = r.duration_s > 0 ? static_cast<double>(r.bytes_up) / r.duration_s : NAN;
    }
  }
  Metrics m;
  m.family("sparrow_info", "gauge", "The run this program serves (labels); always 1.");
  m.out << "sparrow_info{program=\"" << label(run.program) << "\",run_id=\"" << label(run.run_id) << "\",model=\""
        << label(run.model) << "\"} 1\n";
  m.one("sparrow_rounds_completed", "gauge", "Completed rounds of the run (including those before a restart).",
        static_cast<double>(std::max(p.rounds_completed, last_round)));
  m.one("sparrow_rounds_planned", "gauge", "Rounds the run is configured for.", static_cast<double>(run.rounds_total));
  m.one("sparrow_round", "gauge", "The round in progress (or the last one).", static_cast<double>(p.round));
  m.one("sparrow_round_clients_selected", "gauge", "Clients selected for the round in progress.",
        static_cast<double>(p.selected));
  m.one("sparrow_round_updates_received", "gauge", "Updates received so far in the round in progress.",
        static_cast<double>(p.received));
  m.one("sparrow_clients_connected", "gauge", "Clients with a live session (simulator: clients of this round).",
        static_cast<double>(std::max<size_t>(connected, static_cast<size_t>(p.clients_connected))));
  m.one("sparrow_clients_known", "gauge", "Clients ever seen.", static_cast<double>(known));
  m.one("sparrow_last_round_duration_seconds", "gauge", "Wall-clock seconds of the last completed round.", duration);
  m.one("sparrow_last_round_ingest_bytes_per_second", "gauge",
        "Uplink bytes of the last completed round divided by its duration.", ingest);
  m.one("sparrow_accuracy", "gauge", "Accuracy of the last evaluation (NaN before one).", accuracy);
  m.one("sparrow_loss", "gauge", "Test loss of the last evaluation (NaN before one).", loss);
  m.one("sparrow_train_loss", "gauge", "Mean local training loss of the last round's clients.", train_loss);
  if (std::isfinite(epsilon))
    m.one("sparrow_dp_epsilon", "gauge", "Differential privacy: epsilon spent so far (at the configured delta).",
          epsilon);
  m.one("sparrow_uplink_bytes_total", "counter", "Update bytes of the completed rounds (client to server).",
        static_cast<double>(up));
  m.one("sparrow_downlink_bytes_total", "counter", "Model bytes of the completed rounds (server to clients).",
        static_cast<double>(down));
  m.one("sparrow_clients_selected_total", "counter", "Client selections over the completed rounds.",
        static_cast<double>(selected));
  m.one("sparrow_updates_accepted_total", "counter", "Updates aggregated over the completed rounds.",
        static_cast<double>(accepted));
  m.one("sparrow_updates_rejected_total", "counter", "Updates rejected on verification in the completed rounds.",
        static_cast<double>(rejected));
  m.one("sparrow_updates_stale_total", "counter", "Stale or repeated updates in the completed rounds.",
        static_cast<double>(stale));
  m.one("sparrow_updates_dropped_total", "counter",
        "Selected clients whose update was not aggregated (late, missing or rejected).", static_cast<double>(dropped));
  if (totals) {
    m.one("sparrow_wire_received_bytes_total", "counter", "Bytes of every frame received.",
          static_cast<double>(t.bytes_in));
    m.one("sparrow_wire_sent_bytes_total", "counter", "Bytes of every frame sent.", static_cast<double>(t.bytes_out));
    m.one("sparrow_messages_received_total", "counter", "Frames received.", static_cast<double>(t.messages_in));
    m.one("sparrow_messages_sent_total", "counter", "Frames sent.", static_cast<double>(t.messages_out));
    m.family("sparrow_messages_rejected_total", "counter", "Messages answered with an Error, by reason.");
    for (const auto& [why, v] : t.rejected)
      m.out << "sparrow_messages_rejected_total{reason=\"" << label(why) << "\"} " << v << '\n';
    m.one("sparrow_messages_unknown_total", "counter", "Messages from connections without a session.",
          static_cast<double>(t.unknown));
    m.one("sparrow_send_failures_total", "counter", "Frames that could not be queued to a peer.",
          static_cast<double>(t.send_failures));
    m.one("sparrow_rounds_abandoned_total", "counter", "Rounds restarted for lack of quorum.",
          static_cast<double>(t.rounds_abandoned));
  }
  return m.out.str();
}

}  // namespace sparrow::monitor
