// Server::Impl drives the round engine (federation::RoundEngine, the code
// sparrow-sim runs its rounds with) on the round thread: choose the clients
// (least recently selected first), open the round (its context, the tasks),
// wait for the updates (deadlines, quorum, liveness), close it, take the
// global step and record the round with its checkpoint. SecAgg+
// rounds go through secagg_round.cc for the exchanges between open and close.
#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "compression/lowrank.h"
#include "compression/mask.h"
#include "core/error.h"
#include "core/rng.h"
#include "federation/algorithms.h"
#include "federation/client_pipeline.h"
#include "federation/sampler.h"
#include "server/impl.h"

namespace sparrow::server {
namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

}  // namespace

std::vector<std::string> select_clients(std::vector<Candidate> candidates, size_t k, uint64_t key) {
  std::vector<federation::Candidate> c;
  c.reserve(candidates.size());
  for (auto& x : candidates) c.push_back({std::move(x.client_id), x.last_selected});
  return federation::least_recent_by_key(key, std::move(c), k);
}

std::shared_ptr<RoundContext> Server::Impl::make_round_context(uint64_t r, const std::vector<std::string>& chosen) {
  auto rc = std::make_shared<RoundContext>();
  rc->round = r;
  // A gateway passes its root's tcs masks on.
  rc->contexts = engine->open(r, chosen, relay ? relay->masks : nullptr);
  for (const auto& nm : names) {
    const compression::Context& c = rc->contexts.at(nm);
    const std::vector<int64_t> shape = gm->weights().at(nm).sizes().vec();
    // ACP: labelled as the factor kind it is (the one sent in round r + 1).
    if (c.shared_factor.defined())
      rc->shared.push_back({nm, compression::acp_factor_encoded(c.shared_factor, shape, static_cast<int64_t>(r) + 1)});
    if (c.mask.defined()) rc->shared.push_back({nm, compression::mask_encoded(c.mask, shape)});
    rc->full.push_back({nm, dense_encoded(gm->broadcast().at(nm))});
    if (cfg.algorithm == "scaffold" && !gm->control().empty())
      rc->control.push_back({nm, dense_encoded(gm->control().at(nm))});
  }
  rc->delta = down_last;
  rc->catchup = gm->catchup_view(r - 1);
  if (relay) rc->relay_train = *relay->train;
  return rc;
}

void Server::Impl::send_task(const std::string& rid, Session& s, const RoundContext& rc) {
  const uint64_t r = rc.round;
  wire::Task t;
  t.round = r;
  t.train.algorithm = cfg.algorithm;
  t.train.local_epochs = static_cast<uint32_t>(cfg.local_epochs);
  t.train.batch_size = static_cast<uint32_t>(cfg.batch_size);
  t.train.lr = cfg.lr;
  t.train.momentum = cfg.momentum;
  t.train.weight_decay = cfg.weight_decay;
  t.train.mu = federation::proximal_weight(cfg);  // FedProx's mu, FedDyn's alpha
  if (rc.relay_train) t.train = *rc.relay_train;  // a gateway passes the root's settings on
  t.compression = cfg.compression;
  t.seed = federation::task_seed(cfg.seed, r, s.client_id);  // as the simulator's clients
  if (!rc.contexts.empty()) t.clients = static_cast<uint32_t>(rc.contexts.begin()->second.num_workers);
  t.shared = rc.shared;
  t.control = rc.control;
  t.deadline_ms = static_cast<uint64_t>(cfg.round_deadline_s * 1000.0);
  if (auto it = sa_setup.find(s.client_id); it != sa_setup.end()) t.secagg = it->second;
  // A gateway's round 1 model is the root's B_0: sent in full (the client's
  // own seed-built model follows this server's model_seed, not the root's).
  // By what the client holds, in both modes: in mode = "async" (round =
  // version + 1) a client whose last task was of the version before gets the
  // downlink's delta; one further behind what the run's downlink_catchup
  // policy picks (federation/catchup.h): a chain or a patch to a client of
  // protocol 1.9 on, else the whole model.
  using Kind = federation::CatchupPlan::Kind;
  Kind kind = Kind::kFull;
  if (s.last_round && *s.last_round == r - 1 && !(rc.relay_train && r == 1)) {
    t.model_encoding = wire::ModelEncoding::kDelta;
    t.base_round = r - 1;
    kind = Kind::kDelta;
  } else if (gm->has_downlink() && r >= 2 && s.last_round && *s.last_round == r - 2 && !rc.delta.empty()) {
    t.model_encoding = wire::ModelEncoding::kDelta;
    t.base_round = r - 2;
    t.weights = rc.delta;
    kind = Kind::kDelta;
  } else if (rc.catchup && s.last_round && *s.last_round + 2 < r) {
    federation::CatchupPlan p = rc.catchup->plan(s.last_round, s.minor);
    kind = p.kind;
    t.base_round = p.base;
    if (kind == Kind::kChain) {
      t.model_encoding = wire::ModelEncoding::kChain;
      for (const auto& st : p.chain) t.chain.push_back(st->tensors);
    } else if (kind == Kind::kPatch) {
      t.model_encoding = wire::ModelEncoding::kPatch;
      t.weights = std::move(p.patch);
    } else {
      kind = Kind::kFull;  // a one-step Delta is the branch above
    }
  }
  if (kind == Kind::kFull) {
    t.model_encoding = wire::ModelEncoding::kFull;
    t.base_round = 0;
    t.weights = rc.full;
  }
  down_tasks[static_cast<size_t>(kind)]++;
  // Catch-up tasks go packed to clients that read it (protocol 1.10).
  t.packed = kind != Kind::kFull && s.minor >= wire::kPackedMinor;
  if (t.packed) {
    down_model_bytes += wire::packed_size(t.weights, t.chain);
  } else {
    for (const auto& nt : t.weights) down_model_bytes += wire::encoded_size(nt.tensor, nt.name);
    for (const auto& step : t.chain)
      for (const auto& nt : step) down_model_bytes += wire::encoded_size(nt.tensor, nt.name);
  }
  s.last_round = r - 1;  // what the client holds once it applied this task
  std::string bytes = wire::serialize(msg(std::move(t)));
  clients[s.client_id].bytes_down += bytes.size();
  send_bytes(rid, std::move(bytes));
}

bool Server::Impl::run_round() {
  const uint64_t r = relay ? relay->round : static_cast<uint64_t>(completed.load()) + 1;
  // 1. Wait for enough live clients.
  const Waited w = wait_for_clients(r);
  if (w == Waited::kStopped) return false;
  if (w == Waited::kAbandon) {
    n.abandoned++;
    return true;  // no relay_out: the root gets an Error for this round
  }
  // 2. Select and send tasks (a gateway: from the root's model).
  const OpenedRound o = open_round(r);
  // 3. Collect until all arrived, or the deadline passed with quorum. 4. Close.
  const Collected c = collect_and_close(o);
  if (c == Collected::kStopped) {
    engine->abandon();
    return false;
  }
  bool abandon = c == Collected::kAbandon;
  std::map<std::string, double> metrics;
  if (sa) abandon = end_secagg(r, abandon, metrics);
  if (abandon) {
    engine->abandon();
    n.abandoned++;
    return true;
  }
  board->update_progress([](monitor::Progress& p) { p.phase = "aggregating"; });
  // Acks first: the round's Acks leave before the aggregation and the
  // checkpoint take the cores (on a small machine they would wait behind them).
  wait_outbox_drained(std::chrono::milliseconds(50));
  // 5. Aggregate.
  Merged merged = close_fold();
  const double weight = engine->sum().total_weight();
  if (weight <= 0) {
    engine->abandon();
    n.abandoned++;
    return true;
  }
  aggregation::AggregateStats ast;
  if (!global_step(r, weight, ast)) {
    n.abandoned++;
    return true;
  }
  // 6. Evaluate (optional), then checkpoint and record in one transaction.
  record_round(o, weight, ast, merged, metrics);
  return true;
}

Server::Impl::Waited Server::Impl::wait_for_clients(uint64_t r) {
  const size_t need = static_cast<size_t>(cfg.effective_min_clients());
  std::unique_lock<std::mutex> g(mu);
  board->update_progress([&](monitor::Progress& p) {
    p.round = static_cast<int64_t>(r);
    p.phase = "waiting";
    p.selected = p.received = 0;
    p.started = 0;
    p.deadline = kNaN;
  });
  bool logged = false;
  for (;;) {
    if (stop.load()) return Waited::kStopped;
    sweep();
    if (sessions.size() >= need) break;
    if (relay && Clock::now() >= relay->until) {
      spdlog::warn(
          "event=round_abandoned round={} live={} need={} msg=\"the root's deadline passed before enough "
          "clients were live\"",
          r, sessions.size(), need);
      return Waited::kAbandon;
    }
    if (!logged) spdlog::info("event=waiting_for_clients round={} live={} need={}", r, sessions.size(), need);
    logged = true;
    cv.wait_for(g, kRoundTick);
  }
  return Waited::kReady;
}

std::vector<std::string> Server::Impl::choose_clients(uint64_t r) {
  std::lock_guard<std::mutex> g(mu);
  std::vector<Candidate> cand;
  for (const auto& [cid, rid] : by_client) {
    auto h = holdouts.find(cid);
    if (h != holdouts.end() && h->second.until >= r) continue;  // held out (strike())
    cand.push_back({cid, clients[cid].last_selected});
  }
  std::vector<federation::Candidate> cands;
  cands.reserve(cand.size());
  for (auto& c : cand) cands.push_back({std::move(c.client_id), c.last_selected});
  return federation::sampler(cfg.effective_sampler("least_recent"))(cfg.seed, r, std::move(cands),
                                                                    static_cast<size_t>(cfg.clients_per_round));
}

Server::Impl::OpenedRound Server::Impl::open_round(uint64_t r) {
  if (relay) {
    std::lock_guard<std::mutex> g(weights_mu);
    for (auto& [nm, v] : gm->weights()) v.copy_(relay->base->at(nm));
  }
  OpenedRound o;
  o.round = r;
  o.started = unix_now();
  o.t0 = Clock::now();
  o.bytes_in0 = n.bytes_in.load();
  o.bytes_out0 = n.bytes_out.load();
  o.chosen = choose_clients(r);
  const std::vector<std::string>& chosen = o.chosen;
  const double started = o.started;
  std::shared_ptr<RoundContext> rc = make_round_context(r, chosen);
  {
    std::unique_lock<std::mutex> g(mu);
    round = r;
    selected.clear();
    round_accepted = round_rejected = round_stale = 0;
    round_ctx = rc;
    round_open = true;
    if (sa_params.enabled) setup_secagg(r, chosen);
    for (const auto& cid : chosen) {
      selected[cid] = Status::kWaiting;
      ClientRow& row = clients[cid];
      row.last_selected = static_cast<int64_t>(r);
      row.selected++;
      dirty_clients.insert(cid);
      auto bit = by_client.find(cid);
      if (bit != by_client.end()) send_task(bit->second, sessions.at(bit->second), *rc);
    }
    board->update_progress([&](monitor::Progress& p) {
      p.phase = "training";
      p.selected = static_cast<int64_t>(chosen.size());
      p.received = 0;
      p.started = started;
      p.deadline = started + cfg.round_deadline_s;
    });
    publish_clients(true);
  }
  spdlog::info("event=round_started round={} selected={} clients=[{}]", r, chosen.size(), join(chosen));
  return o;
}

Server::Impl::Collected Server::Impl::collect_and_close(const OpenedRound& o) {
  const uint64_t r = o.round;
  const auto t0 = o.t0;
  const auto period = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.round_deadline_s));
  auto hard =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.effective_max_round_wait_s()));
  auto deadline = t0 + period;
  if (relay) {  // a gateway's round ends in time, the wait for clients included
    hard = std::min(hard, relay->until);
    deadline = std::min(deadline, relay->until);
  }
  bool abandon = false, stopped = false;
  {
    std::unique_lock<std::mutex> g(mu);
    if (sa) {
      const Collected c = collect_secagg(g, r, t0, hard);
      stopped = c == Collected::kStopped;
      abandon = c == Collected::kAbandon;
    }
    for (; !sa;) {
      cv.wait_for(g, kRoundTick);
      sweep();
      if (stop.load()) {
        stopped = true;
        break;
      }
      size_t done = 0;
      for (const auto& [cid, st] : selected) done += st == Status::kDone;
      if (done == selected.size()) break;
      const auto now = Clock::now();
      if (now < deadline) continue;
      if (round_accepted >= cfg.quorum) {
        spdlog::info("event=deadline round={} updates={} selected={} msg=\"closing with quorum\"", r, round_accepted,
                     selected.size());
        break;
      }
      if (now >= hard) {
        spdlog::warn(
            "event=round_abandoned round={} updates={} quorum={} msg=\"no quorum; restarting the round "
            "with a fresh selection\"",
            r, round_accepted, cfg.quorum);
        abandon = true;
        break;
      }
      deadline += period;
      board->update_progress([&](monitor::Progress& p) { p.deadline += cfg.round_deadline_s; });
      spdlog::warn("event=deadline_extended round={} updates={} quorum={}", r, round_accepted, cfg.quorum);
    }
    // 4. Close admissions; wait for updates being folded in.
    round_open = false;
    cv.wait(g, [&] { return in_flight == 0; });
  }
  return stopped ? Collected::kStopped : abandon ? Collected::kAbandon : Collected::kOk;
}

Server::Impl::Merged Server::Impl::close_fold() {
  engine->close();
  for (const auto& cid : engine->late_failures())  // acknowledged, then not foldable: memory
    spdlog::error("event=update_lost client={} round={} msg=\"an accepted update could not be summed\"", cid,
                  engine->round());
  if (engine->relaxed() && cfg.fold_buffer_mb > 0)
    spdlog::warn(
        "event=fold_order_relaxed round={} held_bytes={} msg=\"early updates passed fold_buffer_mb = {}: the rest of "
        "the round was summed in arrival order\"",
        engine->round(), engine->held_peak(), cfg.fold_buffer_mb);
  Merged m;
  m.metric_sum = engine->metric_sum();
  m.metric_weight = engine->metric_weight();
  return m;
}

bool Server::Impl::global_step(uint64_t r, double weight, aggregation::AggregateStats& ast) {
  // The engine's global step (as in sparrow-sim): all or nothing; a
  // non-finite aggregate abandons the round.
  federation::StepResult step;
  if (relay) {
    // A gateway: the mean delta goes to the root, which steps its model.
    step = engine->finish_only(&ast);
  } else {
    double population;
    {
      std::lock_guard<std::mutex> g(mu);
      population = cfg.scaffold_population(clients.size());  // SCAFFOLD: `clients`, or the clients seen
    }
    std::lock_guard<std::mutex> g(weights_mu);
    step = engine->step(population, &ast);
  }
  if (!step.applied) {
    spdlog::error("event=round_abandoned round={} error=\"{}\"", r, step.error);
    return false;
  }
  if (relay) {
    relay_out = Server::RelayResult{};
    relay_out->delta = std::move(step.delta);
    relay_out->weight = weight;
  }
  if (gm->has_downlink()) {
    down_last.clear();
    for (auto& [nm, e] : step.downlink) down_last.push_back({nm, std::move(e)});
  }
  return true;
}

void Server::Impl::record_round(const OpenedRound& o, double weight, const aggregation::AggregateStats& ast, Merged& m,
                                std::map<std::string, double>& metrics) {
  const uint64_t r = o.round;
  RoundRow row;
  row.round = static_cast<int64_t>(r);
  row.started = o.started;
  row.selected = static_cast<int64_t>(o.chosen.size());
  for (const auto& [k, v] : m.metric_sum)
    if (m.metric_weight[k] > 0) metrics["client." + k] = v / m.metric_weight[k];
  row.train_loss = metrics.count("client.train_loss") ? metrics["client.train_loss"] : kNaN;
  row.eval_loss = row.eval_accuracy = kNaN;
  // Clients with a holdout evaluated the model they received (federated
  // evaluation, weighted by their samples); the server's own evaluation,
  // when it runs, takes precedence in the round row.
  if (metrics.count("client.eval_accuracy")) {
    row.eval_accuracy = metrics["client.eval_accuracy"];
    row.eval_loss = metrics.count("client.eval_loss") ? metrics["client.eval_loss"] : kNaN;
  }
  if (eval_model && (r % static_cast<uint64_t>(cfg.eval_every) == 0 || r == static_cast<uint64_t>(cfg.rounds))) {
    board->update_progress([](monitor::Progress& p) { p.phase = "evaluating"; });
    auto [loss, acc] = evaluate();
    row.eval_loss = loss;
    row.eval_accuracy = acc;
    metrics["eval.loss"] = loss;
    metrics["eval.accuracy"] = acc;
  }
  std::vector<ClientRow> dirty;
  {
    std::lock_guard<std::mutex> g(mu);
    // An async step: its buffer's updates; the refusals since the last step.
    row.updates = async_mode() ? static_cast<int64_t>(o.chosen.size()) : round_accepted;
    row.rejected = round_rejected;
    row.stale = round_stale;
    if (async_mode()) round_accepted = round_rejected = round_stale = 0;
    // Downlink (docs/server.md, "Send tasks"): the tasks of the round by how
    // they carried the model, and those models' bytes.
    if (gm->has_downlink()) {
      for (size_t k = 0; k < down_tasks.size(); ++k)
        metrics[std::string("downlink.") + federation::plan_name(static_cast<federation::CatchupPlan::Kind>(k))] =
            static_cast<double>(down_tasks[k]);
      metrics["downlink.model_bytes"] = static_cast<double>(down_model_bytes);
    }
    down_tasks.fill(0);
    down_model_bytes = 0;
    for (const auto& cid : dirty_clients) dirty.push_back(clients[cid]);
    dirty_clients.clear();
  }
  row.bytes_in = n.bytes_in.load() - o.bytes_in0;
  row.bytes_out = n.bytes_out.load() - o.bytes_out0;
  row.finished = unix_now();
  metrics["round.seconds"] = std::chrono::duration<double>(Clock::now() - o.t0).count();
  metrics["round.weight"] = weight;
  if (ast.clip > 0) {
    metrics["aggregate.clip"] = ast.clip;
    metrics["aggregate.clipped"] = static_cast<double>(ast.clipped);
  }
  if (!aggregator->robust().is_mean()) metrics["aggregate.kept"] = static_cast<double>(ast.kept);
  if (aggregator->dp().mode != aggregation::DpSpec::Mode::kNone) {
    // Selection is not random (least recently selected first), so no
    // sampling amplification: the most-selected client's participations,
    // each a Gaussian mechanism.
    int64_t most = 0;
    {
      std::lock_guard<std::mutex> g(mu);
      for (const auto& [cid, crow] : clients) most = std::max<int64_t>(most, crow.selected);
    }
    const double eps = aggregator->epsilon(most, 1.0, most);
    if (std::isfinite(eps)) metrics["dp.epsilon"] = eps;  // noise 0: no guarantee, nothing to report
  }
  if (relay_out) {
    relay_out->updates = static_cast<size_t>(row.updates);
    for (const auto& [k, v] : metrics)
      if (k.rfind("client.", 0) == 0) relay_out->metrics[k.substr(7)] = v;
  }
  store->commit_round(row, metrics, checkpoint(static_cast<int64_t>(r)), dirty, cfg.keep_checkpoints);
  completed = static_cast<int64_t>(r);
  n.rounds = r;
  board->add_round(point_of(row, value_or_nan(metrics, std::string("round.seconds")),
                            value_or_nan(metrics, std::string("dp.epsilon"))));
  board->update_progress([&](monitor::Progress& p) {
    p.rounds_completed = static_cast<int64_t>(r);
    p.phase = static_cast<int>(r) >= cfg.rounds ? "done" : "waiting";
  });
  {
    std::lock_guard<std::mutex> g(mu);
    publish_clients(true);
  }
  spdlog::info(
      "event=round_completed round={} updates={} selected={} rejected={} stale={} train_loss={} eval_loss={} "
      "eval_accuracy={} seconds={:.3f} bytes_in={} bytes_out={}",
      r, row.updates, row.selected, row.rejected, row.stale, row.train_loss, row.eval_loss, row.eval_accuracy,
      metrics["round.seconds"], row.bytes_in, row.bytes_out);
}

}  // namespace sparrow::server
