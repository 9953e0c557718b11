// Server::Impl's database and evaluation: the run created or resumed from
// cfg.db (server/store.h) with its checks, what a checkpoint holds (the
// global model, the optimiser, SCAFFOLD's c, the downlink, ACP factors, the
// aggregator's DP state), and W_r evaluated on the evaluation data.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <sstream>

#include "compression/state.h"
#include "core/error.h"
#include "server/impl.h"

namespace sparrow::server {

void Server::Impl::open_store() {
  store = ServerStore::open(cfg.db);
  const std::string hash = config_hash(cfg);
  std::optional<RunRow> run = store->run();
  if (!run) {
    RunRow r;
    std::ostringstream id;
    id << "run-" << hash.substr(0, 8) << "-" << std::hex << static_cast<uint64_t>(unix_now() * 1000);
    r.run_id = id.str();
    r.config_hash = hash;
    r.config = identity_text(cfg);
    r.created = static_cast<int64_t>(unix_now());
    store->create_run(r);
    run = r;
    spdlog::info("event=run_created run_id={} db={} config_hash={}", r.run_id, cfg.db, hash);
  } else {
    SPARROW_CHECK_T(ConfigError, run->config_hash == hash,
                    "database '" << cfg.db << "' holds run " << run->run_id
                                 << " with another configuration; use another db or the same settings. Stored:\n"
                                 << run->config << "This config:\n"
                                 << identity_text(cfg));
  }
  run_id = run->run_id;
  run_created = run->created;
  for (ClientRow& c : store->clients()) {
    if (!c.public_key.empty()) id_of_key.emplace(c.public_key, c.client_id);  // the first binding stands
    clients[c.client_id] = c;
  }
  std::optional<Checkpoint> ck = store->latest_checkpoint();
  for (int64_t r : store->damaged_checkpoints())
    spdlog::warn("event=checkpoint_damaged round={} db={} msg=\"checksum mismatch: skipped, {}\"", r, cfg.db,
                 ck ? "resuming from round " + std::to_string(ck->round) + " (later rounds run again)"
                    : std::string("no intact checkpoint"));
  // The rounds table says how far the run got. A newest checkpoint behind it
  // (rows deleted or damaged) loses the rounds in between, said in a warning;
  // none at all is refused rather than taken for a new run.
  const int64_t recorded = store->completed_rounds();
  SPARROW_CHECK_T(FormatError, ck || recorded == 0,
                  "server database '" << cfg.db << "' records " << recorded
                                      << " completed round(s) but holds no checkpoint to resume from; restore it "
                                         "from a backup, or use another db to start a new run");
  if (ck && ck->round < recorded)
    spdlog::warn(
        "event=rounds_lost db={} checkpoint_round={} recorded_rounds={} lost={} msg=\"the newest checkpoint is of "
        "round {}: rounds {} to {} are lost and run again\"",
        cfg.db, ck->round, recorded, recorded - ck->round, ck->round, ck->round + 1, recorded);
  if (ck) resume(*ck);
}

void Server::Impl::resume(const Checkpoint& ck) {
  // The global side's pieces, checked and restored by the round engine (as
  // sparrow-sim restores its own). (Checkpoints before the shared round
  // engine also hold per-tensor downlink codec states; each round's encode
  // now starts afresh.)
  federation::GlobalState st;
  st.weights = ck.weights;
  st.server_opt = ck.server_opt;
  st.control = ck.control;
  st.shared = ck.acp;
  st.aggregator = ck.aggregator;
  st.broadcast = ck.broadcast;
  {
    std::lock_guard<std::mutex> g(weights_mu);
    engine->load(st, "server database '" + cfg.db + "'");
  }
  if (gm->has_downlink() && !ck.downlink_last.empty()) {
    wire::Message m = wire::parse(ck.downlink_last);
    down_last = std::move(std::get<wire::ModelUpdate>(m.body).tensors);
  }
  completed = ck.round;
  round = static_cast<uint64_t>(ck.round);
  n.rounds = static_cast<uint64_t>(ck.round);
  spdlog::info("event=resumed run_id={} round={} db={}", run_id, ck.round, cfg.db);
}

Checkpoint Server::Impl::checkpoint(int64_t r) {
  Checkpoint c;
  c.round = r;
  federation::GlobalState st;
  {
    std::lock_guard<std::mutex> g(weights_mu);
    st = engine->save();
  }
  c.weights = std::move(st.weights);
  c.server_opt = std::move(st.server_opt);
  c.control = std::move(st.control);
  c.acp = std::move(st.shared);
  c.aggregator = std::move(st.aggregator);
  c.broadcast = std::move(st.broadcast);
  if (gm->has_downlink()) {
    wire::ModelUpdate u;
    u.round = static_cast<uint64_t>(r);
    u.client_id = "server";
    u.num_samples = 1;
    u.tensors = down_last;
    c.downlink_last = wire::serialize(msg(std::move(u)));
  }
  c.rng = "seed=" + std::to_string(cfg.seed) + ";select_round=" + std::to_string(r + 1);
  return c;
}

std::pair<double, double> Server::Impl::evaluate() {
  c10::NoGradGuard ng;
  {
    std::lock_guard<std::mutex> g(weights_mu);
    for (auto& p : eval_model->named_parameters(/*recurse=*/true)) p.value().copy_(gm->weights().at(p.key()));
  }
  eval_model->eval();
  const int64_t N = test.size();
  double loss = 0;
  int64_t correct = 0;
  for (int64_t i = 0; i < N; i += cfg.eval_batch) {
    const int64_t e = std::min<int64_t>(N, i + cfg.eval_batch);
    at::Tensor x = test.x.slice(0, i, e), y = test.y.slice(0, i, e);
    at::Tensor logits = eval_model->forward(x);
    loss += at::nll_loss(at::log_softmax(logits, 1), y, {}, at::Reduction::Sum).item<double>();
    correct += logits.argmax(1).eq(y).sum().item<int64_t>();
  }
  return {N ? loss / static_cast<double>(N) : kNaN, N ? static_cast<double>(correct) / static_cast<double>(N) : kNaN};
}

}  // namespace sparrow::server
