// Server::Impl in mode = "async" (docs/async.md): buffered asynchronous
// aggregation on federation::AsyncEngine, the engine sparrow-sim's async mode
// runs. The round thread hands tasks out; the workers fold, record and step.
//
// Durability: an update is written to the database (async_updates, its own
// synced transaction) after the engine folded it and before its Ack is
// queued; the step's commit_round deletes those rows in the transaction that
// writes the checkpoint holding them. A restart folds the rows again in their
// order into the engine at the checkpoint's version, so the buffer is the one
// the killed process held, bit for bit.
#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/peer_text.h"
#include "server/impl.h"
#include "wire/net.h"

namespace sparrow::server {

void Server::Impl::init_async() {
  const federation::AsyncSettings a = federation::async_settings(cfg);
  const uint64_t version = static_cast<uint64_t>(completed.load());
  async = std::make_unique<federation::AsyncEngine>(*gm, *aggregator, shapes, a.buffer, a.staleness, version,
                                                    cfg.max_update_norm);
  async_open = OpenedRound{};
  async_open.round = version + 1;
  async_open.started = unix_now();
  async_open.t0 = Clock::now();
  size_t replayed = 0, dropped = 0;
  for (AsyncUpdateRow& row : store->async_updates()) {
    // Rows of another step (a damaged newest checkpoint made the run go
    // back): their buffer is gone with the rounds it was lost with.
    if (row.step != static_cast<int64_t>(version) + 1) {
      ++dropped;
      continue;
    }
    wire::Message m = wire::parse(row.body, limits);
    auto* u = std::get_if<wire::ModelUpdate>(&m.body);
    SPARROW_CHECK_T(FormatError, u && u->round >= 1 && u->round <= version + 1,
                    "server database '" << cfg.db << "': an acknowledged update of step " << row.step
                                        << " is not an update of that step");
    async->add(u->client_id, u->round - 1, arrival_of(*u));
    async_open.chosen.push_back(row.client_id);
    async_last[row.client_id] = version + 1;  // one task per client and version, across the restart too
    ++replayed;
  }
  async_buffered = async->buffered();
  if (dropped > 0)
    spdlog::warn(
        "event=async_updates_dropped count={} msg=\"acknowledged updates of a step after the newest intact "
        "checkpoint: lost with that step\"",
        dropped);
  if (replayed > 0)
    spdlog::info("event=async_buffer_restored step={} updates={} buffer={}", version + 1, replayed, a.buffer);
  publish_async_context();
}

void Server::Impl::publish_async_context() {
  auto rc = std::make_shared<RoundContext>();
  rc->round = async->version() + 1;
  rc->contexts = async->contexts();
  for (const auto& nm : names) {
    rc->full.push_back({nm, dense_encoded(gm->broadcast().at(nm))});
    if (cfg.algorithm == "scaffold" && !gm->control().empty())
      rc->control.push_back({nm, dense_encoded(gm->control().at(nm))});
  }
  rc->delta = down_last;  // C_version: B_(version-1) -> B_version
  rc->catchup = gm->catchup_view(async->version());
  std::lock_guard<std::mutex> g(mu);
  round_ctx = std::move(rc);
  round = async->version() + 1;
  async_stepping = false;
}

void Server::Impl::async_hand_out(Clock::time_point now) {
  const federation::AsyncSettings a = federation::async_settings(cfg);
  const uint64_t r = round_ctx->round;
  // Tasks whose client left, or past their deadline (round_deadline_s), free
  // their slot; an update for one of them is refused as stale.
  const auto period = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.round_deadline_s));
  for (auto it = async_tasks.begin(); it != async_tasks.end();) {
    const bool gone = !by_client.count(it->first);
    if (!it->second.folding && (gone || now - it->second.sent > period)) {
      spdlog::info("event=task_expired client={} round={} reason={}", it->first, it->second.round,
                   gone ? "disconnected" : "deadline");
      ++async_expired;
      it = async_tasks.erase(it);
    } else {
      ++it;
    }
  }
  if (async_stepping || static_cast<int>(sessions.size()) < cfg.effective_min_clients()) return;
  if (async_tasks.size() >= static_cast<size_t>(a.max_concurrency)) return;
  if (completed.load() >= cfg.rounds) return;
  // Free clients that have not trained this version (a second task of one
  // version would train the same model with the same seed), least recently
  // handed a task first, then by id.
  std::vector<std::pair<int64_t, std::string>> free;
  for (const auto& [cid, rid] : by_client) {
    if (async_tasks.count(cid)) continue;
    if (auto l = async_last.find(cid); l != async_last.end() && l->second == r) continue;
    if (auto h = holdouts.find(cid); h != holdouts.end() && h->second.until >= r) continue;
    free.emplace_back(clients[cid].last_selected, cid);
  }
  const size_t slots = static_cast<size_t>(a.max_concurrency) - async_tasks.size();
  if (free.size() > slots)
    std::partial_sort(free.begin(), free.begin() + static_cast<ptrdiff_t>(slots), free.end());
  else
    std::sort(free.begin(), free.end());
  free.resize(std::min(free.size(), slots));
  for (const auto& [last, cid] : free) {
    const std::string& rid = by_client.at(cid);
    async_tasks[cid] = AsyncTask{r, now, false};
    async_last[cid] = r;
    ClientRow& row = clients[cid];
    row.last_selected = static_cast<int64_t>(r);
    row.selected++;
    dirty_clients.insert(cid);
    send_task(rid, sessions.at(rid), *round_ctx);
  }
}

void Server::Impl::run_async() {
  spdlog::info("event=async_started version={} buffer={} max_concurrency={} staleness=\"{}\"", async->version(),
               async->buffer(), federation::async_settings(cfg).max_concurrency, cfg.staleness);
  board->update_progress([&](monitor::Progress& p) {
    p.phase = "training";
    p.round = static_cast<int64_t>(async->version()) + 1;
    p.deadline = kNaN;
    p.async = true;
    p.version = static_cast<int64_t>(async->version());
    p.received = static_cast<int64_t>(async_open.chosen.size());  // restored from the database
  });
  std::unique_lock<std::mutex> g(mu);
  async_since = Clock::now();
  while (!stop.load() && completed.load() < cfg.rounds) {
    cv.wait_for(g, kRoundTick);
    if (async_error) break;
    // Group commit: the updates staged since the last pass, one transaction.
    g.unlock();
    flush_async_pending();
    g.lock();
    sweep();
    async_hand_out(Clock::now());
    publish_async_progress();
  }
  g.unlock();
  flush_async_pending();  // stopped: what was folded is still acknowledged when it can be stored
  if (async_error) std::rethrow_exception(async_error);
}

void Server::Impl::publish_async_progress() {
  const auto now = Clock::now();
  while (!async_arrivals.empty() && now - async_arrivals.front() > std::chrono::minutes(1)) async_arrivals.pop_front();
  // Updates per minute: those of the last minute (over the time since
  // run_async began when that is shorter).
  const double span = std::min(60.0, std::chrono::duration<double>(now - async_since).count());
  const double per_min = static_cast<double>(async_arrivals.size()) * 60.0 / std::max(span, 1.0);
  const int64_t out = static_cast<int64_t>(async_tasks.size());
  const int64_t buffered = static_cast<int64_t>(async_buffered.load());
  const uint64_t expired = async_expired;
  const int64_t buffer = async->buffer();  // fixed at construction
  board->update_progress([&](monitor::Progress& p) {
    p.async = true;
    p.selected = buffer;  // the progress bar: updates buffered of `buffer`
    p.received = buffered;
    p.updates_per_min = per_min;
    p.in_flight = out;
    p.tasks_expired = static_cast<int64_t>(expired);
  });
}

void Server::Impl::handle_async_update(const std::string& rid, wire::ModelUpdate u, size_t frame_bytes) {
  std::string cid;
  {
    std::unique_lock<std::mutex> g(mu);
    Session* sp = update_session(g, rid, u);
    if (!sp) return;
    Session& s = *sp;
    cid = s.client_id;
    auto t = async_tasks.find(cid);
    std::string why;
    if (t == async_tasks.end())
      why = "stale update: no task of round " + std::to_string(u.round) +
            " is out to this client (it expired after round_deadline_s, was answered already, or was handed out "
            "before the server restarted)";
    else if (t->second.round != u.round)
      why = "stale update: round " + std::to_string(u.round) + ", this client's task is of round " +
            std::to_string(t->second.round);
    else if (t->second.folding)
      why = "update for round " + std::to_string(u.round) + " already received";
    if (!why.empty()) {
      n.stale++;
      round_stale++;
      clients[cid].rejects++;
      dirty_clients.insert(cid);
      g.unlock();
      spdlog::info("event=update_stale client={} round={} reason=\"{}\"", core::printable(cid), u.round, why);
      reply(rid, net::error_message(ErrorCode::kRejected, why, u.round));
      return;
    }
    t->second.folding = true;
    if (u.num_samples > s.num_samples) {
      if (const auto k = mismatch_log.admit("samples:" + cid))
        spdlog::warn("event=samples_capped client={} key={} round={} claimed={} capped_to={} since_last_warning={}",
                     core::printable(cid), s.key, u.round, u.num_samples, s.num_samples, *k);
      u.num_samples = s.num_samples;
    }
  }
  const uint64_t task_round = u.round;
  std::string error;
  ErrorCode code = ErrorCode::kRejected;
  std::unique_lock<std::mutex> ag(async_mu);
  bool folded = false;
  try {
    SPARROW_CHECK_T(Error, completed.load() < cfg.rounds, "the run is finished");
    // As folded (the samples capped): what a restart folds again.
    std::string body = wire::serialize(msg(u));
    const federation::AsyncEngine::Folded f = async->add(cid, task_round - 1, arrival_of(u));  // all or nothing
    folded = true;
    async_open.chosen.push_back(cid);
    async_buffered = async->buffered();
    spdlog::debug("event=update_folded client={} round={} staleness={} discount={:.4f} buffered={}", cid, task_round,
                  f.staleness, f.discount, f.buffered);
    // Staged in fold order; acknowledged once durable (flush_async_pending,
    // or the step's checkpoint).
    std::lock_guard<std::mutex> pg(pending_mu);
    async_pending.push_back(
        PendingAck{rid, cid, task_round, frame_bytes,
                   AsyncUpdateRow{0, static_cast<int64_t>(async->version()) + 1, cid, std::move(body)}});
  } catch (const compression::NonFiniteError& e) {
    error = e.what();
    code = ErrorCode::kMalformed;
  } catch (const std::bad_alloc&) {
    error = "out of memory";
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!folded) {
    ag.unlock();
    {
      std::lock_guard<std::mutex> g(mu);
      async_tasks.erase(cid);  // answered: the slot is free
      ClientRow& row = clients[cid];
      ++round_rejected;
      row.rejects++;
      strike(cid, row.public_key);
      dirty_clients.insert(cid);
    }
    spdlog::warn("event=update_rejected client={} round={} error=\"{}\"", core::printable(cid), task_round,
                 core::printable(error));
    reply_error(rid, code, "update rejected: " + error, task_round);
    cv.notify_all();
    return;
  }
  if (async->due()) {
    {
      // No task of this version leaves while the step is pending: free
      // clients wait for the next version (as the simulator's steps, which
      // take no time).
      std::lock_guard<std::mutex> g(mu);
      async_stepping = true;
    }
    // The staged updates not yet written are made durable by the step's
    // checkpoint: acknowledged after it.
    std::vector<PendingAck> mine;
    {
      std::lock_guard<std::mutex> pg(pending_mu);
      mine.swap(async_pending);
    }
    try {
      std::lock_guard<std::mutex> sg(store_mu);
      async_step();
      ack_async(mine, true);
    } catch (...) {
      // A step that cannot be recorded (the database) ends the run, as in
      // sync mode; its updates were not acknowledged.
      ack_async(mine, false);
      std::lock_guard<std::mutex> g(mu);
      async_error = std::current_exception();
      stop.store(true);
    }
  }
  ag.unlock();
  cv.notify_all();  // the round thread writes the staged updates
}

void Server::Impl::flush_async_pending() {
  std::vector<PendingAck> batch;
  {
    std::lock_guard<std::mutex> pg(pending_mu);
    batch.swap(async_pending);
  }
  if (batch.empty()) return;
  bool durable = true;
  try {
    std::vector<const AsyncUpdateRow*> rows;
    rows.reserve(batch.size());
    for (const PendingAck& p : batch) rows.push_back(&p.row);
    std::lock_guard<std::mutex> sg(store_mu);
    store->put_async_updates(rows);  // one synced transaction for the batch
  } catch (const std::exception& e) {
    // Folded but not durable: never acknowledged (the clients hear an
    // Error), so a crash that loses them loses no acknowledged update.
    spdlog::error("event=updates_not_durable count={} error=\"{}\"", batch.size(), e.what());
    durable = false;
  }
  ack_async(batch, durable);
}

void Server::Impl::ack_async(const std::vector<PendingAck>& batch, bool durable) {
  if (batch.empty()) return;
  {
    std::lock_guard<std::mutex> g(mu);
    const auto now = Clock::now();
    for (const PendingAck& p : batch) {
      async_tasks.erase(p.cid);  // answered: the slot is free
      ClientRow& row = clients[p.cid];
      if (durable) {
        holdouts[p.cid].strikes = 0;
        ++round_accepted;
        row.updates++;
        row.bytes_up += p.frame_bytes;
        n.accepted++;
        async_arrivals.push_back(now);
      } else {
        ++round_rejected;
        row.rejects++;
      }
      dirty_clients.insert(p.cid);
    }
  }
  for (const PendingAck& p : batch) {
    if (durable)
      reply(p.rid, msg(wire::Ack{p.round}));
    else
      reply_error(p.rid, ErrorCode::kRejected, "update rejected: the server could not store it", p.round);
  }
}

void Server::Impl::async_step() {
  const uint64_t r = async->version() + 1;
  board->update_progress([](monitor::Progress& p) { p.phase = "aggregating"; });
  // The Acks of the buffer leave before the step takes the cores.
  wait_outbox_drained(std::chrono::milliseconds(50));
  Merged merged;
  merged.metric_sum = async->metric_sum();
  merged.metric_weight = async->metric_weight();
  const double weight = async->sum().total_weight();
  const uint64_t max_st = async->max_staleness();
  const double mean_st = async->mean_staleness();
  double population;
  {
    std::lock_guard<std::mutex> g(mu);
    population = cfg.scaffold_population(clients.size());
  }
  aggregation::AggregateStats ast;
  federation::StepResult step;
  {
    std::lock_guard<std::mutex> g(weights_mu);
    step = async->step(population, &ast);
  }
  std::map<std::string, double> metrics;
  metrics["async.staleness_max"] = static_cast<double>(max_st);
  metrics["async.staleness_mean"] = mean_st;
  if (!step.applied) {
    // As a synchronous round whose aggregate is not finite: the model is
    // unchanged, but the version advances (the engine's contract), so the
    // step is recorded.
    spdlog::error("event=step_abandoned round={} error=\"{}\"", r, step.error);
    n.abandoned++;
    metrics["round.abandoned"] = 1;
  } else if (gm->has_downlink()) {
    down_last.clear();
    for (auto& [nm, e] : step.downlink) down_last.push_back({nm, std::move(e)});
  }
  async_buffered = 0;
  OpenedRound o = std::move(async_open);
  o.round = r;
  record_round(o, weight, ast, merged, metrics);
  spdlog::info("event=async_step step={} staleness_max={} staleness_mean={:.3f} updates={}", r, max_st, mean_st,
               o.chosen.size());
  async_open = OpenedRound{};
  async_open.round = r + 1;
  async_open.started = unix_now();
  async_open.t0 = Clock::now();
  async_open.bytes_in0 = n.bytes_in.load();
  async_open.bytes_out0 = n.bytes_out.load();
  publish_async_context();
  const bool done = completed.load() >= cfg.rounds;
  board->update_progress([&](monitor::Progress& p) {
    p.round = static_cast<int64_t>(r) + 1;
    p.phase = done ? "done" : "training";
    p.received = 0;
    p.version = static_cast<int64_t>(r);
    p.staleness_max = static_cast<double>(max_st);
    p.staleness_mean = mean_st;
  });
}

}  // namespace sparrow::server
