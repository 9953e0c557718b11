// The public Server (server.h) over Server::Impl (server/impl.h): the
// construction of a server (model, evaluation data, aggregator, the workers'
// partials, then the listener and the database), the start and stop of its
// threads, run(), the gateway role's entry points and the thread-safe
// snapshots.
#include "server/server.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <optional>

#include "compression/compressor.h"
#include "core/data_folder.h"
#include "core/error.h"
#include "core/model_digest.h"
#include "core/rng.h"
#include "server/impl.h"

namespace sparrow::server {
namespace {
constexpr uint64_t kDpTag = 0x64702020;  // "dp  "
}  // namespace

void Server::Impl::init(Weights initial) {
  validate(cfg);
  compression::register_builtins();
  Weights w0;
  if (initial.empty()) {
    std::shared_ptr<core::Model> m = core::make_model(cfg.model, cfg.effective_model_seed());
    for (const auto& p : m->named_parameters(/*recurse=*/true)) {
      names.push_back(p.key());
      w0[p.key()] = p.value().detach().to(at::kCPU, at::kFloat).contiguous().clone();
    }
    if (cfg.eval_every > 0) eval_model = m;
  } else {
    for (auto& [k, v] : initial) {
      SPARROW_CHECK_T(ConfigError, v.defined() && v.dim() >= 1, "initial weights: tensor '" << k << "' is empty");
      names.push_back(k);
      w0[k] = v.detach().to(at::kCPU, at::kFloat).contiguous().clone();
    }
    if (cfg.eval_every > 0) eval_model = core::make_model(cfg.model, cfg.effective_model_seed());
  }
  SPARROW_CHECK_T(ConfigError, !names.empty(), "model '" << cfg.model << "' has no parameters");
  gm = std::make_unique<federation::GlobalModel>(federation::global_config_of(cfg), std::move(w0), names);
  for (const auto& nm : names) {
    shapes.emplace_back(nm, gm->weights().at(nm).sizes().vec());
    numel += gm->weights().at(nm).numel();
  }
  digest = core::model_digest(gm->weights());
  if (eval_model) {
    if (cfg.eval_data.empty()) {
      test = core::load_fashion_mnist(cfg.data_dir, "test");
    } else {
      std::optional<core::Dataset> t = core::load_data_folder_test(cfg.eval_data);
      test = t ? std::move(*t) : core::load_data_folder(cfg.eval_data);
    }
    // The model against the evaluation data before the first round.
    test = core::check_data_for_model(std::move(test), cfg.model);
    core::check_model_on_data(*eval_model, test, cfg.model);
    spdlog::info("event=eval_data samples={} source=\"{}\"", test.size(),
                 cfg.eval_data.empty() ? cfg.data_dir + " (test split)" : cfg.eval_data);
  }

  sa_params = secagg::Params::parse(cfg.secagg);
  limits.max_bytes = cfg.max_message_bytes();
  limits.max_elements = static_cast<uint64_t>(numel) * 2 + (uint64_t{1} << 20);
  // A dense fp32 update's finiteness is checked while the aggregator folds
  // it (one read of the values instead of two); every consumer validates.
  limits.update_values = compression::ValueCheck::kDeferDenseF32;
  aggregator = std::make_unique<aggregation::Aggregator>(cfg.aggregator, cfg.dp, cfg.clients_per_round,
                                                         rng::derive(cfg.seed, kDpTag));
  if (aggregator->robust().buffers()) {
    const double need = static_cast<double>(numel) * 4 * cfg.clients_per_round / (1024.0 * 1024.0);
    SPARROW_CHECK_T(ConfigError, need <= cfg.max_buffer_mb,
                    "config key 'aggregator' '"
                        << cfg.aggregator << "' keeps every update of a round: " << cfg.clients_per_round
                        << " clients x " << numel * 4 << " bytes = " << static_cast<int64_t>(need)
                        << " MiB > max_buffer_mb = " << cfg.max_buffer_mb);
  }
  engine = std::make_unique<federation::RoundEngine>(*gm, *aggregator, shapes, static_cast<size_t>(cfg.workers),
                                                     static_cast<int64_t>(cfg.fold_buffer_mb * 1024 * 1024),
                                                     cfg.max_update_norm);

  // The socket first: a server that cannot listen (port taken, bad
  // endpoint) leaves the database as it was, not with a new run in it.
  bind();
  if (!cfg.http.empty()) {
    http = std::make_unique<monitor::HttpEndpoint>(cfg.http, cfg.http_token, board);
    spdlog::info("event=http url={} token={}", http->url(), cfg.http_token.empty() ? 0 : 1);
  }
  open_store();
  if (async_mode()) init_async();  // after the resume: the engine at its version
  publish_history();
  spdlog::info("event=listening endpoint={} curve={} run_id={} model={} digest={} round={}", endpoint,
               cfg.insecure ? 0 : 1, run_id, cfg.model, digest, completed.load());
}

void Server::Impl::start_threads() {
  io = std::thread([this] { io_loop(); });
  for (size_t w = 0; w < static_cast<size_t>(cfg.workers); ++w) workers.emplace_back([this, w] { worker_loop(w); });
}

void Server::Impl::stop_threads() {
  {
    std::lock_guard<std::mutex> g(mu);
    // "run finished" tells clients to exit (docs/protocol.md, Bye); any other
    // reason makes them reconnect to a restarted server.
    const bool over = cfg.gateway() ? root_finished : completed.load() >= cfg.rounds;
    const std::string reason = over ? "run finished" : "server shutting down";
    for (const auto& [rid, s] : sessions) reply(rid, msg(wire::Bye{reason}));
    sessions.clear();
    by_client.clear();
  }
  {
    std::lock_guard<std::mutex> g(job_mu);
    jobs_stop = true;
    jobs.clear();
  }
  job_cv.notify_all();
  for (auto& t : workers)
    if (t.joinable()) t.join();
  workers.clear();
  io_stop = true;
  if (io.joinable()) io.join();
  std::vector<ClientRow> dirty;
  {
    std::lock_guard<std::mutex> g(mu);
    for (const auto& cid : dirty_clients) dirty.push_back(clients[cid]);
    dirty_clients.clear();
  }
  try {
    if (!dirty.empty()) store->put_clients(dirty);
  } catch (const std::exception& e) {
    spdlog::error("event=client_rows_not_saved error=\"{}\"", e.what());
  }
  const bool finished = completed.load() >= cfg.rounds;
  board->update_progress([&](monitor::Progress& p) {
    p.phase = finished ? "done" : "stopped";
    p.clients_connected = 0;
  });
  std::lock_guard<std::mutex> g(mu);
  publish_clients(true);
}

Server::Server(ServerConfig cfg) : Server(std::move(cfg), Weights{}) {}

Server::Server(ServerConfig cfg, Weights initial_weights) : impl_(std::make_unique<Impl>()) {
  impl_->cfg = std::move(cfg);
  impl_->init(std::move(initial_weights));
}

Server::~Server() {
  if (!impl_) return;
  // Give the final Byes (queued by run() on its way out) a bounded chance to
  // leave, or clients never learn the run finished.
  if (impl_->listener) impl_->listener->close(std::chrono::milliseconds(1000));
  impl_->listener.reset();
}

void Server::run() {
  Impl& s = *impl_;
  SPARROW_CHECK(!s.ran, "Server::run() may be called once");
  s.ran = true;
  s.start_threads();
  try {
    if (s.async_mode())
      s.run_async();  // async_round.cc
    else
      while (!s.stop.load() && s.completed.load() < s.cfg.rounds)
        if (!s.run_round()) break;
  } catch (...) {
    s.stop_threads();
    throw;
  }
  s.stop_threads();
  spdlog::info("event=stopped round={} accepted={} stale={}", s.completed.load(), s.n.accepted.load(),
               s.n.stale.load());
}

void Server::start() {
  Impl& s = *impl_;
  SPARROW_CHECK(!s.ran, "Server::start()/run() may be called once");
  s.ran = true;
  s.start_threads();
}

std::optional<Server::RelayResult> Server::relay_round(uint64_t round, const Weights& base,
                                                       const wire::TrainSettings& train, const Weights& masks,
                                                       double limit_s) {
  Impl& s = *impl_;
  SPARROW_CHECK(s.cfg.gateway(), "relay_round: this server has no upstream (not a gateway)");
  SPARROW_CHECK(round >= 1, "relay_round: round must be >= 1");
  for (const auto& [nm, v] : s.gm->weights())
    SPARROW_CHECK(base.count(nm) && base.at(nm).sizes() == v.sizes(),
                  "relay_round: the root's model lacks '" << nm << "' or has another shape");
  for (const auto& [nm, m] : masks) {
    SPARROW_CHECK(s.gm->weights().count(nm), "relay_round: a mask for '" << nm << "', which the model does not have");
    const int64_t numel = s.gm->weights().at(nm).numel();
    SPARROW_CHECK(
        m.dim() == 1 && m.scalar_type() == at::kLong && m.device().is_cpu() &&
            (m.numel() == 0 || (m[0].item<int64_t>() >= 0 && m[-1].item<int64_t>() < numel &&
                                (m.slice(0, 1) > m.slice(0, 0, -1)).all().item<bool>())),
        "relay_round: the mask of '" << nm << "' is not ascending positions within its " << numel << " elements");
  }
  const double limit = limit_s > 0 ? limit_s : s.cfg.effective_max_round_wait_s();
  s.relay =
      Impl::Relay{round, &base, &train, &masks,
                  Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(limit))};
  s.relay_out.reset();
  struct Clear {
    Impl& s;
    ~Clear() { s.relay.reset(); }
  } clear{s};
  if (!s.run_round()) return std::nullopt;  // stopped
  return std::move(s.relay_out);            // nullopt when abandoned
}

void Server::finish(bool run_over) {
  impl_->root_finished = run_over;
  impl_->stop_threads();
  spdlog::info("event=stopped round={} accepted={} stale={}", impl_->completed.load(), impl_->n.accepted.load(),
               impl_->n.stale.load());
}

uint64_t Server::live_samples() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  uint64_t total = 0;
  for (const auto& [rid, sess] : impl_->sessions) total += sess.num_samples;
  return total;
}

void Server::stop() noexcept { impl_->stop.store(true); }
const std::string& Server::dashboard_url() const {
  static const std::string none;
  return impl_->http ? impl_->http->url() : none;
}

const std::string& Server::endpoint() const { return impl_->endpoint; }
const std::string& Server::run_id() const { return impl_->run_id; }
const std::string& Server::public_key() const { return impl_->public_key; }
int64_t Server::completed_rounds() const { return impl_->completed.load(); }
uint64_t Server::model_digest() const { return impl_->digest; }
const ServerConfig& Server::config() const { return impl_->cfg; }

Weights Server::global_weights() const {
  std::lock_guard<std::mutex> g(impl_->weights_mu);
  Weights out;
  for (const auto& [k, v] : impl_->gm->weights()) out[k] = v.clone();
  return out;
}

Counters Server::counters() const {
  const AtomicCounters& n = impl_->n;
  Counters c;
  c.updates_accepted = n.accepted.load();
  for (size_t i = 0; i < c.rejected_by_code.size(); ++i) c.rejected_by_code[i] = n.rejected[i].load();
  c.stale = n.stale.load();
  c.unknown = n.unknown.load();
  c.bytes_in = n.bytes_in.load();
  c.bytes_out = n.bytes_out.load();
  c.messages_in = n.messages_in.load();
  c.messages_out = n.messages_out.load();
  c.send_failures = n.send_failures.load();
  c.rounds_completed = n.rounds.load();
  c.rounds_abandoned = n.abandoned.load();
  c.clients_connected = impl_->n_connected.load();
  return c;
}

}  // namespace sparrow::server
