#pragma once
// The simulator's run loop (FedML Parrot's design with Sparrow's own client and
// aggregation code): a population of stateful clients trained one after another
// on a few workers, each worker folding its clients' updates into a partial
// aggregate, the partials merged in worker order into the global step.
//
// One round t (0-based; metrics number rounds from 1):
//  1. Available clients: Bernoulli(profiles.availability) per (seed, t, client).
//     clients_per_round of them are sampled without replacement (seeded by
//     (seed, t)) and sorted by id.
//  2. schedule_lpt assigns them to `workers` threads with a cost model fed by
//     each client's measured training seconds (one client at a time; batched
//     passes: by sample count, see Determinism).
//  3. A worker, for each of its clients in ascending id: loads the client's
//     ClientState, trains (LocalTrainer, weights copied into the worker's one
//     replica), encodes every parameter delta with the one compressor and the
//     client's per-tensor state, serialises a wire ModelUpdate (bytes_up is its
//     exact size), parses the bytes back as a server would and adds the parsed
//     tensors to its StreamingAggregator with weight num_samples.
//  4. Straggler model: simulated client time = downlink (dense fp32 model) +
//     measured train seconds / speed factor + uplink (message bytes). With
//     deadline_s > 0 a client slower than the deadline is dropped (its update is
//     not aggregated; its own state still advances, as on a real device).
//  5. Partials merged in worker order; ServerOptimizer steps the global model
//     with the mean delta; SCAFFOLD's server control c += (1/N)·Σ Δc_i over the
//     kept clients (Karimireddy et al. Alg. 1, |S|/N · mean); ACP's next shared
//     factor per low-rank tensor = acp_next_shared(factor_mean).
//  6. Each client's state is put into the store right after it is encoded (the
//     store's writer thread streams it into an open transaction). The metrics
//     row goes to run.db, then metrics.csv; every checkpoint_every rounds (and
//     after the last) the checkpoint is set as store meta and commits that
//     transaction: client states and checkpoint are one atomic commit.
//
// Determinism: a run is bit-reproducible from its config (and resume
// reproduces the uninterrupted run) with any number of workers: updates fold
// in client-id order, and with batched passes (whose bits depend on the pass
// mates) the LPT assignment is by sample count, never by measured times.
// Straggler dropping depends on measured train seconds and so is only
// reproducible when the deadline is far from the clients' times.
//
// Over MPI ranks (mpirun -np R sparrow-sim): the LPT slots are ranks x workers;
// rank 0 sends each rank the round's model and its clients with their states
// (the state travels with the task), the ranks send back each client's wire
// update and new state, and rank 0 folds them in client-id order. With
// client_batch = 1 the model is then bit-identical for any number of ranks and
// workers, and to one process with workers = 1 (batched passes group clients
// by rank and worker).
//
// Run folder (cfg.out): config.toml, metrics.csv, run.db (table rounds),
// client_state.db (client states and the checkpoint; with keep_client_state =
// false only the checkpoint once the run is done). See docs/simulator.md.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "simulator/config.h"

namespace at {
class Tensor;
}

namespace sparrow::core {
class Model;
}

namespace sparrow::simulator {

class Cluster;

// One selected client of a round (for the dashboard's client table).
struct Participant {
  int64_t client = 0;
  int64_t samples = 0;    // its training samples
  uint64_t bytes_up = 0;  // its serialized update
  bool kept = false;      // aggregated (false: a straggler dropped at the deadline)
};

struct RoundMetrics {
  int round = 0;            // 1-based
  double accuracy = 0;      // NaN on rounds without evaluation
  double loss = 0;          // NaN on rounds without evaluation
  double train_loss = 0;    // sample-weighted mean local training loss of the selected clients
  uint64_t bytes_up = 0;    // serialized ModelUpdate bytes of the selected clients
  uint64_t bytes_down = 0;  // dense fp32 model bytes × selected clients
  double sim_round_s = 0;   // simulated wall-clock of the round
  double real_s = 0;        // measured wall-clock of the round
  int clients = 0;          // selected clients
  int dropped = 0;          // stragglers whose update was not aggregated
  // The global step refused the round's aggregate (not finite) and left the
  // model as it was, as sparrow-server abandons such a round. Not persisted.
  bool abandoned = false;
  int64_t samples = 0;  // samples trained (data × local epochs); not persisted, 0 on rounds a resume reloads
  double eval_s = 0;    // of real_s, the seconds spent evaluating; not persisted
  double epsilon = 0;   // DP: privacy spent after this round at dp's delta; NaN without DP
  double clip = 0;      // the norm bound the aggregator applied (central DP, normclip); NaN if none
  std::vector<Participant> participants;  // by client id; not persisted, empty on rounds a resume reloads
  // Over MPI ranks: the bytes each rank sent this round (rank 0: the round's
  // model to every rank and each rank the ids of its clients; rank r: its
  // clients' updates; client states stay on their owner rank). Empty in one
  // process; not persisted.
  std::vector<uint64_t> rank_bytes;
  // Over MPI ranks, rank 0's seconds this round: sending the round (model,
  // client ids), waiting for the other ranks after training its own clients,
  // folding every update in id order. Not persisted.
  double rank0_send_s = 0, rank0_wait_s = 0, rank0_fold_s = 0;
};

struct Summary {
  int rounds = 0;         // completed rounds
  double accuracy = 0;    // last evaluated (NaN if none)
  double loss = 0;        // last evaluated (NaN if none)
  uint64_t bytes_up = 0;  // totals over all completed rounds
  uint64_t bytes_down = 0;
  double sim_wall_s = 0;
  double real_s = 0;
  double epsilon = 0;              // DP: after the last completed round (NaN without DP)
  int ranks = 1;                   // MPI ranks of this process's run (1: one process)
  std::vector<double> rank_bytes;  // over ranks: mean bytes each rank sent per round this process ran
  double rank0_send_s = 0, rank0_wait_s = 0, rank0_fold_s = 0;  // over ranks: means per round
};

// {"rounds":..,"accuracy":..,"loss":..,"bytes_up":..,"bytes_down":..,"sim_wall_s":..,"real_s":..,"epsilon":..}
// on one line; NaN values are null. Over MPI ranks also "ranks" and
// "rank_bytes_per_round" (one mean per rank), "rank0_send_s", "rank0_wait_s"
// and "rank0_fold_s" (means per round).
std::string summary_json(const Summary& s);

// The model for `name`: core::make_model, plus the simulator's "logreg"
// (multinomial logistic regression input_dim -> classes, zero-initialised as
// in FedProx's Synthetic experiments; one parameter pair "fc.weight"/"fc.bias").
std::shared_ptr<core::Model> make_sim_model(const std::string& name, uint64_t seed, int64_t input_dim, int64_t classes);

// The global model of a run folder's last checkpoint and its round: what
// `sparrow-sim export` writes out. ConfigError for a folder without a run or a
// checkpoint, FormatError for a damaged one.
std::pair<std::map<std::string, at::Tensor>, int> load_run_model(const std::string& run_dir);

class Simulator {
 public:
  using Weights = std::map<std::string, at::Tensor>;

  // Builds data, population, workers and the run folder. resume = false starts
  // afresh (an existing run folder's metrics, checkpoints and client states are
  // replaced); resume = true continues cfg.out's last checkpoint, which must
  // have been written with the same config up to `rounds` (ConfigError
  // otherwise, or when there is nothing to resume). Throws ConfigError for a
  // bad config (model/dataset mismatch, unknown compressor, ...).
  //
  // With `cluster` of several ranks (simulator/cluster.h) every rank
  // constructs a Simulator from the same config: rank 0 runs the rounds (and
  // alone keeps the run folder), the others call serve(). A run's model does
  // not depend on the number of ranks (updates are folded on rank 0 in
  // client-id order). secagg and attack = "alie" are refused over ranks.
  explicit Simulator(SimConfig cfg, bool resume = false, Cluster* cluster = nullptr);
  ~Simulator();
  Simulator(const Simulator&) = delete;
  Simulator& operator=(const Simulator&) = delete;

  // Runs the next round and checkpoints it. Error when all rounds are done.
  // After request_stop() it may stop in the middle: then interrupted() is
  // true, the round did not happen (no metrics row, no client state of it is
  // kept) and completed_rounds() is unchanged.
  RoundMetrics run_round();
  // Ranks other than 0: trains the clients rank 0 sends, round after round,
  // until rank 0's Simulator is destroyed.
  void serve();
  // From any thread (a signal handler too: it only stores atomics): stop the
  // current round once `after_clients` more clients have finished training
  // (0: after the clients in training now). run() returns then.
  void request_stop(int64_t after_clients = 0) noexcept;
  bool interrupted() const;
  // Clients of the round in progress that finished training so far (any
  // thread: an atomic read; 0 between rounds).
  int64_t clients_finished() const;
  // Runs the remaining rounds; `progress` (may be empty) after each.
  void run(const std::function<void(const RoundMetrics&)>& progress = {});
  bool done() const;
  // Blocks until the checkpoints run_round() handed to the client-state
  // store's background writer are durable (run_round() does not wait, except
  // after the last round). Benchmarks use it to charge that work to the round.
  void wait_for_checkpoint();
  // Checkpoints the last completed round now and waits until it is durable
  // (an interrupted run stops between rounds; --resume continues from here).
  void checkpoint_now();
  int completed_rounds() const;

  Summary summary() const;
  const std::vector<RoundMetrics>& history() const;
  const Weights& global() const;
  const SimConfig& config() const;
  // How clients are trained (batched or one at a time, per pass, device), one
  // line for the log; says when client_batch was ignored and why.
  const std::string& training_mode() const;
  // The clients round `round` (0-based) trains, sorted by id (a pure function
  // of the config), and each client's sample indices into the training set:
  // what a benchmark needs to run the same workload in another tool.
  std::vector<int64_t> selection(int round) const;
  std::vector<std::vector<int64_t>> partition() const;

 private:
  struct Impl;
  // keep_client_state = false, once the last round is checkpointed:
  // client_state.db is replaced by one that holds only that checkpoint
  // (run_folder.cc).
  void drop_client_states();
  std::unique_ptr<Impl> impl_;
};

// What a run writes into its folder, estimated before it starts from the
// model, the codec and the algorithm (run_folder.cc; docs/simulator.md, "Disk
// use"). One client's state is measured, not guessed: the codec's state after
// encoding the model once (DGC: residual and momentum, 2 x the model), plus
// SCAFFOLD's control (1 x the model), serialized as client_state.db stores it.
struct DiskEstimate {
  uint64_t state_per_client = 0;  // one client's stored state (ClientState::serialize)
  uint64_t codec_state = 0;       // of which the codec's state
  uint64_t control_state = 0;     // of which SCAFFOLD's control variate
  double clients_with_state = 0;  // expected clients that take part at least once (selection is random)
  uint64_t client_states = 0;     // clients_with_state x state_per_client, as stored
  uint64_t checkpoint = 0;        // the run checkpoint (model, optimiser, control, broadcast)
  uint64_t client_state_db = 0;   // client_state.db after the last round, keep_client_state = true
  uint64_t checkpoint_wal = 0;    // while a checkpoint commits, client_state.db-wal up to this
  uint64_t history = 0;           // run.db, metrics.csv, config.toml
  uint64_t total = 0;             // what the folder reaches: client_state.db and the history
  uint64_t after_run = 0;         // what it holds after the last round (less with keep_client_state = false)
};
DiskEstimate estimate_disk(const Simulator& sim);
// One line for the log: the total, what makes it up, what keep_client_state does.
std::string disk_estimate_text(const DiskEstimate& e, const SimConfig& cfg);

}  // namespace sparrow::simulator
