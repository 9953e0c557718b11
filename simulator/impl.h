#pragma once
// Private to sparrow_sim: Simulator::Impl, the state of one run, and the
// plain structs its parts share. Its methods are defined by job:
//   simulator.cc     the public Simulator: construction, the run loop, the summary
//   data.cc          the data set, its partition over the clients, the clients' profiles
//   clients.cc       workers: training (one client at a time or batched), the client
//                    pipeline (federation/client_pipeline.h), the fold into the round
//   round.cc         driving one round of the engine (federation::RoundEngine, the
//                    server's): selection, scheduling, the global step, its metrics
//   secagg_round.cc  SecAgg+ with its messages handed over in memory
//   ranks.cc         MPI ranks: client owners, rank 0's messages, the other ranks' loop
//   run_folder.cc    run.db, metrics.csv and config.toml: the history of the rounds
//   checkpoint.cc    checkpoints in client_state.db, resume and its checks
// Threads: run_worker() runs on one thread per worker; what it touches
// besides its Worker is the store (thread-safe), `sa` (under sa->mu) and the
// stop counters (atomics). Everything else belongs to the thread that calls
// Simulator's methods.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "aggregation/aggregator.h"
#include "aggregation/robust.h"
#include "client/batched_trainer.h"
#include "client/trainer.h"
#include "compression/compressor.h"
#include "core/datasets.h"
#include "core/models.h"
#include "core/sqlite_db.h"
#include "federation/async_engine.h"
#include "federation/global_model.h"
#include "federation/round_engine.h"
#include "secagg/secagg.h"
#include "simulator/attack.h"
#include "simulator/cluster.h"
#include "simulator/config.h"
#include "simulator/scheduler.h"
#include "simulator/simulator.h"
#include "state/store.h"
#include "wire/wire.h"

namespace sparrow::simulator {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

inline const double kNaN = std::numeric_limits<double>::quiet_NaN();

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A client's compute speed and link rates, drawn once from the seed.
struct Profile {
  double speed = 1;
  double up_bps = 0;
  double down_bps = 0;
};

// What a worker reports about one client.
struct ClientResult {
  int64_t client = 0;
  int64_t samples = 0;
  double train_s = 0;
  double sim_s = 0;
  double train_loss = 0;
  uint64_t bytes_up = 0;
  bool kept = false;
  bool trained = false;      // false for the clients a stop in the middle of the round skipped
  state::ClientState state;  // moved into the store once encoded
  // Over MPI ranks: the serialized wire update and SCAFFOLD's Δc, folded on
  // rank 0 in client-id order.
  std::string update;
  client::Weights control_delta;
};

// An ALIE adversary's honest update, held until the round's pool is complete.
struct Deferred {
  ClientResult* r = nullptr;
  client::TrainResult tr;
};

// A worker's host path, summed over its clients since the round began:
// everything a client costs besides training (docs/performance.md, "Per-client
// host cost"). Seconds; one worker's thread writes it, step() reads it after
// the workers joined.
struct HostStages {
  double get = 0;      // the client's state from the store
  double encode = 0;   // the client pipeline: local DP or an attack, the codec
  double message = 0;  // the wire message built (or its size computed)
  double put = 0;      // the client's state into the store
  double parse = 0;    // the message parsed back (the wire round trip only)
  double fold = 0;     // the update into the round's aggregate
  int64_t clients = 0;
  HostStages& operator+=(const HostStages& o) {
    get += o.get;
    encode += o.encode;
    message += o.message;
    put += o.put;
    parse += o.parse;
    fold += o.fold;
    clients += o.clients;
    return *this;
  }
};

struct Worker {
  std::shared_ptr<core::Model> model;
  std::unique_ptr<client::LocalTrainer> trainer;
  std::unique_ptr<client::BatchedTrainer> batched;  // null when clients train one at a time
  size_t batch = 1;                                 // clients per pass (cap)
  size_t slot = 0;                                  // its slot in the round's OrderedFold
  std::vector<Deferred> deferred;                   // ALIE adversaries of this round
  HostStages host;                                  // this round's host path (reset by step())
};

// The client-state store as the simulator keeps it: checkpoint mode
// (background writer, explicit flushes), the run's state_encoding.
std::unique_ptr<state::ClientStateStore> open_store(const std::string& path, const SimConfig& cfg);

struct Simulator::Impl {
  SimConfig cfg;
  fs::path dir;

  explicit Impl(SimConfig c) : cfg(std::move(c)), dir(cfg.out), cost(std::max(1, cfg.workers)) {}

  // ---- data and population (data.cc) ----

  // Data: the full train tensor once, clients as index tensors.
  at::Tensor train_x, train_y, test_x, test_y;  // with validation > 0, test_* is the validation split
  std::string validation_note;
  std::vector<at::Tensor> client_idx;  // each client's samples in the data set as loaded
  // train_x/train_y are stored client-major: client c's samples are rows
  // [client_off[c], client_off[c] + its count), so a client's data is a view.
  std::vector<int64_t> client_off;
  std::vector<Profile> profiles;
  double availability = 1;
  std::string data_note;  // where a folder dataset's training and test samples came from

  void load_data();
  // The user's data: PATH in the format sparrow-client reads (x.npy + y.npy or
  // MNIST-format IDX), partitioned over the clients like Fashion-MNIST. The
  // test set is the folder's own (a test/ subfolder, or t10k IDX files), or
  // else `test_fraction` of the samples, drawn with the run's seed and held out
  // of training.
  void load_folder(const std::string& path);
  // validation > 0: `validation` of the training samples (drawn with the seed,
  // before partitioning) replace the test set, which this run then never reads.
  // Hyper-parameters are chosen on these runs; the chosen ones are then run
  // with validation = 0 and reported on the test set.
  void hold_validation(core::Dataset& tr, core::Dataset& te);
  // Client-major storage, once: no per-round copy of each client's samples.
  void store_client_major();
  // The data set lives on the training device for the whole run: each round's
  // minibatches are gathered there, never copied from the host per client.
  void stage_data();
  void build_population();

  // ---- the model, its codec, the global side ----

  std::unique_ptr<compression::Compressor> compressor;
  // Downlink compression, as sparrow-server does it (the same code:
  // federation::GlobalModel): clients train from the broadcast model B; after
  // each round the server encodes C = W - B (the gap is the error feedback)
  // and B += C. A client is sent what `downlink_catchup` picks for the
  // broadcast it holds (federation/catchup.h: the one-round delta C, a chain
  // of the deltas it missed, an exact patch, or the dense model), counted in
  // wire bytes. Who took part in a round follows from the seed
  // (select_clients), and the codec's step from the round, so only B, the
  // size of C are checkpointed; the catch-up history is not (after --resume a
  // client further behind gets the dense model, as after a server restart).
  uint64_t down_bytes = 0;         // wire bytes of the last C
  std::vector<std::string> names;  // parameter names, model order
  aggregation::TensorShapes shapes;
  uint64_t model_bytes = 0;  // dense fp32
  // W, B, SCAFFOLD's c, ACP factors and TCS masks, the server optimiser and
  // the global step: the round engine's global side, shared with sparrow-server.
  std::unique_ptr<federation::GlobalModel> gm;
  aggregation::ContextMap round_ctxs;                   // the codec contexts of the round in progress (gm->contexts)
  std::unique_ptr<aggregation::Aggregator> aggregator;  // robust aggregation, central DP
  // The round (federation::RoundEngine, the code sparrow-server runs its
  // rounds with): contexts, the fold in client-id order whatever worker or
  // rank finishes first, the global step.
  std::unique_ptr<federation::RoundEngine> engine;
  aggregation::DpSpec dp;       // local DP acts in finish_client
  std::vector<char> adversary;  // per client: attacks when selected
  AttackSpec attack;
  int64_t classes = 10;

  // The model the clients of a round start from.
  const client::Weights& start_model() const { return gm->broadcast(); }

  // ---- workers and their clients (clients.cc) ----

  std::vector<Worker> workers;
  CostModel cost;
  at::Device device{at::kCPU};
  std::string training;  // how clients are trained, for the log
  // Memory for one worker's stacked batched-client state (automatic client_batch).
  static constexpr int64_t kBatchBudget = int64_t{1} << 30;
  std::atomic<bool> stop_requested{false};
  std::atomic<int64_t> stop_after{0};  // clients still to finish after a stop request
  std::atomic<int64_t> finished{0};    // clients of the round in progress that finished training

  client::TrainConfig train_config() const;
  // The workers, their models and trainers; the global model from worker 0's.
  void build_workers();
  bool attacks(int64_t c) const { return !adversary.empty() && adversary[static_cast<size_t>(c)]; }
  // One worker's clients, in ascending id; results go to their slots.
  void run_worker(int w, int t, const std::vector<int64_t>& ids, std::vector<ClientResult*> out);
  // request_stop(): stop once `stop_after` more clients have finished.
  bool stop_now() const { return stop_requested.load() && stop_after.load() <= 0; }
  // Runs the client pipeline on one trained client (local DP, then encoding or,
  // under SecAgg+, quantising and masking: federation/client_pipeline.h), puts
  // its state into the store, and folds the update (as a server parses it)
  // into the worker's aggregate unless the straggler model drops it.
  void finish_client(Worker& wk, int t, ClientResult& r, const client::TrainResult& tr, aggregation::ContextMap& ctxs,
                     const client::Weights* replaced = nullptr);
  // Client c's update as a server parses it, and its SCAFFOLD Δc, into the
  // round's OrderedFold (from worker slot `slot`).
  // `host`, when given, gets the parse and fold times.
  void fold(size_t slot, int64_t c, const std::string& bytes, const client::Weights& control_delta,
            HostStages* host = nullptr);
  // This process's workers on their slots' clients (slots 0..workers-1), on
  // threads when there are several.
  void run_local(int t, const std::vector<std::vector<int64_t>>& wids,
                 const std::vector<std::vector<ClientResult*>>& wout);
  // ALIE: the round's adversaries pool their honest updates (in client-id
  // order) and each sends μ − z·σ of the pool.
  void send_alie(int t, int n_sel);

  // ---- one round (round.cc) ----

  int round = 0;             // completed rounds
  bool interrupted = false;  // the last run_round() was stopped in the middle
  std::vector<RoundMetrics> history;
  std::vector<int64_t> participations;  // rounds each client was selected (local DP accounting)
  int64_t most_participations = 0;

  // Round t (0-based): selection, training, the global step, evaluation, the
  // metrics row and (when due) a checkpoint.
  RoundMetrics step();
  // The clients of round t (0-based), ascending: the `sampler` rule
  // (federation/sampler.h) over the clients reachable in t. The uniform rule
  // needs no history; another rule (least_recent) sees each client's last
  // selection, replayed from round 0 and cached (selection_history).
  std::vector<int64_t> select_clients(int t) const;
  mutable std::vector<std::vector<int64_t>> selection_history;  // rounds 0.. of a history-dependent rule
  mutable std::vector<int64_t> last_selected;                   // per client: 1-based round, 0 = never
  // Privacy spent after `rounds` rounds (NaN without DP). Central: the
  // sampled Gaussian mechanism with q = clients_per_round / available
  // clients. Local: the most-selected client's participations, no
  // amplification.
  double epsilon_after(int rounds) const;
  void count_participations(const std::vector<int64_t>& ids);
  // Downlink bytes of round t (0-based) for the selected clients, and their
  // bookkeeping; then, after the server step, the broadcast of round t.
  uint64_t downlink_bytes(int t, const std::vector<int64_t>& ids) const;
  // Wire bytes of the masks that go to each selected client with the round's model.
  uint64_t mask_bytes() const;
  // At debug level: the round's host stages summed over the workers
  // (event=host_stages; sparrow-bench sim --case host reads it).
  void log_host_stages(int t, const RoundMetrics& m, const std::vector<ClientResult>& results, double wall_s) const;

  // ---- asynchronous mode (round.cc; docs/async.md) ----

  // A client's task in mode = "async": handed the model of `version` at
  // simulated `start`; trained lazily (all tasks of a version in one batch,
  // before the model changes or when one of them is the next to arrive); its
  // update arrives at `finish`.
  struct AsyncTask {
    int64_t client = 0;
    uint64_t version = 0;
    uint64_t seq = 0;  // hand-out order: breaks ties in `finish`
    double start = 0, finish = 0;
    double earliest = 0;  // start + download + compute: `finish` before training knows the upload
    bool trained = false;
    std::string update;  // the serialized ModelUpdate (from fold())
    client::Weights control_delta;
    ClientResult result;
  };
  std::unique_ptr<federation::AsyncEngine> async;
  std::vector<std::unique_ptr<AsyncTask>> in_flight;
  std::vector<uint64_t> async_last;  // per client: 1 + the version of its last task (0 = none)
  double sim_clock = 0;              // simulated seconds since the run began
  uint64_t handed = 0;               // tasks handed out so far
  uint64_t async_down = 0;           // downlink bytes of the step in progress
  std::mutex async_mu;               // hold() from the workers
  bool async_mode() const { return cfg.mode == "async"; }
  // One server step of async mode: tasks to free clients, arrivals in
  // simulated order into the engine's buffer until it holds `buffer`, the
  // global step, evaluation, the metrics row, a checkpoint when due.
  RoundMetrics async_step();
  void async_fill();
  void async_train();
  // fold()'s destination in async mode: the update waits in its task.
  void hold(int64_t c, std::string bytes, const client::Weights& control_delta);
  // The async run state at the last step boundary (the tasks in flight with
  // their updates, the clock, the hand-out stream, participations), written
  // after every step and checkpointed as "checkpoint.async": a resume, or a
  // step run again after a stop, continues as the uninterrupted run.
  std::string async_saved;
  std::string async_save() const;
  void async_load(const std::string& bytes);

  // ---- secure aggregation (secagg_round.cc) ----

  // Secure aggregation (docs/security.md): the same protocol code as
  // sparrow-server and sparrow-client, its messages serialised and parsed as
  // on the wire (their bytes counted) but handed over in memory. A straggler
  // the deadline drops is a client that sent its shares but no masked update.
  secagg::Params sa_params;
  struct SecAggRound {
    std::unique_ptr<secagg::Server> server;
    std::map<int64_t, std::unique_ptr<secagg::Client>> party;  // by client id
    std::map<int64_t, uint32_t> index;
    std::map<int64_t, double> weight;
    std::map<int64_t, uint64_t> up, down;  // protocol bytes besides the masked update, per client
    double scale = 0;
    size_t length = 0;
    std::mutex mu;  // server->add_masked from the workers
  };
  std::unique_ptr<SecAggRound> sa;

  // `m` serialised and parsed back, as it would cross the network; its bytes
  // are added to `bytes`.
  static wire::SecAgg over_wire(const wire::SecAgg& m, uint64_t& bytes);
  // Keys and shares of round t's clients (before they train, as in the service).
  void begin_secagg(int t, const std::vector<int64_t>& ids);
  // The unmask exchange; the survivors' weighted mean joins the engine's round with their
  // total weight. Returns false (the round leaves the model as it was) when a
  // secret lacks shares.
  bool end_secagg(int t, const std::vector<int64_t>& ids);

  // ---- MPI ranks (ranks.cc) ----

  // Over MPI ranks (docs/simulator.md): rank 0 holds the run folder, the
  // checkpoints and the global step; client c's state lives on its owner
  // rank, owner(c) = c mod ranks, in that rank's own store (every rank trains
  // the clients it owns, rank 0 included).
  Cluster* cluster = nullptr;
  bool distributed() const { return cluster != nullptr && cluster->size() > 1; }
  bool remote() const { return distributed() && cluster->rank() != 0; }
  std::vector<uint64_t> rank_sent;   // the last round's bytes sent by each rank
  std::vector<uint64_t> rank_dirty;  // rank 0: each rank's unflushed store bytes (its last results)
  // Message buffers kept across rounds (tens of MB with dense updates: fresh
  // ones would page-fault every round).
  std::string msg_out;
  std::string msg_in;

  // The rank that keeps client c's state and trains it (0 in one process).
  int owner(int64_t c) const;
  // Of `ids`, the clients this process owns (all of them in one process).
  std::vector<int64_t> owned(const std::vector<int64_t>& ids) const;
  // Rank `rank`'s client-state store in the run folder: client_state.db for
  // rank 0 (and one process), client_state.rank<r>.db for the others.
  fs::path rank_store_path(int rank) const;
  // schedule_lpt with each client on one of its owner rank's worker slots.
  Assignment schedule_owners(const std::vector<int64_t>& ids, const std::vector<double>& jobs) const;
  // Rank 0, once its run folder is open (and a resume loaded): every rank
  // opens its store (a resume checks it is at the checkpoint's round);
  // ConfigError naming the file when one cannot.
  void start_ranks(bool resume);
  // Rank 0: one answer from every other rank; the first error is thrown, as
  // a ConfigError when `refusal` (a run folder the ranks cannot start from).
  void collect_acks(bool refusal);
  // Rank 0: the round's model to every rank, then each rank its clients
  // (slots r*workers .. (r+1)*workers-1), ids only.
  void send_round(int t, int n_sel, const std::vector<std::vector<int64_t>>& wids);
  // Rank 0: every other rank's results, into their slots.
  void receive_round(const std::vector<std::vector<int64_t>>& wids,
                     const std::vector<std::vector<ClientResult*>>& wout);
  // Rank 0: the round's updates into the engine's round (summed in client-id
  // order, so the model does not depend on the number of ranks or workers,
  // or on timing).
  void fold_ranked(std::vector<ClientResult>& results);
  // A round given up (a stop): this process's store back to the round's
  // start, and every rank's.
  void rollback_round();
  // Rank 0, before its own checkpoint of `completed` rounds: every rank
  // commits its store at that round and answers.
  void checkpoint_ranks(int completed);
  // The most unflushed client-state bytes any rank holds (a checkpoint is
  // taken early beyond kUnflushedBudget).
  size_t unflushed_bytes() const;
  // Ranks other than 0, in the constructor: rank 0's start message, this
  // rank's store opened (and checked, resuming), the answer sent.
  void join_ranks();
  // Ranks other than 0: one message from rank 0 (a round to train, a
  // checkpoint to commit, a round to give up). False when rank 0 ends the run.
  bool serve_round();
  // Rank 0, at the end: the other ranks' serve() returns (and, with
  // keep_client_state = false after the last round, their stores go).
  void end_ranks();

  // ---- the run folder (run_folder.cc) ----

  std::unique_ptr<sqlite::Db> db;  // run.db

  // Creates the run folder (or, resuming, opens it after checking that
  // run.db still holds a history), run.db and client_state.db.
  void open_db(bool resume);
  // Round m's row: to run.db (one transaction), then metrics.csv.
  void commit(const RoundMetrics& m);
  // A round's (or an async step's) end: epsilon, evaluation, metrics row,
  // checkpoint; sets `round` (round.cc).
  void finish_round(int t, RoundMetrics& m, Clock::time_point t0, bool async = false);
  // The history up to the checkpoint of round `upto`: later rows (a crash
  // between a row and its checkpoint) are deleted; FormatError when a row
  // up to it is missing. Rewrites metrics.csv from it.
  void load_history(int upto);

  // ---- checkpoints and resume (checkpoint.cc) ----

  // This process's client-state store: every client's in one process, the
  // clients this rank owns over MPI ranks (rank_store_path).
  std::unique_ptr<state::ClientStateStore> store;
  // Client states put since the last checkpoint stay in memory (the store
  // serves them until the checkpoint commits): checkpoint early beyond this.
  static constexpr size_t kUnflushedBudget = size_t{512} << 20;

  // The run state after the round just completed, committed with every
  // client state changed since the last checkpoint in one transaction of
  // client_state.db (written on the store's background thread; `wait` blocks
  // until it is durable). Client states on disk therefore always match the
  // checkpoint: between checkpoints nothing reaches the database.
  void checkpoint(int completed, bool wait);
  // Copies checkpointed weights into `into`, which fixes the tensor set and
  // shapes; `what` names them in the error ("checkpoint", ...).
  static void load_weights(const std::string& bytes, client::Weights& into, const char* what);
  // The keys a resumed run may change: they change neither the experiment's
  // results nor what was recorded (docs/simulator.md, "Resuming").
  static void copy_safe_keys(const SimConfig& from, SimConfig& to);
  // ConfigError naming the keys in which `now` differs from `recorded`.
  [[noreturn]] static void refuse_differences(const SimConfig& recorded, const SimConfig& now,
                                              const std::string& where);
  // The config a resume runs under must be the one the checkpoint was taken
  // under (recorded with it), whatever config.toml says now: an edited
  // config.toml would mix two experiments in one run folder. Run folders of
  // older versions have no recorded config; config.toml is then all there is.
  void check_resume_config();
  // The run state of the last checkpoint, and the history up to it.
  void load_checkpoint();
};

}  // namespace sparrow::simulator
