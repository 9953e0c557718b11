#include "server/gateway.h"

#include <spdlog/spdlog.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <limits>

#include "client/session.h"
#include "compression/compressor.h"
#include "compression/mask.h"
#include "core/error.h"
#include "server/server.h"

namespace sparrow::server {
namespace {

std::atomic<client::ClientSession*> g_session{nullptr};
std::atomic<Server*> g_server{nullptr};

}  // namespace

bool run_gateway(Server& server, const ServerConfig& cfg) {
  SPARROW_CHECK_T(ConfigError, cfg.gateway(), "upstream: not set (this server is not a gateway)");
  client::SessionConfig sc;
  sc.server = cfg.upstream;
  sc.server_key = cfg.upstream_server_key;
  sc.key = cfg.upstream_key;
  sc.insecure = cfg.insecure;
  sc.client_id = cfg.upstream_id;
  sc.model = cfg.model;
  sc.state_db = cfg.upstream_state_db.empty() ? cfg.db + "-upstream" : cfg.upstream_state_db;
  sc.max_message_mb = static_cast<uint64_t>(std::ceil(cfg.max_message_mb));
  sc.heartbeat_ms = static_cast<uint32_t>(cfg.heartbeat_ms);
  sc.give_up_s = 0;  // an unreachable or restarting root is retried for as long as the gateway runs
  client::TaskRunner runner;
  runner.samples = [&server] { return server.live_samples(); };
  // A failure of the server itself (its database, ...) is fatal as in
  // Server::run(): kept here, the session stopped, rethrown below. A round
  // without quorum is only an Error for that round, sent to the root.
  std::exception_ptr fatal;
  // tcs on this gateway's clients: they encode against the root's mask, which
  // comes with each Task (the root must use tcs too).
  const bool own_tcs = compression::make_compressor(cfg.compression)->mask_ratio() > 0;
  runner.run = [&server, &fatal, own_tcs](const wire::Task& task, const Weights& base) {
    SPARROW_CHECK_T(Error, !task.secagg,
                    "gateway: secure aggregation does not span a gateway (its clients' sum "
                    "would be unmasked here); run SecAgg between a gateway and its clients "
                    "or without gateways");
    Weights masks;
    if (own_tcs) {
      SPARROW_CHECK_T(Error, compression::make_compressor(task.compression)->mask_ratio() > 0,
                      "gateway: this gateway's clients use tcs, which needs the root's masks, but the root's "
                      "uplink is '"
                          << task.compression << "'; set the same tcs compression on the root");
      for (const auto& nt : task.shared) {
        masks[nt.name] = compression::mask_positions(nt.tensor);
        // Checked here, not in relay_round, so a bad mask refuses this task
        // (an Error to the root) instead of stopping the gateway.
        const auto it = base.find(nt.name);
        SPARROW_CHECK_T(Error, it != base.end() && nt.tensor.numel() == it->second.numel(),
                        "gateway: the root's mask for '" << nt.name << "' does not fit the model");
      }
    }
    spdlog::info("event=relay_started round={} deadline_ms={} masks={}", task.round, task.deadline_ms, masks.size());
    // The round, the wait for live clients included, ends within this server's
    // max_round_wait_s (relay_round's default): the root always gets an answer.
    std::optional<Server::RelayResult> res;
    try {
      res = server.relay_round(task.round, base, task.train, masks);
    } catch (...) {
      fatal = std::current_exception();
      if (auto* s = g_session.load()) s->stop();
      throw;
    }
    SPARROW_CHECK_T(Error, res.has_value(),
                    "gateway: round " << task.round << " closed without quorum among its clients (or it stopped)");
    client::TrainResult tr;
    tr.delta = std::move(res->delta);
    tr.num_samples = static_cast<int64_t>(std::llround(res->weight));
    auto it = res->metrics.find("train_loss");
    tr.mean_loss = it != res->metrics.end() ? it->second : std::numeric_limits<double>::quiet_NaN();
    spdlog::info("event=relay_forwarded round={} updates={} samples={}", task.round, res->updates, tr.num_samples);
    return tr;
  };
  client::ClientSession session(sc, std::move(runner));
  server.start();
  g_server.store(&server);
  g_session.store(&session);
  bool finished = false;
  try {
    finished = session.run();
  } catch (...) {
    g_session.store(nullptr);
    g_server.store(nullptr);
    server.finish(false);
    throw;
  }
  g_session.store(nullptr);
  g_server.store(nullptr);
  server.finish(finished && !fatal);
  if (fatal) std::rethrow_exception(fatal);
  return finished;
}

void stop_gateway() noexcept {
  if (auto* s = g_session.load()) s->stop();
  if (auto* s = g_server.load()) s->stop();
}

}  // namespace sparrow::server
