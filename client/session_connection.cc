// ClientSession::Impl's connection to the server (transport/transport.h):
// opening and closing it, reading its handshake events (a refused key, a wrong
// server_key, plain TCP against CURVE) and giving up after give_up_s of them,
// sends that never block, Hello, and the jittered backoff before a reconnect.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "client/session_impl.h"
#include "core/error.h"
#include "core/rng.h"

namespace sparrow::client {
namespace {
constexpr uint64_t kBackoffTag = 0x626b6f66;  // "bkof"
}  // namespace

void ClientSession::Impl::open_connection() {
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

void ClientSession::Impl::close_connection() { conn.reset(); }

void ClientSession::Impl::clear_failures() {
  failing_since.reset();
  last_failure.reset();
  failures = 0;
  decisive = false;
  failure_cause.clear();
  failure_rank = 0;
}

void ClientSession::Impl::check_handshakes() {
  if (!conn) return;
  using Kind = transport::HandshakeEvent::Kind;
  for (const auto& e : conn->handshake_events()) {
    if (e.kind == Kind::kConnected) {
      handshake_ok = false;
    } else if (e.kind == Kind::kSucceeded) {
      handshake_ok = true;
      clear_failures();
    } else if (e.kind == Kind::kRefused || e.kind == Kind::kMismatch || e.kind == Kind::kFailed ||
               (e.kind == Kind::kDisconnected && !handshake_ok)) {
      const std::string cause = transport::client_cause(e, !cfg.insecure);
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

bool ClientSession::Impl::send(const wire::Message& m) { return send_bytes(wire::serialize(m)); }

bool ClientSession::Impl::send_bytes(const std::string& bytes) {
  try {
    return conn->send(bytes) == transport::SendResult::kSent;
  } catch (const transport::TransportError& e) {
    spdlog::warn("send failed: {}", e.what());
    return false;
  }
}

bool ClientSession::Impl::send_hello() {
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

wire::ParseLimits ClientSession::Impl::limits() const {
  wire::ParseLimits l;
  l.max_bytes = max_bytes;
  l.max_elements = 3 * static_cast<uint64_t>(total_numel) + (uint64_t{1} << 20);
  return l;
}

void ClientSession::Impl::backoff() {
  const double base = std::min<double>(cfg.backoff_max_ms,
                                       cfg.backoff_initial_ms * std::pow(2.0, std::min<uint64_t>(backoff_attempt, 30)));
  const uint64_t key = rng::derive(rng::hash_name(cfg.client_id), kBackoffTag);
  const double ms = base * (0.5 + 0.5 * rng::uniform01(key, n.reconnects.load()));
  ++backoff_attempt;
  spdlog::info("reconnecting in {:.0f} ms", ms);
  const auto until = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
  while (!self.stop_.load() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

}  // namespace sparrow::client
