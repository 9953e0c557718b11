// The public ClientSession (client/session.h) over ClientSession::Impl
// (client/session_impl.h): construction (the config as the loader checks it,
// the model replica, the data and its holdout, the keys, the state database),
// the loop (connect, Hello, serve, reconnect after a backoff) and the dispatch
// of the server's messages.
#include "client/session.h"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "client/data_folder.h"
#include "client/session_impl.h"
#include "core/error.h"
#include "core/model_digest.h"
#include "core/peer_text.h"
#include "core/rng.h"

namespace sparrow::client {
namespace {
constexpr uint64_t kHoldoutTag = 0x686f6c64;  // "hold"
constexpr int kPollSliceMs = 100;             // stop() is noticed within this
}  // namespace

ClientSession::Impl::Impl(ClientSession& s, SessionConfig c, core::Dataset d, TaskRunner run)
    : self(s), cfg(std::move(c)), runner(std::move(run)) {
  // Validate the config as the loader would (a SessionConfig built in code skips it).
  SPARROW_CHECK_T(ConfigError, core::valid_client_id(cfg.client_id),
                  "client_id: " << core::client_id_problem(cfg.client_id));
  // heartbeat_ms, max_message_mb, backoff_*: the link's (checked before any work).
  link = transport::ClientLink(transport::client_link_options(cfg));
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

  open_state();
}

void ClientSession::Impl::split_holdout() {
  const int64_t n = data.size();
  const auto k = static_cast<int64_t>(std::llround(cfg.holdout * static_cast<double>(n)));
  SPARROW_CHECK_T(ConfigError, k >= 1 && k < n,
                  "holdout: " << cfg.holdout << " of " << n << " samples holds out " << k
                              << "; need at least 1 to evaluate on and 1 to train on");
  holdout = core::hold_out(data, k, rng::derive(rng::hash_name(cfg.client_id), kHoldoutTag));
  spdlog::info("event=holdout samples={} train_samples={}", k, n - k);
}

bool ClientSession::Impl::run() {
  while (!self.stop_.load()) {
    open_connection();
    const Outcome o = serve();
    if (o == Outcome::kFinished) {
      link.close();
      store->flush();
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
  store->flush();
  spdlog::info("stopped");
  return false;
}

ClientSession::Impl::Outcome ClientSession::Impl::serve() {
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
    std::optional<transport::Frame> frame = link.connection().receive(std::chrono::milliseconds(timeout));
    if (!frame) continue;
    std::optional<wire::Message> msg;
    try {
      msg = wire::parse(frame->data(), frame->size(), limits());
    } catch (const wire::ProtocolError& e) {
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

ClientSession::Impl::Outcome ClientSession::Impl::handle(wire::Message& m) {
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

ClientSession::Impl::Outcome ClientSession::Impl::on_welcome(const wire::Welcome& w) {
  ++n.welcomes;
  link.welcomed();
  welcome = w;
  welcomed = true;
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

ClientSession::Impl::Outcome ClientSession::Impl::on_error(const wire::ErrorBody& e) {
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
    answered(*pending_round);
    pending_round.reset();
  } else {
    spdlog::warn("server error ({}): {}", wire::error_code_name(e.code), core::printable(e.message));
  }
  return Outcome::kContinue;
}

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
