// The public Simulator (simulator/simulator.h) over Simulator::Impl
// (simulator/impl.h, whose parts are defined by job in this folder):
// construction (config checks, data, workers, the run folder or its resume),
// the run loop, stop requests and the summary; and the simulator's own
// "logreg" model.
#include "simulator/simulator.h"

#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <mutex>

#include "aggregation/robust.h"
#include "core/error.h"
#include "core/rng.h"
#include "simulator/impl.h"

namespace sparrow::simulator {
namespace {

constexpr uint64_t kDpTag = 0x64702020;  // "dp  ": central DP's noise stream

class LogReg final : public core::Model {
 public:
  LogReg(int64_t in, int64_t out) {
    fc_ = register_module("fc", torch::nn::Linear(in, out));
    torch::NoGradGuard g;
    fc_->weight.zero_();
    fc_->bias.zero_();
  }
  at::Tensor forward(const at::Tensor& x) override { return fc_->forward(x.reshape({x.size(0), -1})); }
  bool can_forward_clients() const override { return true; }
  at::Tensor forward_clients(const std::vector<at::Tensor>& p, const at::Tensor& x) override {
    SPARROW_CHECK(p.size() == 2 && x.dim() >= 3, "logreg forward_clients: bad arguments");
    return core::linear_clients(x.reshape({x.size(0), x.size(1), -1}).transpose(1, 2), p[0], p[1]).transpose(1, 2);
  }

 private:
  torch::nn::Linear fc_{nullptr};
};

}  // namespace

std::shared_ptr<core::Model> make_sim_model(const std::string& name, uint64_t seed, int64_t input_dim,
                                            int64_t classes) {
  // "logreg" through the model registry, like any user model (its size
  // follows the data: ModelArgs).
  static std::once_flag once;
  std::call_once(once, [] {
    core::register_model(
        "logreg",
        [](Spec&, const core::ModelArgs& a) -> std::shared_ptr<core::Model> {
          SPARROW_CHECK_T(ConfigError, a.input_dim > 0, "model 'logreg' needs the data's feature count");
          return std::make_shared<LogReg>(a.input_dim, a.classes);
        },
        "multinomial logistic regression over the data's features, zero-initialised (sparrow-sim)");
  });
  core::ModelArgs args;
  args.seed = seed;
  args.input_dim = input_dim;
  args.classes = classes;
  return core::make_model(name, args);
}

Simulator::Simulator(SimConfig cfg, bool resume, Cluster* cluster) : impl_(std::make_unique<Impl>(std::move(cfg))) {
  Impl& s = *impl_;
  s.cluster = cluster;
  SPARROW_CHECK_T(ConfigError, s.cfg.workers >= 1, "workers: must be >= 1");
  SPARROW_CHECK_T(ConfigError, s.cfg.clients_per_round >= 1 && s.cfg.clients_per_round <= s.cfg.clients,
                  "clients_per_round: must be in 1..clients");
  if (resume && !s.remote()) {
    const fs::path prev = s.dir / "config.toml";
    SPARROW_CHECK_T(ConfigError, fs::exists(prev), "resume: " << prev.string() << " not found");
    SimConfig old = load_config(prev.string());
    Impl::copy_safe_keys(s.cfg, old);
    if (!(old == s.cfg)) Impl::refuse_differences(old, s.cfg, prev.string());
  }
  compression::register_builtins();
  s.compressor = compression::make_compressor(s.cfg.compression);
  s.aggregator = std::make_unique<aggregation::Aggregator>(s.cfg.aggregator, s.cfg.dp, s.cfg.clients_per_round,
                                                           rng::derive(s.cfg.seed, kDpTag));
  aggregation::check_combination(s.aggregator->robust(), s.aggregator->dp(), s.cfg.compression, s.cfg.algorithm);
  SPARROW_CHECK_T(ConfigError, s.aggregator->robust().min_updates() <= s.cfg.clients_per_round,
                  "aggregator: '" << s.cfg.aggregator << "' needs at least " << s.aggregator->robust().min_updates()
                                  << " updates per round");
  s.dp = s.aggregator->dp();
  s.sa_params = secagg::Params::parse(s.cfg.secagg);
  if (s.sa_params.enabled) {
    secagg::check_compatible(s.cfg.compression, s.cfg.aggregator, s.cfg.dp, s.cfg.algorithm);
    SPARROW_CHECK_T(ConfigError, static_cast<uint32_t>(s.cfg.clients_per_round) >= s.sa_params.min_clients(),
                    "secagg: threshold " << s.sa_params.effective_threshold()
                                         << " needs clients_per_round >= " << s.sa_params.min_clients());
  }
  s.attack = AttackSpec::parse(s.cfg.attack);
  if (s.async_mode()) {  // what a simulated asynchronous run cannot do yet (docs/async.md)
    SPARROW_CHECK_T(ConfigError, !s.distributed(),
                    "mode: \"async\" runs in one process; run sparrow-sim without mpirun");
    SPARROW_CHECK_T(ConfigError, s.attack.kind != AttackSpec::Kind::kAlie,
                    "attack: alie pools a round's honest updates, and mode = \"async\" has no rounds");
    SPARROW_CHECK_T(ConfigError, !(s.cfg.deadline_s > 0),
                    "deadline_s: mode = \"async\" has no round deadline (no update is waited for); set deadline_s = 0");
  }
  if (s.distributed()) {
    SPARROW_CHECK_T(ConfigError, !s.sa_params.enabled,
                    "secagg: not available over MPI ranks yet (the protocol's server runs in one process); run "
                    "sparrow-sim without mpirun");
    SPARROW_CHECK_T(ConfigError, s.attack.kind != AttackSpec::Kind::kAlie,
                    "attack: alie needs every honest update of the round in one process; run sparrow-sim without "
                    "mpirun");
    s.cost = CostModel(s.cfg.workers * s.cluster->size());
  }
  if (s.cfg.adversaries > 0) s.adversary = choose_adversaries(s.cfg.clients, s.cfg.adversaries, s.cfg.seed);
  if (s.cfg.device != "cpu") {
    SPARROW_CHECK_T(
        ConfigError, torch::cuda::is_available(),
        "device = \"" << s.cfg.device << "\": no CUDA device is visible, or this build's LibTorch has no CUDA");
    s.device = at::Device(s.cfg.device);
    // Ranks on one machine share its GPUs: "cuda" means cuda:(local rank mod GPUs).
    if (s.distributed() && s.cfg.device == "cuda") {
      const char* lr = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
      const int gpus = static_cast<int>(torch::cuda::device_count());
      if (lr != nullptr && gpus > 1)
        s.device = at::Device(at::kCUDA, static_cast<at::DeviceIndex>(std::atoi(lr) % gpus));
    }
  }
  s.load_data();
  s.stage_data();
  s.build_population();
  s.build_workers();
  if (s.remote()) {  // rank 0 keeps the run folder; this rank its clients' store (ranks.cc)
    s.join_ranks();
    return;
  }
  s.open_db(resume);
  if (resume) {
    s.check_resume_config();
    s.load_checkpoint();
    std::ofstream(s.dir / "config.toml") << to_toml(s.cfg);  // records a changed `rounds`
  }
  if (s.distributed()) s.start_ranks(resume);
}

Simulator::~Simulator() {
  // Rank 0 ends the other ranks' serve(); not while an exception unwinds (a
  // rank may be blocked mid-round then: the caller aborts the job).
  Impl& s = *impl_;
  if (s.distributed() && !s.remote() && std::uncaught_exceptions() == 0) {
    try {
      s.end_ranks();
    } catch (...) {
    }
  }
}

void Simulator::serve() {
  Impl& s = *impl_;
  SPARROW_CHECK(s.remote(), "serve: only ranks other than 0 of an MPI run serve");
  while (s.serve_round()) {
  }
}

RoundMetrics Simulator::run_round() {
  impl_->interrupted = false;
  struct Reset {  // 0 between rounds, also when the round throws
    std::atomic<int64_t>& n;
    ~Reset() { n.store(0); }
  } reset{impl_->finished};
  RoundMetrics m = impl_->step();
  if (done() && !impl_->cfg.keep_client_state) drop_client_states();
  return m;
}

void Simulator::run(const std::function<void(const RoundMetrics&)>& progress) {
  while (!done()) {
    RoundMetrics m = run_round();
    if (impl_->interrupted) return;
    if (progress) progress(m);
  }
}

void Simulator::request_stop(int64_t after_clients) noexcept {
  impl_->stop_after.store(after_clients);
  impl_->stop_requested.store(true);
}

bool Simulator::interrupted() const { return impl_->interrupted; }

int64_t Simulator::clients_finished() const { return impl_->finished.load(); }

void Simulator::wait_for_checkpoint() { impl_->store->wait_written(); }

void Simulator::checkpoint_now() {
  // Round 0 too: a run stopped before its first round ends says "continue
  // with --resume", so the initial model and config must be there to resume.
  impl_->checkpoint(impl_->round, /*wait=*/true);
}

bool Simulator::done() const { return impl_->round >= impl_->cfg.rounds; }
int Simulator::completed_rounds() const { return impl_->round; }

Summary Simulator::summary() const {
  Summary s;
  s.rounds = impl_->round;
  s.accuracy = s.loss = s.epsilon = kNaN;
  if (impl_->distributed()) {
    s.ranks = impl_->cluster->size();
    s.rank_bytes.assign(static_cast<size_t>(s.ranks), 0.0);
    int n = 0;
    for (const auto& m : impl_->history)
      if (m.rank_bytes.size() == s.rank_bytes.size()) {
        for (size_t r = 0; r < m.rank_bytes.size(); ++r) s.rank_bytes[r] += static_cast<double>(m.rank_bytes[r]);
        s.rank0_send_s += m.rank0_send_s;
        s.rank0_wait_s += m.rank0_wait_s;
        s.rank0_fold_s += m.rank0_fold_s;
        ++n;
      }
    for (double& b : s.rank_bytes) b = n > 0 ? b / n : 0.0;
    for (double* v : {&s.rank0_send_s, &s.rank0_wait_s, &s.rank0_fold_s}) *v = n > 0 ? *v / n : 0.0;
  }
  for (const auto& m : impl_->history) {
    s.bytes_up += m.bytes_up;
    s.bytes_down += m.bytes_down;
    s.sim_wall_s += m.sim_round_s;
    s.real_s += m.real_s;
    if (!std::isnan(m.accuracy)) {
      s.accuracy = m.accuracy;
      s.loss = m.loss;
    }
    s.epsilon = m.epsilon;
  }
  return s;
}

const std::vector<RoundMetrics>& Simulator::history() const { return impl_->history; }
const Simulator::Weights& Simulator::global() const { return impl_->gm->weights(); }
const SimConfig& Simulator::config() const { return impl_->cfg; }
const std::string& Simulator::training_mode() const { return impl_->training; }
std::vector<int64_t> Simulator::selection(int round) const { return impl_->select_clients(round); }
std::vector<std::vector<int64_t>> Simulator::partition() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& idx : impl_->client_idx) {
    const at::Tensor c = idx.to(at::kCPU).contiguous();
    out.emplace_back(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  }
  return out;
}

}  // namespace sparrow::simulator
