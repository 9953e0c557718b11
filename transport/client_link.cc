#include "transport/client_link.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "core/error.h"
#include "core/rng.h"
#include "wire/net.h"

namespace sparrow::transport {
namespace {
using Clock = std::chrono::steady_clock;
constexpr uint64_t kBackoffTag = 0x626b6f66;  // "bkof"
}  // namespace

ClientLink::ClientLink(ClientLinkOptions o) : o_(std::move(o)) {
  SPARROW_CHECK_T(ConfigError, o_.heartbeat_ms >= 10, "heartbeat_ms: must be >= 10");
  SPARROW_CHECK_T(ConfigError, o_.max_message_mb >= 1 && o_.max_message_mb <= 2047,
                  "max_message_mb: must be in [1, 2047]");
  SPARROW_CHECK_T(ConfigError, o_.backoff_initial_ms >= 1 && o_.backoff_max_ms >= o_.backoff_initial_ms,
                  "backoff_initial_ms/backoff_max_ms: need 1 <= initial <= max");
  if (o_.insecure) {
    spdlog::warn("insecure = true: plain TCP, no authentication or encryption");
  } else {
    const net::KeyPair own = net::load_keypair(o_.key);
    connect_.public_key = own.public_key;
    connect_.secret_key = own.secret_key;
    connect_.server_key = net::load_public_key(o_.server_key);
  }
  connect_.max_message_bytes = o_.max_message_mb << 20;
  connect_.heartbeat_ms = static_cast<int>(o_.heartbeat_ms);
}

void ClientLink::open() {
  handshake_ok_ = false;
  conn_ = connect(o_.server, connect_);
}

bool ClientLink::send(const std::string& bytes) {
  try {
    return conn_->send(bytes) == SendResult::kSent;
  } catch (const TransportError& e) {
    spdlog::warn("send failed: {}", e.what());
    return false;
  }
}

void ClientLink::clear_failures() {
  failing_since_.reset();
  last_failure_.reset();
  failures_ = 0;
  decisive_ = false;
  failure_cause_.clear();
  failure_rank_ = 0;
}

void ClientLink::welcomed() {
  clear_failures();
  backoff_attempt_ = 0;
}

void ClientLink::check_handshakes(uint32_t heartbeat_ms) {
  if (!conn_) return;
  using Kind = HandshakeEvent::Kind;
  for (const auto& e : conn_->handshake_events()) {
    if (e.kind == Kind::kConnected) {
      handshake_ok_ = false;
    } else if (e.kind == Kind::kSucceeded) {
      handshake_ok_ = true;
      clear_failures();
    } else if (e.kind == Kind::kRefused || e.kind == Kind::kMismatch || e.kind == Kind::kFailed ||
               (e.kind == Kind::kDisconnected && !handshake_ok_)) {
      const std::string cause = client_cause(e, !o_.insecure);
      // A refusal or a mismatch says more than a handshake that just fails,
      // which says more than the disconnect that follows it: a vaguer event
      // (the reconnect's handshake can fail either way) never replaces a
      // more specific cause already seen.
      const int rank = e.kind == Kind::kRefused || e.kind == Kind::kMismatch ? 2 : e.kind == Kind::kFailed ? 1 : 0;
      if (failure_cause_.empty() || rank >= failure_rank_) {
        if (cause != failure_cause_) spdlog::warn("event=handshake_failed server={} msg=\"{}\"", o_.server, cause);
        failure_cause_ = cause;
        failure_rank_ = rank;
      }
      const auto now = Clock::now();
      if (!failing_since_) failing_since_ = now;
      last_failure_ = now;
      ++failures_;
      decisive_ = decisive_ || e.kind == Kind::kRefused || e.kind == Kind::kMismatch;
    }
  }
  const auto now = Clock::now();
  // Failures that stopped (the server went away: "connection refused" makes
  // no handshake events) are not a handshake problem: forget them. The
  // window covers the longest reconnect backoff and a silence timeout.
  const auto stale = std::chrono::milliseconds(static_cast<int64_t>(o_.backoff_max_ms) + 3 * heartbeat_ms + 5000);
  if (last_failure_ && now - *last_failure_ > stale) clear_failures();
  if (failing_since_ && o_.give_up_s > 0 && (decisive_ || failures_ >= 3) &&
      now - *failing_since_ >= std::chrono::duration<double>(o_.give_up_s))
    throw Error("gave up after " + std::to_string(static_cast<int64_t>(o_.give_up_s)) +
                " s of failed handshakes with " + o_.server + ": " + failure_cause_);
}

void ClientLink::backoff(uint64_t reconnects, const std::atomic<bool>& stop) {
  const double base = std::min<double>(o_.backoff_max_ms,
                                       o_.backoff_initial_ms * std::pow(2.0, std::min<uint64_t>(backoff_attempt_, 30)));
  const uint64_t key = rng::derive(rng::hash_name(o_.client_id), kBackoffTag);
  const double ms = base * (0.5 + 0.5 * rng::uniform01(key, reconnects));
  ++backoff_attempt_;
  spdlog::info("reconnecting in {:.0f} ms", ms);
  const auto until = Clock::now() + std::chrono::microseconds(static_cast<int64_t>(ms * 1000));
  while (!stop.load() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

}  // namespace sparrow::transport
