#include "server/server.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.hpp>

#include "aggregation/aggregator.h"
#include "aggregation/robust.h"
#include "aggregation/server_optimizer.h"
#include "compression/compressor.h"
#include "compression/mask.h"
#include "federation/client_pipeline.h"
#include "federation/global_model.h"
#include "compression/lowrank.h"
#include "compression/state.h"
#include "core/data_folder.h"
#include "core/datasets.h"
#include "core/error.h"
#include "core/model_digest.h"
#include "core/models.h"
#include "core/peer_text.h"
#include "core/refusal_log.h"
#include "core/rng.h"
#include "core/spec.h"
#include "monitor/board.h"
#include "monitor/http.h"
#include "secagg/secagg.h"
#include "server/store.h"
#include "wire/net.h"
#include "wire/wire.h"

namespace sparrow::server {
namespace {

using Clock = std::chrono::steady_clock;
using wire::ErrorCode;

constexpr uint64_t kSelectTag = 0x73656c65;  // "sele"
constexpr uint64_t kDpTag = 0x64702020;      // "dp  "
constexpr uint64_t kSecAggTag = 0x73656361;  // "seca"
// Frames up to this size are parsed on the I/O thread (control messages);
// larger ones are parsed by the pool so the I/O thread keeps serving.
constexpr size_t kInlineParseBytes = size_t{64} << 10;
constexpr auto kPollInterval = std::chrono::milliseconds(2);

constexpr auto kRoundTick = std::chrono::milliseconds(20);

const double kNaN = std::numeric_limits<double>::quiet_NaN();

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

double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

compression::Encoded dense_encoded(const at::Tensor& t) {
  at::Tensor c = t.to(at::kCPU, at::kFloat).contiguous();
  compression::Encoded e;
  e.format = compression::Format::kDense;
  e.shape = c.sizes().vec();
  e.value_type = compression::ValueType::kF32;
  const size_t bytes = static_cast<size_t>(c.numel()) * sizeof(float);
  e.values.resize_uninitialized(bytes);
  if (bytes) std::memcpy(e.values.data(), c.data_ptr<float>(), bytes);
  return e;
}

wire::Message msg(wire::Body body) {
  wire::Message m;
  m.body = std::move(body);
  return m;
}

enum class Status { kWaiting, kInFlight, kDone };

struct Session {
  std::string client_id;
  std::string key;
  Clock::time_point last_seen;
  std::optional<uint64_t> last_round;  // the broadcast model round the client holds
  uint64_t num_samples = 0;
};

struct Job {
  std::string routing_id;
  std::string key;
  zmq::message_t frame;                 // unparsed (large) frame, or empty
  std::optional<wire::Message> parsed;  // parsed on the I/O thread
  size_t size = 0;
};

// What every task and every update of a round shares; immutable while the
// round is open (workers hold a shared_ptr taken under the state mutex).
struct RoundContext {
  uint64_t round = 0;
  aggregation::ContextMap contexts;
  std::vector<wire::NamedTensor> full;     // B_{r-1} in full (Dense F32)
  std::vector<wire::NamedTensor> delta;    // downlink: C_{r-1}; empty otherwise
  std::vector<wire::NamedTensor> shared;   // ACP shared factors
  std::vector<wire::NamedTensor> control;  // SCAFFOLD server control
  // A gateway's round (relay_round): the root's training settings, passed on.
  std::optional<wire::TrainSettings> relay_train;
};

// One worker's share of the open round.
struct Partial {
  std::unique_ptr<aggregation::Accumulator> agg;
  Weights control_sum;
  std::map<std::string, double> metric_sum;     // Σ w·metric
  std::map<std::string, double> metric_weight;  // Σ w over the updates that carry the metric
  void reset(double clip) {
    agg->reset(clip);
    control_sum.clear();
    metric_sum.clear();
    metric_weight.clear();
  }
};

struct AtomicCounters {
  std::atomic<uint64_t> accepted{0}, stale{0}, unknown{0}, bytes_in{0}, bytes_out{0}, messages_in{0}, messages_out{0},
      send_failures{0}, rounds{0}, abandoned{0};
  std::array<std::atomic<uint64_t>, 8> rejected{};
};

}  // namespace

std::vector<std::string> select_clients(std::vector<Candidate> candidates, size_t k, uint64_t key) {
  std::vector<std::pair<std::pair<int64_t, uint64_t>, std::string>> order;
  order.reserve(candidates.size());
  for (auto& c : candidates)
    order.push_back({{c.last_selected, rng::at(key, rng::hash_name(c.client_id))}, std::move(c.client_id)});
  std::sort(order.begin(), order.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < order.size() && i < k; ++i) out.push_back(order[i].second);
  return out;
}

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

  // Transport.
  zmq::context_t ctx{1};
  // Declared before `zap`, whose thread uses it: destroyed after it.
  core::RefusalLog refused_log;  // refused keys by address (ZAP thread notes, I/O thread flushes)
  RateLimiter mismatch_log;      // handshake failures, on the I/O thread
  std::unique_ptr<net::ZapHandler> zap;
  zmq::socket_t router;
  std::unique_ptr<net::HandshakeMonitor> monitor;  // of `router` (CURVE only), read by the I/O thread
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
  // signals `wake`, which the I/O thread polls next to the socket: an Ack leaves
  // at once instead of at the end of the poll interval.
  std::mutex out_mu;
  std::deque<std::pair<std::string, std::string>> outbox;
  struct EventFd {
    int fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    EventFd() { SPARROW_CHECK(fd >= 0, "eventfd: " << std::strerror(errno)); }
    EventFd(const EventFd&) = delete;
    EventFd& operator=(const EventFd&) = delete;
    ~EventFd() { ::close(fd); }
    void signal() const {
      const uint64_t one = 1;
      (void)!::write(fd, &one, sizeof one);  // only fails when the counter is full: already signalled
    }
    void clear() const {
      uint64_t v;
      (void)!::read(fd, &v, sizeof v);
    }
  } wake;

  // Worker pool.
  std::mutex job_mu;
  std::condition_variable job_cv;
  std::deque<Job> jobs;
  bool jobs_stop = false;
  std::vector<Partial> partials;
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

  // ---- set-up ---------------------------------------------------------------

  void init(Weights initial) {
    validate(cfg);
    compression::register_builtins();
    Weights w0;
    if (initial.empty()) {
      std::shared_ptr<core::Model> m = core::make_model(cfg.model, cfg.model_seed);
      for (const auto& p : m->named_parameters(/*recurse=*/true)) {
        names.push_back(p.key());
        w0[p.key()] = p.value().detach().to(at::kCPU, at::kFloat).contiguous().clone();
      }
      if (cfg.eval_every > 0) eval_model = m;
    } else {
      for (auto& [k, v] : initial) {
        SPARROW_CHECK_T(ConfigError, v.defined() && v.dim() >= 1, "initial weights: tensor '" << k << "' is empty");
        names.push_back(k);
        w0[k] = v.detach().to(at::kCPU, at::kFloat).contiguous().clone();
      }
      if (cfg.eval_every > 0) eval_model = core::make_model(cfg.model, cfg.model_seed);
    }
    SPARROW_CHECK_T(ConfigError, !names.empty(), "model '" << cfg.model << "' has no parameters");
    gm = std::make_unique<federation::GlobalModel>(federation::global_config_of(cfg), std::move(w0), names);
    for (const auto& nm : names) {
      shapes.emplace_back(nm, gm->weights().at(nm).sizes().vec());
      numel += gm->weights().at(nm).numel();
    }
    digest = core::model_digest(gm->weights());
    if (eval_model) {
      if (cfg.eval_data.empty()) {
        test = core::load_fashion_mnist(cfg.data_dir, "test");
      } else {
        std::optional<core::Dataset> t = core::load_data_folder_test(cfg.eval_data);
        test = t ? std::move(*t) : core::load_data_folder(cfg.eval_data);
      }
      // The model against the evaluation data before the first round.
      test = core::check_data_for_model(std::move(test), cfg.model);
      core::check_model_on_data(*eval_model, test, cfg.model);
      spdlog::info("event=eval_data samples={} source=\"{}\"", test.size(),
                   cfg.eval_data.empty() ? cfg.data_dir + " (test split)" : cfg.eval_data);
    }

    sa_params = secagg::Params::parse(cfg.secagg);
    limits.max_bytes = cfg.max_message_bytes();
    limits.max_elements = static_cast<uint64_t>(numel) * 2 + (uint64_t{1} << 20);
    // A dense fp32 update's finiteness is checked while the aggregator folds
    // it (one read of the values instead of two); every consumer validates.
    limits.update_values = compression::ValueCheck::kDeferDenseF32;
    partials.resize(static_cast<size_t>(cfg.workers));
    aggregator = std::make_unique<aggregation::Aggregator>(cfg.aggregator, cfg.dp, cfg.clients_per_round,
                                                           rng::derive(cfg.seed, kDpTag));
    if (aggregator->robust().buffers()) {
      const double need = static_cast<double>(numel) * 4 * cfg.clients_per_round / (1024.0 * 1024.0);
      SPARROW_CHECK_T(ConfigError, need <= cfg.max_buffer_mb,
                      "config key 'aggregator' '"
                          << cfg.aggregator << "' keeps every update of a round: " << cfg.clients_per_round
                          << " clients x " << numel * 4 << " bytes = " << static_cast<int64_t>(need)
                          << " MiB > max_buffer_mb = " << cfg.max_buffer_mb);
    }
    for (auto& p : partials) {
      p.agg = std::make_unique<aggregation::Accumulator>(aggregator->make_accumulator(shapes));
      if (cfg.max_update_norm > 0) p.agg->set_max_update_norm(cfg.max_update_norm);
      p.agg->reset(aggregator->clip());
    }

    // The socket first: a server that cannot listen (port taken, bad
    // endpoint) leaves the database as it was, not with a new run in it.
    bind();
    if (!cfg.http.empty()) {
      http = std::make_unique<monitor::HttpEndpoint>(cfg.http, cfg.http_token, board);
      spdlog::info("event=http url={} token={}", http->url(), cfg.http_token.empty() ? 0 : 1);
    }
    open_store();
    publish_history();
    spdlog::info("event=listening endpoint={} curve={} run_id={} model={} digest={} round={}", endpoint,
                 cfg.insecure ? 0 : 1, run_id, cfg.model, digest, completed.load());
  }

  // ---- dashboard ------------------------------------------------------------------

  // `seconds` and `epsilon`: the round's round.seconds and dp.epsilon metrics (NaN when absent).
  static monitor::RoundPoint point_of(const RoundRow& row, double seconds, double epsilon) {
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

  template <class K>
  static double value_or_nan(const std::map<K, double>& m, const K& key) {
    auto it = m.find(key);
    return it != m.end() ? it->second : kNaN;
  }

  // The run and its completed rounds (a resumed run shows its history).
  void publish_history() {
    monitor::RunInfo info;
    info.program = "sparrow-server";
    info.run_id = run_id;
    info.model = cfg.model;
    info.config = to_toml(cfg);
    info.rounds_total = cfg.rounds;
    info.started = static_cast<double>(run_created);  // the run's, not this process's
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

  // Under mu: the client table and the counters, at most every 500 ms unless forced.
  void publish_clients(bool force = false) {
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

  void open_store() {
    store = ServerStore::open(cfg.db);
    const std::string hash = config_hash(cfg);
    std::optional<RunRow> run = store->run();
    if (!run) {
      RunRow r;
      std::ostringstream id;
      id << "run-" << hash.substr(0, 8) << "-" << std::hex << static_cast<uint64_t>(unix_now() * 1000);
      r.run_id = id.str();
      r.config_hash = hash;
      r.config = identity_text(cfg);
      r.created = static_cast<int64_t>(unix_now());
      store->create_run(r);
      run = r;
      spdlog::info("event=run_created run_id={} db={} config_hash={}", r.run_id, cfg.db, hash);
    } else {
      SPARROW_CHECK_T(ConfigError, run->config_hash == hash,
                      "database '" << cfg.db << "' holds run " << run->run_id
                                   << " with another configuration; use another db or the same settings. Stored:\n"
                                   << run->config << "This config:\n"
                                   << identity_text(cfg));
    }
    run_id = run->run_id;
    run_created = run->created;
    for (ClientRow& c : store->clients()) {
      if (!c.public_key.empty()) id_of_key.emplace(c.public_key, c.client_id);  // the first binding stands
      clients[c.client_id] = c;
    }
    std::optional<Checkpoint> ck = store->latest_checkpoint();
    for (int64_t r : store->damaged_checkpoints())
      spdlog::warn("event=checkpoint_damaged round={} db={} msg=\"checksum mismatch: skipped, {}\"", r, cfg.db,
                   ck ? "resuming from round " + std::to_string(ck->round) + " (later rounds run again)"
                      : std::string("no intact checkpoint"));
    // The rounds table says how far the run got. A newest checkpoint behind it
    // (rows deleted or damaged) loses the rounds in between, said in a warning;
    // none at all is refused rather than taken for a new run.
    const int64_t recorded = store->completed_rounds();
    SPARROW_CHECK_T(FormatError, ck || recorded == 0,
                    "server database '" << cfg.db << "' records " << recorded
                                        << " completed round(s) but holds no checkpoint to resume from; restore it "
                                           "from a backup, or use another db to start a new run");
    if (ck && ck->round < recorded)
      spdlog::warn(
          "event=rounds_lost db={} checkpoint_round={} recorded_rounds={} lost={} msg=\"the newest checkpoint is of "
          "round {}: rounds {} to {} are lost and run again\"",
          cfg.db, ck->round, recorded, recorded - ck->round, ck->round, ck->round + 1, recorded);
    if (ck) resume(*ck);
  }

  Weights check_weights(const std::string& blob, const char* what) {
    Weights w = deserialize_weights(blob);
    SPARROW_CHECK_T(FormatError, w.size() == gm->weights().size(),
                    "checkpoint " << what << " has " << w.size() << " tensors, the model " << gm->weights().size());
    for (const auto& [k, v] : gm->weights())
      SPARROW_CHECK_T(FormatError, w.count(k) && w.at(k).sizes() == v.sizes(),
                      "checkpoint " << what << " does not match the model at '" << k << "'");
    return w;
  }

  void resume(const Checkpoint& ck) {
    gm->weights() = check_weights(ck.weights, "weights");
    if (!ck.server_opt.empty()) gm->optimizer().deserialize_state(ck.server_opt);
    aggregator->deserialize_state(ck.aggregator);
    if (!ck.control.empty()) gm->control() = check_weights(ck.control, "control");
    if (gm->has_downlink()) {
      // (Checkpoints before the shared round engine also hold per-tensor
      // downlink codec states; each round's encode now starts afresh.)
      if (!ck.broadcast.empty()) gm->broadcast() = check_weights(ck.broadcast, "broadcast");
      if (!ck.downlink_last.empty()) {
        wire::Message m = wire::parse(ck.downlink_last);
        down_last = std::move(std::get<wire::ModelUpdate>(m.body).tensors);
      }
    }
    gm->shared() = deserialize_weights(ck.acp);
    completed = ck.round;
    round = static_cast<uint64_t>(ck.round);
    n.rounds = static_cast<uint64_t>(ck.round);
    spdlog::info("event=resumed run_id={} round={} db={}", run_id, ck.round, cfg.db);
  }

  void bind() {
    router = zmq::socket_t(ctx, zmq::socket_type::router);
    if (cfg.insecure) {
      spdlog::warn("event=insecure msg=\"plain TCP without CurveZMQ: traffic is neither encrypted nor authenticated\"");
    } else {
      net::KeyPair keys = net::load_keypair(cfg.server_key);
      public_key = keys.public_key;
      std::set<std::string> allowed = net::load_allow_list(cfg.allow);
      spdlog::info("event=allow_list path={} keys={}", cfg.allow, allowed.size());
      // A refused client retries every ~100 ms, and a peer can use a fresh
      // key per connection: one warning per source address and minute (with
      // the counts since the last one), at most 20 a minute in all; the
      // counted refusals are written by log_handshake_failures().
      zap = std::make_unique<net::ZapHandler>(
          ctx, std::move(allowed), [this](const std::string& key, const std::string& addr, bool ok) {
            if (ok) {
              spdlog::debug("event=zap key={} address={} admitted=1", key, core::printable(addr));
              return;
            }
            if (const auto line = refused_log.note(addr, key)) log_refused(*line);
          });
      net::make_curve_server(router, keys);
    }
    net::set_limits(router, cfg.max_message_bytes(), cfg.heartbeat_ms);
    router.set(zmq::sockopt::router_mandatory, 1);
    // Peers that speak plain TCP to a CURVE server never reach the ZAP
    // handler: the socket monitor is where they show.
    if (!cfg.insecure) monitor = std::make_unique<net::HandshakeMonitor>(ctx, router);
    try {
      net::check_endpoint("listen", cfg.listen, /*for_bind=*/true);
      router.bind(cfg.listen);
    } catch (const zmq::error_t& e) {
      throw ConfigError("listen: cannot bind '" + cfg.listen + "': " + e.what());
    }
    endpoint = router.get(zmq::sockopt::last_endpoint);
  }

  // ---- replies ----------------------------------------------------------------

  void send_bytes(const std::string& routing_id, std::string bytes) {
    std::lock_guard<std::mutex> g(out_mu);
    if (outbox.empty()) wake.signal();
    outbox.emplace_back(routing_id, std::move(bytes));
  }
  void reply(const std::string& routing_id, const wire::Message& m) { send_bytes(routing_id, wire::serialize(m)); }
  // Until the I/O thread has handed every queued reply to ZeroMQ, or `limit`.
  void wait_outbox_drained(std::chrono::milliseconds limit) {
    const auto until = Clock::now() + limit;
    for (;;) {
      {
        std::lock_guard<std::mutex> g(out_mu);
        if (outbox.empty()) return;
      }
      if (Clock::now() >= until) return;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  // The peer gets `code` and `text` without its internal detail (" [COND
  // failed at FILE:LINE]", core::peer_text); the full text goes to the log.
  void reply_error(const std::string& routing_id, ErrorCode code, const std::string& text,
                   std::optional<uint64_t> r = std::nullopt) {
    n.rejected[static_cast<size_t>(code) & 7]++;
    const wire::Message m = net::error_message(code, text, r);
    if (std::get<wire::ErrorBody>(m.body).message.size() != text.size())
      spdlog::info("event=error_detail code={} detail=\"{}\"", wire::error_code_name(code), core::printable(text));
    reply(routing_id, m);
  }

  // ---- I/O thread --------------------------------------------------------------

  void flush_outbox() {
    std::deque<std::pair<std::string, std::string>> out;
    {
      std::lock_guard<std::mutex> g(out_mu);
      out.swap(outbox);
    }
    for (auto& [id, bytes] : out) {
      bool ok = false;
      try {
        ok = net::send_bytes_to(router, id, bytes, /*dont_wait=*/true);
      } catch (const zmq::error_t& e) {
        spdlog::warn("event=send_failed error=\"{}\"", e.what());
      }
      if (ok) {
        n.messages_out++;
        n.bytes_out += bytes.size();
      } else {
        n.send_failures++;
      }
    }
  }

  void io_loop() {
    const size_t max_jobs = static_cast<size_t>(cfg.workers) * 4;
    while (!io_stop.load()) {
      size_t queued;
      {
        std::lock_guard<std::mutex> g(job_mu);
        queued = jobs.size();
      }
      // Back-pressure: a full job queue stops reading (libzmq buffers, then
      // TCP flow control), never drops or rejects updates.
      const bool can_read = queued < max_jobs;
      zmq::pollitem_t items[2] = {{static_cast<void*>(router), 0, static_cast<short>(can_read ? ZMQ_POLLIN : 0), 0},
                                  {nullptr, wake.fd, ZMQ_POLLIN, 0}};
      const zmq::pollitem_t& item = items[0];
      try {
        zmq::poll(items, 2, kPollInterval);
        if (items[1].revents & ZMQ_POLLIN) wake.clear();
        if (can_read && (item.revents & ZMQ_POLLIN))
          for (int i = 0; i < 256; ++i)
            if (!receive_one()) break;
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) break;
        spdlog::error("event=io_error error=\"{}\"", e.what());
      }
      flush_outbox();
      log_handshake_failures();
    }
    flush_outbox();
    for (const auto& l : refused_log.drain()) log_refused(l);  // the counts not written yet
  }

  static void log_refused(const core::RefusalLog::Line& l) { spdlog::warn("{}", core::RefusalLog::text(l)); }

  void log_handshake_failures() {
    if (!monitor) return;
    for (const auto& l : refused_log.due()) log_refused(l);
    using Kind = net::HandshakeMonitor::Kind;
    for (const auto& e : monitor->drain()) {
      if (e.kind != Kind::kMismatch && e.kind != Kind::kFailed) continue;
      const char* what = e.kind == Kind::kMismatch
                             ? "plain TCP peer on a CURVE server (client without keys?)"
                             : "handshake failed or closed early (a client with a wrong server_key, a peer "
                               "without CURVE, or a port probe)";
      // The address libzmq reports is the listening endpoint: one key per kind.
      if (const auto n = mismatch_log.admit(what))
        spdlog::warn("event=handshake_failed endpoint={} failures_since_last_warning={} msg=\"{}\"", e.address, *n,
                     what);
    }
  }

  bool receive_one() {
    std::optional<net::RoutedFrame> in = net::receive_routed(router);
    if (!in) return false;
    if (!in->payload) return true;  // no payload frame (cannot happen with ROUTER)
    std::string& routing_id = in->routing_id;
    zmq::message_t& frame = in->frame;
    n.messages_in++;
    n.bytes_in += frame.size();
    if (in->extra_frames) {
      reply_error(routing_id, ErrorCode::kMalformed, "one frame per message expected");
      return true;
    }
    Job job;
    job.routing_id = std::move(routing_id);
    job.key = net::peer_key(frame);
    job.size = frame.size();
    if (frame.size() <= kInlineParseBytes) {
      try {
        job.parsed = wire::parse(frame.data(), frame.size(), limits);
      } catch (const wire::ProtocolError& e) {
        reply_error(job.routing_id, e.code(), e.what());
        return true;
      }
      if (!std::holds_alternative<wire::ModelUpdate>(job.parsed->body)) {
        try {
          handle_control(job.routing_id, job.key, *job.parsed, job.size);
        } catch (const std::exception& e) {  // never fatal for the I/O thread
          spdlog::error("event=control_error error=\"{}\"", core::printable(e.what()));
          reply_error(job.routing_id, ErrorCode::kInternal, "internal error");
        }
        return true;
      }
    } else {
      job.frame = std::move(frame);
    }
    {
      std::lock_guard<std::mutex> g(job_mu);
      jobs.push_back(std::move(job));
    }
    job_cv.notify_one();
    return true;
  }

  // ---- worker pool -------------------------------------------------------------

  void worker_loop(size_t w) {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> g(job_mu);
        job_cv.wait(g, [&] { return jobs_stop || !jobs.empty(); });
        if (jobs.empty()) return;  // stopping
        job = std::move(jobs.front());
        jobs.pop_front();
      }
      try {
        if (!job.parsed) {
          try {
            // The frame outlives the parse: a dense update's values stay where
            // they arrived until the update has been folded.
            auto frame = std::make_shared<zmq::message_t>(std::move(job.frame));
            job.parsed = wire::parse(frame->data(), frame->size(), limits, frame);
          } catch (const wire::ProtocolError& e) {
            reply_error(job.routing_id, e.code(), e.what());
            continue;
          }
        }
        if (auto* u = std::get_if<wire::ModelUpdate>(&job.parsed->body))
          handle_update(w, job.routing_id, std::move(*u), job.size);
        else
          handle_control(job.routing_id, job.key, *job.parsed, job.size);
      } catch (const std::exception& e) {
        // Never fatal: a peer's message cannot take the server down.
        spdlog::error("event=worker_error error=\"{}\"", core::printable(e.what()));
        reply_error(job.routing_id, ErrorCode::kInternal, "internal error");
      }
    }
  }

  // ---- control messages (any thread) -------------------------------------------

  void handle_control(const std::string& rid, const std::string& key, const wire::Message& m, size_t frame_bytes) {
    if (const auto* h = std::get_if<wire::Hello>(&m.body)) return handle_hello(rid, key, *h);
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
      spdlog::info("event=client_bye client={} reason=\"{}\"", core::printable(s.client_id),
                   core::printable(b->reason));
      by_client.erase(s.client_id);
      sessions.erase(it);
      n_connected_changed();
    } else {
      g.unlock();
      reply_error(rid, ErrorCode::kUnsupported, std::string("unexpected message ") + wire::body_name(m.body));
    }
  }

  void n_connected_changed() { cv.notify_all(); }

  void touch(const std::string& client_id) {
    auto it = clients.find(client_id);
    if (it == clients.end()) return;
    it->second.last_seen = static_cast<int64_t>(unix_now());
    dirty_clients.insert(client_id);
  }

  void handle_hello(const std::string& rid, const std::string& key, const wire::Hello& h) {
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
    s.num_samples = h.num_samples;
    by_client[h.client_id] = rid;
    wire::Welcome w;
    w.run_id = run_id;
    w.heartbeat_ms = static_cast<uint32_t>(cfg.heartbeat_ms);
    w.round = round;
    w.max_message_bytes = cfg.max_message_bytes();
    w.model_seed = cfg.model_seed;
    reply(rid, msg(w));
    spdlog::info("event=hello client={} samples={} last_round={} software=\"{}\" sessions={}", h.client_id,
                 h.num_samples, h.last_round ? std::to_string(*h.last_round) : "none", core::printable(h.software),
                 sessions.size());
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

  // ---- secure aggregation (docs/security.md) ------------------------------------

  // Under mu (held by g): one SecAgg message of a session. The protocol state
  // checks it against the stage; a refused message changes nothing.
  void handle_secagg(std::unique_lock<std::mutex>& g, const std::string& rid, Session& s, const wire::SecAgg& m,
                     size_t frame_bytes) {
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

  // Under mu: a client that broke the SecAgg+ protocol or whose pairs its
  // neighbours rejected. It is out of the round already; it sits out the next
  // selections (strike(), at once) and the log names it with its key.
  void secagg_offender(const std::string& cid, const std::string& key, uint64_t r, const char* stage,
                       const std::string& why) {
    spdlog::warn("event=secagg_offender client={} key={} round={} stage={} reason=\"{}\"", core::printable(cid),
                 key.empty() ? "-" : key, r, stage, core::printable(why));
    strike(cid, key, /*at_once=*/true);
  }

  // Under mu: the protocol state of round r over the chosen clients, and each
  // one's part (sent with its Task).
  void setup_secagg(uint64_t r, const std::vector<std::string>& chosen) {
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

  // Under mu: one message per index to its client, when connected.
  void send_secagg(std::map<uint32_t, wire::SecAgg> out) {
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

  // Under mu: until done() or `until` (sweeping liveness); false when stopped.
  template <class Done>
  bool wait_phase(std::unique_lock<std::mutex>& g, Clock::time_point until, Done done) {
    for (;;) {
      if (done()) return true;
      if (stop.load()) return false;
      if (Clock::now() >= until) return true;
      cv.wait_for(g, kRoundTick);
      sweep();
    }
  }

  enum class Collected { kOk, kAbandon, kStopped };

  // Under mu: the four exchanges of a SecAgg+ round (the training happens
  // between shares and masked updates, under the round deadline).
  Collected collect_secagg(std::unique_lock<std::mutex>& g, uint64_t r, Clock::time_point t0, Clock::time_point hard) {
    const auto phase = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(sa_params.timeout_s));
    const auto period =
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.round_deadline_s));
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
    for (const auto& [v, by] : sa->reported()) {
      std::string who;
      for (uint32_t u : by) who += (who.empty() ? "" : ",") + sa_client.at(u);
      const std::string& cid = sa_client.at(v);
      secagg_offender(cid, clients[cid].public_key, r, "shares",
                      "its encrypted pairs were rejected by neighbours " + who);
    }
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
    return Collected::kOk;
  }

  // After the round closed: the unmasked sum of the survivors' weighted
  // updates, folded into the aggregate as their weighted mean (with their
  // total weight), and their metrics. Returns the survivors.
  size_t fold_secagg(const RoundContext& rc, std::map<std::string, double>& metrics) {
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
    aggregation::EncodedUpdate eu;
    size_t off = 0;
    for (const auto& nm : names) {
      at::Tensor t = at::empty(gm->weights().at(nm).sizes(), at::kFloat);
      const size_t len = static_cast<size_t>(t.numel());
      secagg::dequantise(sum.data() + off, len, scale, t.data_ptr<float>());
      t.div_(wsum);
      off += len;
      eu.emplace_back(nm, dense_encoded(t));
    }
    Partial& p = partials[0];
    p.agg->add(eu, samples, rc.contexts);
    for (const auto& [w, ms] : client_metrics)
      for (const auto& [k, v] : ms) {
        p.metric_sum[k] += w * v;
        p.metric_weight[k] += w;
      }
    metrics["secagg.keys"] = static_cast<double>(sa->keyed().size());
    metrics["secagg.shares"] = static_cast<double>(sa->shared().size());
    metrics["secagg.masked"] = static_cast<double>(sa->survivors().size());
    metrics["secagg.unmask_seconds"] = std::chrono::duration<double>(Clock::now() - t0).count();
    return sa->survivors().size();
  }

  // ---- tasks ---------------------------------------------------------------------

  // Under mu. Picks Full or Delta by what the client holds (docs/server.md).
  void send_task(const std::string& rid, Session& s, const RoundContext& rc) {
    const uint64_t r = rc.round;
    wire::Task t;
    t.round = r;
    t.train.algorithm = cfg.algorithm;
    t.train.local_epochs = static_cast<uint32_t>(cfg.local_epochs);
    t.train.batch_size = static_cast<uint32_t>(cfg.batch_size);
    t.train.lr = cfg.lr;
    t.train.momentum = cfg.momentum;
    t.train.weight_decay = cfg.weight_decay;
    t.train.mu = cfg.algorithm == "fedprox" ? cfg.mu : 0.0;
    if (rc.relay_train) t.train = *rc.relay_train;  // a gateway passes the root's settings on
    t.compression = cfg.compression;
    t.seed = federation::task_seed(cfg.seed, r, s.client_id);  // as the simulator's clients
    if (!rc.contexts.empty()) t.clients = static_cast<uint32_t>(rc.contexts.begin()->second.num_workers);
    t.shared = rc.shared;
    t.control = rc.control;
    t.deadline_ms = static_cast<uint64_t>(cfg.round_deadline_s * 1000.0);
    if (auto it = sa_setup.find(s.client_id); it != sa_setup.end()) t.secagg = it->second;
    // A gateway's round 1 model is the root's B_0: sent in full (the client's
    // own seed-built model follows this server's model_seed, not the root's).
    if (s.last_round && *s.last_round == r - 1 && !(rc.relay_train && r == 1)) {
      t.model_encoding = wire::ModelEncoding::kDelta;
      t.base_round = r - 1;
    } else if (gm->has_downlink() && r >= 2 && s.last_round && *s.last_round == r - 2 && !rc.delta.empty()) {
      t.model_encoding = wire::ModelEncoding::kDelta;
      t.base_round = r - 2;
      t.weights = rc.delta;
    } else {
      t.model_encoding = wire::ModelEncoding::kFull;
      t.weights = rc.full;
    }
    s.last_round = r - 1;  // what the client holds once it applied this task
    std::string bytes = wire::serialize(msg(std::move(t)));
    clients[s.client_id].bytes_down += bytes.size();
    send_bytes(rid, std::move(bytes));
  }

  // ---- updates (workers) -----------------------------------------------------------

  void handle_update(size_t w, const std::string& rid, wire::ModelUpdate u, size_t frame_bytes) {
    std::shared_ptr<const RoundContext> rc;
    {
      std::unique_lock<std::mutex> g(mu);
      auto it = sessions.find(rid);
      if (it == sessions.end()) {
        n.unknown++;
        g.unlock();
        reply_error(rid, ErrorCode::kRejected, "unknown client: send Hello", u.round);
        return;
      }
      Session& s = it->second;
      s.last_seen = Clock::now();
      if (u.client_id != s.client_id) {
        g.unlock();
        reply_error(rid, ErrorCode::kRejected, "client_id '" + u.client_id + "' is not this connection's", u.round);
        return;
      }
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
      rc = round_ctx;
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
      fold(partials[w], u, *rc);
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
      spdlog::warn("event=update_rejected client={} round={} error=\"{}\"", u.client_id, u.round,
                   core::printable(error));
      reply_error(rid, code, "update rejected: " + error, u.round);
    }
    cv.notify_all();
  }

  // Under mu: one more refused update of `cid`. holdout_after refusals in a
  // row hold it out of selection for holdout_rounds rounds, twice as long each
  // time after (at most 64x); an accepted update clears the count.
  // `at_once`: a protocol breach, held out now whatever holdout_after says.
  void strike(const std::string& cid, const std::string& key, bool at_once = false) {
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

  // Verifies and adds one update to a worker's partial; all-or-nothing.
  void fold(Partial& p, wire::ModelUpdate& u, const RoundContext& rc) {
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
    aggregation::EncodedUpdate eu;
    eu.reserve(u.tensors.size());
    for (auto& nt : u.tensors) eu.emplace_back(std::move(nt.name), std::move(nt.tensor));
    const double weight = static_cast<double>(u.num_samples);
    p.agg->add(eu, weight, rc.contexts);
    for (auto& [k, d] : cdelta) {
      auto it = p.control_sum.find(k);
      if (it == p.control_sum.end())
        p.control_sum[k] = d.clone();
      else
        it->second.add_(d);
    }
    for (const auto& [k, v] : u.metrics) {
      p.metric_sum[k] += weight * v;
      p.metric_weight[k] += weight;  // per metric: not every client reports every metric
    }
  }

  // ---- round thread ------------------------------------------------------------------

  // Under mu: drops sessions silent for 3 heartbeats, unless they owe an update
  // in the open round (the deadline governs those).
  void sweep() {
    const auto now = Clock::now();
    const auto limit = std::chrono::milliseconds(3 * cfg.heartbeat_ms);
    for (auto it = sessions.begin(); it != sessions.end();) {
      const Session& s = it->second;
      bool owes = false;
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
  std::atomic<uint64_t> n_connected{0};

  std::shared_ptr<RoundContext> make_round_context(uint64_t r, int num_selected) {
    auto rc = std::make_shared<RoundContext>();
    rc->round = r;
    // A gateway passes its root's tcs masks on.
    rc->contexts = gm->contexts(r, num_selected, relay ? relay->masks : nullptr);
    for (const auto& nm : names) {
      const compression::Context& c = rc->contexts.at(nm);
      const std::vector<int64_t> shape = gm->weights().at(nm).sizes().vec();
      // ACP: labelled as the factor kind it is (the one sent in round r + 1).
      if (c.shared_factor.defined())
        rc->shared.push_back(
            {nm, compression::acp_factor_encoded(c.shared_factor, shape, static_cast<int64_t>(r) + 1)});
      if (c.mask.defined()) rc->shared.push_back({nm, compression::mask_encoded(c.mask, shape)});
      rc->full.push_back({nm, dense_encoded(gm->broadcast().at(nm))});
      if (cfg.algorithm == "scaffold" && !gm->control().empty())
        rc->control.push_back({nm, dense_encoded(gm->control().at(nm))});
    }
    rc->delta = down_last;
    if (relay) rc->relay_train = *relay->train;
    return rc;
  }

  // Runs round completed + 1. Returns false when stopped.
  bool run_round() {
    const uint64_t r = relay ? relay->round : static_cast<uint64_t>(completed.load()) + 1;
    const size_t need = static_cast<size_t>(cfg.effective_min_clients());
    // 1. Wait for enough live clients.
    {
      std::unique_lock<std::mutex> g(mu);
      board->update_progress([&](monitor::Progress& p) {
        p.round = static_cast<int64_t>(r);
        p.phase = "waiting";
        p.selected = p.received = 0;
        p.started = 0;
        p.deadline = kNaN;
      });
      bool logged = false;
      for (;;) {
        if (stop.load()) return false;
        sweep();
        if (sessions.size() >= need) break;
        if (relay && Clock::now() >= relay->until) {
          spdlog::warn(
              "event=round_abandoned round={} live={} need={} msg=\"the root's deadline passed before enough "
              "clients were live\"",
              r, sessions.size(), need);
          n.abandoned++;
          return true;  // no relay_out: the root gets an Error for this round
        }
        if (!logged) spdlog::info("event=waiting_for_clients round={} live={} need={}", r, sessions.size(), need);
        logged = true;
        cv.wait_for(g, kRoundTick);
      }
    }
    // 2. Select and send tasks (a gateway: from the root's model).
    if (relay) {
      std::lock_guard<std::mutex> g(weights_mu);
      for (auto& [nm, v] : gm->weights()) v.copy_(relay->base->at(nm));
    }
    const double started = unix_now();
    const auto t0 = Clock::now();
    std::vector<std::string> chosen;
    uint64_t bytes_in0 = n.bytes_in.load(), bytes_out0 = n.bytes_out.load();
    {
      std::unique_lock<std::mutex> g(mu);
      std::vector<Candidate> cand;
      for (const auto& [cid, rid] : by_client) {
        auto h = holdouts.find(cid);
        if (h != holdouts.end() && h->second.until >= r) continue;  // held out (strike())
        cand.push_back({cid, clients[cid].last_selected});
      }
      chosen = select_clients(std::move(cand), static_cast<size_t>(cfg.clients_per_round),
                              rng::derive(rng::derive(cfg.seed, kSelectTag), r));
      g.unlock();
      std::shared_ptr<RoundContext> rc = make_round_context(r, static_cast<int>(chosen.size()));
      g.lock();
      for (auto& p : partials) p.reset(aggregator->clip());
      round = r;
      selected.clear();
      round_accepted = round_rejected = round_stale = 0;
      round_ctx = rc;
      round_open = true;
      if (sa_params.enabled) setup_secagg(r, chosen);
      for (const auto& cid : chosen) {
        selected[cid] = Status::kWaiting;
        ClientRow& row = clients[cid];
        row.last_selected = static_cast<int64_t>(r);
        row.selected++;
        dirty_clients.insert(cid);
        auto bit = by_client.find(cid);
        if (bit != by_client.end()) send_task(bit->second, sessions.at(bit->second), *rc);
      }
      board->update_progress([&](monitor::Progress& p) {
        p.phase = "training";
        p.selected = static_cast<int64_t>(chosen.size());
        p.received = 0;
        p.started = started;
        p.deadline = started + cfg.round_deadline_s;
      });
      publish_clients(true);
    }
    spdlog::info("event=round_started round={} selected={} clients=[{}]", r, chosen.size(), join(chosen));
    // 3. Collect until all arrived, or the deadline passed with quorum.
    const auto period =
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.round_deadline_s));
    auto hard = t0 + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(cfg.effective_max_round_wait_s()));
    auto deadline = t0 + period;
    if (relay) {  // a gateway's round ends in time, the wait for clients included
      hard = std::min(hard, relay->until);
      deadline = std::min(deadline, relay->until);
    }
    bool abandon = false, stopped = false;
    {
      std::unique_lock<std::mutex> g(mu);
      if (sa) {
        const Collected c = collect_secagg(g, r, t0, hard);
        stopped = c == Collected::kStopped;
        abandon = c == Collected::kAbandon;
      }
      for (; !sa;) {
        cv.wait_for(g, kRoundTick);
        sweep();
        if (stop.load()) {
          stopped = true;
          break;
        }
        size_t done = 0;
        for (const auto& [cid, st] : selected) done += st == Status::kDone;
        if (done == selected.size()) break;
        const auto now = Clock::now();
        if (now < deadline) continue;
        if (round_accepted >= cfg.quorum) {
          spdlog::info("event=deadline round={} updates={} selected={} msg=\"closing with quorum\"", r, round_accepted,
                       selected.size());
          break;
        }
        if (now >= hard) {
          spdlog::warn(
              "event=round_abandoned round={} updates={} quorum={} msg=\"no quorum; restarting the round "
              "with a fresh selection\"",
              r, round_accepted, cfg.quorum);
          abandon = true;
          break;
        }
        deadline += period;
        board->update_progress([&](monitor::Progress& p) { p.deadline += cfg.round_deadline_s; });
        spdlog::warn("event=deadline_extended round={} updates={} quorum={}", r, round_accepted, cfg.quorum);
      }
      // 4. Close admissions; wait for updates being folded in.
      round_open = false;
      cv.wait(g, [&] { return in_flight == 0; });
    }
    if (stopped) return false;
    std::map<std::string, double> metrics;
    if (sa && !abandon) {
      try {
        const size_t survivors = fold_secagg(*round_ctx, metrics);
        std::lock_guard<std::mutex> g(mu);
        round_accepted = static_cast<int64_t>(survivors);  // a rejected client's masked update is not in the sum
      } catch (const Error& e) {
        spdlog::error("event=round_abandoned round={} secagg=1 error=\"{}\"", r, e.what());
        abandon = true;
      }
    }
    if (sa) {
      std::lock_guard<std::mutex> g(mu);
      sa.reset();
      sa_setup.clear();
      sa_client.clear();
      sa_metrics.clear();
    }
    if (abandon) {
      n.abandoned++;
      return true;
    }
    board->update_progress([](monitor::Progress& p) { p.phase = "aggregating"; });
    // Acks first: the round's Acks leave before the aggregation and the
    // checkpoint take the cores (on a small machine they would wait behind them).
    wait_outbox_drained(std::chrono::milliseconds(50));
    // 5. Aggregate.
    aggregation::Accumulator agg = aggregator->make_accumulator(shapes);
    agg.reset(aggregator->clip());
    Weights control_sum;
    std::map<std::string, double> metric_sum, metric_weight;
    for (auto& p : partials) {
      agg.merge(*p.agg);
      for (const auto& [k, v] : p.control_sum) {
        auto it = control_sum.find(k);
        if (it == control_sum.end())
          control_sum[k] = v.clone();
        else
          it->second.add_(v);
      }
      for (const auto& [k, v] : p.metric_sum) metric_sum[k] += v;
      for (const auto& [k, v] : p.metric_weight) metric_weight[k] += v;
    }
    // The round is closed and nothing is in flight: no worker touches its
    // partial until the next round opens. Reset now, so the frames the partials
    // hold (the aggregator's held dense updates) are freed before the checkpoint
    // and the wait for the next round, not when it opens.
    for (auto& p : partials) p.reset(aggregator->clip());
    if (agg.total_weight() <= 0) {
      n.abandoned++;
      return true;
    }
    aggregation::AggregateStats ast;
    // The global step (federation::GlobalModel, as in sparrow-sim): all or
    // nothing; a non-finite aggregate abandons the round.
    federation::StepResult step;
    if (relay) {
      // A gateway: the mean delta goes to the root, which steps its model.
      step = gm->finish_only(*aggregator, agg, r, &ast);
    } else {
      double population;
      {
        std::lock_guard<std::mutex> g(mu);
        population = static_cast<double>(std::max<size_t>(clients.size(), 1));  // SCAFFOLD: the clients seen
      }
      std::lock_guard<std::mutex> g(weights_mu);
      step = gm->step(*aggregator, agg, control_sum, r, population, &ast);
    }
    if (!step.applied) {
      spdlog::error("event=round_abandoned round={} error=\"{}\"", r, step.error);
      n.abandoned++;
      return true;
    }
    if (relay) {
      relay_out = Server::RelayResult{};
      relay_out->delta = std::move(step.delta);
      relay_out->weight = agg.total_weight();
    }
    if (gm->has_downlink()) {
      down_last.clear();
      for (auto& [nm, e] : step.downlink) down_last.push_back({nm, std::move(e)});
    }
    // 6. Evaluate (optional), then checkpoint and record in one transaction.
    RoundRow row;
    row.round = static_cast<int64_t>(r);
    row.started = started;
    row.selected = static_cast<int64_t>(chosen.size());
    for (const auto& [k, v] : metric_sum)
      if (metric_weight[k] > 0) metrics["client." + k] = v / metric_weight[k];
    row.train_loss = metrics.count("client.train_loss") ? metrics["client.train_loss"] : kNaN;
    row.eval_loss = row.eval_accuracy = kNaN;
    // Clients with a holdout evaluated the model they received (federated
    // evaluation, weighted by their samples); the server's own evaluation,
    // when it runs, takes precedence in the round row.
    if (metrics.count("client.eval_accuracy")) {
      row.eval_accuracy = metrics["client.eval_accuracy"];
      row.eval_loss = metrics.count("client.eval_loss") ? metrics["client.eval_loss"] : kNaN;
    }
    if (eval_model && (r % static_cast<uint64_t>(cfg.eval_every) == 0 || r == static_cast<uint64_t>(cfg.rounds))) {
      board->update_progress([](monitor::Progress& p) { p.phase = "evaluating"; });
      auto [loss, acc] = evaluate();
      row.eval_loss = loss;
      row.eval_accuracy = acc;
      metrics["eval.loss"] = loss;
      metrics["eval.accuracy"] = acc;
    }
    std::vector<ClientRow> dirty;
    {
      std::lock_guard<std::mutex> g(mu);
      row.updates = round_accepted;
      row.rejected = round_rejected;
      row.stale = round_stale;
      for (const auto& cid : dirty_clients) dirty.push_back(clients[cid]);
      dirty_clients.clear();
    }
    row.bytes_in = n.bytes_in.load() - bytes_in0;
    row.bytes_out = n.bytes_out.load() - bytes_out0;
    row.finished = unix_now();
    metrics["round.seconds"] = std::chrono::duration<double>(Clock::now() - t0).count();
    metrics["round.weight"] = agg.total_weight();
    if (ast.clip > 0) {
      metrics["aggregate.clip"] = ast.clip;
      metrics["aggregate.clipped"] = static_cast<double>(ast.clipped);
    }
    if (aggregator->robust().method != aggregation::RobustSpec::Method::kMean)
      metrics["aggregate.kept"] = static_cast<double>(ast.kept);
    if (aggregator->dp().mode != aggregation::DpSpec::Mode::kNone) {
      // Selection is not random (least recently selected first), so no
      // sampling amplification: the most-selected client's participations,
      // each a Gaussian mechanism.
      int64_t most = 0;
      {
        std::lock_guard<std::mutex> g(mu);
        for (const auto& [cid, crow] : clients) most = std::max<int64_t>(most, crow.selected);
      }
      const double eps = aggregator->epsilon(most, 1.0, most);
      if (std::isfinite(eps)) metrics["dp.epsilon"] = eps;  // noise 0: no guarantee, nothing to report
    }
    if (relay_out) {
      relay_out->updates = static_cast<size_t>(row.updates);
      for (const auto& [k, v] : metrics)
        if (k.rfind("client.", 0) == 0) relay_out->metrics[k.substr(7)] = v;
    }
    store->commit_round(row, metrics, checkpoint(static_cast<int64_t>(r)), dirty, cfg.keep_checkpoints);
    completed = static_cast<int64_t>(r);
    n.rounds = r;
    board->add_round(point_of(row, value_or_nan(metrics, std::string("round.seconds")),
                              value_or_nan(metrics, std::string("dp.epsilon"))));
    board->update_progress([&](monitor::Progress& p) {
      p.rounds_completed = static_cast<int64_t>(r);
      p.phase = static_cast<int>(r) >= cfg.rounds ? "done" : "waiting";
    });
    {
      std::lock_guard<std::mutex> g(mu);
      publish_clients(true);
    }
    spdlog::info(
        "event=round_completed round={} updates={} selected={} rejected={} stale={} train_loss={} eval_loss={} "
        "eval_accuracy={} seconds={:.3f} bytes_in={} bytes_out={}",
        r, row.updates, row.selected, row.rejected, row.stale, row.train_loss, row.eval_loss, row.eval_accuracy,
        metrics["round.seconds"], row.bytes_in, row.bytes_out);
    return true;
  }

  static std::string join(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
    return s;
  }

  Checkpoint checkpoint(int64_t r) {
    Checkpoint c;
    c.round = r;
    {
      std::lock_guard<std::mutex> g(weights_mu);
      c.weights = serialize_weights(gm->weights());
    }
    c.server_opt = gm->optimizer().serialize_state();
    if (!gm->control().empty()) c.control = serialize_weights(gm->control());
    if (gm->has_downlink()) {
      c.broadcast = serialize_weights(gm->broadcast());
      wire::ModelUpdate u;
      u.round = static_cast<uint64_t>(r);
      u.client_id = "server";
      u.num_samples = 1;
      u.tensors = down_last;
      c.downlink_last = wire::serialize(msg(std::move(u)));
    }
    if (!gm->shared().empty()) c.acp = serialize_weights(gm->shared());
    c.rng = "seed=" + std::to_string(cfg.seed) + ";select_round=" + std::to_string(r + 1);
    c.aggregator = aggregator->serialize_state();
    return c;
  }

  std::pair<double, double> evaluate() {
    c10::NoGradGuard ng;
    {
      std::lock_guard<std::mutex> g(weights_mu);
      for (auto& p : eval_model->named_parameters(/*recurse=*/true)) p.value().copy_(gm->weights().at(p.key()));
    }
    eval_model->eval();
    const int64_t N = test.size();
    double loss = 0;
    int64_t correct = 0;
    for (int64_t i = 0; i < N; i += cfg.eval_batch) {
      const int64_t e = std::min<int64_t>(N, i + cfg.eval_batch);
      at::Tensor x = test.x.slice(0, i, e), y = test.y.slice(0, i, e);
      at::Tensor logits = eval_model->forward(x);
      loss += at::nll_loss(at::log_softmax(logits, 1), y, {}, at::Reduction::Sum).item<double>();
      correct += logits.argmax(1).eq(y).sum().item<int64_t>();
    }
    return {N ? loss / static_cast<double>(N) : kNaN, N ? static_cast<double>(correct) / static_cast<double>(N) : kNaN};
  }

  // ---- lifecycle -------------------------------------------------------------------

  void start_threads() {
    io = std::thread([this] { io_loop(); });
    for (size_t w = 0; w < partials.size(); ++w) workers.emplace_back([this, w] { worker_loop(w); });
  }

  void stop_threads() {
    {
      std::lock_guard<std::mutex> g(mu);
      // "run finished" tells clients to exit (docs/protocol.md, Bye); any other
      // reason makes them reconnect to a restarted server.
      const bool over = cfg.gateway() ? root_finished : completed.load() >= cfg.rounds;
      const std::string reason = over ? "run finished" : "server shutting down";
      for (const auto& [rid, s] : sessions) reply(rid, msg(wire::Bye{reason}));
      sessions.clear();
      by_client.clear();
    }
    {
      std::lock_guard<std::mutex> g(job_mu);
      jobs_stop = true;
      jobs.clear();
    }
    job_cv.notify_all();
    for (auto& t : workers)
      if (t.joinable()) t.join();
    workers.clear();
    io_stop = true;
    if (io.joinable()) io.join();
    std::vector<ClientRow> dirty;
    {
      std::lock_guard<std::mutex> g(mu);
      for (const auto& cid : dirty_clients) dirty.push_back(clients[cid]);
      dirty_clients.clear();
    }
    try {
      if (!dirty.empty()) store->put_clients(dirty);
    } catch (const std::exception& e) {
      spdlog::error("event=client_rows_not_saved error=\"{}\"", e.what());
    }
    const bool finished = completed.load() >= cfg.rounds;
    board->update_progress([&](monitor::Progress& p) {
      p.phase = finished ? "done" : "stopped";
      p.clients_connected = 0;
    });
    std::lock_guard<std::mutex> g(mu);
    publish_clients(true);
  }
};

Server::Server(ServerConfig cfg) : Server(std::move(cfg), Weights{}) {}

Server::Server(ServerConfig cfg, Weights initial_weights) : impl_(std::make_unique<Impl>()) {
  impl_->cfg = std::move(cfg);
  impl_->init(std::move(initial_weights));
}

Server::~Server() {
  if (!impl_) return;
  // set_limits() made linger 0; give the final Byes (queued by run() on its way
  // out) a bounded chance to leave, or clients never learn the run finished.
  try {
    impl_->router.set(zmq::sockopt::linger, 1000);
  } catch (const zmq::error_t&) {
  }
  impl_->monitor.reset();  // stop monitoring before the socket goes (its events would find no reader)
  impl_->router.close();
  impl_->zap.reset();
}

void Server::run() {
  Impl& s = *impl_;
  SPARROW_CHECK(!s.ran, "Server::run() may be called once");
  s.ran = true;
  s.start_threads();
  try {
    while (!s.stop.load() && s.completed.load() < s.cfg.rounds)
      if (!s.run_round()) break;
  } catch (...) {
    s.stop_threads();
    throw;
  }
  s.stop_threads();
  spdlog::info("event=stopped round={} accepted={} stale={}", s.completed.load(), s.n.accepted.load(),
               s.n.stale.load());
}

void Server::start() {
  Impl& s = *impl_;
  SPARROW_CHECK(!s.ran, "Server::start()/run() may be called once");
  s.ran = true;
  s.start_threads();
}

std::optional<Server::RelayResult> Server::relay_round(uint64_t round, const Weights& base,
                                                       const wire::TrainSettings& train, const Weights& masks,
                                                       double limit_s) {
  Impl& s = *impl_;
  SPARROW_CHECK(s.cfg.gateway(), "relay_round: this server has no upstream (not a gateway)");
  SPARROW_CHECK(round >= 1, "relay_round: round must be >= 1");
  for (const auto& [nm, v] : s.gm->weights())
    SPARROW_CHECK(base.count(nm) && base.at(nm).sizes() == v.sizes(),
                  "relay_round: the root's model lacks '" << nm << "' or has another shape");
  for (const auto& [nm, m] : masks) {
    SPARROW_CHECK(s.gm->weights().count(nm), "relay_round: a mask for '" << nm << "', which the model does not have");
    const int64_t numel = s.gm->weights().at(nm).numel();
    SPARROW_CHECK(
        m.dim() == 1 && m.scalar_type() == at::kLong && m.device().is_cpu() &&
            (m.numel() == 0 || (m[0].item<int64_t>() >= 0 && m[-1].item<int64_t>() < numel &&
                                (m.slice(0, 1) > m.slice(0, 0, -1)).all().item<bool>())),
        "relay_round: the mask of '" << nm << "' is not ascending positions within its " << numel << " elements");
  }
  const double limit = limit_s > 0 ? limit_s : s.cfg.effective_max_round_wait_s();
  s.relay =
      Impl::Relay{round, &base, &train, &masks,
                  Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(limit))};
  s.relay_out.reset();
  struct Clear {
    Impl& s;
    ~Clear() { s.relay.reset(); }
  } clear{s};
  if (!s.run_round()) return std::nullopt;  // stopped
  return std::move(s.relay_out);            // nullopt when abandoned
}

void Server::finish(bool run_over) {
  impl_->root_finished = run_over;
  impl_->stop_threads();
  spdlog::info("event=stopped round={} accepted={} stale={}", impl_->completed.load(), impl_->n.accepted.load(),
               impl_->n.stale.load());
}

uint64_t Server::live_samples() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  uint64_t total = 0;
  for (const auto& [rid, sess] : impl_->sessions) total += sess.num_samples;
  return total;
}

void Server::stop() noexcept { impl_->stop.store(true); }
const std::string& Server::dashboard_url() const {
  static const std::string none;
  return impl_->http ? impl_->http->url() : none;
}

const std::string& Server::endpoint() const { return impl_->endpoint; }
const std::string& Server::run_id() const { return impl_->run_id; }
const std::string& Server::public_key() const { return impl_->public_key; }
int64_t Server::completed_rounds() const { return impl_->completed.load(); }
uint64_t Server::model_digest() const { return impl_->digest; }
const ServerConfig& Server::config() const { return impl_->cfg; }

Weights Server::global_weights() const {
  std::lock_guard<std::mutex> g(impl_->weights_mu);
  Weights out;
  for (const auto& [k, v] : impl_->gm->weights()) out[k] = v.clone();
  return out;
}

Counters Server::counters() const {
  const AtomicCounters& n = impl_->n;
  Counters c;
  c.updates_accepted = n.accepted.load();
  for (size_t i = 0; i < c.rejected_by_code.size(); ++i) c.rejected_by_code[i] = n.rejected[i].load();
  c.stale = n.stale.load();
  c.unknown = n.unknown.load();
  c.bytes_in = n.bytes_in.load();
  c.bytes_out = n.bytes_out.load();
  c.messages_in = n.messages_in.load();
  c.messages_out = n.messages_out.load();
  c.send_failures = n.send_failures.load();
  c.rounds_completed = n.rounds.load();
  c.rounds_abandoned = n.abandoned.load();
  c.clients_connected = impl_->n_connected.load();
  return c;
}

}  // namespace sparrow::server
