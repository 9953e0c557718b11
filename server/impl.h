#pragma once
// Private to sparrow_server: Server::Impl, the state of one server, and the
// plain structs its parts share. Its methods are defined by job:
//   server.cc         the public Server: construction (model, evaluation data,
//                     aggregator, round engine), start and stop of the threads
//   io.cc             the listener, the I/O thread (receive, outbox), the worker
//                     pool's loop (parse of large frames), replies
//   sessions.cc       Hello/Welcome, heartbeats and other control messages, the
//                     liveness sweep, strikes and holdouts
//   updates.cc        a ModelUpdate's admission into the open round and its fold
//                     (federation::RoundEngine::add, worker threads)
//   round.cc          driving the round (federation::RoundEngine, the simulator's
//                     engine): selection, tasks, deadlines and quorum, closing,
//                     the global step, the round's record
//   async_round.cc    mode = "async" (federation::AsyncEngine, the simulator's
//                     engine): tasks to free clients, the fold with its durable
//                     record before the Ack, the step every `buffer` updates
//   secagg_round.cc   SecAgg+ orchestration: setup, the four exchanges, offenders,
//                     the unmasked sum folded into the aggregate
//   checkpoint.cc     the server database: open, resume, checkpoint contents;
//                     evaluation
//   dashboard.cc      publishing to the live dashboard (monitor::Board)
// Threads (server.h, docs/server.md "Threading"): the I/O thread alone uses
// the listener; workers fold into the round engine (its own lock) and, under `mu`, the session
// and round state; the round thread (run(), relay_round()) owns the global
// model, guarded by `weights_mu` for readers on other threads. Methods marked
// "under mu" expect the caller to hold it.

#include <ATen/core/Tensor.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "aggregation/aggregator.h"
#include "aggregation/robust.h"
#include "compression/encoded.h"
#include "core/datasets.h"
#include "core/models.h"
#include "core/refusal_log.h"
#include "federation/async_engine.h"
#include "federation/global_model.h"
#include "federation/round_engine.h"
#include "monitor/board.h"
#include "monitor/http.h"
#include "secagg/secagg.h"
#include "server/server.h"
#include "server/store.h"
#include "transport/transport.h"
#include "wire/wire.h"

namespace sparrow::server {

using Clock = std::chrono::steady_clock;
using wire::ErrorCode;

// How often the round thread wakes to sweep liveness and check deadlines.
inline constexpr auto kRoundTick = std::chrono::milliseconds(20);

inline const double kNaN = std::numeric_limits<double>::quiet_NaN();

// At most one log line per key and period: admit() returns how many events of
// that key came since the last admitted one (1 the first time), or nullopt.
class RateLimiter {
 public:
  explicit RateLimiter(std::chrono::seconds period = std::chrono::seconds(60)) : period_(period) {}
  std::optional<uint64_t> admit(const std::string& key) {
    std::lock_guard<std::mutex> g(mu_);
    const auto now = std::chrono::steady_clock::now();
    auto it = seen_.find(key);
    if (it == seen_.end()) {
      if (seen_.size() >= 10000) seen_.clear();  // a flood of distinct keys cannot grow it without bound
      seen_[key] = Entry{0, now};
      return uint64_t{1};
    }
    Entry& e = it->second;
    ++e.count;  // events since the last admitted one
    if (now - e.last < period_) return std::nullopt;
    const uint64_t n = e.count;
    e.count = 0;
    e.last = now;
    return n;
  }

 private:
  struct Entry {
    uint64_t count = 0;
    std::chrono::steady_clock::time_point last;
  };
  std::chrono::seconds period_;
  std::mutex mu_;
  std::map<std::string, Entry> seen_;
};

inline double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

using compression::dense_encoded;

inline wire::Message msg(wire::Body body) {
  wire::Message m;
  m.body = std::move(body);
  return m;
}

// A selected client's update in the open round.
enum class Status { kWaiting, kInFlight, kDone };

struct Session {
  std::string client_id;
  std::string key;
  Clock::time_point last_seen;
  std::optional<uint64_t> last_round;  // the broadcast model round the client holds
  uint16_t minor = 0;                  // its Hello's protocol minor (catch-up tasks from 1.9)
  uint64_t num_samples = 0;
};

// A frame handed from the I/O thread to the worker pool.
struct Job {
  std::string routing_id;
  std::string key;
  transport::Frame frame;               // unparsed (large) frame, or empty
  std::optional<wire::Message> parsed;  // parsed on the I/O thread
  size_t size = 0;
};

// What every task and every update of a round shares; immutable while the
// round is open (workers hold a shared_ptr taken under the state mutex).
struct RoundContext {
  uint64_t round = 0;
  aggregation::ContextMap contexts;
  std::vector<wire::NamedTensor> full;   // B_{r-1} in full (Dense F32)
  std::vector<wire::NamedTensor> delta;  // downlink: C_{r-1}; empty otherwise
  // Downlink: the catch-up sources of B_{r-1} (federation/catchup.h); null without a codec.
  std::shared_ptr<const federation::CatchupView> catchup;
  std::vector<wire::NamedTensor> shared;   // ACP shared factors
  std::vector<wire::NamedTensor> control;  // SCAFFOLD server control
  // A gateway's round (relay_round): the root's training settings, passed on.
  std::optional<wire::TrainSettings> relay_train;
};

struct AtomicCounters {
  std::atomic<uint64_t> accepted{0}, stale{0}, unknown{0}, bytes_in{0}, bytes_out{0}, messages_in{0}, messages_out{0},
      send_failures{0}, rounds{0}, abandoned{0};
  std::array<std::atomic<uint64_t>, 8> rejected{};
};

struct Server::Impl {
  ServerConfig cfg;
  // Model.
  std::vector<std::string> names;  // model order
  aggregation::TensorShapes shapes;
  uint64_t digest = 0;
  int64_t numel = 0;
  std::shared_ptr<core::Model> eval_model;
  core::Dataset test;

  // Global state (round thread; weights_mu guards `global` for readers).
  mutable std::mutex weights_mu;
  // W_r, B_r, SCAFFOLD's c, ACP factors and TCS masks, the server optimiser and
  // the global step: the round engine's global side, shared with sparrow-sim.
  std::unique_ptr<federation::GlobalModel> gm;
  std::vector<wire::NamedTensor> down_last;             // C_r, as sent in tasks
  std::unique_ptr<aggregation::Aggregator> aggregator;  // robust aggregation, central DP
  std::atomic<int64_t> completed{0};
  // Gateway role: the root's round, model and settings for the round run_round
  // runs now (relay_round), and what it gives back.
  struct Relay {
    uint64_t round = 0;
    const Weights* base = nullptr;
    const wire::TrainSettings* train = nullptr;
    const Weights* masks = nullptr;  // the root's tcs masks for this round
    Clock::time_point until;         // the round ends by then, the wait for live clients included
  };
  std::optional<Relay> relay;
  std::optional<Server::RelayResult> relay_out;
  bool root_finished = false;  // a gateway whose root ended the run: its clients are told so

  // Persistence.
  std::unique_ptr<ServerStore> store;
  std::string run_id;
  int64_t run_created = 0;  // unix seconds

  // Transport (transport/transport.h): the I/O thread alone uses the listener.
  // Declared before `listener`, whose authentication thread uses it:
  // destroyed after it.
  core::RefusalLog refused_log;  // refused keys by address (auth thread notes, I/O thread flushes)
  RateLimiter mismatch_log;      // handshake failures, on the I/O thread
  std::unique_ptr<transport::Listener> listener;
  std::string endpoint;
  std::string public_key;
  wire::ParseLimits limits;

  // Session state (mu).
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, Session> sessions;       // routing id -> session
  std::map<std::string, std::string> by_client;  // client id -> routing id
  std::map<std::string, ClientRow> clients;      // every client ever seen
  struct Holdout {
    int64_t strikes = 0;  // refused updates in a row
    uint64_t holds = 0;   // times held out so far
    uint64_t until = 0;   // not selected in rounds <= until
  };
  std::map<std::string, Holdout> holdouts;       // client id -> its record (strike())
  std::map<std::string, std::string> id_of_key;  // CURVE public key -> the client id it registered
  std::set<std::string> dirty_clients;
  uint64_t round = 0;  // the round in progress (0 before the first)
  bool round_open = false;
  std::map<std::string, Status> selected;
  int in_flight = 0;
  int64_t round_accepted = 0, round_rejected = 0, round_stale = 0;
  // Tasks sent since the last round was recorded, by how they carried the
  // model (federation::CatchupPlan::Kind), and those models' payload bytes.
  std::array<uint64_t, 4> down_tasks{};
  uint64_t down_model_bytes = 0;
  std::shared_ptr<const RoundContext> round_ctx;
  // Secure aggregation (docs/security.md): the open round's protocol state
  // (null in a plain round) and each selected client's part, under mu.
  secagg::Params sa_params;
  std::unique_ptr<secagg::Server> sa;
  std::map<std::string, wire::SecAggSetup> sa_setup;  // client id -> its index, weight, graph
  std::map<uint32_t, std::string> sa_client;          // index -> client id
  std::map<std::string, std::vector<std::pair<std::string, double>>> sa_metrics;  // masked updates' metrics
  uint64_t sa_attempt = 0;  // graph seeds differ when a round is retried

  // Outbox (any thread -> I/O thread). A reply queued on an empty outbox
  // wakes the I/O thread's poll: an Ack leaves at once instead of at the end
  // of the poll interval.
  std::mutex out_mu;
  std::deque<std::pair<std::string, std::string>> outbox;

  // Worker pool.
  std::mutex job_mu;
  std::condition_variable job_cv;
  std::deque<Job> jobs;
  bool jobs_stop = false;
  // The round: contexts, the fold in client-id order whatever the arrival
  // order (fold_buffer_mb > 0, the default), the global step. The code
  // sparrow-sim runs its rounds with.
  std::unique_ptr<federation::RoundEngine> engine;
  std::vector<std::thread> workers;
  std::thread io;
  std::atomic<bool> io_stop{false};
  std::atomic<bool> stop{false};
  bool ran = false;

  AtomicCounters n;

  // Live dashboard (docs/monitoring.md): the round thread and the session
  // handlers publish to the board; the HTTP threads only read it.
  std::shared_ptr<monitor::Board> board = std::make_shared<monitor::Board>();
  std::unique_ptr<monitor::HttpEndpoint> http;
  Clock::time_point clients_published{};
  std::atomic<uint64_t> n_connected{0};  // live sessions at the last sweep (counters())

  // ---- set-up and lifecycle (server.cc) ----------------------------------------

  // Validates cfg, builds the model (or takes `initial`), the evaluation data,
  // the aggregator and the workers' partials, binds, opens the database.
  void init(Weights initial);
  void start_threads();
  // Says Bye to the sessions, joins the workers and the I/O thread, saves the
  // client rows not yet written.
  void stop_threads();

  // ---- I/O (io.cc) ---------------------------------------------------------------

  // Binds cfg.listen (CURVE with the allow-list unless insecure).
  void bind();
  // Any thread: queued for the I/O thread.
  void send_bytes(const std::string& routing_id, std::string bytes);
  void reply(const std::string& routing_id, const wire::Message& m);
  // Until the I/O thread has handed every queued reply to the transport, or `limit`.
  void wait_outbox_drained(std::chrono::milliseconds limit);
  // The peer gets `code` and `text` without its internal detail (" [COND
  // failed at FILE:LINE]", core::peer_text); the full text goes to the log.
  void reply_error(const std::string& routing_id, ErrorCode code, const std::string& text,
                   std::optional<uint64_t> r = std::nullopt);
  // I/O thread.
  void flush_outbox();
  void io_loop();
  static void log_refused(const core::RefusalLog::Line& l);
  void log_handshake_failures();
  // One inbound frame: small ones parsed here (control messages handled at
  // once), updates and large frames queued for the pool. False when none.
  bool receive_one();
  // Worker thread `w`: parses large frames, handles updates and the rest.
  void worker_loop(size_t w);

  // ---- sessions (sessions.cc) -----------------------------------------------------

  // Any thread: a message other than a ModelUpdate.
  void handle_control(const std::string& rid, const std::string& key, const wire::Message& m, size_t frame_bytes);
  void n_connected_changed();
  // Under mu: the client's last_seen, to be saved with the next round.
  void touch(const std::string& client_id);
  void handle_hello(const std::string& rid, const std::string& key, const wire::Hello& h, uint16_t minor);
  // Under mu: one more refused update of `cid`. holdout_after refusals in a
  // row hold it out of selection for holdout_rounds rounds, twice as long each
  // time after (at most 64x); an accepted update clears the count.
  // `at_once`: a protocol breach, held out now whatever holdout_after says.
  void strike(const std::string& cid, const std::string& key, bool at_once = false);
  // Under mu: drops sessions silent for 3 heartbeats, unless they owe an update
  // in the open round (the deadline governs those).
  void sweep();

  // ---- updates (updates.cc, worker threads) ---------------------------------------

  // Under mu (held by g): the session an update arrives on, its last_seen
  // refreshed. Null, with g unlocked and the client answered with an Error,
  // when rid has no session or u names another client. Shared by the
  // synchronous and the async admission so both refuse alike.
  Session* update_session(std::unique_lock<std::mutex>& g, const std::string& rid, const wire::ModelUpdate& u);
  // Admits an update into the open round (or refuses it as stale), folds it
  // (RoundEngine::add, from worker slot w) and answers Ack or Error.
  void handle_update(size_t w, const std::string& rid, wire::ModelUpdate u, size_t frame_bytes);
  // Verifies and adds one update from worker w; all-or-nothing.
  void fold(size_t w, wire::ModelUpdate& u);
  // The update as the engines fold it (SCAFFOLD's control delta checked,
  // FedNova's weight); FormatError for a bad control delta. Moves u's tensors.
  federation::Arrival arrival_of(wire::ModelUpdate& u);

  // ---- the round (round.cc, round thread) -----------------------------------------

  enum class Collected { kOk, kAbandon, kStopped };
  enum class Waited { kReady, kAbandon, kStopped };
  // What open_round() started, read by the later steps of the round.
  struct OpenedRound {
    uint64_t round = 0;
    double started = 0;  // unix seconds
    Clock::time_point t0;
    std::vector<std::string> chosen;
    uint64_t bytes_in0 = 0, bytes_out0 = 0;  // the counters when it opened
  };
  // The closed round's client metrics (beside the engine's sum).
  struct Merged {
    std::map<std::string, double> metric_sum;     // Σ w·metric
    std::map<std::string, double> metric_weight;  // Σ w over the updates that carry the metric
  };

  // Opens the engine's round r with `chosen`; the tasks' contents.
  std::shared_ptr<RoundContext> make_round_context(uint64_t r, const std::vector<std::string>& chosen);
  // Under mu. Picks Full or Delta by what the client holds (docs/server.md).
  void send_task(const std::string& rid, Session& s, const RoundContext& rc);
  // Runs round completed + 1 (a gateway: the root's round). Returns false
  // when stopped; an abandoned round returns true with nothing recorded.
  bool run_round();
  // 1. Until enough clients are live (a gateway: or the root's deadline passed).
  Waited wait_for_clients(uint64_t r);
  // 2. The round's clients, least recently selected first, held-out ones skipped.
  std::vector<std::string> choose_clients(uint64_t r);
  // 2. Opens round r: the engine's round, its context, the tasks sent.
  OpenedRound open_round(uint64_t r);
  // 3. Until all updates arrived, or the deadline passed with quorum (extended
  // up to max_round_wait_s); SecAgg+ through collect_secagg. 4. Closes
  // admissions and waits for the updates being folded in.
  Collected collect_and_close(const OpenedRound& o);
  // 5. Closes the engine's round (what was held is folded); its metrics.
  Merged close_fold();
  // 5. The global step (a gateway: the mean delta for the root). False when
  // the aggregate was not finite: the round is abandoned, nothing changed.
  bool global_step(uint64_t r, double weight, aggregation::AggregateStats& ast);
  // 6. Evaluates when due, then checkpoints and records the round in one
  // transaction, and publishes it.
  void record_round(const OpenedRound& o, double weight, const aggregation::AggregateStats& ast, Merged& m,
                    std::map<std::string, double>& metrics);

  // ---- mode = "async" (async_round.cc, docs/async.md) -----------------------------
  //
  // No round barrier: the round thread hands the current model version to
  // free clients (at most max_concurrency tasks out); a worker folds an
  // update (AsyncEngine::add), writes it to the database and only then Acks
  // it; the worker whose update fills the buffer takes the step, records it
  // as round version + 1 (metrics row, checkpoint) and publishes the next
  // version's task. A task's `round` is version + 1 and its update echoes it:
  // the version it started from. Lock order: async_mu, then mu.

  bool async_mode() const { return cfg.mode == "async"; }
  // A client's task out: the round it carries, when it left, whether its
  // update is being folded (then neither expired nor replaced).
  struct AsyncTask {
    uint64_t round = 0;
    Clock::time_point sent;
    bool folding = false;
  };
  std::map<std::string, AsyncTask> async_tasks;  // client id -> its task out (mu)
  std::map<std::string, uint64_t> async_last;    // client id -> round of its last task (mu)
  std::deque<Clock::time_point> async_arrivals;  // accepted updates of the last minute (mu)
  uint64_t async_expired = 0;                    // tasks given up at their deadline or disconnect (mu)
  Clock::time_point async_since;                 // run_async began (mu)
  bool async_stepping = false;                   // the buffer is full, its step not yet published (mu)
  // Under async_mu: the engine and the step's record.
  std::mutex async_mu;
  // An update folded and staged for its durable write; its Ack waits for it.
  struct PendingAck {
    std::string rid, cid;
    uint64_t round = 0;
    size_t frame_bytes = 0;
    AsyncUpdateRow row;
  };
  std::mutex pending_mu;                  // a leaf lock: async_pending only
  std::vector<PendingAck> async_pending;  // staged in fold order (pending_mu)
  std::mutex store_mu;                    // the store's writes: the round thread's batches, a worker's step
  std::atomic<size_t> async_buffered{0};  // updates in the buffer (the dashboard)
  std::unique_ptr<federation::AsyncEngine> async;
  OpenedRound async_open;          // the step being filled: its start, its clients, the byte counters then
  std::exception_ptr async_error;  // a step that could not be recorded: run() rethrows it

  // init(): the engine at the resumed version, with the acknowledged updates
  // of the unfinished buffer folded again in their order (store.h).
  void init_async();
  // run(): the round thread until the rounds are done or stop().
  void run_async();
  // Under mu: tasks to free live clients, least recently handed one first.
  void async_hand_out(Clock::time_point now);
  // Under async_mu: the task contents of the current version, published under mu.
  void publish_async_context();
  // Worker: checks the update against its client's task, folds it, stages
  // its durable record (the round thread writes and Acks it), and steps when
  // the buffer is full.
  void handle_async_update(const std::string& rid, wire::ModelUpdate u, size_t frame_bytes);
  // Under async_mu and store_mu: the global step of the full buffer and its record.
  void async_step();
  // Round thread (group commit): the staged updates written in one
  // transaction, then acknowledged (or refused when the write failed).
  void flush_async_pending();
  // Frees the slots of `batch` and answers Ack (durable) or Error.
  void ack_async(const std::vector<PendingAck>& batch, bool durable);
  // The progress line's async figures (dashboard).
  void publish_async_progress();

  // ---- secure aggregation (secagg_round.cc, docs/security.md) ---------------------

  // Under mu (held by g): one SecAgg message of a session. The protocol state
  // checks it against the stage; a refused message changes nothing.
  void handle_secagg(std::unique_lock<std::mutex>& g, const std::string& rid, Session& s, const wire::SecAgg& m,
                     size_t frame_bytes);
  // Under mu: a client that broke the SecAgg+ protocol or whose pairs its
  // neighbours rejected. It is out of the round already; it sits out the next
  // selections (strike(), at once) and the log names it with its key.
  void secagg_offender(const std::string& cid, const std::string& key, uint64_t r, const char* stage,
                       const std::string& why);
  // Under mu: the protocol state of round r over the chosen clients, and each
  // one's part (sent with its Task).
  void setup_secagg(uint64_t r, const std::vector<std::string>& chosen);
  // Under mu: one message per index to its client, when connected.
  void send_secagg(std::map<uint32_t, wire::SecAgg> out);
  // Under mu: until done() or `until` (sweeping liveness); false when stopped.
  template <class Done>
  bool wait_phase(std::unique_lock<std::mutex>& g, Clock::time_point until, Done done);
  // Under mu: the four exchanges of a SecAgg+ round (the training happens
  // between shares and masked updates, under the round deadline).
  Collected collect_secagg(std::unique_lock<std::mutex>& g, uint64_t r, Clock::time_point t0, Clock::time_point hard);
  // After the round closed: the unmasked sum of the survivors' weighted
  // updates, folded into the aggregate as their weighted mean (with their
  // total weight), and their metrics. Returns the survivors.
  size_t fold_secagg(std::map<std::string, double>& metrics);
  // After the round closed: folds the unmasked sum (fold_secagg) unless the
  // round is `abandon`ed, then clears the protocol state. Returns whether the
  // round is abandoned.
  bool end_secagg(uint64_t r, bool abandon, std::map<std::string, double>& metrics);

  // ---- the database and evaluation (checkpoint.cc) ---------------------------------

  // Opens cfg.db: a new run, or the run of this config resumed from its newest
  // intact checkpoint (ConfigError for a run of another config).
  void open_store();
  void resume(const Checkpoint& ck);
  // The contents of round r's checkpoint.
  Checkpoint checkpoint(int64_t r);
  // (loss, accuracy) of W_r on the evaluation data.
  std::pair<double, double> evaluate();

  // ---- dashboard (dashboard.cc) -----------------------------------------------------

  // `seconds` and `epsilon`: the round's round.seconds and dp.epsilon metrics (NaN when absent).
  static monitor::RoundPoint point_of(const RoundRow& row, double seconds, double epsilon);
  template <class K>
  static double value_or_nan(const std::map<K, double>& m, const K& key) {
    auto it = m.find(key);
    return it != m.end() ? it->second : kNaN;
  }
  // The run and its completed rounds (a resumed run shows its history).
  void publish_history();
  // Under mu: the client table and the counters, at most every 500 ms unless forced.
  void publish_clients(bool force = false);
};

}  // namespace sparrow::server
