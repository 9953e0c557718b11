#include "client/session.h"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "aggregation/dp_accountant.h"
#include "aggregation/robust.h"
#include "client/data_folder.h"
#include "client/trainer.h"
#include "compression/compressor.h"
#include "compression/lowrank.h"
#include "compression/mask.h"
#include "core/error.h"
#include "core/flat_config.h"
#include "core/model_digest.h"
#include "core/models.h"
#include "core/peer_text.h"
#include "core/rng.h"
#include "federation/client_pipeline.h"
#include "secagg/secagg.h"
#include "state/store.h"
#include "wire/net.h"
#include "wire/wire.h"

namespace sparrow::client {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kSoftware = "sparrow-client 0.1.0";
constexpr int64_t kStateKey = 0;              // one client per state database
constexpr uint64_t kBackoffTag = 0x626b6f66;  // "bkof"
constexpr uint64_t kHoldoutTag = 0x686f6c64;  // "hold"
constexpr int kPollSliceMs = 100;             // stop() is noticed within this

// Meta keys of the state database (state/store.h set_meta).
constexpr const char* kMetaClientId = "client.id";
constexpr const char* kMetaDigest = "client.digest";
constexpr const char* kMetaHeldRound = "held.round";
constexpr const char* kMetaHeldRun = "held.run_id";
constexpr const char* kMetaHeldWeights = "held.weights";

// ---- config ------------------------------------------------------------------------

void bind_all(core::FlatConfig& f, SessionConfig& c) {
  f.bind("server", &c.server);
  f.bind("server_key", &c.server_key);
  f.bind("key", &c.key);
  f.bind("insecure", &c.insecure);
  f.bind("client_id", &c.client_id);
  f.bind("model", &c.model);
  f.bind("data", &c.data.data);
  f.bind("data_dir", &c.data.data_dir);
  f.bind("partition", &c.data.partition);
  f.bind("clients", &c.data.clients);
  f.bind("index", &c.data.index);
  f.bind("partition_seed", &c.data.partition_seed);
  f.bind("state_db", &c.state_db);
  f.bind("heartbeat_ms", &c.heartbeat_ms);
  f.bind("max_message_mb", &c.max_message_mb);
  f.bind("device", &c.device);
  f.bind("backoff_initial_ms", &c.backoff_initial_ms);
  f.bind("backoff_max_ms", &c.backoff_max_ms);
  f.bind("give_up_s", &c.give_up_s);
  f.bind("holdout", &c.holdout);
  f.bind("dp", &c.dp);
}

// Cross-key checks, after the file and the overrides; errors name where the key was set.
void check_session_config(const core::FlatConfig& f, const SessionConfig& c) {
  f.check("server", !c.server.empty(), "must not be empty");
  try {
    net::check_endpoint("server", c.server, /*for_bind=*/false);
  } catch (const ConfigError& e) {
    f.fail("server", e.what());
  }
  // The server refuses other ids at Hello (docs/security.md): said here, before any connection.
  f.check("client_id", core::valid_client_id(c.client_id), core::client_id_problem(c.client_id));
  f.check("model", !c.model.empty(), "must not be empty");
  f.check("data", !c.data.data.empty(), "must not be empty");
  f.check("clients", c.data.clients >= 1, "must be >= 1");
  f.check("index", c.data.index >= 0 && c.data.index < c.data.clients,
          "must be in [0, clients = " + std::to_string(c.data.clients) + ")");
  f.check("state_db", !c.state_db.empty(), "must not be empty");
  // The ranges of docs/client.md's key table. ZeroMQ keeps the heartbeat TTL
  // (3 x heartbeat_ms) in deciseconds below 2^16.
  f.check("clients", c.data.clients <= 10000000, "must be in [1, 10000000]");
  f.check("heartbeat_ms", c.heartbeat_ms >= 10 && c.heartbeat_ms <= 600000, "must be in [10, 600000]");
  f.check("max_message_mb", c.max_message_mb >= 1 && c.max_message_mb <= 2047, "must be in [1, 2047]");
  f.check("backoff_initial_ms", c.backoff_initial_ms >= 1 && c.backoff_initial_ms <= 600000, "must be in [1, 600000]");
  f.check("backoff_max_ms", c.backoff_max_ms >= c.backoff_initial_ms && c.backoff_max_ms <= 3600000,
          "must be in [backoff_initial_ms, 3600000]");
  f.check("give_up_s", std::isfinite(c.give_up_s) && c.give_up_s >= 0 && c.give_up_s <= 1e7,
          "must be in [0, 1e7] (0 = never give up)");
  f.check("holdout", std::isfinite(c.holdout) && c.holdout >= 0 && c.holdout <= 0.5, "must be in [0, 0.5] (0 = off)");
  try {
    const aggregation::DpSpec d = aggregation::DpSpec::parse(c.dp);
    f.check("dp", d.mode != aggregation::DpSpec::Mode::kCentral,
            "central DP is the server's setting (its `dp` key); a client takes \"none\" or \"local:clip=,noise=\"");
  } catch (const ConfigError& e) {
    f.fail("dp", e.what());
  }
  if (!c.insecure) {
    f.check("server_key", !c.server_key.empty(), "must name the server's public key file (or set insecure = true)");
    f.check("key", !c.key.empty(), "must name this client's .key_secret file (or set insecure = true)");
  }
}

// ---- helpers -----------------------------------------------------------------------

using compression::deserialize_weights;
using compression::serialize_weights;

Weights clone_weights(const Weights& w) {
  Weights out;
  for (const auto& [k, v] : w) out[k] = v.clone();
  return out;
}

bool same_train_config(const TrainConfig& a, const TrainConfig& b) {
  return a.algorithm == b.algorithm && a.local_epochs == b.local_epochs && a.batch_size == b.batch_size &&
         a.lr == b.lr && a.momentum == b.momentum && a.weight_decay == b.weight_decay && a.mu == b.mu;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  return os.str() + ']';
}

wire::Message message(wire::Body body) {
  wire::Message m;
  m.body = std::move(body);
  return m;
}

}  // namespace

SessionConfig parse_session_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                                   const std::string& source) {
  SessionConfig c;
  core::FlatConfig f(source);
  bind_all(f, c);
  f.read(toml_text, overrides);
  check_session_config(f, c);
  return c;
}

SessionConfig load_session_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_session_config(core::read_config_file(path), overrides, path);
}

// ---- the session ---------------------------------------------------------------------

struct ClientSession::Impl {
  enum class Outcome { kContinue, kFinished, kReconnect };

  ClientSession& self;
  SessionConfig cfg;
  core::Dataset data;
  core::Dataset holdout;  // empty unless cfg.holdout > 0
  at::Device device{at::kCPU};
  std::shared_ptr<core::Model> replica;
  std::vector<std::string> names;  // model order
  std::map<std::string, std::vector<int64_t>> shapes;
  int64_t total_numel = 0;
  uint64_t digest = 0;
  net::KeyPair own_keys;
  std::string server_key;
  uint64_t max_bytes = 0;

  std::unique_ptr<state::ClientStateStore> store;
  state::ClientState st;  // the persisted state, key kStateKey
  Weights held;           // B_{held_round} on the CPU; empty: the seed-built model (held_round 0)
  std::string held_run_id;
  Weights initial;  // W_0 from initial_seed (built on first need)
  std::optional<uint64_t> initial_seed;

  std::unique_ptr<LocalTrainer> trainer;
  std::unique_ptr<compression::Compressor> dense;  // "none": control deltas
  aggregation::DpSpec ldp;                         // local DP (cfg.dp)
  std::random_device entropy;                      // local DP noise keys

  zmq::context_t ctx;
  std::unique_ptr<zmq::socket_t> sock;
  std::unique_ptr<net::HandshakeMonitor> monitor;  // of `sock`
  // Handshakes failing since (no success, no Welcome in between), and why.
  std::optional<Clock::time_point> failing_since, last_failure;
  int failures = 0;
  bool decisive = false;  // the server refused the key, or the security mechanisms differ
  std::string failure_cause;
  int failure_rank = 0;       // how specific failure_cause is (see check_handshakes)
  bool handshake_ok = false;  // on the current connection
  bool welcomed = false;
  wire::Welcome welcome;
  uint32_t hb_ms = 1000;
  uint64_t known_round = 0;
  std::optional<uint64_t> pending_round;  // update sent, awaiting Ack/Error
  std::optional<uint64_t> rehello_round;  // a Delta of this round was answered with a re-Hello
  Clock::time_point last_rx, next_hb;
  uint64_t backoff_attempt = 0;

  struct AtomicCounters {
    std::atomic<uint64_t> hellos{0}, welcomes{0}, tasks_done{0}, tasks_refused{0}, updates_acked{0},
        updates_rejected{0}, reconnects{0}, heartbeats{0}, errors_received{0};
  } n;

  TaskRunner runner;  // set: Tasks go to it instead of local training (a gateway)

  Impl(ClientSession& s, SessionConfig c, core::Dataset d, TaskRunner run = {})
      : self(s), cfg(std::move(c)), runner(std::move(run)) {
    // Validate the config as the loader would (a SessionConfig built in code skips it).
    SPARROW_CHECK_T(ConfigError, core::valid_client_id(cfg.client_id),
                    "client_id: " << core::client_id_problem(cfg.client_id));
    SPARROW_CHECK_T(ConfigError, cfg.heartbeat_ms >= 10, "heartbeat_ms: must be >= 10");
    SPARROW_CHECK_T(ConfigError, cfg.max_message_mb >= 1 && cfg.max_message_mb <= 2047,
                    "max_message_mb: must be in [1, 2047]");
    SPARROW_CHECK_T(ConfigError, cfg.backoff_initial_ms >= 1 && cfg.backoff_max_ms >= cfg.backoff_initial_ms,
                    "backoff_initial_ms/backoff_max_ms: need 1 <= initial <= max");
    try {
      device = at::Device(cfg.device);
    } catch (const std::exception&) {
      throw ConfigError("device: '" + cfg.device + "' is not a device (cpu, cuda, cuda:N)");
    }
    SPARROW_CHECK_T(ConfigError, device.is_cpu() || (device.is_cuda() && torch::cuda::is_available()),
                    "device: '" << cfg.device << "' is not available (cpu, or cuda when a GPU is present)");
    max_bytes = cfg.max_message_mb << 20;
    hb_ms = cfg.heartbeat_ms;

    compression::register_builtins();
    dense = compression::make_compressor("none");
    ldp = aggregation::DpSpec::parse(cfg.dp);
    // The replica's initial weights do not matter (every train() loads the
    // global model); the digest depends on names and shapes only.
    replica = core::make_model(cfg.model, 0);
    if (!device.is_cpu()) replica->to(device);
    for (const auto& p : replica->named_parameters()) {
      names.push_back(p.key());
      shapes[p.key()] = p.value().sizes().vec();
      total_numel += p.value().numel();
    }
    digest = core::model_digest(*replica);
    if (runner.run) {
      SPARROW_CHECK_T(ConfigError, cfg.holdout == 0, "holdout: a session with a task runner has no data to hold out");
    } else {
      data = check_data_for_model(std::move(d), cfg.model);
    }
    if (cfg.holdout > 0) split_holdout();
    if (!device.is_cpu()) {
      data.x = data.x.to(device);
      data.y = data.y.to(device);
      if (holdout.size() > 0) {
        holdout.x = holdout.x.to(device);
        holdout.y = holdout.y.to(device);
      }
    }

    if (cfg.insecure) {
      spdlog::warn("insecure = true: plain TCP, no authentication or encryption");
    } else {
      own_keys = net::load_keypair(cfg.key);
      server_key = net::load_public_key(cfg.server_key);
    }
    open_state();
  }

  // ---- local state ----

  void open_state() {
    store = state::ClientStateStore::open(cfg.state_db);
    const auto id = store->get_meta(kMetaClientId);
    SPARROW_CHECK_T(
        ConfigError, !id || *id == cfg.client_id,
        "state_db: '" << cfg.state_db << "' belongs to client '" << *id << "', not '" << cfg.client_id << "'");
    const auto dg = store->get_meta(kMetaDigest);
    SPARROW_CHECK_T(ConfigError, !dg || *dg == std::to_string(digest),
                    "state_db: '" << cfg.state_db << "' was written for another model than '" << cfg.model << "'");
    if (auto s = store->get(kStateKey)) st = std::move(*s);
    uint64_t round = 0;
    if (auto r = store->get_meta(kMetaHeldRound); r && !r->empty()) {
      try {
        round = std::stoull(*r);
      } catch (const std::exception&) {
        throw FormatError("state_db: bad held round '" + *r + "' in " + cfg.state_db);
      }
    }
    held_run_id = store->get_meta(kMetaHeldRun).value_or("");
    if (round > 0) {
      held = deserialize_weights(store->get_meta(kMetaHeldWeights).value_or(""));
      bool ok = held.size() == shapes.size();
      for (const auto& [k, v] : held) ok = ok && shapes.count(k) && shapes.at(k) == v.sizes().vec();
      if (!ok) {
        spdlog::warn("state_db: the held model of round {} does not match the model; reporting round 0", round);
        held.clear();
        round = 0;
      }
    }
    self.held_round_.store(round);
    store->set_meta(kMetaClientId, cfg.client_id);
    store->set_meta(kMetaDigest, std::to_string(digest));
    store->flush();
    if (round > 0) spdlog::info("state: holding the broadcast model of round {} (run '{}')", round, held_run_id);
  }

  // Forgets everything that belongs to another run.
  void reset_state() {
    st = state::ClientState{};
    held.clear();
    self.held_round_.store(0);
    store->put(kStateKey, st);
    store->set_meta(kMetaHeldRound, "0");
    store->set_meta(kMetaHeldWeights, "");
    store->set_meta(kMetaHeldRun, "");
    store->flush();
  }

  void persist_held(uint64_t round, const Weights& w) {
    held = w;
    self.held_round_.store(round);
    held_run_id = welcome.run_id;
    store->set_meta(kMetaHeldRound, std::to_string(round));
    store->set_meta(kMetaHeldRun, held_run_id);
    store->set_meta(kMetaHeldWeights, serialize_weights(w));
    store->flush();
  }

  const Weights& initial_model(uint64_t seed) {
    if (!initial_seed || *initial_seed != seed) {
      initial = get_weights(*core::make_model(cfg.model, seed));
      for (auto& [k, v] : initial) v = v.to(at::kCPU, at::kFloat).contiguous();
      initial_seed = seed;
    }
    return initial;
  }

  // The holdout: a fixed share of the samples (the same for the same client_id
  // and data), never trained on.
  void split_holdout() {
    const int64_t n = data.size();
    const auto k = static_cast<int64_t>(std::llround(cfg.holdout * static_cast<double>(n)));
    SPARROW_CHECK_T(ConfigError, k >= 1 && k < n,
                    "holdout: " << cfg.holdout << " of " << n << " samples holds out " << k
                                << "; need at least 1 to evaluate on and 1 to train on");
    holdout = core::hold_out(data, k, rng::derive(rng::hash_name(cfg.client_id), kHoldoutTag));
    spdlog::info("event=holdout samples={} train_samples={}", k, n - k);
  }

  // ---- transport ----

  void open_socket() {
    sock = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer);
    if (!cfg.insecure) net::make_curve_client(*sock, own_keys, server_key);
    net::set_limits(*sock, max_bytes, static_cast<int>(cfg.heartbeat_ms));
    monitor = std::make_unique<net::HandshakeMonitor>(ctx, *sock);
    handshake_ok = false;
    sock->connect(cfg.server);
    welcomed = false;
    pending_round.reset();
  }

  void close_socket() {
    monitor.reset();
    if (sock) sock->close();
    sock.reset();
  }

  void clear_failures() {
    failing_since.reset();
    last_failure.reset();
    failures = 0;
    decisive = false;
    failure_cause.clear();
    failure_rank = 0;
  }

  // Reads the socket monitor: a handshake that fails again and again has a
  // cause the server cannot tell us in a message (it never gets one from us).
  void check_handshakes() {
    if (!monitor) return;
    using Kind = net::HandshakeMonitor::Kind;
    for (const auto& e : monitor->drain()) {
      if (e.kind == Kind::kConnected) {
        handshake_ok = false;
      } else if (e.kind == Kind::kSucceeded) {
        handshake_ok = true;
        clear_failures();
      } else if (e.kind == Kind::kRefused || e.kind == Kind::kMismatch || e.kind == Kind::kFailed ||
                 (e.kind == Kind::kDisconnected && !handshake_ok)) {
        const std::string cause = net::HandshakeMonitor::client_cause(e, !cfg.insecure);
        // A refusal or a mismatch says more than a handshake that just fails,
        // which says more than the disconnect that follows it: a vaguer event
        // (the reconnect's handshake can fail either way) never replaces a
        // more specific cause already seen.
        const int rank = e.kind == Kind::kRefused || e.kind == Kind::kMismatch ? 2 : e.kind == Kind::kFailed ? 1 : 0;
        if (failure_cause.empty() || rank >= failure_rank) {
          if (cause != failure_cause) spdlog::warn("event=handshake_failed server={} msg=\"{}\"", cfg.server, cause);
          failure_cause = cause;
          failure_rank = rank;
        }
        const auto now = Clock::now();
        if (!failing_since) failing_since = now;
        last_failure = now;
        ++failures;
        decisive = decisive || e.kind == Kind::kRefused || e.kind == Kind::kMismatch;
      }
    }
    const auto now = Clock::now();
    // Failures that stopped (the server went away: "connection refused" makes
    // no handshake events) are not a handshake problem: forget them. The
    // window covers the longest reconnect backoff and a silence timeout.
    const auto stale = std::chrono::milliseconds(static_cast<int64_t>(cfg.backoff_max_ms) + 3 * hb_ms + 5000);
    if (last_failure && now - *last_failure > stale) clear_failures();
    // A refused key or a security mismatch is certain; a handshake that just
    // closes must have happened a few times.
    if (failing_since && cfg.give_up_s > 0 && (decisive || failures >= 3) &&
        now - *failing_since >= std::chrono::duration<double>(cfg.give_up_s))
      throw Error("gave up after " + std::to_string(static_cast<int64_t>(cfg.give_up_s)) +
                  " s of failed handshakes with " + cfg.server + ": " + failure_cause);
  }

  // Never blocks: a full queue (or no peer) counts as a failed send.
  bool send(const wire::Message& m) {
    try {
      return net::send(*sock, m, /*dont_wait=*/true);
    } catch (const zmq::error_t& e) {
      spdlog::warn("send failed: {}", e.what());
      return false;
    }
  }

  bool send_hello() {
    wire::Hello h;
    h.client_id = cfg.client_id;
    h.num_samples =
        runner.run ? std::max<uint64_t>(1, runner.samples ? runner.samples() : 1) : static_cast<uint64_t>(data.size());
    h.model = cfg.model;
    h.model_digest = digest;
    h.last_round = self.held_round_.load();
    h.software = kSoftware;
    welcomed = false;
    ++n.hellos;
    spdlog::info("hello: client '{}' at {}, {} samples, last_round {}", cfg.client_id, cfg.server, h.num_samples,
                 *h.last_round);
    return send(message(h));
  }

  wire::ParseLimits limits() const {
    wire::ParseLimits l;
    l.max_bytes = max_bytes;
    l.max_elements = 3 * static_cast<uint64_t>(total_numel) + (uint64_t{1} << 20);
    return l;
  }

  // Backoff before reconnect attempt `attempt` (0-based): min(max, initial * 2^attempt),
  // times a jitter in [0.5, 1) drawn per client and attempt.
  void backoff() {
    const double base = std::min<double>(
        cfg.backoff_max_ms, cfg.backoff_initial_ms * std::pow(2.0, std::min<uint64_t>(backoff_attempt, 30)));
    const uint64_t key = rng::derive(rng::hash_name(cfg.client_id), kBackoffTag);
    const double ms = base * (0.5 + 0.5 * rng::uniform01(key, n.reconnects.load()));
    ++backoff_attempt;
    spdlog::info("reconnecting in {:.0f} ms", ms);
    const auto until = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
    while (!self.stop_.load() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  // ---- the loop ----

  bool run() {
    while (!self.stop_.load()) {
      open_socket();
      const Outcome o = serve();
      if (o == Outcome::kFinished) {
        close_socket();
        store->flush();
        spdlog::info("the server finished the run");
        return true;
      }
      if (self.stop_.load()) break;
      close_socket();
      ++n.reconnects;
      backoff();
    }
    if (sock) {
      send(message(wire::Bye{"client stopping"}));
      close_socket();
    }
    store->flush();
    spdlog::info("stopped");
    return false;
  }

  Outcome serve() {
    last_rx = Clock::now();
    if (!send_hello()) return Outcome::kReconnect;
    while (!self.stop_.load()) {
      check_handshakes();
      const auto now = Clock::now();
      const auto silence = last_rx + std::chrono::milliseconds(3 * static_cast<int64_t>(hb_ms));
      if (now >= silence) {
        spdlog::warn("server silent for {} ms", 3 * hb_ms);
        return Outcome::kReconnect;
      }
      if (welcomed && now >= next_hb) {
        ++n.heartbeats;
        // A gateway's samples change with its clients: the server caps its
        // relayed num_samples at the latest value (docs/server.md).
        const uint64_t samples = runner.run && runner.samples ? std::max<uint64_t>(1, runner.samples()) : 0;
        if (!send(message(wire::Heartbeat{known_round, samples}))) return Outcome::kReconnect;
        next_hb = now + std::chrono::milliseconds(hb_ms);
      }
      auto wake = std::min(silence, now + std::chrono::milliseconds(kPollSliceMs));
      if (welcomed) wake = std::min(wake, next_hb);
      const int timeout = static_cast<int>(
          std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count()));
      std::optional<wire::Message> msg;
      try {
        msg = net::receive(*sock, timeout, limits());
      } catch (const wire::ProtocolError& e) {
        last_rx = Clock::now();
        spdlog::warn("bad frame from the server: {}", e.what());
        wire::Message reply;
        reply.body = wire::error_for(e);
        send(reply);
        continue;
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR) continue;
        throw;
      }
      if (!msg) continue;
      last_rx = Clock::now();
      const Outcome o = handle(*msg);
      if (o != Outcome::kContinue) return o;
    }
    return Outcome::kContinue;
  }

  Outcome handle(wire::Message& m) {
    if (auto* w = std::get_if<wire::Welcome>(&m.body)) return on_welcome(*w);
    if (auto* e = std::get_if<wire::ErrorBody>(&m.body)) return on_error(*e);
    if (auto* t = std::get_if<wire::Task>(&m.body)) {
      if (!welcomed) {
        spdlog::warn("task for round {} before Welcome: ignored", t->round);
        return Outcome::kContinue;
      }
      on_task(*t);
      // Training took a while without listening: the silence clock restarts.
      last_rx = Clock::now();
      next_hb = last_rx + std::chrono::milliseconds(hb_ms);
      return Outcome::kContinue;
    }
    if (auto* h = std::get_if<wire::Heartbeat>(&m.body)) {
      known_round = std::max(known_round, h->round);
      return Outcome::kContinue;
    }
    if (auto* sm = std::get_if<wire::SecAgg>(&m.body)) {
      if (!welcomed) return Outcome::kContinue;
      on_secagg(*sm);
      // Training (after SharesIn) took a while without listening.
      last_rx = Clock::now();
      next_hb = last_rx + std::chrono::milliseconds(hb_ms);
      return Outcome::kContinue;
    }
    if (auto* a = std::get_if<wire::Ack>(&m.body)) {
      if (pending_round && *pending_round == a->round) {
        ++n.updates_acked;
        pending_round.reset();
        spdlog::info("round {}: update acknowledged", a->round);
      }
      return Outcome::kContinue;
    }
    if (auto* b = std::get_if<wire::Bye>(&m.body)) {
      if (b->reason == "run finished") return Outcome::kFinished;
      spdlog::info("server said bye ('{}'): reconnecting", core::printable(b->reason));
      return Outcome::kReconnect;
    }
    send(net::error_message(wire::ErrorCode::kRejected,
                            std::string("unexpected ") + wire::body_name(m.body) + " from the server"));
    return Outcome::kContinue;
  }

  Outcome on_welcome(const wire::Welcome& w) {
    ++n.welcomes;
    clear_failures();
    welcome = w;
    welcomed = true;
    backoff_attempt = 0;
    if (w.heartbeat_ms > 0) hb_ms = std::max<uint32_t>(10, w.heartbeat_ms);
    known_round = w.round;
    next_hb = Clock::now() + std::chrono::milliseconds(hb_ms);
    spdlog::info("welcome: run '{}', round {}, heartbeat {} ms", core::printable(w.run_id), w.round, hb_ms);
    if (!held_run_id.empty() && held_run_id != w.run_id) {
      // Our state (held model, residuals, c_i) belongs to another run: drop it
      // and tell the server what we now hold (only the seed-built model).
      spdlog::warn("state: held state is from run '{}', the server runs '{}': starting afresh",
                   core::printable(held_run_id), core::printable(w.run_id));
      reset_state();
      held_run_id = w.run_id;
      store->set_meta(kMetaHeldRun, held_run_id);
      store->flush();
      if (!send_hello()) return Outcome::kReconnect;
      return Outcome::kContinue;
    }
    if (held_run_id.empty()) {
      held_run_id = w.run_id;
      store->set_meta(kMetaHeldRun, held_run_id);
      store->flush();
    }
    return Outcome::kContinue;
  }

  Outcome on_error(const wire::ErrorBody& e) {
    ++n.errors_received;
    if (e.message.rfind("unknown client", 0) == 0) {
      // The server forgot our session (it restarted): Hello again, once per
      // forgetting (several queued answers to heartbeats say the same).
      if (welcomed) {
        spdlog::info("server: '{}': sending Hello again", core::printable(e.message));
        pending_round.reset();
        if (!send_hello()) return Outcome::kReconnect;
      }
      return Outcome::kContinue;
    }
    if (!welcomed)
      throw Error(std::string("the server refused the Hello (") + wire::error_code_name(e.code) + "): " + e.message);
    if (pending_round && (!e.round || *e.round == *pending_round)) {
      ++n.updates_rejected;
      spdlog::warn("round {}: update rejected ({}): {}", *pending_round, wire::error_code_name(e.code),
                   core::printable(e.message));
      pending_round.reset();
    } else {
      spdlog::warn("server error ({}): {}", wire::error_code_name(e.code), core::printable(e.message));
    }
    return Outcome::kContinue;
  }

  // Checks a tensor list against the model: known names, unique, the
  // parameters' shapes (unless !same_shape: ACP's shared factors), and when
  // `exact`, every parameter exactly once.
  void check_tensors(const std::vector<wire::NamedTensor>& ts, const char* what, bool exact,
                     bool same_shape = true) const {
    std::map<std::string, int> seen;
    for (const auto& t : ts) {
      SPARROW_CHECK_T(Error, shapes.count(t.name), what << ": '" << t.name << "' is not a parameter of " << cfg.model);
      SPARROW_CHECK_T(Error, ++seen[t.name] == 1, what << ": '" << t.name << "' appears twice");
      SPARROW_CHECK_T(Error, !same_shape || t.tensor.shape == shapes.at(t.name),
                      what << ": '" << t.name << "' has shape " << shape_text(t.tensor.shape) << ", the model "
                           << shape_text(shapes.at(t.name)));
    }
    SPARROW_CHECK_T(Error, !exact || seen.size() == shapes.size(),
                    what << ": " << seen.size() << " of the model's " << shapes.size() << " parameters");
  }

  Weights decode_all(const std::vector<wire::NamedTensor>& ts) const {
    Weights w;
    for (const auto& t : ts) w[t.name] = compression::decode(t.tensor).contiguous();
    return w;
  }

  void on_task(const wire::Task& task) {
    const uint64_t r = task.round;
    spdlog::info("round {}: task received", r);
    try {
      std::optional<Weights> base = broadcast_model(task);
      if (!base) return;  // answered with a re-Hello
      if (task.secagg) {
        SPARROW_CHECK_T(Error, !runner.run,
                        "task: secure aggregation does not span a gateway (its clients' sum would be unmasked there)");
        start_secagg(task, *base);
      } else
        train_and_send(task, *base);
    } catch (const std::exception& e) {
      ++n.tasks_refused;
      spdlog::warn("round {}: task refused: {}", r, core::printable(e.what()));
      wire::Message reply;
      reply.body = wire::error_for(e, r);
      send(reply);
    }
  }

  // B_{r-1} from the Task (Full, or Delta against what we hold), or nullopt
  // when a Delta's base is not ours (then Hello reports what we hold, once per
  // round; a second such Delta of the same round is an Error).
  std::optional<Weights> broadcast_model(const wire::Task& task) {
    const uint64_t r = task.round;
    SPARROW_CHECK_T(Error, r >= 1, "task: round must be >= 1");
    if (task.model_encoding == wire::ModelEncoding::kFull) {
      check_tensors(task.weights, "task weights", /*exact=*/true);
      return decode_all(task.weights);
    }
    check_tensors(task.weights, "task delta", /*exact=*/false);
    const uint64_t b = task.base_round;
    if (task.weights.empty())
      SPARROW_CHECK_T(Error, b + 1 == r, "task: an empty Delta of round " << r << " needs base_round " << r - 1);
    else
      SPARROW_CHECK_T(Error, b + 2 == r, "task: a Delta with tensors in round " << r << " needs base_round " << r - 2);
    const Weights* from = nullptr;
    if (b == 0)
      from = &initial_model(welcome.model_seed);
    else if (self.held_round_.load() == b && !held.empty())
      from = &held;
    if (!from) {
      const uint64_t h = self.held_round_.load();
      SPARROW_CHECK_T(Error, rehello_round != r,
                      "task: cannot apply a Delta against round " << b << ": this client holds round " << h);
      rehello_round = r;
      ++n.tasks_refused;
      spdlog::warn("round {}: Delta against round {} but holding round {}: sending Hello again", r, b, h);
      send_hello();
      return std::nullopt;
    }
    Weights w = clone_weights(*from);
    for (const auto& t : task.weights) compression::decode_add(t.tensor, w.at(t.name), 1.0f);
    return w;
  }

  // A Task's settings, checked; once they pass, the client holds B_{r-1}.
  struct Prepared {
    TrainConfig tc;
    std::unique_ptr<compression::Compressor> comp;
    Weights shared, server_control;
    Weights masks;  // tcs: the server's mask per parameter (int64 positions)
  };
  Prepared prepare(const wire::Task& task, const Weights& base) {
    Prepared p;
    TrainConfig& tc = p.tc;
    tc.algorithm = task.train.algorithm;
    tc.local_epochs = static_cast<int>(task.train.local_epochs);
    tc.batch_size = static_cast<int>(task.train.batch_size);
    tc.lr = task.train.lr;
    tc.momentum = task.train.momentum;
    tc.weight_decay = task.train.weight_decay;
    tc.mu = task.train.mu;
    validate(tc);
    const bool scaffold = tc.algorithm == "scaffold";
    p.comp = compression::make_compressor(task.compression);
    if (p.comp->mask_ratio() > 0) {
      // tcs: each entry is the server's mask of a parameter, a sparse tensor of
      // its shape whose positions are the mask.
      check_tensors(task.shared, "task shared", /*exact=*/false);
      for (const auto& nt : task.shared) {
        SPARROW_CHECK_T(Error, nt.tensor.format == compression::Format::kSparse,
                        "task: the mask of '" << nt.name << "' is not a sparse tensor");
        p.masks[nt.name] = compression::mask_positions(nt.tensor);
      }
    } else {
      check_tensors(task.shared, "task shared", /*exact=*/false, /*same_shape=*/false);
      // ACP: each entry is the round's shared factor of a parameter, {k, r}:
      // as sparrow-server sends it, a factor (compression::acp_factor_encoded),
      // whose values are the factor itself (decoding it would expand a
      // full-shape product), or a dense {k, r} tensor.
      for (const auto& nt : task.shared)
        p.shared[nt.name] = nt.tensor.format == compression::Format::kLowRankFactor
                                ? compression::acp_factor(nt.tensor).contiguous()
                                : compression::decode(nt.tensor).contiguous();
    }
    SPARROW_CHECK_T(Error, task.control.empty() || scaffold,
                    "task: control variates with algorithm '" << tc.algorithm << "'");
    check_tensors(task.control, "task control", /*exact=*/!task.control.empty());
    p.server_control = decode_all(task.control);
    if (task.secagg)  // the server's config refuses these; a client checks what it is asked to do
      secagg::check_compatible(task.compression, "mean", "none", tc.algorithm);
    // The Task is acceptable: we now hold B_{r-1}.
    persist_held(task.round - 1, base);
    rehello_round.reset();
    return p;
  }

  struct Trained {
    TrainResult tr;
    double secs = 0;
    std::vector<std::pair<std::string, double>> metrics;
    Weights outgoing;         // the delta, local DP noise added when configured
    state::ClientState next;  // committed when the update is sent
  };
  Trained train(const wire::Task& task, const Weights& base, Prepared& p) {
    const uint64_t r = task.round;
    const bool scaffold = p.tc.algorithm == "scaffold";
    if (!runner.run && (!trainer || !same_train_config(trainer->config(), p.tc)))
      trainer = std::make_unique<LocalTrainer>(replica, p.tc);
    Trained t;
    // Work on a copy: a failure below leaves the persisted state as it was.
    t.next = st.deep_copy();
    // The model received, on data it was never trained on (federated evaluation).
    std::optional<std::pair<double, double>> held;
    if (holdout.size() > 0) held = trainer->evaluate(base, holdout.x, holdout.y);
    const auto t0 = Clock::now();
    if (runner.run) {
      SPARROW_CHECK_T(Error, !scaffold, "task: algorithm scaffold cannot be relayed by a gateway");
      t.tr = runner.run(task, base);
      SPARROW_CHECK_T(Error, t.tr.num_samples > 0, "task: the runner returned no samples");
      for (const auto& nm : names)
        SPARROW_CHECK_T(Error, t.tr.delta.count(nm) && t.tr.delta.at(nm).sizes().vec() == shapes.at(nm),
                        "task: the runner's delta lacks '" << nm << "' or has another shape");
    } else {
      t.tr = trainer->train(base, data.x, data.y, task.seed, scaffold ? &t.next.control : nullptr,
                            scaffold ? &p.server_control : nullptr);
    }
    t.secs = std::chrono::duration<double>(Clock::now() - t0).count();
    t.metrics = {{"train_loss", t.tr.mean_loss}, {"train_seconds", t.secs}};
    if (held) {
      t.metrics.emplace_back("eval_loss", held->first);
      t.metrics.emplace_back("eval_accuracy", held->second);
    }
    t.outgoing = t.tr.delta;
    if (ldp.mode == aggregation::DpSpec::Mode::kLocal) {
      // The noise must be unknown to the server: drawn from this device's own
      // entropy, never from the task's seed.
      const uint64_t key = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
      for (auto& [k, v] : t.outgoing) v = v.to(at::kCPU, at::kFloat);
      const double norm = aggregation::local_dp(t.outgoing, ldp.clip, ldp.noise, key);
      const auto spent =
          aggregation::sgm_epsilon(1.0, std::max(ldp.noise, 1e-12), static_cast<int64_t>(t.next.rounds + 1), ldp.delta);
      spdlog::info("event=local_dp round={} norm={:.4g} clip={} noise={} participations={} epsilon={:.4g} delta={}", r,
                   norm, ldp.clip, ldp.noise, t.next.rounds + 1, spent.epsilon, ldp.delta);
    }
    t.next.rounds += 1;
    return t;
  }

  // Commits the state that produced an update and queues the update's bytes.
  void commit_and_send(uint64_t r, const Trained& t, const std::string& bytes) {
    const uint64_t limit = welcome.max_message_bytes > 0 ? std::min(welcome.max_message_bytes, max_bytes) : max_bytes;
    SPARROW_CHECK_T(Error, bytes.size() <= limit,
                    "update of " << bytes.size() << " bytes exceeds max_message_bytes " << limit);
    // Error feedback is committed with the update it produced, before sending:
    // a lost update loses its information either way, a crash after this
    // point does not replay the residual.
    st = t.next.deep_copy();
    store->put(kStateKey, st);
    store->flush();
    ++n.tasks_done;
    pending_round = r;
    spdlog::info("round {}: trained {} samples in {:.2f} s (loss {:.4f}), sending {} bytes", r, t.tr.num_samples,
                 t.secs, t.tr.mean_loss, bytes.size());
    // A gateway says how many samples it holds right before its update (the
    // server caps the update's weight at that; its clients came after its
    // Hello). In order on the one connection, so the server has it first.
    if (runner.run && runner.samples)
      send(message(wire::Heartbeat{known_round, std::max<uint64_t>(1, runner.samples())}));
    bool sent = false;
    try {
      sent = sock->send(zmq::buffer(bytes), zmq::send_flags::dontwait).has_value();
    } catch (const zmq::error_t& e) {
      spdlog::warn("send failed: {}", e.what());
    }
    if (!sent) spdlog::warn("round {}: the update could not be queued", r);
  }

  void train_and_send(const wire::Task& task, const Weights& base) {
    const uint64_t r = task.round;
    Prepared p = prepare(task, base);
    Trained t = train(task, base, p);
    // The client pipeline the simulator's clients run too
    // (federation/client_pipeline.h).
    std::map<std::string, compression::Context> contexts;
    for (const auto& name : names) {
      compression::Context c;
      c.name = name;
      c.round = static_cast<int64_t>(r);
      if (auto it = p.shared.find(name); it != p.shared.end()) c.shared_factor = it->second;
      if (auto it = p.masks.find(name); it != p.masks.end()) c.mask = it->second;
      contexts[name] = federation::client_context(std::move(c), task.seed, task.clients);
    }
    const wire::ModelUpdate u = federation::make_update(r, cfg.client_id, t.tr.num_samples, names, t.outgoing, *p.comp,
                                                        t.next.compressor, contexts, t.tr.control_delta, t.metrics);
    if (cfg.update_delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(cfg.update_delay_ms));
    commit_and_send(r, t, wire::serialize(message(u)));
  }

  // ---- secure aggregation (docs/security.md) ----

  // The open SecAgg+ round: its Task, the model it trains, and the protocol
  // state (keys, shares held). In memory only: a restarted client is a
  // dropout of the round.
  struct SecAggRound {
    wire::Task task;
    Weights base;
    Prepared prepared;
    std::unique_ptr<secagg::Client> party;
  };
  std::unique_ptr<SecAggRound> sa;

  // Test aid (--fault): exit as a crash would, at the named point.
  void fault_point(const char* where) {
    if (cfg.fault == where) {
      spdlog::warn("fault injection: exiting at {}", where);
      std::_Exit(3);
    }
  }

  void start_secagg(const wire::Task& task, const Weights& base) {
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

  void on_secagg(const wire::SecAgg& m) {
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

  // Trains, quantises the weighted update into the ring, masks it and sends it.
  void masked_update() {
    const wire::SecAggSetup& a = *sa->task.secagg;
    const uint64_t r = sa->task.round;
    Trained t = train(sa->task, sa->base, sa->prepared);
    std::vector<uint32_t> x(static_cast<size_t>(total_numel));
    const double scale = secagg::ring_scale(a.clients, a.clip);
    const uint64_t key = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();  // rounding: this device's own
    size_t off = 0, clipped = 0;
    for (const auto& name : names) {
      const at::Tensor d = t.outgoing.at(name).to(at::kCPU, at::kFloat).contiguous();
      const size_t len = static_cast<size_t>(d.numel());
      clipped +=
          secagg::quantise(d.data_ptr<float>(), len, a.weight, a.clip, scale, rng::derive(key, off), x.data() + off);
      off += len;
    }
    if (clipped)
      spdlog::warn("round {}: secure aggregation clipped {} of {} coordinates to +-{}", r, clipped, x.size(), a.clip);
    std::vector<std::pair<std::string, double>> metrics = t.metrics;
    metrics.emplace_back("secagg_clipped", static_cast<double>(clipped));
    commit_and_send(r, t, wire::serialize(message(sa->party->masked(std::move(x), std::move(metrics)))));
  }
};

ClientSession::ClientSession(SessionConfig cfg, core::Dataset data)
    : impl_(std::make_unique<Impl>(*this, std::move(cfg), std::move(data))) {}

ClientSession::ClientSession(SessionConfig cfg, TaskRunner runner)
    : impl_(std::make_unique<Impl>(*this, std::move(cfg), core::Dataset{}, std::move(runner))) {
  SPARROW_CHECK_T(ConfigError, impl_->runner.run != nullptr, "task runner: no run function");
}

ClientSession::~ClientSession() = default;

bool ClientSession::run() { return impl_->run(); }

ClientSession::Counters ClientSession::counters() const {
  const auto& n = impl_->n;
  Counters c;
  c.hellos = n.hellos.load();
  c.welcomes = n.welcomes.load();
  c.tasks_done = n.tasks_done.load();
  c.tasks_refused = n.tasks_refused.load();
  c.updates_acked = n.updates_acked.load();
  c.updates_rejected = n.updates_rejected.load();
  c.reconnects = n.reconnects.load();
  c.heartbeats = n.heartbeats.load();
  c.errors_received = n.errors_received.load();
  return c;
}

uint64_t ClientSession::digest() const { return impl_->digest; }
uint64_t ClientSession::num_samples() const {
  if (impl_->runner.run) return impl_->runner.samples ? impl_->runner.samples() : 1;
  return static_cast<uint64_t>(impl_->data.size());
}

}  // namespace sparrow::client
