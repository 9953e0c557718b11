// ClientSession::Impl's Tasks: the broadcast model B_{r-1} (Full, or a Delta,
// Chain or Patch against what the client holds), the Task's settings checked, local training
// (or a gateway's runner) with federated evaluation on the holdout and local
// DP, the update built by the client pipeline the simulator runs too
// (federation/client_pipeline.h), and the state committed with it.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <thread>

#include "aggregation/dp_accountant.h"
#include "client/session_impl.h"
#include "compression/lowrank.h"
#include "compression/mask.h"
#include "core/error.h"
#include "core/peer_text.h"
#include "federation/client_pipeline.h"

namespace sparrow::client {
namespace {

bool same_train_config(const TrainConfig& a, const TrainConfig& b) {
  return a.algorithm == b.algorithm && a.local_epochs == b.local_epochs && a.batch_size == b.batch_size &&
         a.lr == b.lr && a.momentum == b.momentum && a.weight_decay == b.weight_decay && a.mu == b.mu;
}

}  // namespace

void ClientSession::Impl::check_tensors(const std::vector<wire::NamedTensor>& ts, const char* what, bool exact,
                                        bool same_shape) const {
  std::map<std::string, int> seen;
  for (const auto& t : ts) {
    SPARROW_CHECK_T(Error, shapes.count(t.name), what << ": '" << t.name << "' is not a parameter of " << cfg.model);
    SPARROW_CHECK_T(Error, ++seen[t.name] == 1, what << ": '" << t.name << "' appears twice");
    SPARROW_CHECK_T(Error, !same_shape || t.tensor.shape == shapes.at(t.name),
                    what << ": '" << t.name << "' has shape " << shape_text(t.tensor.shape) << ", the model "
                         << shape_text(shapes.at(t.name)));
  }
  SPARROW_CHECK_T(Error, !exact || seen.size() == shapes.size(),
                  what << ": " << seen.size() << " of the model's " << shapes.size() << " parameters");
}

Weights ClientSession::Impl::decode_all(const std::vector<wire::NamedTensor>& ts) const {
  Weights w;
  for (const auto& t : ts) w[t.name] = compression::decode(t.tensor).contiguous();
  return w;
}

void ClientSession::Impl::on_task(const wire::Task& task) {
  const uint64_t r = task.round;
  spdlog::info("round {}: task received", r);
  try {
    std::optional<Weights> base = broadcast_model(task);
    if (!base) return;  // answered with a re-Hello
    if (task.secagg) {
      SPARROW_CHECK_T(Error, !runner.run,
                      "task: secure aggregation does not span a gateway (its clients' sum would be unmasked there)");
      start_secagg(task, *base);
    } else
      train_and_send(task, *base);
  } catch (const std::exception& e) {
    ++n.tasks_refused;
    spdlog::warn("round {}: task refused: {}", r, core::printable(e.what()));
    wire::Message reply;
    reply.body = wire::error_for(e, r);
    send(reply);
  }
}

std::optional<Weights> ClientSession::Impl::broadcast_model(const wire::Task& task) {
  const uint64_t r = task.round;
  SPARROW_CHECK_T(Error, r >= 1, "task: round must be >= 1");
  if (task.model_encoding == wire::ModelEncoding::kFull) {
    check_tensors(task.weights, "task weights", /*exact=*/true);
    return decode_all(task.weights);
  }
  // Delta, and the catch-up encodings of protocol 1.9 (wire::parse checked
  // their shape: a Chain's step count, a Patch's tensor kind).
  const bool chain = task.model_encoding == wire::ModelEncoding::kChain;
  const bool patch = task.model_encoding == wire::ModelEncoding::kPatch;
  check_tensors(task.weights, patch ? "task patch" : "task delta", /*exact=*/false);
  for (const auto& step : task.chain) check_tensors(step, "task chain", /*exact=*/false);
  const uint64_t b = task.base_round;
  if (chain || patch)
    SPARROW_CHECK_T(Error, b + 2 <= r, "task: a catch-up of round " << r << " needs base_round <= " << r - 2);
  else if (task.weights.empty())
    SPARROW_CHECK_T(Error, b + 1 == r, "task: an empty Delta of round " << r << " needs base_round " << r - 1);
  else
    SPARROW_CHECK_T(Error, b + 2 == r, "task: a Delta with tensors in round " << r << " needs base_round " << r - 2);
  const Weights* from = nullptr;
  if (b == 0)
    from = &initial_model(welcome.model_seed);
  else if (self.held_round_.load() == b && !held.empty())
    from = &held;
  if (!from) {
    const uint64_t h = self.held_round_.load();
    SPARROW_CHECK_T(Error, rehello_round != r,
                    "task: cannot apply a Delta against round " << b << ": this client holds round " << h);
    rehello_round = r;
    ++n.tasks_refused;
    spdlog::warn("round {}: Delta against round {} but holding round {}: sending Hello again", r, b, h);
    send_hello();
    return std::nullopt;
  }
  // Into a copy: a step or a patch that fails leaves the held model as it was.
  Weights w = clone_weights(*from);
  if (patch) {
    for (const auto& t : task.weights) {
      at::Tensor& x = w.at(t.name);
      wire::apply_patch(t.tensor, x.data_ptr<float>(), x.numel());
    }
  } else if (chain) {
    for (const auto& step : task.chain)
      for (const auto& t : step) compression::decode_add(t.tensor, w.at(t.name), 1.0f);
  } else {
    for (const auto& t : task.weights) compression::decode_add(t.tensor, w.at(t.name), 1.0f);
  }
  return w;
}

ClientSession::Impl::Prepared ClientSession::Impl::prepare(const wire::Task& task, const Weights& base) {
  Prepared p;
  TrainConfig& tc = p.tc;
  tc.algorithm = task.train.algorithm;
  tc.local_epochs = static_cast<int>(task.train.local_epochs);
  tc.batch_size = static_cast<int>(task.train.batch_size);
  tc.lr = task.train.lr;
  tc.momentum = task.train.momentum;
  tc.weight_decay = task.train.weight_decay;
  tc.mu = task.train.mu;
  validate(tc);
  const bool scaffold = tc.algorithm == "scaffold";
  p.comp = compression::make_compressor(task.compression);
  if (p.comp->mask_ratio() > 0) {
    // tcs: each entry is the server's mask of a parameter, a sparse tensor of
    // its shape whose positions are the mask.
    check_tensors(task.shared, "task shared", /*exact=*/false);
    for (const auto& nt : task.shared) {
      SPARROW_CHECK_T(Error, nt.tensor.format == compression::Format::kSparse,
                      "task: the mask of '" << nt.name << "' is not a sparse tensor");
      p.masks[nt.name] = compression::mask_positions(nt.tensor);
    }
  } else {
    check_tensors(task.shared, "task shared", /*exact=*/false, /*same_shape=*/false);
    // ACP: each entry is the round's shared factor of a parameter, {k, r}:
    // as sparrow-server sends it, a factor (compression::acp_factor_encoded),
    // whose values are the factor itself (decoding it would expand a
    // full-shape product), or a dense {k, r} tensor.
    for (const auto& nt : task.shared)
      p.shared[nt.name] = nt.tensor.format == compression::Format::kLowRankFactor
                              ? compression::acp_factor(nt.tensor).contiguous()
                              : compression::decode(nt.tensor).contiguous();
  }
  SPARROW_CHECK_T(Error, task.control.empty() || scaffold,
                  "task: control variates with algorithm '" << tc.algorithm << "'");
  check_tensors(task.control, "task control", /*exact=*/!task.control.empty());
  p.server_control = decode_all(task.control);
  if (task.secagg)  // the server's config refuses these; a client checks what it is asked to do
    secagg::check_compatible(task.compression, "mean", "none", tc.algorithm);
  // The Task is acceptable: we now hold B_{r-1}.
  persist_held(task.round - 1, base);
  rehello_round.reset();
  return p;
}

ClientSession::Impl::Trained ClientSession::Impl::train(const wire::Task& task, const Weights& base, Prepared& p) {
  const uint64_t r = task.round;
  const bool scaffold = p.tc.algorithm == "scaffold";
  const bool stateful = scaffold || p.tc.algorithm == "feddyn";  // c_i or h_i, kept in the state db
  if (!runner.run && (!trainer || !same_train_config(trainer->config(), p.tc)))
    trainer = std::make_unique<LocalTrainer>(replica, p.tc);
  Trained t;
  // Work on a copy: a failure below leaves the persisted state as it was.
  // The round whose update was committed last and never answered, asked
  // again (the update never reached the server: the client died, or the
  // connection closed, right after committing it; the server re-sends the
  // Task of its open round on the next Hello): trained again from the state
  // before it, so the update that goes out is the lost one and no residual
  // or c_i step is applied twice. (An answered round asked again, e.g. by a
  // server resumed from an older checkpoint, trains from the current state.)
  t.replay = committed_round == r && r > 0 && !committed_answered;
  std::optional<state::ClientState> kept;
  if (t.replay) kept = store->get(kKeptStateKey);
  if (t.replay && !kept) {
    spdlog::warn("round {}: the state from before the last update is missing: training from the current state", r);
    t.replay = false;
  }
  if (t.replay)
    spdlog::info("round {}: asked again for the round last committed: training from the state before it", r);
  t.next = t.replay ? std::move(*kept) : st.deep_copy();
  // The model received, on data it was never trained on (federated evaluation).
  std::optional<std::pair<double, double>> held;
  if (holdout.size() > 0) held = trainer->evaluate(base, holdout.x, holdout.y);
  const auto t0 = Clock::now();
  if (runner.run) {
    SPARROW_CHECK_T(Error, !stateful && p.tc.algorithm != "fednova",
                    "task: algorithm " << p.tc.algorithm << " cannot be relayed by a gateway");
    t.tr = runner.run(task, base);
    SPARROW_CHECK_T(Error, t.tr.num_samples > 0, "task: the runner returned no samples");
    for (const auto& nm : names)
      SPARROW_CHECK_T(Error, t.tr.delta.count(nm) && t.tr.delta.at(nm).sizes().vec() == shapes.at(nm),
                      "task: the runner's delta lacks '" << nm << "' or has another shape");
  } else {
    t.tr = trainer->train(base, data.x, data.y, task.seed, stateful ? &t.next.control : nullptr,
                          scaffold ? &p.server_control : nullptr);
  }
  t.secs = std::chrono::duration<double>(Clock::now() - t0).count();
  t.metrics = {{"train_loss", t.tr.mean_loss}, {"train_seconds", t.secs}};
  if (held) {
    t.metrics.emplace_back("eval_loss", held->first);
    t.metrics.emplace_back("eval_accuracy", held->second);
  }
  t.outgoing = t.tr.delta;
  if (ldp.mode == aggregation::DpSpec::Mode::kLocal) {
    // The noise must be unknown to the server: drawn from this device's own
    // entropy, never from the task's seed.
    const uint64_t key = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
    const double norm = federation::local_dp_update(t.outgoing, ldp.clip, ldp.noise, key);
    const auto spent =
        aggregation::sgm_epsilon(1.0, std::max(ldp.noise, 1e-12), static_cast<int64_t>(t.next.rounds + 1), ldp.delta);
    spdlog::info("event=local_dp round={} norm={:.4g} clip={} noise={} participations={} epsilon={:.4g} delta={}", r,
                 norm, ldp.clip, ldp.noise, t.next.rounds + 1, spent.epsilon, ldp.delta);
  }
  t.next.rounds += 1;
  return t;
}

void ClientSession::Impl::commit_and_send(uint64_t r, const Trained& t, const std::string& bytes) {
  const uint64_t limit = welcome.max_message_bytes > 0 ? std::min(welcome.max_message_bytes, max_bytes) : max_bytes;
  SPARROW_CHECK_T(Error, bytes.size() <= limit,
                  "update of " << bytes.size() << " bytes exceeds max_message_bytes " << limit);
  // Error feedback is committed with the update it produced, before sending
  // (a crash after this point does not replay the residual), and the state
  // before it is kept, in the same transaction, until the server answers: a
  // Task of this round asked again is trained from it (train()).
  // In this order, a state the store refuses changes nothing.
  state::ClientState next = t.next.deep_copy();
  next.round_to(state::parse_encoding(cfg.state_encoding));  // what state_db keeps: a restart continues the same
  if (!t.replay) store->put(kKeptStateKey, st);
  store->put(kStateKey, next);
  st = std::move(next);
  committed_round = r;
  committed_answered = false;
  store->set_meta(kMetaCommitRound, std::to_string(r));
  store->set_meta(kMetaCommitAnswered, "0");
  store->flush();
  ++n.tasks_done;
  pending_round = r;
  spdlog::info("round {}: trained {} samples in {:.2f} s (loss {:.4f}), sending {} bytes", r, t.tr.num_samples, t.secs,
               t.tr.mean_loss, bytes.size());
  // A gateway says how many samples it holds right before its update (the
  // server caps the update's weight at that; its clients came after its
  // Hello). In order on the one connection, so the server has it first.
  if (runner.run && runner.samples)
    send(message(wire::Heartbeat{known_round, std::max<uint64_t>(1, runner.samples())}));
  if (!link.send(bytes)) spdlog::warn("round {}: the update could not be queued", r);
}

void ClientSession::Impl::train_and_send(const wire::Task& task, const Weights& base) {
  const uint64_t r = task.round;
  Prepared p = prepare(task, base);
  Trained t = train(task, base, p);
  // The client pipeline the simulator's clients run too
  // (federation/client_pipeline.h).
  std::map<std::string, compression::Context> contexts;
  for (const auto& name : names) {
    compression::Context c;
    c.name = name;
    c.round = static_cast<int64_t>(r);
    if (auto it = p.shared.find(name); it != p.shared.end()) c.shared_factor = it->second;
    if (auto it = p.masks.find(name); it != p.masks.end()) c.mask = it->second;
    contexts[name] = federation::client_context(std::move(c), task.seed, task.clients);
  }
  wire::ModelUpdate u = federation::make_update(r, cfg.client_id, t.tr.num_samples, names, t.outgoing, *p.comp,
                                                t.next.compressor, contexts, t.tr.control_delta, t.metrics);
  u.packed = wire::packs_well(u, server_minor);
  if (cfg.update_delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(cfg.update_delay_ms));
  commit_and_send(r, t, wire::serialize(message(u)));
}

}  // namespace sparrow::client
