// Server::Impl's I/O: the listener (bind), the I/O thread that alone uses it
// (receive, the outbox, handshake failure logs), the worker pool's loop (the
// parse of large frames) and the replies any thread queues.
#include <spdlog/spdlog.h>

#include <chrono>
#include <set>
#include <thread>

#include "core/error.h"
#include "core/peer_text.h"
#include "server/impl.h"
#include "wire/net.h"

namespace sparrow::server {
namespace {
// Frames up to this size are parsed on the I/O thread (control messages);
// larger ones are parsed by the pool so the I/O thread keeps serving.
constexpr size_t kInlineParseBytes = size_t{64} << 10;
constexpr auto kPollInterval = std::chrono::milliseconds(2);
}  // namespace

void Server::Impl::bind() {
  transport::ListenOptions o;
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
    o.public_key = keys.public_key;
    o.secret_key = keys.secret_key;
    o.allowed = std::move(allowed);
    o.on_auth = [this](const std::string& key, const std::string& addr, bool ok) {
      if (ok) {
        spdlog::debug("event=zap key={} address={} admitted=1", key, core::printable(addr));
        return;
      }
      if (const auto line = refused_log.note(addr, key)) log_refused(*line);
    };
  }
  o.max_message_bytes = cfg.max_message_bytes();
  o.heartbeat_ms = cfg.heartbeat_ms;
  net::check_endpoint("listen", cfg.listen, /*for_bind=*/true);
  try {
    listener = transport::listen(cfg.listen, o);
  } catch (const ConfigError& e) {
    throw ConfigError(std::string("listen: ") + e.what());
  }
  endpoint = listener->endpoint();
}

void Server::Impl::send_bytes(const std::string& routing_id, std::string bytes) {
  std::lock_guard<std::mutex> g(out_mu);
  if (outbox.empty()) listener->wake();
  outbox.emplace_back(routing_id, std::move(bytes));
}

void Server::Impl::reply(const std::string& routing_id, const wire::Message& m) {
  send_bytes(routing_id, wire::serialize(m));
}

void Server::Impl::wait_outbox_drained(std::chrono::milliseconds limit) {
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

void Server::Impl::reply_error(const std::string& routing_id, ErrorCode code, const std::string& text,
                               std::optional<uint64_t> r) {
  n.rejected[static_cast<size_t>(code) & 7]++;
  const wire::Message m = net::error_message(code, text, r);
  if (std::get<wire::ErrorBody>(m.body).message.size() != text.size())
    spdlog::info("event=error_detail code={} detail=\"{}\"", wire::error_code_name(code), core::printable(text));
  reply(routing_id, m);
}

void Server::Impl::flush_outbox() {
  std::deque<std::pair<std::string, std::string>> out;
  {
    std::lock_guard<std::mutex> g(out_mu);
    out.swap(outbox);
  }
  for (auto& [id, bytes] : out) {
    bool ok = false;
    try {
      ok = listener->send(id, bytes) == transport::SendResult::kSent;  // else the peer is gone or its queue full
    } catch (const transport::TransportError& e) {
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

void Server::Impl::io_loop() {
  const size_t max_jobs = static_cast<size_t>(cfg.workers) * 4;
  while (!io_stop.load()) {
    size_t queued;
    {
      std::lock_guard<std::mutex> g(job_mu);
      queued = jobs.size();
    }
    // Back-pressure: a full job queue stops reading (the transport queues,
    // then TCP flow control), never drops or rejects updates.
    const bool can_read = queued < max_jobs;
    try {
      if (listener->poll(kPollInterval, can_read))
        for (int i = 0; i < 256; ++i)
          if (!receive_one()) break;
    } catch (const transport::TransportError& e) {
      spdlog::error("event=io_error error=\"{}\"", e.what());
    }
    flush_outbox();
    log_handshake_failures();
  }
  flush_outbox();
  for (const auto& l : refused_log.drain()) log_refused(l);  // the counts not written yet
}

void Server::Impl::log_refused(const core::RefusalLog::Line& l) { spdlog::warn("{}", core::RefusalLog::text(l)); }

void Server::Impl::log_handshake_failures() {
  if (cfg.insecure) return;
  for (const auto& l : refused_log.due()) log_refused(l);
  using Kind = transport::HandshakeEvent::Kind;
  for (const auto& e : listener->handshake_events()) {
    if (e.kind != Kind::kMismatch && e.kind != Kind::kFailed) continue;
    const char* what = e.kind == Kind::kMismatch
                           ? "plain TCP peer on a CURVE server (client without keys?)"
                           : "handshake failed or closed early (a client with a wrong server_key, a peer "
                             "without CURVE, or a port probe)";
    // The address reported is the listening endpoint: one key per kind.
    if (const auto n = mismatch_log.admit(what))
      spdlog::warn("event=handshake_failed endpoint={} failures_since_last_warning={} msg=\"{}\"", e.address, *n, what);
  }
}

bool Server::Impl::receive_one() {
  std::optional<transport::Inbound> in = listener->receive();
  if (!in) return false;
  std::string& routing_id = in->peer;
  transport::Frame& frame = in->frame;
  n.messages_in++;
  n.bytes_in += frame.size();
  if (in->extra_frames) {
    reply_error(routing_id, ErrorCode::kMalformed, "one frame per message expected");
    return true;
  }
  Job job;
  job.routing_id = std::move(routing_id);
  job.key = std::move(in->key);
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

void Server::Impl::worker_loop(size_t w) {
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
          job.parsed = wire::parse(job.frame.data(), job.frame.size(), limits, job.frame.owner());
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

}  // namespace sparrow::server
