// ClientSession::Impl's connection to the server: a new connection, sends,
// Hello and the parse limits. Handshake failures, giving up and the backoff
// are the link's (transport/client_link.h, shared with sparrow-client-lite).
#include <spdlog/spdlog.h>

#include <algorithm>

#include "client/session_impl.h"
#include "core/error.h"

namespace sparrow::client {

void ClientSession::Impl::open_connection() {
  link.open();
  welcomed = false;
  pending_round.reset();
}

bool ClientSession::Impl::send(const wire::Message& m) { return link.send(wire::serialize(m)); }

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

}  // namespace sparrow::client
