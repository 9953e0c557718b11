#pragma once
// The config keys of a client's connection to the server, written once for
// sparrow-client (client::SessionConfig, client/session_config.cc) and
// sparrow-client-lite (liteclient::Config, liteclient/config.cc): both structs
// have these fields, so the two programs bind them in the same order (the
// known-key list of an unknown-key error) and refuse a bad value with the same
// message (docs/client.md's key table). Each program binds and checks the rest
// (model, data, state) itself, between the two halves.

#include <cmath>

#include "core/error.h"
#include "core/flat_config.h"
#include "core/peer_text.h"
#include "wire/net.h"

namespace sparrow::net {

// The keys bound before the program's own: the server and the keys of CURVE.
template <class C>
void bind_client_head_keys(core::FlatConfig& f, C& c) {
  f.bind("server", &c.server);
  f.bind("server_key", &c.server_key);
  f.bind("key", &c.key);
  f.bind("insecure", &c.insecure);
  f.bind("client_id", &c.client_id);
}

// The keys bound after the program's own: timing, limits, device and privacy.
template <class C>
void bind_client_tail_keys(core::FlatConfig& f, C& c) {
  f.bind("heartbeat_ms", &c.heartbeat_ms);
  f.bind("max_message_mb", &c.max_message_mb);
  f.bind("device", &c.device);
  f.bind("backoff_initial_ms", &c.backoff_initial_ms);
  f.bind("backoff_max_ms", &c.backoff_max_ms);
  f.bind("give_up_s", &c.give_up_s);
  f.bind("holdout", &c.holdout);
  f.bind("dp", &c.dp);
}

// `server` (an endpoint to connect to) and `client_id`, checked first. The
// server refuses other ids at Hello (docs/security.md): said here, before any
// connection.
template <class C>
void check_client_server_keys(const core::FlatConfig& f, const C& c) {
  f.check("server", !c.server.empty(), "must not be empty");
  try {
    check_endpoint("server", c.server, /*for_bind=*/false);
  } catch (const ConfigError& e) {
    f.fail("server", e.what());
  }
  f.check("client_id", core::valid_client_id(c.client_id), core::client_id_problem(c.client_id));
}

// The ranges of docs/client.md's key table. ZeroMQ keeps the heartbeat TTL
// (3 x heartbeat_ms) in deciseconds below 2^16.
template <class C>
void check_client_ranges(const core::FlatConfig& f, const C& c) {
  f.check("heartbeat_ms", c.heartbeat_ms >= 10 && c.heartbeat_ms <= 600000, "must be in [10, 600000]");
  f.check("max_message_mb", c.max_message_mb >= 1 && c.max_message_mb <= 2047, "must be in [1, 2047]");
  f.check("backoff_initial_ms", c.backoff_initial_ms >= 1 && c.backoff_initial_ms <= 600000, "must be in [1, 600000]");
  f.check("backoff_max_ms", c.backoff_max_ms >= c.backoff_initial_ms && c.backoff_max_ms <= 3600000,
          "must be in [backoff_initial_ms, 3600000]");
  f.check("give_up_s", std::isfinite(c.give_up_s) && c.give_up_s >= 0 && c.give_up_s <= 1e7,
          "must be in [0, 1e7] (0 = never give up)");
}

// `server_key` and `key` unless insecure; with insecure = true in the file,
// neither may be set there. --insecure (or --set) on a secure file is the
// documented way to try it without CURVE, so that combination passes.
template <class C>
void check_client_key_files(const core::FlatConfig& f, const C& c) {
  if (!c.insecure) {
    f.check("server_key", !c.server_key.empty(), "must name the server's public key file (or set insecure = true)");
    f.check("key", !c.key.empty(), "must name this client's .key_secret file (or set insecure = true)");
  } else if (f.where("insecure") != "--set") {
    for (const char* k : {"server_key", "key"})
      f.check(k, !f.has(k), "has no effect with insecure = true (plain TCP, no CURVE keys)");
  }
}

}  // namespace sparrow::net
