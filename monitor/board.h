#pragma once
// The live state a running program shows on its dashboard (docs/monitoring.md).
//
// A Board is written by the program's own loop (the server's round thread and
// session handlers, the simulator's run loop) and read by the HTTP threads of
// monitor::HttpEndpoint. Every method takes one short internal lock: writers
// copy a few numbers (or, for set_clients, a vector they built outside the
// lock), readers copy what they render and format it after unlocking, so a
// slow or hostile HTTP peer can never hold up a round.
//
// The JSON renderers are the dashboard's API (docs/monitoring.md lists every
// field); prometheus() is the text exposition format 0.0.4.

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace sparrow::monitor {

double unix_now();

struct RunInfo {
  std::string program;  // "sparrow-server" or "sparrow-sim"
  std::string run_id;
  std::string model;
  std::string config;  // the run's configuration as TOML text
  int64_t rounds_total = 0;
  double started = 0;  // unix seconds
  // What a round needs, for the progress line's wording (0: not applicable,
  // as in the simulator, which samples clients_per_round of the reachable
  // clients): live clients to start a round, updates to close it at its
  // deadline, and clients it selects.
  int64_t min_clients = 0, quorum = 0, clients_per_round = 0;
};

// One completed round. NaN = not measured this round (JSON null).
struct RoundPoint {
  int64_t round = 0;
  double finished = 0;    // unix seconds
  double duration_s = 0;  // wall-clock of the round
  double accuracy = 0, loss = 0, train_loss = 0;
  uint64_t bytes_up = 0, bytes_down = 0;
  int64_t selected = 0, accepted = 0, rejected = 0, stale = 0, dropped = 0;
  double epsilon = 0;  // DP: privacy spent after the round; NaN without DP
};

struct Progress {
  int64_t round = 0;              // the round in progress (or the last one)
  std::string phase = "waiting";  // waiting, training, aggregating, evaluating, done, stopped
  int64_t selected = 0, received = 0;
  double started = 0;   // unix seconds; 0 = no round yet
  double deadline = 0;  // unix seconds; NaN = none
  int64_t rounds_completed = 0;
  int64_t clients_connected = 0;
  // mode = "async" (docs/async.md): a round is a step of the model version.
  bool async = false;
  int64_t version = 0;         // steps taken: the model version tasks carry
  double staleness_max = NAN;  // of the last step's buffer
  double staleness_mean = NAN;
  double updates_per_min = NAN;  // accepted updates over the last minute
  int64_t in_flight = 0;         // tasks out now
  int64_t tasks_expired = 0;     // tasks given up (deadline, disconnect) since start
};

struct ClientInfo {
  std::string id;
  bool connected = false;
  double last_seen = 0;  // unix seconds
  int64_t rounds = 0;    // updates accepted from it
  uint64_t bytes_up = 0, bytes_down = 0, samples = 0;
  std::string software;  // what the client said it runs (Hello.software); "" in the simulator
};

// Monotonic totals for /metrics (counters since the program started).
struct Totals {
  uint64_t bytes_in = 0, bytes_out = 0;  // wire bytes received / sent
  uint64_t messages_in = 0, messages_out = 0;
  uint64_t updates_accepted = 0, stale = 0, unknown = 0, send_failures = 0, rounds_abandoned = 0;
  std::map<std::string, uint64_t> rejected;  // by reason (wire error code name)
};

class Board {
 public:
  void set_run(RunInfo run);
  // Appends (or replaces, after a resume re-publishes history) round p.round.
  void add_round(const RoundPoint& p);
  void set_progress(const Progress& p);
  // Changes some fields of the progress under the board's lock (f must be quick).
  template <class F>
  void update_progress(F&& f) {
    std::lock_guard<std::mutex> g(mu_);
    f(progress_);
  }
  void set_clients(std::vector<ClientInfo> clients);
  void set_totals(const Totals& t);

  // GET /api/run, /api/progress, /api/rounds?since=N, /api/clients?limit=N.
  // /api/progress also carries the run's headline figures, computed from the
  // completed rounds: the latest accuracy and its round, the bytes each way,
  // and eta_s (the mean duration of the last 10 rounds x the rounds left; 0
  // once done, null before a round completed). A finished or stopped run has
  // no deadline (null), whatever its last round had.
  // Peer text (client ids, `software`) is rendered core::printable() inside
  // the JSON string: plain ASCII, no control bytes (docs/security.md).
  std::string run_json() const;
  std::string progress_json() const;
  std::string rounds_json(int64_t since) const;
  // Most recently seen first (ties by id); at most `limit` rows.
  std::string clients_json(size_t limit) const;
  // Every round (for the report page).
  std::vector<RoundPoint> rounds() const;
  RunInfo run() const;
  // GET /metrics.
  std::string prometheus() const;

  static std::string round_json(const RoundPoint& p);
  static std::string run_json(const RunInfo& r, double now);

 private:
  mutable std::mutex mu_;
  RunInfo run_;
  std::vector<RoundPoint> rounds_;
  Progress progress_;
  // The client table as an immutable snapshot: readers take the pointer under
  // the lock and copy rows after releasing it.
  std::shared_ptr<const std::vector<ClientInfo>> clients_ = std::make_shared<const std::vector<ClientInfo>>();
  size_t clients_connected_ = 0;
  Totals totals_;
  bool have_totals_ = false;
};

}  // namespace sparrow::monitor
