// Session (session.h) over Session::Impl (session_impl.h): construction, the
// loop (connect, Hello, serve, reconnect after a backoff), the dispatch of
// the server's messages and the connection (transport/client_link.h, as
// sparrow-client's). The same behaviour as client/session.cc.
#include "liteclient/session.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "core/error.h"
#include "core/peer_text.h"
#include "liteclient/session_impl.h"

namespace sparrow::liteclient {
namespace {
constexpr int kPollSliceMs = 100;  // stop() is noticed within this
}  // namespace

Session::Impl::Impl(Session& s, Config c, std::unique_ptr<SessionTrainer> t)
    : self(s), cfg(std::move(c)), trainer(std::move(t)), layout(trainer->layout()) {
  SPARROW_CHECK_T(ConfigError, core::valid_client_id(cfg.client_id),
                  "client_id: " << core::client_id_problem(cfg.client_id));
  // heartbeat_ms, max_message_mb, backoff_*, the key files: the link's.
  link = transport::ClientLink(transport::client_link_options(cfg));
  SPARROW_CHECK_T(ConfigError, trainer->num_samples() >= 1, "data: no samples");
  max_bytes = cfg.max_message_mb << 20;
  hb_ms = cfg.heartbeat_ms;
  digest = model_digest(layout);
  ldp = parse_local_dp(cfg.dp);
  open_state();
}

bool Session::Impl::run() {
  while (!self.stop_.load()) {
    open_connection();
    const Outcome o = serve();
    if (o == Outcome::kFinished) {
      link.close();
      spdlog::info("the server finished the run");
      return true;
    }
    if (self.stop_.load()) break;
    link.close();
    ++n.reconnects;
    link.backoff(n.reconnects.load(), self.stop_);
  }
  if (link.is_open()) {
    send(message(wire::Bye{"client stopping"}));
    link.close();
  }
  spdlog::info("stopped");
  return false;
}

Session::Impl::Outcome Session::Impl::serve() {
  last_rx = Clock::now();
  if (!send_hello()) return Outcome::kReconnect;
  while (!self.stop_.load()) {
    link.check_handshakes(hb_ms);
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
    std::optional<transport::Frame> frame = link.connection().receive(std::chrono::milliseconds(timeout));
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
  if (auto* w = std::get_if<wire::Welcome>(&m.body)) {
    server_minor = m.minor;
    return on_welcome(*w);
  }
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
  link.welcomed();
  welcome = w;
  welcomed = true;
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
  link.open();
  welcomed = false;
  pending_round.reset();
}

bool Session::Impl::send(const wire::Message& m) { return link.send(wire::serialize(m)); }

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
