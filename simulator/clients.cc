// The simulator's clients: workers, each with its model replica and trainer
// (one client at a time, or many in one batched pass), train their share of
// the round's clients and run on each the client pipeline sparrow-client runs
// (federation/client_pipeline.h: local DP, then encoding or SecAgg+'s
// quantisation), then fold the update, parsed back as a server parses it, into
// the worker's partial aggregate. Attacks replace an adversary's update here.
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <optional>
#include <thread>

#include "compression/compressor.h"
#include "core/data_folder.h"
#include "core/error.h"
#include "core/rng.h"
#include "federation/algorithms.h"
#include "federation/client_pipeline.h"
#include "simulator/impl.h"

namespace sparrow::simulator {
namespace {
constexpr uint64_t kAttackTag = 0x61747461;  // "atta"
}  // namespace

client::TrainConfig Simulator::Impl::train_config() const {
  client::TrainConfig t;
  t.algorithm = cfg.algorithm;
  t.local_epochs = cfg.local_epochs;
  t.batch_size = cfg.batch_size;
  t.lr = cfg.lr;
  t.momentum = cfg.momentum;
  t.weight_decay = cfg.weight_decay;
  t.mu = federation::proximal_weight(cfg);  // FedProx's mu, FedDyn's alpha
  return t;
}

void Simulator::Impl::build_workers() {
  const int64_t input_dim = train_x.numel() / std::max<int64_t>(1, train_x.size(0));
  classes = std::max<int64_t>(10, train_y.max().item<int64_t>() + 1);
  if (cfg.model != "logreg") {
    SPARROW_CHECK_T(ConfigError, input_dim == 784 || cfg.model.rfind("torchscript:", 0) == 0,
                    "model: '" << cfg.model << "' takes 28x28 images but dataset '" << cfg.dataset << "' has "
                               << input_dim << " features per sample (use model = \"logreg\")");
  }
  for (int w = 0; w < cfg.workers; ++w) {
    Worker wk;
    wk.model = make_sim_model(cfg.model, cfg.effective_model_seed(), input_dim, classes);
    if (w == 0) {
      // The model against the data before the first round: one forward pass.
      core::Dataset probe;
      probe.x = train_x.slice(0, 0, 4);
      probe.y = train_y.slice(0, 0, 4);
      const int64_t max_label = std::max(train_y.max().item<int64_t>(), test_y.max().item<int64_t>());
      core::check_model_on_data(*wk.model, probe, cfg.model, max_label);
    }
    wk.model->to(device);
    wk.trainer = std::make_unique<client::LocalTrainer>(wk.model, train_config());
    wk.batch = 1;
    if (cfg.client_batch != 1 && client::BatchedTrainer::supports(*wk.model)) {
      wk.batched = std::make_unique<client::BatchedTrainer>(wk.model, train_config());
      // Automatic: every client of the worker's share in one pass, within a
      // memory budget for the stacked state.
      const int64_t per = std::max<int64_t>(1, wk.batched->bytes_per_client());
      const auto cap = static_cast<size_t>(std::max<int64_t>(1, kBatchBudget / per));
      const size_t share = static_cast<size_t>((cfg.clients_per_round + cfg.workers - 1) / cfg.workers);
      wk.batch = cfg.client_batch > 0 ? static_cast<size_t>(cfg.client_batch) : std::min(share, cap);
      if (wk.batch <= 1) wk.batched.reset();
    }
    if (w == 0) {
      client::Weights w0 = client::get_weights(*wk.model);
      for (auto& [n, v] : w0) v = v.to(at::kCPU);
      names = wk.trainer->names();
      gm = std::make_unique<federation::GlobalModel>(federation::global_config_of(cfg), std::move(w0), names);
      if (wk.batched)
        training = "batched clients: up to " + std::to_string(wk.batch) + " per pass on each of " +
                   std::to_string(cfg.workers) + (cfg.workers == 1 ? " worker" : " workers") + ", on " + cfg.device;
      else if (cfg.client_batch > 1)
        training = "one client at a time on " + cfg.device + " (model '" + cfg.model +
                   "' cannot be batched: client_batch = " + std::to_string(cfg.client_batch) + " ignored)";
      else
        training = "one client at a time on " + cfg.device;
      if (!data_note.empty()) training += "; data: " + data_note;
      if (!validation_note.empty()) training += "; " + validation_note;
      for (const auto& n : names) {
        const at::Tensor& t = gm->weights().at(n);
        shapes.emplace_back(n, t.sizes().vec());
        model_bytes += static_cast<uint64_t>(t.numel()) * 4;
      }
    }
    wk.slot = static_cast<size_t>(w);
    workers.push_back(std::move(wk));
  }
  engine = std::make_unique<federation::RoundEngine>(*gm, *aggregator, shapes, workers.size(),
                                                     static_cast<int64_t>(cfg.fold_buffer_mb * 1024 * 1024));
  if (aggregator->robust().buffers()) {
    const double need = static_cast<double>(model_bytes) * cfg.clients_per_round / (1024.0 * 1024.0);
    SPARROW_CHECK_T(ConfigError, need <= cfg.max_buffer_mb,
                    "aggregator '" << cfg.aggregator << "' keeps every update of a round: " << cfg.clients_per_round
                                   << " x " << model_bytes << " bytes = " << static_cast<int64_t>(need)
                                   << " MiB > max_buffer_mb = " << cfg.max_buffer_mb);
  }
}

void Simulator::Impl::send_alie(int t, int n_sel) {
  std::vector<std::pair<Worker*, Deferred*>> all;
  for (auto& wk : workers)
    for (auto& d : wk.deferred) all.emplace_back(&wk, &d);
  if (all.empty()) return;
  std::sort(all.begin(), all.end(),
            [](const auto& a, const auto& b) { return a.second->r->client < b.second->r->client; });
  std::vector<client::Weights> pool;
  for (auto& [wk, d] : all) pool.push_back(d->tr.delta);
  const double z = attack.z > 0 ? attack.z : alie_z(n_sel, static_cast<int64_t>(all.size()));
  const client::Weights sent = alie_update(pool, z);
  aggregation::ContextMap ctxs = round_ctxs;  // per-client edits stay local
  for (auto& [wk, d] : all) finish_client(*wk, t, *d->r, d->tr, ctxs, &sent);
  for (auto& wk : workers) wk.deferred.clear();
}

void Simulator::Impl::run_worker(int w, int t, const std::vector<int64_t>& ids, std::vector<ClientResult*> out) {
  Worker& wk = workers[w];
  wk.deferred.clear();
  aggregation::ContextMap ctxs = round_ctxs;  // per-client edits stay local
  const bool scaffold = cfg.algorithm == "scaffold";
  const bool stateful = federation::has_client_state(cfg.algorithm);  // SCAFFOLD's c_i, FedDyn's h_i
  // Clients in ascending id, in passes of up to wk.batch; each pass trains,
  // then its clients are encoded and aggregated one by one in id order.
  for (size_t j0 = 0; j0 < ids.size(); j0 += wk.batch) {
    if (stop_now()) return;  // a stop: the round is given up after the clients in training
    const size_t j1 = std::min(ids.size(), j0 + wk.batch);
    std::vector<client::ClientJob> jobs;
    for (size_t j = j0; j < j1; ++j) {
      const int64_t c = ids[j];
      ClientResult& r = *out[j];
      r.client = c;
      // From this process's store: over ranks, c's owner rank trains it (ranks.cc).
      const auto g0 = Clock::now();
      std::optional<state::ClientState> got = store->take(c);  // put() back once encoded
      r.state = got ? std::move(*got) : state::ClientState{};
      wk.host.get += seconds_since(g0);
      const int64_t n = client_idx[c].numel();
      client::ClientJob job;
      job.x = train_x.narrow(0, client_off[c], n);  // views: the data is client-major
      job.y = train_y.narrow(0, client_off[c], n);
      if (attacks(c) && attack.kind == AttackSpec::Kind::kLabelFlip) job.y = (classes - 1) - job.y;
      // The seed sparrow-server gives client c's task in this round.
      job.seed = federation::task_seed(cfg.seed, static_cast<uint64_t>(t) + 1, federation::sim_client_id(c));
      job.client_control = stateful ? &r.state.control : nullptr;
      jobs.push_back(std::move(job));
    }
    std::vector<client::TrainResult> trained;
    if (!wk.batched) {  // a pass of one client still takes the batched path's faster kernels
      for (size_t j = j0; j < j1; ++j) {
        client::ClientJob& job = jobs[j - j0];
        const auto t0 = Clock::now();
        trained.push_back(wk.trainer->train(start_model(), job.x, job.y, job.seed, job.client_control,
                                            scaffold ? &gm->control() : nullptr));
        out[j]->train_s = seconds_since(t0);
      }
    } else {
      const auto t0 = Clock::now();
      trained = wk.batched->train(start_model(), jobs, scaffold ? &gm->control() : nullptr);
      // One pass trained them all: each client is charged the pass's time in
      // proportion to its steps x batch (its share of the work).
      const double secs = seconds_since(t0);
      double work = 0;
      for (const auto& tr : trained) work += static_cast<double>(tr.num_samples);
      for (size_t j = j0; j < j1; ++j) out[j]->train_s = secs * static_cast<double>(trained[j - j0].num_samples) / work;
    }
    for (size_t j = j0; j < j1; ++j) {
      out[j]->trained = true;
      if (attacks(ids[j]) && attack.kind == AttackSpec::Kind::kAlie) {
        wk.deferred.push_back({out[j], std::move(trained[j - j0])});  // sent once the round's pool is known
        continue;
      }
      finish_client(wk, t, *out[j], trained[j - j0], ctxs);
      stop_after.fetch_sub(1);
      finished.fetch_add(1);
    }
  }
}

void Simulator::Impl::finish_client(Worker& wk, int t, ClientResult& r, const client::TrainResult& tr,
                                    aggregation::ContextMap& ctxs, const client::Weights* replaced) {
  const int64_t c = r.client;
  HostStages& host = wk.host;
  host.clients += 1;
  auto e0 = Clock::now();
  r.samples = tr.num_samples;
  r.train_loss = tr.mean_loss;
  // What the client sends: an attacker's update, or its own under local DP.
  client::Weights sent = replaced ? *replaced : tr.delta;
  const auto t64 = static_cast<uint64_t>(t);
  if (attacks(c) && !replaced) {
    const uint64_t ckey = rng::derive(t64, static_cast<uint64_t>(c));
    sent = attack_update(attack, tr.delta, rng::derive(rng::derive(cfg.seed, kAttackTag), ckey));
  } else if (!attacks(c) && dp.mode == aggregation::DpSpec::Mode::kLocal) {
    federation::local_dp_update(sent, dp.clip, dp.noise, federation::sim_local_dp_key(cfg.seed, t64, c));
  }
  std::string bytes;
  if (sa) {
    // The weighted update quantised into the ring (the client pipeline's
    // quantise_update, as sparrow-client) and masked.
    federation::RingUpdate q = federation::quantise_update(names, sent, sa->weight.at(c), sa_params.clip, sa->scale,
                                                           federation::sim_secagg_key(cfg.seed, t64, c));
    SPARROW_CHECK(q.x.size() == sa->length,
                  "secagg: client " << c << "'s update has " << q.x.size() << " coordinates, the model " << sa->length);
    host.encode += seconds_since(e0);
    e0 = Clock::now();
    bytes = wire::serialize(wire::Message{wire::kProtocolMajor, wire::kProtocolMinor,
                                          sa->party.at(c)->masked(std::move(q.x), {{"train_loss", tr.mean_loss}})});
    host.message += seconds_since(e0);
  } else {
    // The client pipeline sparrow-client runs (federation/client_pipeline.h):
    // the task's seed in each codec context, the round's client count.
    const std::string id = federation::sim_client_id(c);
    const uint64_t seed = federation::task_seed(cfg.seed, static_cast<uint64_t>(t) + 1, id);
    std::map<std::string, compression::Context> cctx;
    for (const auto& n : names)
      cctx[n] = federation::client_context(ctxs.at(n), seed, static_cast<uint32_t>(ctxs.at(n).num_workers));
    wire::ModelUpdate u =
        federation::make_update(static_cast<uint64_t>(t) + 1, id, tr.num_samples, names, sent, *compressor,
                                r.state.compressor, cctx, {}, {{"train_loss", tr.mean_loss}});
    u.packed = wire::packs_well(u, wire::kProtocolMinor);  // as sparrow-client packs for a server of this build
    host.encode += seconds_since(e0);
    e0 = Clock::now();
    bytes = wire::serialize(wire::Message{wire::kProtocolMajor, wire::kProtocolMinor, u});
    host.message += seconds_since(e0);
  }
  e0 = Clock::now();
  r.state.rounds += 1;
  // To the store now: its writer streams it into the open checkpoint
  // transaction while the next clients train. Over ranks this is the
  // owner's store: the state never leaves the rank that trains the client.
  store->put(c, std::move(r.state));
  host.put += seconds_since(e0);
  r.bytes_up = bytes.size();
  const Profile& p = profiles[c];
  r.sim_s = static_cast<double>(model_bytes) * 8 / p.down_bps + r.train_s / p.speed +
            static_cast<double>(bytes.size()) * 8 / p.up_bps;
  r.kept = !(cfg.deadline_s > 0 && r.sim_s > cfg.deadline_s);
  if (distributed()) {
    if (r.kept) {
      r.update = std::move(bytes);
      if (cfg.algorithm == "scaffold")
        for (const auto& [n, dc] : tr.control_delta) r.control_delta[n] = dc.to(at::kCPU, at::kFloat);
    }
    return;
  }
  if (!r.kept) {
    engine->skip(federation::sim_client_id(c));  // the clients after it need not wait
    return;
  }
  if (sa) {
    const wire::SecAgg y = std::get<wire::SecAgg>(wire::parse(bytes).body);
    std::lock_guard<std::mutex> g(sa->mu);
    sa->server->add_masked(sa->index.at(c), y);
    return;
  }
  fold(wk.slot, c, bytes, tr.control_delta, &host);
}

void Simulator::Impl::fold(size_t slot, int64_t c, const std::string& bytes, const client::Weights& control_delta,
                           HostStages* host) {
  if (async_mode()) return hold(c, bytes, control_delta);  // folded when it arrives (round.cc)
  auto p0 = Clock::now();
  wire::Message back = wire::parse(bytes);
  auto& pu = std::get<wire::ModelUpdate>(back.body);
  if (host) {
    host->parse += seconds_since(p0);
    p0 = Clock::now();
  }
  federation::Arrival a;
  a.update.reserve(pu.tensors.size());
  for (auto& nt : pu.tensors) a.update.emplace_back(std::move(nt.name), std::move(nt.tensor));
  federation::fold_terms(cfg, pu.num_samples, a);  // the weight (FedNova's n / a_i) and its sums
  if (cfg.algorithm == "scaffold")
    for (const auto& [n, dc] : control_delta) a.control_delta[n] = dc.to(at::kCPU, at::kFloat);
  // Its own updates: an early one is held unchecked (a failure shows when folded).
  engine->add(slot, federation::sim_client_id(c), std::move(a), /*check=*/false);
  if (host) host->fold += seconds_since(p0);
}

void Simulator::Impl::run_local(int t, const std::vector<std::vector<int64_t>>& wids,
                                const std::vector<std::vector<ClientResult*>>& wout) {
  if (workers.size() == 1) {
    run_worker(0, t, wids[0], wout[0]);
    return;
  }
  std::vector<std::thread> th;
  std::vector<std::exception_ptr> errs(workers.size());
  for (size_t w = 0; w < workers.size(); ++w)
    th.emplace_back([&, w] {
      try {
        // Workers sharing a GPU: each launches on a stream of its own, so
        // one worker's copies to the host (its update, its codec's
        // reductions) wait only for its own kernels, and the host-side work
        // of one (encoding, the state store, the fold) overlaps the others'
        // training. The round's model and data were staged before.
        c10::optional<c10::Stream> own;
        if (device.is_cuda()) own = c10::impl::getDeviceGuardImpl(device.type())->getStreamFromGlobalPool(device);
        c10::OptionalStreamGuard guard(own);
        run_worker(static_cast<int>(w), t, wids[w], wout[w]);
        // Its last kernels done before the main thread (default stream)
        // touches the worker's tensors again.
        if (own) own->synchronize();
      } catch (...) {
        errs[w] = std::current_exception();
      }
    });
  for (auto& x : th) x.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
}
}  // namespace sparrow::simulator
