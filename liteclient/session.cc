// Session (session.h) over Session::Impl (session_impl.h): construction, the
// loop (connect, Hello, serve, reconnect after a backoff), the dispatch of
// the server's messages and the connection. The same behaviour as
// sparrow-client's (client/session.cc, client/session_connection.cc).
#include "liteclient/session.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "core/error.h"
#include "core/peer_text.h"
#include "core/rng.h"
#include "liteclient/session_impl.h"

namespace sparrow::liteclient {
namespace {
constexpr int kPollSliceMs = 100;             // stop() is noticed within this
constexpr uint64_t kBackoffTag = 0x626b6f66;  // "bkof", as sparrow-client
}  // namespace

Session::Impl::Impl(Session& s, Config c, std::unique_ptr<SessionTrainer> t)
    : self(s), cfg(std::move(c)), trainer(std::move(t)), layout(trainer->layout()) {
  SPARROW_CHECK_T(ConfigError, core::valid_client_id(cfg.client_id),
                  "client_id: " << core::client_id_problem(cfg.client_id));
  SPARROW_CHECK_T(ConfigError, cfg.heartbeat_ms >= 10, "heartbeat_ms: must be >= 10");
  SPARROW_CHECK_T(ConfigError, cfg.max_message_mb >= 1 && cfg.max_message_mb <= 2047,
                  "max_message_mb: must be in [1, 2047]");
  SPARROW_CHECK_T(ConfigError, cfg.backoff_initial_ms >= 1 && cfg.backoff_max_ms >= cfg.backoff_initial_ms,
                  "backoff_initial_ms/backoff_max_ms: need 1 <= initial <= max");
  SPARROW_CHECK_T(ConfigError, trainer->num_samples() >= 1, "data: no samples");
  max_bytes = cfg.max_message_mb << 20;
  hb_ms = cfg.heartbeat_ms;
  digest = model_digest(layout);
  ldp = parse_local_dp(cfg.dp);
  if (cfg.insecure) {
    spdlog::warn("insecure = true: plain TCP, no authentication or encryption");
  } else {
    own_keys = net::load_keypair(cfg.key);
    server_key = net::load_public_key(cfg.server_key);
  }
  open_state();
}

bool Session::Impl::run() {
  while (!self.stop_.load()) {
    open_connection();
    const Outcome o = serve();
    if (o == Outcome::kFinished) {
      conn.reset();
      spdlog::info("the server finished the run");
      return true;
    }
    if (self.stop_.load()) break;
    conn.reset();
    ++n.reconnects;
    backoff();
  }
  if (conn) {
    send(message(wire::Bye{"client stopping"}));
    conn.reset();
  }
  spdlog::info("stopped");
  return false;
}

Session::Impl::Outcome Session::Impl::serve() {
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
      if (!send(message(wire::Heartbeat{known_round, 0}))) return Outcome::kReconnect;
      next_hb = now + std::chrono::milliseconds(hb_ms);
    }
    auto wake = std::min(silence, now + std::chrono::milliseconds(kPollSliceMs));
    if (welcomed) wake = std::min(wake, next_hb);
    const int timeout = static_cast<int>(
        std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count()));
    std::optional<transport::Frame> frame = conn->receive(std::chrono::milliseconds(timeout));
    if (!frame) continue;
    std::optional<wire::Message> msg;
    try {
      // The message's tensors are views into the frame (no copy of a whole
      // model), which they keep alive for as long as they live; on_task()
      // drops the broadcast weights once decoded, so the frame goes with them.
      msg = wire::parse(frame->data(), frame->size(), limits(), frame->owner());
      frame.reset();
    } catch (const wire::ProtocolError& e) {
      frame.reset();
      last_rx = Clock::now();
      spdlog::warn("bad frame from the server: {}", e.what());
      wire::Message reply;
      reply.body = wire::error_for(e);
      send(reply);
      continue;
    }
    last_rx = Clock::now();
    const Outcome o = handle(*msg);
    if (o != Outcome::kContinue) return o;
  }
  return Outcome::kContinue;
}

Session::Impl::Outcome Session::Impl::handle(wire::Message& m) {
  if (auto* w = std::get_if<wire::Welcome>(&m.body)) return on_welcome(*w);
  if (auto* e = std::get_if<wire::ErrorBody>(&m.body)) return on_error(*e);
  if (auto* t = std::get_if<wire::Task>(&m.body)) {
    if (!welcomed) {
      spdlog::warn("task for round {} before Welcome: ignored", t->round);
      return Outcome::kContinue;
    }
    on_task(*t);
    last_rx = Clock::now();  // training took a while without listening
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
    last_rx = Clock::now();
    next_hb = last_rx + std::chrono::milliseconds(hb_ms);
    return Outcome::kContinue;
  }
  if (auto* a = std::get_if<wire::Ack>(&m.body)) {
    if (pending_round && *pending_round == a->round) {
      ++n.updates_acked;
      pending_round.reset();
      answered(a->round);
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

Session::Impl::Outcome Session::Impl::on_welcome(const wire::Welcome& w) {
  ++n.welcomes;
  failing_since.reset();
  last_failure.reset();
  failures = 0;
  decisive = false;
  failure_cause.clear();
  failure_rank = 0;
  welcome = w;
  welcomed = true;
  backoff_attempt = 0;
  if (w.heartbeat_ms > 0) hb_ms = std::max<uint32_t>(10, w.heartbeat_ms);
  known_round = w.round;
  next_hb = Clock::now() + std::chrono::milliseconds(hb_ms);
  spdlog::info("welcome: run '{}', round {}, heartbeat {} ms", core::printable(w.run_id), w.round, hb_ms);
  if (!st.run_id.empty() && st.run_id != w.run_id) {
    // Our state belongs to another run: drop it, and say we hold nothing.
    spdlog::warn("state: held state is from run '{}', the server runs '{}': starting afresh",
                 core::printable(st.run_id), core::printable(w.run_id));
    reset_state(w.run_id);
    if (!send_hello()) return Outcome::kReconnect;
    return Outcome::kContinue;
  }
  if (st.run_id.empty()) {
    st.run_id = w.run_id;
    save();
  }
  return Outcome::kContinue;
}

Session::Impl::Outcome Session::Impl::on_error(const wire::ErrorBody& e) {
  ++n.errors_received;
  if (e.message.rfind("unknown client", 0) == 0) {
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
    answered(*pending_round);
    pending_round.reset();
  } else {
    spdlog::warn("server error ({}): {}", wire::error_code_name(e.code), core::printable(e.message));
  }
  return Outcome::kContinue;
}

void Session::Impl::open_connection() {
  transport::ConnectOptions o;
  if (!cfg.insecure) {
    o.public_key = own_keys.public_key;
    o.secret_key = own_keys.secret_key;
    o.server_key = server_key;
  }
  o.max_message_bytes = max_bytes;
  o.heartbeat_ms = static_cast<int>(cfg.heartbeat_ms);
  handshake_ok = false;
  conn = transport::connect(cfg.server, o);
  welcomed = false;
  pending_round.reset();
}

void Session::Impl::check_handshakes() {
  if (!conn) return;
  using Kind = transport::HandshakeEvent::Kind;
  for (const auto& e : conn->handshake_events()) {
    if (e.kind == Kind::kConnected) {
      handshake_ok = false;
    } else if (e.kind == Kind::kSucceeded) {
      handshake_ok = true;
      failing_since.reset();
      last_failure.reset();
      failures = 0;
      decisive = false;
      failure_cause.clear();
      failure_rank = 0;
    } else if (e.kind == Kind::kRefused || e.kind == Kind::kMismatch || e.kind == Kind::kFailed ||
               (e.kind == Kind::kDisconnected && !handshake_ok)) {
      const std::string cause = transport::client_cause(e, !cfg.insecure);
      // A more specific cause already seen is never replaced by a vaguer one.
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
  const auto stale = std::chrono::milliseconds(static_cast<int64_t>(cfg.backoff_max_ms) + 3 * hb_ms + 5000);
  if (last_failure && now - *last_failure > stale) {
    failing_since.reset();
    last_failure.reset();
    failures = 0;
    decisive = false;
    failure_cause.clear();
    failure_rank = 0;
  }
  if (failing_since && cfg.give_up_s > 0 && (decisive || failures >= 3) &&
      now - *failing_since >= std::chrono::duration<double>(cfg.give_up_s))
    throw Error("gave up after " + std::to_string(static_cast<int64_t>(cfg.give_up_s)) +
                " s of failed handshakes with " + cfg.server + ": " + failure_cause);
}

bool Session::Impl::send(const wire::Message& m) { return send_bytes(wire::serialize(m)); }

bool Session::Impl::send_bytes(const std::string& bytes) {
  try {
    return conn->send(bytes) == transport::SendResult::kSent;
  } catch (const transport::TransportError& e) {
    spdlog::warn("send failed: {}", e.what());
    return false;
  }
}

bool Session::Impl::send_hello() {
  wire::Hello h;
  h.client_id = cfg.client_id;
  h.num_samples = trainer->num_samples();
  h.model = cfg.model;
  h.model_digest = digest;
  // Absent when we hold no model: the server then sends it whole (we cannot
  // build its seed-made initial model without LibTorch).
  if (st.holds_model) h.last_round = st.held_round;
  h.software = kSoftware;
  welcomed = false;
  ++n.hellos;
  spdlog::info("hello: client '{}' at {}, {} samples, last_round {}", cfg.client_id, cfg.server, h.num_samples,
               h.last_round ? std::to_string(*h.last_round) : "none");
  return send(message(h));
}

wire::ParseLimits Session::Impl::limits() const {
  wire::ParseLimits l;
  l.max_bytes = max_bytes;
  l.max_elements = 3 * static_cast<uint64_t>(layout.total) + (uint64_t{1} << 20);
  return l;
}

void Session::Impl::backoff() {
  const double base = std::min<double>(cfg.backoff_max_ms,
                                       cfg.backoff_initial_ms * std::pow(2.0, std::min<uint64_t>(backoff_attempt, 30)));
  const uint64_t key = rng::derive(rng::hash_name(cfg.client_id), kBackoffTag);
  const double ms = base * (0.5 + 0.5 * rng::uniform01(key, n.reconnects.load()));
  ++backoff_attempt;
  spdlog::info("reconnecting in {:.0f} ms", ms);
  const auto until = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
  while (!self.stop_.load() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

Session::Session(Config cfg, std::unique_ptr<SessionTrainer> trainer)
    : impl_(std::make_unique<Impl>(*this, std::move(cfg), std::move(trainer))) {}

Session::~Session() = default;

bool Session::run() { return impl_->run(); }

Session::Counters Session::counters() const {
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

uint64_t Session::digest() const { return impl_->digest; }

}  // namespace sparrow::liteclient
