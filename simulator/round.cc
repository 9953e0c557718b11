// One round of a run, rank 0's (or the one process's) view: the clients
// selected from the seed, scheduled onto the workers (and ranks), trained,
// their partials merged in worker order into the global step (the code
// sparrow-server runs: federation::GlobalModel), evaluated, the metrics row
// committed and, when due, a checkpoint.
#include <ATen/Parallel.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <map>
#include <optional>

#include "compression/mask.h"
#include "compression/state.h"
#include "core/error.h"
#include "core/bytes.h"
#include "core/rng.h"
#include "core/threads.h"
#include "federation/client_pipeline.h"
#include "federation/sampler.h"
#include "simulator/impl.h"

namespace sparrow::simulator {
namespace {
// Stream tags: every random decision has its own counter-based stream.
constexpr uint64_t kAvailTag = 0x6176616c;  // "aval"
constexpr uint64_t kAsyncTag = 0x6173796e;  // "asyn": who a free slot is handed to
}  // namespace

std::vector<int64_t> Simulator::Impl::select_clients(int t) const {
  // The clients reachable in round t.
  auto reachable = [&](int r) {
    const uint64_t akey = rng::derive(rng::derive(cfg.seed, kAvailTag), static_cast<uint64_t>(r));
    std::vector<int64_t> avail;
    for (int c = 0; c < cfg.clients; ++c)
      if (availability >= 1 || rng::uniform01(akey, static_cast<uint64_t>(c)) < availability) avail.push_back(c);
    return avail;
  };
  const size_t k = static_cast<size_t>(cfg.clients_per_round);
  const std::string rule = cfg.effective_sampler("uniform");
  if (rule == "uniform") {  // no history, no strings: positions into the ascending ids
    const std::vector<int64_t> avail = reachable(t);
    std::vector<int64_t> out;
    for (size_t p : federation::uniform_positions(cfg.seed, static_cast<uint64_t>(t) + 1, avail.size(), k))
      out.push_back(avail[p]);
    return out;
  }
  const federation::SamplerFn fn = federation::sampler(rule);
  if (last_selected.empty()) last_selected.assign(static_cast<size_t>(cfg.clients), 0);
  while (static_cast<int>(selection_history.size()) <= t) {
    const int r = static_cast<int>(selection_history.size());
    std::vector<federation::Candidate> cands;
    for (int64_t c : reachable(r)) cands.push_back({std::to_string(c), last_selected[static_cast<size_t>(c)]});
    std::vector<int64_t> ids;
    for (const std::string& id : fn(cfg.seed, static_cast<uint64_t>(r) + 1, std::move(cands), k)) {
      const bool digits = !id.empty() && id.size() < 12 &&
                          std::all_of(id.begin(), id.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      const int64_t c = digits ? std::stoll(id) : -1;
      SPARROW_CHECK(c >= 0 && c < cfg.clients, "sampler '" << rule << "' chose '" << id << "', not a candidate");
      ids.push_back(c);
      last_selected[static_cast<size_t>(c)] = r + 1;
    }
    std::sort(ids.begin(), ids.end());
    selection_history.push_back(std::move(ids));
  }
  return selection_history[static_cast<size_t>(t)];
}

double Simulator::Impl::epsilon_after(int rounds) const {
  if (dp.mode == aggregation::DpSpec::Mode::kNone) return kNaN;
  const double avail = std::max(1.0, availability * cfg.clients);
  const double q = std::min(1.0, cfg.clients_per_round / avail);
  return aggregator->epsilon(rounds, q, most_participations);
}

void Simulator::Impl::count_participations(const std::vector<int64_t>& ids) {
  if (participations.empty()) participations.assign(static_cast<size_t>(cfg.clients), 0);
  for (int64_t c : ids)
    most_participations = std::max<int64_t>(most_participations, ++participations[static_cast<size_t>(c)]);
}

uint64_t Simulator::Impl::downlink_bytes(int t, const std::vector<int64_t>& ids) const {
  if (!gm->has_downlink()) return model_bytes * static_cast<uint64_t>(ids.size());
  // A client that never took part holds B_0, the model it builds from the
  // run's model_seed (sparrow-client's Hello says last_round = 0): round 1's
  // task is an empty Delta, a later first task what the policy sends from B_0.
  if (t == 0) return 0;
  const std::vector<int64_t> before = select_clients(t - 1);  // ascending
  // sparrow-server's rule (server/round.cc): a client of the round before
  // gets C_t; one further behind what the downlink_catchup policy sends from
  // the B_s it holds (federation::CatchupView, the server's code). B_s: the
  // model of the last round s it took part in, found by replaying the
  // selection backwards; B_0 when it never took part.
  std::map<int64_t, std::optional<uint64_t>> held;
  size_t missing = 0;
  for (const int64_t c : ids)
    if (!std::binary_search(before.begin(), before.end(), c)) {
      held[c] = std::nullopt;
      ++missing;
    }
  std::shared_ptr<const federation::CatchupView> view;
  if (missing > 0) {
    view = gm->catchup_view(static_cast<uint64_t>(t));
    const federation::CatchupPolicy p = federation::parse_catchup(cfg.downlink_catchup);
    // Beyond a chain's reach and without a patch: the dense model anyway.
    const int oldest = p.patch() ? 0 : std::max<int>(0, t - 1 - static_cast<int>(p.max_steps));
    for (int s = t - 2; s >= oldest && missing > 0 && p.mode != federation::CatchupMode::kFull; --s) {
      for (const int64_t c : select_clients(s)) {
        auto it = held.find(c);
        if (it == held.end() || it->second) continue;
        it->second = static_cast<uint64_t>(s);
        --missing;
      }
    }
    // Not found: never took part (or, under a chain-only policy, beyond the
    // chain's reach, where B_0 gets the dense model as B_s would).
    for (auto& kv : held)
      if (!kv.second) kv.second = uint64_t{0};
  }
  uint64_t bytes = 0;
  std::array<int, 4> kinds{};
  for (const int64_t c : ids) {
    auto it = held.find(c);
    if (it == held.end()) {
      bytes += down_bytes;
      continue;
    }
    const federation::CatchupPlan plan =
        view ? view->plan(it->second, wire::kProtocolMinor) : federation::CatchupPlan{};
    bytes += plan.kind == federation::CatchupPlan::Kind::kFull ? model_bytes : plan.bytes;
    ++kinds[static_cast<size_t>(plan.kind)];
  }
  spdlog::debug("round {}: downlink tasks full={} chain={} patch={} (delta {})", t + 1, kinds[0], kinds[2], kinds[3],
                ids.size() - held.size());
  return bytes;
}

uint64_t Simulator::Impl::mask_bytes() const {
  uint64_t bytes = 0;
  if (gm->mask_ratio() <= 0) return bytes;
  for (const auto& n : names) {
    const at::Tensor mk = gm->mask(n);
    if (mk.defined()) bytes += wire::encoded_size(compression::mask_encoded(mk, gm->weights().at(n).sizes().vec()), n);
  }
  return bytes;
}

RoundMetrics Simulator::Impl::step() {
  SPARROW_CHECK(round < cfg.rounds, "all " << cfg.rounds << " rounds are done");
  if (async_mode()) return async_step();
  const int t = round;
  const auto t0 = Clock::now();
  // What the store holds now is where a stop in this round goes back to.
  store->mark();
  const std::vector<int64_t> ids = select_clients(t);
  count_participations(ids);
  store->prefetch(owned(ids));  // loaded on the store's thread while the first clients train
  std::vector<ClientResult> results(ids.size());
  finished.store(0);
  std::vector<double> jobs;
  for (int64_t c : ids) jobs.push_back(static_cast<double>(client_idx[c].numel()));
  // Over ranks each client goes to a slot of the rank that keeps its state (ranks.cc).
  const Assignment as = distributed() ? schedule_owners(ids, jobs) : schedule_lpt(jobs, cost);
  const size_t slots = static_cast<size_t>(cost.workers());  // workers x ranks
  std::vector<int> worker_of(ids.size(), 0);
  std::vector<std::vector<int64_t>> wids(slots);
  std::vector<std::vector<ClientResult*>> wout(slots);
  for (size_t w = 0; w < slots; ++w) {
    std::vector<int64_t> jobs_w = as.per_worker[w];
    std::sort(jobs_w.begin(), jobs_w.end());  // ids are sorted, so ascending job = ascending id
    for (int64_t j : jobs_w) {
      wids[w].push_back(ids[j]);
      wout[w].push_back(&results[j]);
      worker_of[j] = static_cast<int>(w);
    }
  }
  const int n_sel = static_cast<int>(ids.size());
  {
    std::vector<std::string> chosen;
    for (int64_t c : ids) chosen.push_back(federation::sim_client_id(c));
    round_ctxs = engine->open(static_cast<uint64_t>(t) + 1, chosen);  // rounds are 1-based in the engine
  }
  if (sa_params.enabled) begin_secagg(t, ids);
  for (auto& wk : workers) wk.host = HostStages{};
  const auto s0 = Clock::now();
  if (distributed()) send_round(t, n_sel, wids);
  const double send_s = seconds_since(s0);
  run_local(t, wids, wout);
  const double local_s = seconds_since(s0) - send_s;
  double wait_s = 0, fold_s = 0;
  if (distributed()) {
    receive_round(wids, wout);
    wait_s = seconds_since(s0) - send_s - local_s;
    spdlog::debug("round {}: ranks: sent in {:.3f} s, rank 0 trained in {:.3f} s, waited {:.3f} s for the others",
                  t + 1, send_s, local_s, wait_s);
  }
  const bool all_trained = std::all_of(results.begin(), results.end(), [](const ClientResult& r) { return r.trained; });
  if (!all_trained) {
    // Stopped in the middle: the round did not happen. The client states
    // its clients put are forgotten, so a checkpoint now is the state after
    // round t (and --resume runs round t + 1 as an uninterrupted run would).
    rollback_round();  // every rank's store
    engine->abandon();
    sa.reset();
    interrupted = true;
    RoundMetrics m;
    m.round = t;
    return m;
  }
  if (distributed()) {
    const auto f0 = Clock::now();
    fold_ranked(results);
    fold_s = seconds_since(f0);
    spdlog::debug("round {}: ranks: folded in {:.3f} s", t + 1, fold_s);
  }
  send_alie(t, n_sel);
  // Measured times feed the cost model in client-id order, only when clients
  // train one at a time. A batched pass pads each step to its widest
  // minibatch, so a client's bits depend on its pass mates: the assignment
  // that forms the passes must not follow timing, or two runs of one config
  // (or a resumed run, whose cost model starts empty) differ. Unfed, the
  // model predicts by sample count: the same assignment in every run.
  if (!workers.front().batched)
    for (size_t j = 0; j < ids.size(); ++j)
      cost.observe(worker_of[j], static_cast<double>(results[j].samples), results[j].train_s);

  if (sa) {
    end_secagg(t, ids);  // the unmasked sum into the engine's round
    for (auto& r : results) r.bytes_up += sa->up[r.client];
  }
  engine->close();
  SPARROW_CHECK(engine->late_failures().empty(),
                "round " << t + 1 << ": client " << engine->late_failures().front() << "'s update could not be folded");
  if (engine->relaxed() && cfg.fold_buffer_mb > 0)
    spdlog::warn(
        "event=fold_order_relaxed round={} msg=\"early updates passed fold_buffer_mb = {}: the rest of the "
        "round was summed in arrival order\"",
        t + 1, cfg.fold_buffer_mb);
  RoundMetrics m;
  m.round = t + 1;
  m.clients = n_sel;
  if (distributed()) {
    m.rank_bytes = rank_sent;
    m.rank0_send_s = send_s;
    m.rank0_wait_s = wait_s;
    m.rank0_fold_s = fold_s;
  }
  m.bytes_down = downlink_bytes(t, ids) + mask_bytes() * static_cast<uint64_t>(ids.size());
  if (sa) {
    for (const auto& [c, b] : sa->down) m.bytes_down += b;
    sa.reset();
  }
  double loss_w = 0, slowest = 0;
  int64_t samples = 0;
  for (const auto& r : results) {
    m.participants.push_back({r.client, r.samples, r.bytes_up, r.kept});
    m.bytes_up += r.bytes_up;
    loss_w += r.train_loss * static_cast<double>(r.samples);
    samples += r.samples;
    if (r.kept)
      slowest = std::max(slowest, r.sim_s);
    else
      ++m.dropped;
  }
  m.train_loss = samples > 0 ? loss_w / static_cast<double>(samples) : kNaN;
  m.samples = samples * cfg.local_epochs;
  // With stragglers the server waits out the deadline.
  m.sim_round_s = m.dropped > 0 ? cfg.deadline_s : slowest;

  m.epsilon = m.clip = kNaN;
  if (engine->sum().total_weight() <= 0) {
    engine->abandon();  // nothing arrived (all dropped, or SecAgg+ could not unmask)
  } else {
    aggregation::AggregateStats st;
    // The engine's global step (as in sparrow-server): all or nothing; a
    // non-finite aggregate leaves the model as it was (the round is
    // abandoned, as the server abandons it). SCAFFOLD's c averages over the
    // population, `clients`.
    const federation::StepResult step = engine->step(static_cast<double>(cfg.clients), &st);
    if (!step.applied) {
      spdlog::warn("round {}: abandoned, the model is unchanged: {}", t + 1, step.error);
      m.abandoned = true;
    } else {
      if (st.clip > 0) m.clip = st.clip;
      if (gm->has_downlink()) {
        down_bytes = gm->delta_bytes(wire::kProtocolMinor);  // sent packed to clients of this build
      }
    }
  }
  // Client states were put by the workers; they become durable with the
  // next checkpoint (see checkpoint()).
  finish_round(t, m, t0);
  log_host_stages(t, m, results, seconds_since(t0));
  history.push_back(m);
  return m;
}

void Simulator::Impl::log_host_stages(int t, const RoundMetrics& m, const std::vector<ClientResult>& results,
                                      double wall_s) const {
  if (!spdlog::should_log(spdlog::level::debug)) return;
  HostStages h;
  for (const auto& wk : workers) h += wk.host;
  double train_s = 0;
  for (const auto& r : results) train_s += r.train_s;
  // One worker: the round's wall-clock less training and evaluation is the
  // host path of its clients plus the round's serial part (selection, the
  // global step, the checkpoint).
  spdlog::debug(
      "event=host_stages round={} clients={} wall_s={:.6f} eval_s={:.6f} train_s={:.6f} get_s={:.6f} encode_s={:.6f} "
      "message_s={:.6f} put_s={:.6f} parse_s={:.6f} fold_s={:.6f}",
      t + 1, h.clients, wall_s, m.eval_s, train_s, h.get, h.encode, h.message, h.put, h.parse, h.fold);
}

// ---- asynchronous mode (docs/async.md) ----
//
// The simulated clock runs from event to event: a free slot (of
// max_concurrency) is handed to a client at once, with the current model; its
// update arrives after task_time() on its profile; arrivals fold into the
// engine's buffer in (arrival time, hand-out order), and the step runs when the
// buffer holds `buffer` updates. Training is real and batched: the tasks handed
// out at one version train together, when the next arrival could be one of
// them or before the step changes the model; which update arrives next never
// depends on how fast this machine trains.

void Simulator::Impl::hold(int64_t c, std::string bytes, const client::Weights& control_delta) {
  std::lock_guard<std::mutex> g(async_mu);
  for (auto& t : in_flight)
    if (t->client == c && !t->trained) {
      t->update = std::move(bytes);
      if (cfg.algorithm == "scaffold")
        for (const auto& [n, dc] : control_delta) t->control_delta[n] = dc.to(at::kCPU, at::kFloat);
      return;
    }
  SPARROW_CHECK(false, "async: client " << c << " trained without a task");
}

void Simulator::Impl::async_fill() {
  const federation::AsyncSettings a = federation::async_settings(cfg);
  const uint64_t tag = async->version() + 1;
  std::vector<char> busy(static_cast<size_t>(cfg.clients), 0);
  for (const auto& t : in_flight) busy[static_cast<size_t>(t->client)] = 1;
  const uint64_t key = rng::derive(cfg.seed, kAsyncTag);
  std::shared_ptr<const federation::CatchupView> view;  // of this version, made once
  while (in_flight.size() < static_cast<size_t>(a.max_concurrency)) {
    // A client takes at most one task per model version: a second one would
    // train the same model with the same task seed.
    std::vector<int64_t> free;
    for (int64_t c = 0; c < cfg.clients; ++c)
      if (!busy[static_cast<size_t>(c)] && async_last[static_cast<size_t>(c)] != tag) free.push_back(c);
    if (free.empty()) return;  // the slot waits for the next version
    const int64_t c = free[static_cast<size_t>(rng::at(key, handed) % free.size())];
    auto t = std::make_unique<AsyncTask>();
    t->client = c;
    t->version = async->version();
    t->seq = handed++;
    t->start = sim_clock;
    const Profile& p = profiles[static_cast<size_t>(c)];
    const TaskTime tt =
        task_time(p.speed, p.down_bps, p.up_bps, client_idx[c].numel() * cfg.local_epochs, model_bytes, 0);
    t->earliest = t->finish = t->start + tt.total();
    busy[static_cast<size_t>(c)] = 1;
    // The downlink by sparrow-server's rule (federation::CatchupView): the
    // client holds the model of its last task's version (async_last - 1), or
    // B_0 (built from model_seed) before its first task. The simulated
    // download time stays the dense model's, so that the policy never changes
    // which update arrives first (nor the model).
    const uint64_t prev = async_last[static_cast<size_t>(c)];
    if (gm->has_downlink()) {
      if (!view) view = gm->catchup_view(async->version());
      const federation::CatchupPlan plan =
          view->plan(std::optional<uint64_t>(prev > 0 ? prev - 1 : 0), wire::kProtocolMinor);
      async_down += plan.kind == federation::CatchupPlan::Kind::kFull ? model_bytes : plan.bytes;
    } else {
      async_down += model_bytes;  // the dense broadcast model
    }
    async_last[static_cast<size_t>(c)] = tag;
    in_flight.push_back(std::move(t));
  }
}

void Simulator::Impl::async_train() {
  std::vector<AsyncTask*> todo;
  for (auto& t : in_flight)
    if (!t->trained) todo.push_back(t.get());
  if (todo.empty()) return;
  std::sort(todo.begin(), todo.end(), [](const AsyncTask* x, const AsyncTask* y) { return x->client < y->client; });
  std::vector<double> jobs;
  for (const AsyncTask* t : todo) jobs.push_back(static_cast<double>(client_idx[t->client].numel()));
  const Assignment as = schedule_lpt(jobs, cost);
  std::vector<std::vector<int64_t>> wids(workers.size());
  std::vector<std::vector<ClientResult*>> wout(workers.size());
  for (size_t w = 0; w < workers.size(); ++w) {
    std::vector<int64_t> jw = as.per_worker[w];
    std::sort(jw.begin(), jw.end());
    for (int64_t j : jw) {
      wids[w].push_back(todo[static_cast<size_t>(j)]->client);
      wout[w].push_back(&todo[static_cast<size_t>(j)]->result);
    }
  }
  round_ctxs = async->contexts();
  store->prefetch([&] {
    std::vector<int64_t> ids;
    for (const AsyncTask* t : todo) ids.push_back(t->client);
    return ids;
  }());
  // Round "version" (0-based) to the client pipeline: the task seed and the
  // codec contexts of round version + 1, as a synchronous round of that
  // number would use.
  run_local(static_cast<int>(async->version()), wids, wout);
  for (AsyncTask* t : todo) {
    if (!t->result.trained) {
      interrupted = true;
      continue;
    }
    SPARROW_CHECK(!t->update.empty(), "async: client " << t->client << " trained but sent nothing");
    t->trained = true;
    const Profile& p = profiles[static_cast<size_t>(t->client)];
    const TaskTime tt =
        task_time(p.speed, p.down_bps, p.up_bps, t->result.samples * cfg.local_epochs, model_bytes, t->result.bytes_up);
    t->finish = t->start + tt.total();
  }
}

namespace {
constexpr uint32_t kAsyncStateVersion = 1;
}  // namespace

std::string Simulator::Impl::async_save() const {
  std::string out;
  core::ByteWriter w(out);
  w.put<uint32_t>(kAsyncStateVersion).put<uint64_t>(async ? async->version() : 0).put<double>(sim_clock);
  w.put<uint64_t>(handed).put<uint64_t>(async_last.size());
  for (uint64_t v : async_last) w.put<uint64_t>(v);
  w.put<uint64_t>(participations.size());
  for (int64_t v : participations) w.put<int64_t>(v);
  w.put<int64_t>(most_participations).put<uint64_t>(in_flight.size());
  for (const auto& t : in_flight) {
    SPARROW_CHECK(t->trained, "async: a checkpoint with an untrained task");
    w.put<int64_t>(t->client).put<uint64_t>(t->version).put<uint64_t>(t->seq);
    w.put<double>(t->start).put<double>(t->finish).put<double>(t->earliest);
    w.put<int64_t>(t->result.samples).put<double>(t->result.train_loss).put<uint64_t>(t->result.bytes_up);
    w.put_bytes(t->update);
    w.put_bytes(t->control_delta.empty() ? std::string() : compression::serialize_weights(t->control_delta));
  }
  return out;
}

void Simulator::Impl::async_load(const std::string& bytes) {
  const char* what = "resume: the checkpoint's async state";
  core::ByteReader r(bytes, what);
  SPARROW_CHECK_T(FormatError, r.get<uint32_t>() == kAsyncStateVersion, what << " has an unknown version");
  const auto version = r.get<uint64_t>();
  SPARROW_CHECK_T(FormatError, version == static_cast<uint64_t>(round),
                  what << " is of step " << version << ", the checkpoint of step " << round);
  const federation::AsyncSettings a = federation::async_settings(cfg);
  auto fresh = std::make_unique<federation::AsyncEngine>(*gm, *aggregator, shapes, a.buffer, a.staleness, version);
  const auto clock = r.get<double>();
  const auto next_seq = r.get<uint64_t>();
  auto count = [&](uint64_t expect) {
    const auto n = r.get<uint64_t>();
    SPARROW_CHECK_T(FormatError, n == expect, what << " is for " << n << " clients, the run has " << expect);
    return n;
  };
  std::vector<uint64_t> last(count(static_cast<uint64_t>(cfg.clients)));
  for (auto& v : last) v = r.get<uint64_t>();
  std::vector<int64_t> parts(count(static_cast<uint64_t>(cfg.clients)));
  for (auto& v : parts) v = r.get<int64_t>();
  const auto most = r.get<int64_t>();
  const auto n = r.get<uint64_t>();
  SPARROW_CHECK_T(FormatError, n <= static_cast<uint64_t>(cfg.clients), what << " holds " << n << " tasks");
  std::vector<std::unique_ptr<AsyncTask>> tasks;
  for (uint64_t i = 0; i < n; ++i) {
    auto t = std::make_unique<AsyncTask>();
    t->client = r.get<int64_t>();
    SPARROW_CHECK_T(FormatError, t->client >= 0 && t->client < cfg.clients, what << " names client " << t->client);
    t->version = r.get<uint64_t>();
    t->seq = r.get<uint64_t>();
    t->start = r.get<double>();
    t->finish = r.get<double>();
    t->earliest = r.get<double>();
    t->result.client = t->client;
    t->result.samples = r.get<int64_t>();
    t->result.train_loss = r.get<double>();
    t->result.bytes_up = r.get<uint64_t>();
    t->result.trained = t->result.kept = t->trained = true;
    t->update = r.get_bytes();
    const std::string cd = r.get_bytes();
    if (!cd.empty()) t->control_delta = compression::deserialize_weights(cd);
    SPARROW_CHECK_T(FormatError, t->version <= version, what << " holds a task of a later step");
    tasks.push_back(std::move(t));
  }
  SPARROW_CHECK_T(FormatError, r.done(), what << " has trailing bytes");
  async = std::move(fresh);
  in_flight = std::move(tasks);
  async_last = std::move(last);
  participations = std::move(parts);
  most_participations = most;
  sim_clock = clock;
  handed = next_seq;
  async_saved = bytes;
}

RoundMetrics Simulator::Impl::async_step() {
  const int t = round;
  const auto t0 = Clock::now();
  const federation::AsyncSettings a = federation::async_settings(cfg);
  if (!async) {
    if (!async_saved.empty()) {
      async_load(async_saved);  // after a stop in the middle of a step: the last step's end
    } else {
      SPARROW_CHECK(round == 0, "async: step " << round << " without the state of the step before");
      async = std::make_unique<federation::AsyncEngine>(*gm, *aggregator, shapes, a.buffer, a.staleness, 0);
      in_flight.clear();
      async_last.assign(static_cast<size_t>(cfg.clients), 0);
      participations.assign(static_cast<size_t>(cfg.clients), 0);
      sim_clock = 0;
      handed = 0;
    }
  }
  store->mark();
  finished.store(0);
  const double step_start = sim_clock;
  async_down = 0;
  RoundMetrics m;
  m.round = t;
  auto give_up = [&] {
    // Stopped in the middle: as a synchronous round, the step did not happen;
    // the next one starts from the last step's saved state (as a resume does).
    store->rollback_to_mark();
    async.reset();
    in_flight.clear();
    interrupted = true;
    return m;
  };
  async_fill();
  double loss_w = 0;
  int64_t samples = 0;
  while (!async->due()) {
    SPARROW_CHECK(!in_flight.empty(), "async: no client can take a task (clients = " << cfg.clients << ")");
    // The next arrival: the earliest trained task, unless an untrained one
    // could arrive before it (then the version's tasks train first).
    auto before = [](double f1, uint64_t s1, double f2, uint64_t s2) { return f1 < f2 || (f1 == f2 && s1 < s2); };
    AsyncTask* next = nullptr;
    const AsyncTask* untrained = nullptr;
    for (auto& x : in_flight) {
      if (x->trained) {
        if (!next || before(x->finish, x->seq, next->finish, next->seq)) next = x.get();
      } else if (!untrained || before(x->earliest, x->seq, untrained->earliest, untrained->seq)) {
        untrained = x.get();
      }
    }
    if (untrained && (!next || !before(next->finish, next->seq, untrained->earliest, untrained->seq))) {
      async_train();
      if (interrupted) return give_up();
      continue;
    }
    wire::Message back = wire::parse(next->update);
    auto& pu = std::get<wire::ModelUpdate>(back.body);
    federation::Arrival arr;
    for (auto& nt : pu.tensors) arr.update.emplace_back(std::move(nt.name), std::move(nt.tensor));
    arr.weight = static_cast<double>(pu.num_samples);
    arr.control_delta = std::move(next->control_delta);
    const federation::AsyncEngine::Folded f =
        async->add(federation::sim_client_id(next->client), next->version, std::move(arr));
    spdlog::debug("async: client {} arrives at {:.3f} s, staleness {}, weight x {:.4f}", next->client, next->finish,
                  f.staleness, f.discount);
    sim_clock = std::max(sim_clock, next->finish);
    const ClientResult& r = next->result;
    m.participants.push_back({r.client, r.samples, r.bytes_up, true});
    m.bytes_up += r.bytes_up;
    loss_w += r.train_loss * static_cast<double>(r.samples);
    samples += r.samples;
    count_participations({r.client});
    in_flight.erase(std::find_if(in_flight.begin(), in_flight.end(), [&](const auto& x) { return x.get() == next; }));
    if (!async->due()) async_fill();
  }
  async_train();  // the tasks handed out at this version, before the step changes the model
  if (interrupted) return give_up();
  m.round = t + 1;
  m.clients = static_cast<int>(async->buffered());
  m.train_loss = samples > 0 ? loss_w / static_cast<double>(samples) : kNaN;
  m.samples = samples * cfg.local_epochs;
  m.bytes_down = async_down;
  m.sim_round_s = sim_clock - step_start;
  m.epsilon = m.clip = kNaN;
  const uint64_t max_st = async->max_staleness();
  const double mean_st = async->mean_staleness();
  aggregation::AggregateStats st;
  const federation::StepResult sr = async->step(static_cast<double>(cfg.clients), &st);
  if (!sr.applied) {
    spdlog::warn("step {}: abandoned, the model is unchanged: {}", t + 1, sr.error);
    m.abandoned = true;
  } else if (st.clip > 0) {
    m.clip = st.clip;
  }
  spdlog::info("event=async_step step={} sim_s={:.3f} staleness_max={} staleness_mean={:.3f} in_flight={}", t + 1,
               sim_clock, max_st, mean_st, in_flight.size());
  finish_round(t, m, t0, /*async=*/true);
  history.push_back(m);
  return m;
}

// The end of a round or an async step, t+1: privacy spent, the evaluation when
// due, the metrics row and then (when due) the checkpoint, in that order: a
// checkpoint of round t+1 never exists without its metrics row.
void Simulator::Impl::finish_round(int t, RoundMetrics& m, Clock::time_point t0, bool async) {
  m.epsilon = epsilon_after(t + 1);
  const bool eval = (cfg.eval_every > 0 && (t + 1) % cfg.eval_every == 0) || t + 1 == cfg.rounds;
  m.accuracy = m.loss = kNaN;
  if (eval) {
    const auto e0 = Clock::now();
    // The workers are idle: evaluation takes all of their threads (the
    // CNN's CPU evaluation gives the same bits on any number).
    const int threads = std::min(core::available_cores(), static_cast<int>(workers.size()) * at::get_num_threads());
    const core::ScopedIntraOpThreads eval_threads(device.is_cpu() ? threads : 1);
    auto [loss, acc] = workers[0].trainer->evaluate(gm->weights(), test_x, test_y);
    m.eval_s = seconds_since(e0);
    m.loss = loss;
    m.accuracy = acc;
  }
  const bool last = t + 1 == cfg.rounds;
  const bool ckpt = last || (t + 1) % cfg.checkpoint_every == 0 || unflushed_bytes() > kUnflushedBudget;
  m.real_s = seconds_since(t0);
  if (async) async_saved = async_save();  // the tasks in flight, saved with the checkpoint
  commit(m);
  if (ckpt) checkpoint(t + 1, /*wait=*/last);
  round = t + 1;
}

}  // namespace sparrow::simulator
