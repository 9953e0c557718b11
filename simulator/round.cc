// One round of a run, rank 0's (or the one process's) view: the clients
// selected from the seed, scheduled onto the workers (and ranks), trained,
// their partials merged in worker order into the global step (the code
// sparrow-server runs: federation::GlobalModel), evaluated, the metrics row
// committed and, when due, a checkpoint.
#include <ATen/Parallel.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "compression/mask.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/threads.h"
#include "federation/client_pipeline.h"
#include "federation/sampler.h"
#include "simulator/impl.h"

namespace sparrow::simulator {
namespace {
// Stream tags: every random decision has its own counter-based stream.
constexpr uint64_t kAvailTag = 0x6176616c;  // "aval"
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
  if (!gm->has_downlink() || t == 0) return model_bytes * static_cast<uint64_t>(ids.size());
  const std::vector<int64_t> before = select_clients(t - 1);  // ascending
  uint64_t bytes = 0;
  for (const int64_t c : ids) bytes += std::binary_search(before.begin(), before.end(), c) ? down_bytes : model_bytes;
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
  const int t = round;
  const auto t0 = Clock::now();
  // What the store holds now is where a stop in this round goes back to.
  store->mark();
  const std::vector<int64_t> ids = select_clients(t);
  count_participations(ids);
  store->prefetch(ids);  // loaded on the store's thread while the first clients train
  std::vector<ClientResult> results(ids.size());
  finished.store(0);
  std::vector<double> jobs;
  for (int64_t c : ids) jobs.push_back(static_cast<double>(client_idx[c].numel()));
  const Assignment as = schedule_lpt(jobs, cost);
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
    store->rollback_to_mark();
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
  // Measured times feed the cost model in client-id order.
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
        down_bytes = 0;
        for (const auto& [n, e] : step.downlink) down_bytes += wire::encoded_size(e, n);
      }
    }
  }
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
  // Client states were put by the workers; they become durable with the
  // next checkpoint (see checkpoint()).
  const bool last = t + 1 == cfg.rounds;
  const bool ckpt = last || (t + 1) % cfg.checkpoint_every == 0 || store->dirty_bytes() > kUnflushedBudget;
  m.real_s = seconds_since(t0);
  // The metrics row first: a checkpoint of round t+1 never exists without it.
  commit(m);
  if (ckpt) checkpoint(t + 1, /*wait=*/last);
  round = t + 1;
  history.push_back(m);
  return m;
}
}  // namespace sparrow::simulator
