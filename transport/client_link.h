#pragma once
// A client's link to the server, across reconnects, written once for
// sparrow-client (client/session*.cc) and sparrow-client-lite
// (liteclient/session.cc): opening the connection with the client's keys,
// sends that never block, reading the handshake events (a refused key, a wrong
// server_key, plain TCP against CURVE) and giving up after give_up_s of them,
// and the jittered exponential backoff before a reconnect.
//
// Threads: one (the session's run() thread); `stop` in backoff() may be set
// from any thread.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "transport/transport.h"

namespace sparrow::transport {

struct ClientLinkOptions {
  std::string server;             // endpoint to connect to
  std::string client_id;          // seeds the backoff's jitter (clients reconnect at different times)
  bool insecure = false;          // plain TCP: no key files are read
  std::string key;                // this client's .key_secret file
  std::string server_key;         // the server's public key file
  uint64_t max_message_mb = 256;  // largest frame sent or accepted
  uint32_t heartbeat_ms = 1000;   // the connection's heartbeat (ZeroMQ's TTL is 3x)
  uint32_t backoff_initial_ms = 200, backoff_max_ms = 30000;
  double give_up_s = 60;  // failing handshakes for this long end the session (0: never)
};

// The options from a client config (client::SessionConfig, liteclient::Config:
// both have these fields).
template <class C>
ClientLinkOptions client_link_options(const C& c) {
  ClientLinkOptions o;
  o.server = c.server;
  o.client_id = c.client_id;
  o.insecure = c.insecure;
  o.key = c.key;
  o.server_key = c.server_key;
  o.max_message_mb = c.max_message_mb;
  o.heartbeat_ms = c.heartbeat_ms;
  o.backoff_initial_ms = c.backoff_initial_ms;
  o.backoff_max_ms = c.backoff_max_ms;
  o.give_up_s = c.give_up_s;
  return o;
}

class ClientLink {
 public:
  ClientLink() = default;
  // ConfigError for a heartbeat, message limit or backoff out of range (as the
  // config loaders check them; a config built in code skips those) or a key
  // file that cannot be read. Insecure: logs a warning. Opens nothing.
  explicit ClientLink(ClientLinkOptions o);

  // A new connection (the previous one closed): its handshake is still to come.
  void open();
  void close() { conn_.reset(); }
  bool is_open() const { return conn_ != nullptr; }
  // The open connection (is_open()).
  Connection& connection() { return *conn_; }
  // Queues `bytes`; false (never blocking) when the queue is full, there is
  // no peer, or the transport failed (logged).
  bool send(const std::string& bytes);

  // Reads the connection's handshake events: a handshake that fails again and
  // again has a cause the server cannot tell us in a message (it never gets
  // one from us). Failures that stopped are forgotten after the longest
  // backoff plus three heartbeats (`heartbeat_ms`: the server's, once
  // welcomed) plus 5 s. Throws Error after give_up_s of failures: a refused
  // key or a security mismatch counts at once, a handshake that just closes
  // from its third time.
  void check_handshakes(uint32_t heartbeat_ms);
  // The server took us (Welcome): no failures, and the next backoff is the first.
  void welcomed();

  // Waits before reconnect number `reconnects` (it seeds the jitter): the
  // backoff doubles from backoff_initial_ms up to backoff_max_ms per attempt
  // since the last welcomed(), times a jitter in [0.5, 1). Returns early once
  // `stop` is set.
  void backoff(uint64_t reconnects, const std::atomic<bool>& stop);

 private:
  void clear_failures();

  ClientLinkOptions o_;
  ConnectOptions connect_;
  std::unique_ptr<Connection> conn_;
  // Handshakes failing since (no success, no Welcome in between), and why.
  std::optional<std::chrono::steady_clock::time_point> failing_since_, last_failure_;
  int failures_ = 0;
  bool decisive_ = false;  // the server refused the key, or the security mechanisms differ
  std::string failure_cause_;
  int failure_rank_ = 0;       // how specific failure_cause_ is (see check_handshakes)
  bool handshake_ok_ = false;  // on the current connection
  uint64_t backoff_attempt_ = 0;
};

}  // namespace sparrow::transport
