#include "simulator/simulator.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <spdlog/spdlog.h>
#include <sqlite3.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>

#include "aggregation/aggregator.h"
#include "aggregation/robust.h"
#include "aggregation/server_optimizer.h"
#include "federation/client_pipeline.h"
#include "federation/global_model.h"
#include "client/batched_trainer.h"
#include "client/trainer.h"
#include "compression/compressor.h"
#include "compression/mask.h"
#include "compression/lowrank.h"
#include "core/bytes.h"
#include "core/data_folder.h"
#include "secagg/secagg.h"
#include "core/datasets.h"
#include "core/error.h"
#include "core/idx.h"
#include "core/models.h"
#include "core/partition.h"
#include "core/rng.h"
#include "core/spec.h"
#include "core/sqlite_db.h"
#include "core/threads.h"
#include "simulator/attack.h"
#include "simulator/cluster.h"
#include "simulator/scheduler.h"
#include "state/store.h"
#include "wire/wire.h"

namespace sparrow::simulator {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// Stream tags: every random decision has its own counter-based stream.
constexpr uint64_t kProfileTag = 0x70726f66;  // "prof"
constexpr uint64_t kAvailTag = 0x6176616c;    // "aval"
constexpr uint64_t kSampleTag = 0x73616d70;   // "samp"
constexpr uint64_t kLocalDpTag = 0x6c647020;  // "ldp "
constexpr uint64_t kAttackTag = 0x61747461;   // "atta"
constexpr uint64_t kDpTag = 0x64702020;       // "dp  "
constexpr uint64_t kSecAggTag = 0x73656361;   // "seca"

const double kNaN = std::numeric_limits<double>::quiet_NaN();

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

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The round of the checkpoint in a run's client-state store (nullopt: none
// written); `what` opens the message of a value that is not a round.
std::optional<int> checkpoint_round(state::ClientStateStore& store, const char* what) {
  const std::optional<std::string> saved = store.get_meta("checkpoint.round");
  if (!saved) return std::nullopt;
  try {
    return std::stoi(*saved);
  } catch (const std::exception&) {
    throw FormatError(std::string(what) + ": bad checkpoint round '" + *saved + "' in " + store.path());
  }
}

std::string fmt_double(double v) {
  std::ostringstream os;
  os << std::setprecision(17) << v;
  return os.str();
}

// ---- SQLite helpers (run.db) ------------------------------------------------------

struct Db {
  sqlite3* db = nullptr;
  ~Db() {
    if (db) sqlite3_close(db);
  }
  void exec(const std::string& sql) {
    char* err = nullptr;
    if (sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
      std::string msg = err ? err : "unknown";
      sqlite3_free(err);
      throw Error("run.db: " + msg + " in: " + sql);
    }
  }
  sqlite3_stmt* prepare(const std::string& sql) {
    sqlite3_stmt* st = nullptr;
    if (sqlite3_prepare_v2(db, sql.c_str(), -1, &st, nullptr) != SQLITE_OK)
      throw Error(std::string("run.db: ") + sqlite3_errmsg(db));
    return st;
  }
};

struct Stmt {
  sqlite3_stmt* st;
  ~Stmt() { sqlite3_finalize(st); }
};

using compression::deserialize_weights;
using compression::serialize_weights;

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

// The rank messages (docs/simulator.md): little-endian fields, strings with a
// u64 length. Only rank 0 and ranks it started exchange them.
struct Out {
  std::string b;
  void u64(uint64_t v) { core::put_raw(b, v); }
  void f64(double v) { core::put_raw(b, v); }
  void str(const std::string& s) {
    u64(s.size());
    b += s;
  }
};

struct In : core::ByteReader {
  explicit In(const std::string& b) : core::ByteReader(b, "rank message") {}
  uint64_t u64() { return get<uint64_t>(); }
  double f64() { return get<double>(); }
  std::string str() {
    const uint64_t n = u64();
    return std::string(take(n), n);
  }
};

std::string weights_or_empty(const client::Weights& w) { return w.empty() ? std::string() : serialize_weights(w); }
client::Weights weights_from(const std::string& b) { return b.empty() ? client::Weights{} : deserialize_weights(b); }

// An ALIE adversary's honest update, held until the round's pool is complete.
struct Deferred {
  ClientResult* r = nullptr;
  client::TrainResult tr;
};

struct Worker {
  std::shared_ptr<core::Model> model;
  std::unique_ptr<client::LocalTrainer> trainer;
  std::unique_ptr<client::BatchedTrainer> batched;  // null when clients train one at a time
  size_t batch = 1;                                 // clients per pass (cap)
  std::unique_ptr<aggregation::Accumulator> agg;
  client::Weights control_sum;     // SCAFFOLD: Σ Δc_i of kept clients
  std::vector<Deferred> deferred;  // ALIE adversaries of this round
};

std::string csv_num(double v) { return std::isnan(v) ? "" : fmt_double(v); }

std::string csv_row(const RoundMetrics& m) {
  std::ostringstream os;
  os << m.round << ',' << csv_num(m.accuracy) << ',' << csv_num(m.loss) << ',' << csv_num(m.train_loss) << ','
     << m.bytes_up << ',' << m.bytes_down << ',' << csv_num(m.sim_round_s) << ',' << csv_num(m.real_s) << ','
     << m.clients << ',' << m.dropped << ',' << csv_num(m.epsilon) << ',' << csv_num(m.clip) << '\n';
  return os.str();
}

constexpr const char* kCsvHeader =
    "round,accuracy,loss,train_loss,bytes_up,bytes_down,sim_round_s,real_s,clients,dropped,epsilon,clip\n";

// A resumed run's metrics database must pass SQLite's quick_check (its
// client states and checkpoint are checked by state::ClientStateStore).
void check_intact(sqlite3* db, const std::string& path) {
  sqlite3_stmt* st = nullptr;
  std::string result = "cannot run quick_check";
  if (sqlite3_prepare_v2(db, "PRAGMA quick_check", -1, &st, nullptr) == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW)
    result = reinterpret_cast<const char*>(sqlite3_column_text(st, 0));
  else if (db)
    result = sqlite3_errmsg(db);
  sqlite3_finalize(st);
  SPARROW_CHECK_T(FormatError, result == "ok",
                  "resume: " << path << " is damaged (SQLite quick_check: " << result
                             << "); restore the run folder from a backup or start the run again");
}

}  // namespace

std::string summary_json(const Summary& s) {
  auto num = [](double v) { return std::isfinite(v) ? fmt_double(v) : std::string("null"); };
  std::ostringstream os;
  os << "{\"rounds\":" << s.rounds << ",\"accuracy\":" << num(s.accuracy) << ",\"loss\":" << num(s.loss)
     << ",\"bytes_up\":" << s.bytes_up << ",\"bytes_down\":" << s.bytes_down << ",\"sim_wall_s\":" << num(s.sim_wall_s)
     << ",\"real_s\":" << num(s.real_s) << ",\"epsilon\":" << num(s.epsilon);
  if (s.ranks > 1) {
    os << ",\"ranks\":" << s.ranks << ",\"rank_bytes_per_round\":[";
    for (size_t r = 0; r < s.rank_bytes.size(); ++r) os << (r ? "," : "") << fmt_double(s.rank_bytes[r]);
    os << "],\"rank0_send_s\":" << fmt_double(s.rank0_send_s) << ",\"rank0_wait_s\":" << fmt_double(s.rank0_wait_s)
       << ",\"rank0_fold_s\":" << fmt_double(s.rank0_fold_s);
  }
  os << "}";
  return os.str();
}

std::shared_ptr<core::Model> make_sim_model(const std::string& name, uint64_t seed, int64_t input_dim,
                                            int64_t classes) {
  if (name == "logreg") return std::make_shared<LogReg>(input_dim, classes);
  return core::make_model(name, seed);
}

struct Simulator::Impl {
  SimConfig cfg;
  fs::path dir;
  // Data: the full train tensor once, clients as index tensors.
  at::Tensor train_x, train_y, test_x, test_y;  // with validation > 0, test_* is the validation split
  std::string validation_note;
  std::vector<at::Tensor> client_idx;  // each client's samples in the data set as loaded
  // train_x/train_y are stored client-major: client c's samples are rows
  // [client_off[c], client_off[c] + its count), so a client's data is a view.
  std::vector<int64_t> client_off;
  std::vector<Profile> profiles;
  double availability = 1;

  std::unique_ptr<compression::Compressor> compressor;
  // Downlink compression, as sparrow-server does it (the same code:
  // federation::GlobalModel): clients train from the broadcast model B; after
  // each round the server encodes C = W - B (the gap is the error feedback)
  // and B += C. A client that took part in the previous round holds the
  // broadcast of the round before and is sent C (its wire bytes); any other
  // client the dense model. Who took part in a round follows from the seed
  // (select_clients), and the codec's step from the round, so only B and the
  // size of C are run state.
  uint64_t down_bytes = 0;         // wire bytes of the last C
  std::vector<std::string> names;  // parameter names, model order
  aggregation::TensorShapes shapes;
  uint64_t model_bytes = 0;  // dense fp32

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

  static wire::SecAgg over_wire(const wire::SecAgg& m, uint64_t& bytes) {
    const std::string b = wire::serialize(wire::Message{wire::kProtocolMajor, wire::kProtocolMinor, m});
    bytes += b.size();
    return std::get<wire::SecAgg>(wire::parse(b).body);
  }

  // Keys and shares of round t's clients (before they train, as in the service).
  void begin_secagg(int t, const std::vector<int64_t>& ids) {
    sa = std::make_unique<SecAggRound>();
    SecAggRound& r = *sa;
    const uint32_t n = static_cast<uint32_t>(ids.size());
    const uint64_t seed = rng::derive(rng::derive(cfg.seed, kSecAggTag), static_cast<uint64_t>(t));
    r.length = static_cast<size_t>(model_bytes / sizeof(float));
    r.server = std::make_unique<secagg::Server>(sa_params, static_cast<uint64_t>(t + 1), n, seed, r.length);
    r.scale = secagg::ring_scale(n, sa_params.clip);
    double total = 0;
    for (int64_t c : ids) total += static_cast<double>(client_idx[c].numel());
    for (uint32_t i = 0; i < n; ++i) {
      const int64_t c = ids[i];
      wire::SecAggSetup a{i + 1,
                          n,
                          r.server->degree(),
                          r.server->threshold(),
                          seed,
                          sa_params.clip,
                          static_cast<double>(client_idx[c].numel()) / total};
      r.index[c] = i + 1;
      r.weight[c] = a.weight;
      r.party[c] = std::make_unique<secagg::Client>(a, static_cast<uint64_t>(t + 1), std::to_string(c));
      r.server->add_keys(i + 1, over_wire(r.party[c]->keys(), r.up[c]));
    }
    const auto client_of = [&](uint32_t index) { return ids[index - 1]; };
    std::vector<std::pair<uint32_t, wire::SecAgg>> shares;
    for (auto& [i, m] : r.server->neighbour_messages()) {
      const int64_t c = client_of(i);
      shares.emplace_back(i, over_wire(r.party[c]->shares(over_wire(m, r.down[c])), r.up[c]));
    }
    for (auto& [i, m] : shares) r.server->add_shares(i, m);
    for (auto& [i, m] : r.server->shares_in_messages()) {
      const int64_t c = client_of(i);
      r.party[c]->receive_shares(over_wire(m, r.down[c]));
    }
  }

  // The unmask exchange; the survivors' weighted mean joins `agg` with their
  // total weight. Returns false (the round leaves the model as it was) when a
  // secret lacks shares.
  bool end_secagg(int t, aggregation::Accumulator& agg, const std::vector<int64_t>& ids) {
    SecAggRound& r = *sa;
    for (auto& [i, m] : r.server->unmask_messages()) {
      const int64_t c = ids[i - 1];
      r.server->add_reveal(i, over_wire(r.party[c]->reveal(over_wire(m, r.down[c])), r.up[c]));
    }
    if (!r.server->can_unmask()) {
      spdlog::warn("round {}: secure aggregation cannot unmask ({}): the model stays as it was", t + 1,
                   r.server->missing());
      return false;
    }
    const std::vector<uint32_t> sum = r.server->unmask();
    double wsum = 0, samples = 0;
    for (uint32_t i : r.server->survivors()) {
      wsum += r.weight.at(ids[i - 1]);
      samples += static_cast<double>(client_idx[ids[i - 1]].numel());
    }
    aggregation::EncodedUpdate eu;
    size_t off = 0;
    for (const auto& [n, shape] : shapes) {
      at::Tensor x = at::empty(shape, at::kFloat);
      const size_t len = static_cast<size_t>(x.numel());
      secagg::dequantise(sum.data() + off, len, r.scale, x.data_ptr<float>());
      x.div_(wsum);
      off += len;
      compression::Encoded e;
      e.format = compression::Format::kDense;
      e.value_type = compression::ValueType::kF32;
      e.shape = shape;
      e.values.resize_uninitialized(len * sizeof(float));
      std::memcpy(e.values.data(), x.data_ptr<float>(), len * sizeof(float));
      eu.emplace_back(n, std::move(e));
    }
    aggregation::ContextMap ctxs = round_ctxs;  // per-client edits stay local
    agg.add(eu, samples, ctxs);
    return true;
  }
  std::vector<Worker> workers;
  CostModel cost;

  // W, B, SCAFFOLD's c, ACP factors and TCS masks, the server optimiser and
  // the global step: the round engine's global side, shared with sparrow-server.
  std::unique_ptr<federation::GlobalModel> gm;
  aggregation::ContextMap round_ctxs;                   // the codec contexts of the round in progress (gm->contexts)
  std::unique_ptr<aggregation::Aggregator> aggregator;  // robust aggregation, central DP
  aggregation::DpSpec dp;                               // local DP acts in finish_client
  std::vector<char> adversary;                          // per client: attacks when selected
  AttackSpec attack;
  int64_t classes = 10;
  std::vector<int64_t> participations;  // rounds each client was selected (local DP accounting)
  int64_t most_participations = 0;

  at::Device device{at::kCPU};
  std::atomic<bool> stop_requested{false};
  std::atomic<int64_t> stop_after{0};  // clients still to finish after a stop request
  std::atomic<int64_t> finished{0};    // clients of the round in progress that finished training
  bool interrupted = false;            // the last run_round() was stopped in the middle
  std::string training;                // how clients are trained, for the log
  std::string data_note;               // where a folder dataset's training and test samples came from
  // Memory for one worker's stacked batched-client state (automatic client_batch).
  static constexpr int64_t kBatchBudget = int64_t{1} << 30;

  std::unique_ptr<state::ClientStateStore> store;
  // Client states put since the last checkpoint stay in memory (the store
  // serves them until the checkpoint commits): checkpoint early beyond this.
  static constexpr size_t kUnflushedBudget = size_t{512} << 20;
  Db db;
  int round = 0;  // completed rounds
  std::vector<RoundMetrics> history;

  // Over MPI ranks (docs/simulator.md): rank 0 holds the store, the run
  // folder and the global step; the other ranks train what it sends them.
  Cluster* cluster = nullptr;
  bool distributed() const { return cluster != nullptr && cluster->size() > 1; }
  bool remote() const { return distributed() && cluster->rank() != 0; }
  std::vector<uint64_t> rank_sent;  // the last round's bytes sent by each rank
  // Message buffers kept across rounds (tens of MB with model-sized client
  // states: fresh ones would page-fault every round).
  Out msg_out;
  std::string msg_in;

  explicit Impl(SimConfig c) : cfg(std::move(c)), dir(cfg.out), cost(std::max(1, cfg.workers)) {}

  void load_data() {
    if (cfg.dataset.rfind("folder:", 0) == 0) {  // a path is no spec (it may hold ',' or '=')
      load_folder(cfg.dataset.substr(7));
      return;
    }
    Spec ds = Spec::parse(cfg.dataset);
    if (ds.method() == "fashion-mnist") {
      ds.check_all_consumed();
      // The images stay uint8 until store_client_major() writes them, in
      // client order, as floats (one 188 MB allocation, not two).
      core::ImageSplit trs = core::load_mnist_bytes(cfg.data_dir, "train");
      core::ImageSplit tes = core::load_mnist_bytes(cfg.data_dir, "test");
      core::Dataset tr{trs.images, trs.labels}, te{tes.images, tes.labels};
      hold_validation(tr, te);
      auto parts = core::partition(tr.y, cfg.clients, cfg.partition, federation::partition_seed(cfg.seed));
      train_x = tr.x;
      train_y = tr.y;
      test_x = core::normalize_bytes(te.x, core::kFashionMnistMean, core::kFashionMnistStd);
      test_y = te.y;
      for (auto& p : parts) client_idx.push_back(at::tensor(p, at::kLong));
    } else if (ds.method() == "synthetic") {
      const double a = ds.get_double("alpha", 1.0), b = ds.get_double("beta", 1.0);
      ds.check_all_consumed();
      core::FederatedData fd = core::make_synthetic(a, b, cfg.clients, cfg.seed);
      std::vector<at::Tensor> xs, ys, txs, tys;
      int64_t off = 0;
      for (size_t k = 0; k < fd.train.size(); ++k) {
        const int64_t n = fd.train[k].size();
        client_idx.push_back(at::arange(off, off + n, at::kLong));
        off += n;
        xs.push_back(fd.train[k].x);
        ys.push_back(fd.train[k].y);
        txs.push_back(fd.test[k].x);
        tys.push_back(fd.test[k].y);
      }
      train_x = at::cat(xs);
      train_y = at::cat(ys);
      test_x = at::cat(txs);
      test_y = at::cat(tys);
    } else {
      throw ConfigError("dataset: unknown dataset '" + cfg.dataset +
                        "' (known: fashion-mnist, synthetic, folder:PATH)");
    }
    store_client_major();
  }

  // The user's data: PATH in the format sparrow-client reads (x.npy + y.npy or
  // MNIST-format IDX), partitioned over the clients like Fashion-MNIST. The
  // test set is the folder's own (a test/ subfolder, or t10k IDX files), or
  // else `test_fraction` of the samples, drawn with the run's seed and held out
  // of training.
  void load_folder(const std::string& path) {
    SPARROW_CHECK_T(ConfigError, !path.empty(), "dataset: 'folder:PATH' needs a path");
    const std::string model = cfg.model == "logreg" ? "torchscript:" : cfg.model;  // logreg: any features
    core::Dataset tr = core::check_data_for_model(core::load_data_folder(path), model);
    std::optional<core::Dataset> te = core::load_data_folder_test(path);
    std::string test_from =
        path + (std::filesystem::is_directory(std::filesystem::path(path) / "test") ? "/test" : " (t10k files)");
    if (te) {
      te = core::check_data_for_model(std::move(*te), model);
      SPARROW_CHECK_T(ConfigError, te->x.sizes().slice(1) == tr.x.sizes().slice(1),
                      "dataset: test samples of " << path << " have another shape than the training samples");
    } else {
      const int64_t n = tr.size();
      const auto hold = static_cast<int64_t>(std::llround(cfg.test_fraction * static_cast<double>(n)));
      SPARROW_CHECK_T(ConfigError, hold >= 1 && hold < n,
                      "dataset: " << path << " has no test split (test/ or t10k files) and test_fraction = "
                                  << cfg.test_fraction << " of " << n << " samples holds out " << hold
                                  << ": need at least 1 test and 1 training sample");
      te = core::hold_out(tr, hold, federation::partition_seed(cfg.seed) ^ 0x7e57u);
      test_from =
          std::to_string(hold) + " samples held out (test_fraction = " + std::to_string(cfg.test_fraction) + ")";
    }
    hold_validation(tr, *te);
    SPARROW_CHECK_T(
        ConfigError, tr.size() >= cfg.clients,
        "clients: " << cfg.clients << " clients but " << path << " has " << tr.size() << " training samples");
    auto parts = core::partition(tr.y, cfg.clients, cfg.partition, federation::partition_seed(cfg.seed));
    train_x = tr.x;
    train_y = tr.y;
    test_x = te->x;
    test_y = te->y;
    for (auto& p : parts) client_idx.push_back(at::tensor(p, at::kLong));
    data_note = std::to_string(tr.size()) + " training samples from " + path + ", test set: " + test_from;
    store_client_major();
  }

  // validation > 0: `validation` of the training samples (drawn with the seed,
  // before partitioning) replace the test set, which this run then never reads.
  // Hyper-parameters are chosen on these runs; the chosen ones are then run
  // with validation = 0 and reported on the test set.
  void hold_validation(core::Dataset& tr, core::Dataset& te) {
    if (cfg.validation <= 0) return;
    const auto hold = static_cast<int64_t>(std::llround(cfg.validation * static_cast<double>(tr.size())));
    SPARROW_CHECK_T(ConfigError, hold >= 1 && hold < tr.size(),
                    "validation: " << cfg.validation << " of " << tr.size() << " training samples holds out " << hold);
    te = core::hold_out(tr, hold, federation::partition_seed(cfg.seed) ^ 0x7a11du);
    validation_note = "evaluating on " + std::to_string(hold) + " validation samples held out of the " +
                      std::to_string(tr.size() + hold) +
                      " training samples (validation = " + std::to_string(cfg.validation) +
                      "); the test set is not used";
  }

  void store_client_major() {
    // Client-major storage, once: no per-round copy of each client's samples.
    int64_t off = 0;
    for (const auto& idx : client_idx) {
      client_off.push_back(off);
      off += idx.numel();
    }
    const at::Tensor order = client_idx.empty() ? at::empty({0}, at::kLong) : at::cat(client_idx);
    train_x = train_x.scalar_type() == at::kByte
                  ? core::normalize_bytes(train_x, core::kFashionMnistMean, core::kFashionMnistStd, order)
                  : train_x.index_select(0, order);
    train_y = train_y.index_select(0, order);
  }

  // The data set lives on the training device for the whole run: each round's
  // minibatches are gathered there, never copied from the host per client.
  void stage_data() {
    if (device.is_cpu()) return;
    train_x = train_x.to(device);
    train_y = train_y.to(device);
    test_x = test_x.to(device);
    test_y = test_y.to(device);
    for (auto& idx : client_idx) idx = idx.to(device);
  }

  void build_population() {
    const uint64_t key = rng::derive(cfg.seed, kProfileTag);
    const auto& p = cfg.profiles;
    availability = p.availability;
    profiles.resize(cfg.clients);
    for (int c = 0; c < cfg.clients; ++c) {
      const uint64_t i = 3 * static_cast<uint64_t>(c);
      Profile& q = profiles[c];
      q.speed = p.compute_speed > 0 ? std::exp(p.compute_speed * rng::normal(key, i)) : 1.0;
      q.up_bps = p.uplink_mbps * 1e6 * std::exp(0.5 * rng::normal(key, i + 1));
      q.down_bps = p.downlink_mbps * 1e6 * std::exp(0.5 * rng::normal(key, i + 2));
    }
  }

  client::TrainConfig train_config() const {
    client::TrainConfig t;
    t.algorithm = cfg.algorithm;
    t.local_epochs = cfg.local_epochs;
    t.batch_size = cfg.batch_size;
    t.lr = cfg.lr;
    t.momentum = cfg.momentum;
    t.weight_decay = cfg.weight_decay;
    t.mu = cfg.mu;
    return t;
  }

  void build_workers() {
    const int64_t input_dim = train_x.numel() / std::max<int64_t>(1, train_x.size(0));
    classes = std::max<int64_t>(10, train_y.max().item<int64_t>() + 1);
    if (cfg.model != "logreg") {
      SPARROW_CHECK_T(ConfigError, input_dim == 784 || cfg.model.rfind("torchscript:", 0) == 0,
                      "model: '" << cfg.model << "' takes 28x28 images but dataset '" << cfg.dataset << "' has "
                                 << input_dim << " features per sample (use model = \"logreg\")");
    }
    for (int w = 0; w < cfg.workers; ++w) {
      Worker wk;
      wk.model = make_sim_model(cfg.model, cfg.seed, input_dim, classes);
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
      wk.agg = std::make_unique<aggregation::Accumulator>(aggregator->make_accumulator(shapes));
      workers.push_back(std::move(wk));
    }
    if (aggregator->robust().buffers()) {
      const double need = static_cast<double>(model_bytes) * cfg.clients_per_round / (1024.0 * 1024.0);
      SPARROW_CHECK_T(ConfigError, need <= cfg.max_buffer_mb,
                      "aggregator '" << cfg.aggregator << "' keeps every update of a round: " << cfg.clients_per_round
                                     << " x " << model_bytes << " bytes = " << static_cast<int64_t>(need)
                                     << " MiB > max_buffer_mb = " << cfg.max_buffer_mb);
    }
  }

  void open_db(bool resume) {
    fs::create_directories(dir);
    const fs::path dbp = dir / "run.db";
    const fs::path csv = dir / "metrics.csv";
    const fs::path cs = dir / "client_state.db";
    if (!resume) {
      for (const auto& p : {dbp, csv, cs}) {
        fs::remove(p);
        fs::remove(p.string() + "-wal");
        fs::remove(p.string() + "-shm");
      }
    }
    if (resume) {
      // run.db holds the rounds' history: a missing or empty one would start
      // a new history silently (sqlite3_open creates it).
      std::error_code ec;
      const auto size = fs::file_size(dbp, ec);
      SPARROW_CHECK_T(ConfigError, !ec && size > 0,
                      "resume: " << dbp.string() << (ec ? " is missing" : " is empty")
                                 << ": the history of the run's rounds is gone; restore the run folder from a "
                                    "backup, or start the run again with --force");
    }
    if (resume) sqlite::check_before_open(dbp.string(), "resume: run database");  // not SQLite, a damaged -wal
    if (sqlite3_open(dbp.c_str(), &db.db) != SQLITE_OK)
      throw Error("cannot open " + dbp.string() + ": " + sqlite3_errmsg(db.db));
    if (resume) check_intact(db.db, dbp.string());
    db.exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;");
    db.exec(
        "CREATE TABLE IF NOT EXISTS rounds(round INTEGER PRIMARY KEY, accuracy REAL, loss REAL, train_loss REAL, "
        "bytes_up INTEGER, bytes_down INTEGER, sim_round_s REAL, real_s REAL, clients INTEGER, dropped INTEGER, "
        "epsilon REAL, clip REAL);");
    // Run folders of earlier versions lack the last two columns.
    for (const char* col : {"epsilon", "clip"})
      sqlite3_exec(db.db, (std::string("ALTER TABLE rounds ADD COLUMN ") + col + " REAL;").c_str(), nullptr, nullptr,
                   nullptr);
    // Checkpoint mode: client states reach client_state.db only with a
    // checkpoint, in the same transaction as the run state (set_meta), on the
    // store's background thread; see checkpoint().
    state::ClientStateStore::Options o;
    o.background = true;
    o.explicit_flush = true;
    store = state::ClientStateStore::open(cs.string(), o);
    if (!resume) {
      std::ofstream(csv) << kCsvHeader;
      std::ofstream(dir / "config.toml") << to_toml(cfg);
    }
  }

  // The run state after the round just completed, committed with every
  // client state changed since the last checkpoint in one transaction of
  // client_state.db (written on the store's background thread; `wait` blocks
  // until it is durable). Client states on disk therefore always match the
  // checkpoint: between checkpoints nothing reaches the database.
  void checkpoint(int completed, bool wait) {
    store->set_meta("checkpoint.round", std::to_string(completed));
    // The whole effective config, so that a resume can refuse an edited
    // config.toml (check_resume_config); committed with the checkpoint.
    store->set_meta("checkpoint.config", to_toml(cfg));
    store->set_meta("checkpoint.global", serialize_weights(gm->weights()));
    store->set_meta("checkpoint.server_opt", gm->optimizer().serialize_state());
    store->set_meta("checkpoint.scaffold", gm->control().empty() ? std::string() : serialize_weights(gm->control()));
    store->set_meta("checkpoint.acp", gm->shared().empty() ? std::string() : serialize_weights(gm->shared()));
    store->set_meta("checkpoint.aggregator", aggregator->serialize_state());
    if (gm->has_downlink()) {
      store->set_meta("checkpoint.broadcast", serialize_weights(gm->broadcast()));
      store->set_meta("checkpoint.downlink_bytes", std::to_string(down_bytes));
    }
    if (wait)
      store->flush();
    else
      store->flush_async();
  }

  // Copies checkpointed weights into `into`, which fixes the tensor set and
  // shapes; `what` names them in the error ("checkpoint", ...).
  static void load_weights(const std::string& bytes, client::Weights& into, const char* what) {
    client::Weights g = deserialize_weights(bytes);
    SPARROW_CHECK_T(FormatError, g.size() == into.size(), "resume: " << what << " does not match the model");
    for (auto& [k, v] : into) {
      SPARROW_CHECK_T(FormatError, g.count(k) && g.at(k).sizes() == v.sizes(),
                      "resume: " << what << " does not match the model at '" << k << "'");
      v.copy_(g.at(k));
    }
  }

  // The keys a resumed run may change: they change neither the experiment's
  // results nor what was recorded (docs/simulator.md, "Resuming").
  static void copy_safe_keys(const SimConfig& from, SimConfig& to) {
    to.rounds = from.rounds;
    to.out = from.out;
    to.checkpoint_every = from.checkpoint_every;  // only changes when state is written
    to.threads = from.threads;                    // only changes the speed
  }

  static void refuse_differences(const SimConfig& recorded, const SimConfig& now, const std::string& where) {
    std::string keys;
    for (const std::string& d : config_differences(recorded, now)) keys += (keys.empty() ? "" : ", ") + d;
    if (keys.empty()) keys = "(a key to_toml does not write)";
    throw ConfigError("resume: the config differs from " + where + " in " + keys +
                      "; a resumed run may change only rounds, checkpoint_every and threads");
  }

  // The config a resume runs under must be the one the checkpoint was taken
  // under (recorded with it), whatever config.toml says now: an edited
  // config.toml would mix two experiments in one run folder. Run folders of
  // older versions have no recorded config; config.toml is then all there is.
  void check_resume_config() {
    const std::optional<std::string> text = store->get_meta("checkpoint.config");
    if (!text) return;
    SimConfig recorded;
    try {
      recorded = parse_config_string(*text);
    } catch (const std::exception& e) {
      throw FormatError("resume: the config recorded in " + store->path() + " does not parse (" + e.what() +
                        "); restore the run folder from a backup or start the run again with --force");
    }
    copy_safe_keys(cfg, recorded);
    if (!(recorded == cfg))
      refuse_differences(recorded, cfg,
                         "the one its checkpoint was taken under (" + store->path() + "; config.toml was edited?)");
  }

  void load_checkpoint() {
    const std::optional<int> saved = checkpoint_round(*store, "resume");
    SPARROW_CHECK_T(ConfigError, saved.has_value(),
                    "resume: no checkpoint in " << store->path() << " (none written yet, or a run folder of an older "
                                                << "sparrow)");
    auto blob = [&](const char* key) {
      std::optional<std::string> v = store->get_meta(std::string("checkpoint.") + key);
      SPARROW_CHECK_T(FormatError, v.has_value(),
                      "resume: checkpoint in " << store->path() << " lacks '" << key << "'");
      return *v;
    };
    round = *saved;
    load_weights(blob("global"), gm->weights(), "checkpoint");
    const std::string so = blob("server_opt");
    if (!so.empty()) gm->optimizer().deserialize_state(so);
    gm->control() = deserialize_weights(blob("scaffold"));
    gm->shared() = deserialize_weights(blob("acp"));
    if (std::optional<std::string> a = store->get_meta("checkpoint.aggregator")) aggregator->deserialize_state(*a);
    if (gm->has_downlink()) {
      load_weights(blob("broadcast"), gm->broadcast(), "checkpoint's broadcast model");
      down_bytes = std::stoull(blob("downlink_bytes"));
    }
    SPARROW_CHECK_T(ConfigError, round <= cfg.rounds,
                    "resume: the run already has " << round << " rounds, more than rounds = " << cfg.rounds);
    for (int r0 = 0; r0 < round; ++r0) count_participations(select_clients(r0));
    // Rounds after the checkpoint (a crash mid-commit) are forgotten.
    db.exec("DELETE FROM rounds WHERE round > " + std::to_string(round) + ";");
    {
      // Every round up to the checkpoint has its row (they are written before
      // the checkpoint that covers them): fewer means run.db lost history.
      Stmt c{db.prepare("SELECT COUNT(DISTINCT round) FROM rounds WHERE round BETWEEN 1 AND " + std::to_string(round))};
      const int have = sqlite3_step(c.st) == SQLITE_ROW ? sqlite3_column_int(c.st, 0) : 0;
      SPARROW_CHECK_T(FormatError, have == round,
                      "resume: " << (dir / "run.db").string() << " holds " << have << " of the " << round
                                 << " rounds its checkpoint covers: the run's history is damaged; restore the run "
                                    "folder from a backup, or start the run again with --force");
    }
    Stmt r{db.prepare(
        "SELECT round, accuracy, loss, train_loss, bytes_up, bytes_down, sim_round_s, real_s, clients, dropped, "
        "epsilon, clip "
        "FROM rounds ORDER BY round")};
    auto real = [&](int col) {
      return sqlite3_column_type(r.st, col) == SQLITE_NULL ? kNaN : sqlite3_column_double(r.st, col);
    };
    while (sqlite3_step(r.st) == SQLITE_ROW) {
      RoundMetrics m;
      m.round = sqlite3_column_int(r.st, 0);
      m.accuracy = real(1);
      m.loss = real(2);
      m.train_loss = real(3);
      m.bytes_up = static_cast<uint64_t>(sqlite3_column_int64(r.st, 4));
      m.bytes_down = static_cast<uint64_t>(sqlite3_column_int64(r.st, 5));
      m.sim_round_s = real(6);
      m.real_s = real(7);
      m.clients = sqlite3_column_int(r.st, 8);
      m.dropped = sqlite3_column_int(r.st, 9);
      m.epsilon = real(10);
      m.clip = real(11);
      history.push_back(m);
    }
    std::ofstream csv(dir / "metrics.csv", std::ios::trunc);
    csv << kCsvHeader;
    for (const auto& m : history) csv << csv_row(m);
  }

  std::vector<int64_t> select_clients(int t) const {
    const uint64_t akey = rng::derive(rng::derive(cfg.seed, kAvailTag), static_cast<uint64_t>(t));
    std::vector<int64_t> avail;
    for (int c = 0; c < cfg.clients; ++c)
      if (availability >= 1 || rng::uniform01(akey, static_cast<uint64_t>(c)) < availability) avail.push_back(c);
    rng::Stream s(rng::derive(rng::derive(cfg.seed, kSampleTag), static_cast<uint64_t>(t)));
    const size_t k = std::min<size_t>(avail.size(), static_cast<size_t>(cfg.clients_per_round));
    for (size_t i = 0; i < k; ++i) std::swap(avail[i], avail[i + s.below(avail.size() - i)]);
    avail.resize(k);
    std::sort(avail.begin(), avail.end());
    return avail;
  }

  // ALIE: the round's adversaries pool their honest updates (in client-id
  // order) and each sends μ − z·σ of the pool.
  void send_alie(int t, int n_sel) {
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

  // Privacy spent after `rounds` rounds (NaN without DP). Central: the
  // sampled Gaussian mechanism with q = clients_per_round / available
  // clients. Local: the most-selected client's participations, no
  // amplification.
  double epsilon_after(int rounds) const {
    if (dp.mode == aggregation::DpSpec::Mode::kNone) return kNaN;
    const double avail = std::max(1.0, availability * cfg.clients);
    const double q = std::min(1.0, cfg.clients_per_round / avail);
    return aggregator->epsilon(rounds, q, most_participations);
  }

  void count_participations(const std::vector<int64_t>& ids) {
    if (participations.empty()) participations.assign(static_cast<size_t>(cfg.clients), 0);
    for (int64_t c : ids)
      most_participations = std::max<int64_t>(most_participations, ++participations[static_cast<size_t>(c)]);
  }

  // The model the clients of a round start from.
  const client::Weights& start_model() const { return gm->broadcast(); }

  // Downlink bytes of round t (0-based) for the selected clients, and their
  // bookkeeping; then, after the server step, the broadcast of round t.
  uint64_t downlink_bytes(int t, const std::vector<int64_t>& ids) const {
    if (!gm->has_downlink() || t == 0) return model_bytes * static_cast<uint64_t>(ids.size());
    const std::vector<int64_t> before = select_clients(t - 1);  // ascending
    uint64_t bytes = 0;
    for (const int64_t c : ids) bytes += std::binary_search(before.begin(), before.end(), c) ? down_bytes : model_bytes;
    return bytes;
  }

  // Wire bytes of the masks that go to each selected client with the round's model.
  uint64_t mask_bytes() const {
    uint64_t bytes = 0;
    if (gm->mask_ratio() <= 0) return bytes;
    for (const auto& n : names) {
      const at::Tensor mk = gm->mask(n);
      if (mk.defined())
        bytes += wire::encoded_size(compression::mask_encoded(mk, gm->weights().at(n).sizes().vec()), n);
    }
    return bytes;
  }

  bool attacks(int64_t c) const { return !adversary.empty() && adversary[static_cast<size_t>(c)]; }

  // One worker's clients, in ascending id; results go to their slots.
  void run_worker(int w, int t, const std::vector<int64_t>& ids, std::vector<ClientResult*> out) {
    Worker& wk = workers[w];
    wk.agg->reset(aggregator->clip());
    wk.control_sum.clear();
    wk.deferred.clear();
    aggregation::ContextMap ctxs = round_ctxs;  // per-client edits stay local
    const bool scaffold = cfg.algorithm == "scaffold";
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
        if (store) {  // rank 0 (or one process); other ranks got the state with their task
          std::optional<state::ClientState> got = store->get(c);
          r.state = got ? std::move(*got) : state::ClientState{};
        }
        const int64_t n = client_idx[c].numel();
        client::ClientJob job;
        job.x = train_x.narrow(0, client_off[c], n);  // views: the data is client-major
        job.y = train_y.narrow(0, client_off[c], n);
        if (attacks(c) && attack.kind == AttackSpec::Kind::kLabelFlip) job.y = (classes - 1) - job.y;
        // The seed sparrow-server gives client c's task in this round.
        job.seed = federation::task_seed(cfg.seed, static_cast<uint64_t>(t) + 1, federation::sim_client_id(c));
        job.client_control = scaffold ? &r.state.control : nullptr;
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
        for (size_t j = j0; j < j1; ++j)
          out[j]->train_s = secs * static_cast<double>(trained[j - j0].num_samples) / work;
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

  // request_stop(): stop once `stop_after` more clients have finished.
  bool stop_now() const { return stop_requested.load() && stop_after.load() <= 0; }

  // Encodes one trained client's update with its compressor state, puts its
  // state into the store, and folds the update (as a server parses it) into
  // the worker's aggregate unless the straggler model drops it.
  void finish_client(Worker& wk, int t, ClientResult& r, const client::TrainResult& tr, aggregation::ContextMap& ctxs,
                     const client::Weights* replaced = nullptr) {
    const int64_t c = r.client;
    r.samples = tr.num_samples;
    r.train_loss = tr.mean_loss;
    // What the client sends: an attacker's update, or its own under local DP.
    client::Weights sent = replaced ? *replaced : tr.delta;
    const uint64_t ckey = rng::derive(static_cast<uint64_t>(t), static_cast<uint64_t>(c));
    if (attacks(c) && !replaced) {
      sent = attack_update(attack, tr.delta, rng::derive(rng::derive(cfg.seed, kAttackTag), ckey));
    } else if (!attacks(c) && dp.mode == aggregation::DpSpec::Mode::kLocal) {
      for (auto& [n, v] : sent) v = v.to(at::kCPU, at::kFloat);
      aggregation::local_dp(sent, dp.clip, dp.noise, rng::derive(rng::derive(cfg.seed, kLocalDpTag), ckey));
    }
    std::string bytes;
    if (sa) {
      // The weighted update quantised into the ring and masked.
      std::vector<uint32_t> x(sa->length);
      size_t off = 0;
      const uint64_t qkey = rng::derive(rng::derive(cfg.seed, kSecAggTag), ckey);
      for (const auto& n : names) {
        at::Tensor d = sent.at(n).to(at::kCPU, at::kFloat).contiguous();
        const size_t len = static_cast<size_t>(d.numel());
        secagg::quantise(d.data_ptr<float>(), len, sa->weight.at(c), sa_params.clip, sa->scale, rng::derive(qkey, off),
                         x.data() + off);
        off += len;
      }
      bytes = wire::serialize(wire::Message{wire::kProtocolMajor, wire::kProtocolMinor,
                                            sa->party.at(c)->masked(std::move(x), {{"train_loss", tr.mean_loss}})});
    } else {
      // The client pipeline sparrow-client runs (federation/client_pipeline.h):
      // the task's seed in each codec context, the round's client count.
      const std::string id = federation::sim_client_id(c);
      const uint64_t seed = federation::task_seed(cfg.seed, static_cast<uint64_t>(t) + 1, id);
      std::map<std::string, compression::Context> cctx;
      for (const auto& n : names)
        cctx[n] = federation::client_context(ctxs.at(n), seed, static_cast<uint32_t>(ctxs.at(n).num_workers));
      const wire::ModelUpdate u =
          federation::make_update(static_cast<uint64_t>(t) + 1, id, tr.num_samples, names, sent, *compressor,
                                  r.state.compressor, cctx, {}, {{"train_loss", tr.mean_loss}});
      bytes = wire::serialize(wire::Message{wire::kProtocolMajor, wire::kProtocolMinor, u});
    }
    r.state.rounds += 1;
    // To the store now: its writer streams it into the open checkpoint
    // transaction while the next clients train. Over ranks, rank 0 puts it
    // when it folds the round (fold_ranked).
    if (!distributed()) store->put(c, std::move(r.state));
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
    if (!r.kept) return;
    if (sa) {
      const wire::SecAgg y = std::get<wire::SecAgg>(wire::parse(bytes).body);
      std::lock_guard<std::mutex> g(sa->mu);
      sa->server->add_masked(sa->index.at(c), y);
      return;
    }
    fold(wk, bytes, tr.control_delta, ctxs);
  }

  // One client's update as a server parses it, and its SCAFFOLD Δc, into the
  // worker's partial aggregate.
  void fold(Worker& wk, const std::string& bytes, const client::Weights& control_delta, aggregation::ContextMap& ctxs) {
    wire::Message back = wire::parse(bytes);
    auto& pu = std::get<wire::ModelUpdate>(back.body);
    aggregation::EncodedUpdate eu;
    for (auto& nt : pu.tensors) eu.emplace_back(std::move(nt.name), std::move(nt.tensor));
    wk.agg->add(eu, static_cast<double>(pu.num_samples), ctxs);
    if (cfg.algorithm == "scaffold") {
      for (const auto& [n, dc] : control_delta) {
        at::Tensor d = dc.to(at::kCPU, at::kFloat);
        auto it = wk.control_sum.find(n);
        if (it == wk.control_sum.end())
          wk.control_sum[n] = d.clone();
        else
          it->second.add_(d);
      }
    }
  }

  // This process's workers on their slots' clients (slots 0..workers-1), on
  // threads when there are several.
  void run_local(int t, const std::vector<std::vector<int64_t>>& wids,
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

  // Rank 0: the round's model to every rank, then each rank its clients
  // (slots r*workers .. (r+1)*workers-1) with their states from the store.
  void send_round(int t, int n_sel, const std::vector<std::vector<int64_t>>& wids) {
    const int ranks = cluster->size();
    const size_t nw = workers.size();
    Out h;
    h.u64(1);
    h.u64(static_cast<uint64_t>(t));
    h.u64(static_cast<uint64_t>(n_sel));
    h.str(serialize_weights(start_model()));
    h.str(weights_or_empty(gm->control()));
    h.str(weights_or_empty(gm->shared()));
    cluster->broadcast(h.b);
    rank_sent.assign(static_cast<size_t>(ranks), 0);
    rank_sent[0] = h.b.size() * static_cast<uint64_t>(ranks - 1);
    for (int r = 1; r < ranks; ++r) {
      Out& task = msg_out;
      task.b.clear();
      for (size_t w = 0; w < nw; ++w) {
        const std::vector<int64_t>& ids = wids[static_cast<size_t>(r) * nw + w];
        task.u64(ids.size());
        for (const int64_t c : ids) {
          task.u64(static_cast<uint64_t>(c));
          const std::optional<state::ClientState> got = store->get(c);
          task.str(got ? got->serialize() : std::string());
        }
      }
      cluster->send(r, task.b);
      rank_sent[0] += task.b.size();
    }
  }

  static void put_result(Out& o, const ClientResult& r) {
    o.u64(static_cast<uint64_t>(r.client));
    o.u64((r.trained ? 1u : 0u) | (r.kept ? 2u : 0u));
    o.u64(static_cast<uint64_t>(r.samples));
    o.f64(r.train_s);
    o.f64(r.sim_s);
    o.f64(r.train_loss);
    o.u64(r.bytes_up);
    o.str(r.trained ? r.state.serialize() : std::string());
    o.str(r.update);
    o.str(weights_or_empty(r.control_delta));
  }

  static void get_result(In& in, ClientResult& r, int64_t expected) {
    r.client = static_cast<int64_t>(in.u64());
    SPARROW_CHECK_T(FormatError, r.client == expected,
                    "rank message: client " << r.client << " where " << expected << " was sent");
    const uint64_t flags = in.u64();
    r.trained = (flags & 1u) != 0;
    r.kept = (flags & 2u) != 0;
    r.samples = static_cast<int64_t>(in.u64());
    r.train_s = in.f64();
    r.sim_s = in.f64();
    r.train_loss = in.f64();
    r.bytes_up = in.u64();
    const std::string st = in.str();
    r.state = st.empty() ? state::ClientState{} : state::ClientState::deserialize(st);
    r.update = in.str();
    r.control_delta = weights_from(in.str());
  }

  // Rank 0: every other rank's results, into their slots.
  void receive_round(const std::vector<std::vector<int64_t>>& wids,
                     const std::vector<std::vector<ClientResult*>>& wout) {
    const size_t nw = workers.size();
    for (int r = 1; r < cluster->size(); ++r) {
      std::string& msg = msg_in;
      cluster->receive(r, msg);
      rank_sent[static_cast<size_t>(r)] = msg.size();
      In in{msg};
      for (size_t w = 0; w < nw; ++w) {
        const size_t slot = static_cast<size_t>(r) * nw + w;
        for (size_t j = 0; j < wids[slot].size(); ++j) get_result(in, *wout[slot][j], wids[slot][j]);
      }
      SPARROW_CHECK_T(FormatError, in.done(), "rank message: " << in.left() << " bytes left over");
    }
  }

  // Rank 0: the round's client states to the store and their updates into
  // one partial, in client-id order: float sums in a fixed order, so the model
  // does not depend on the number of ranks or workers, or on timing.
  void fold_ranked(std::vector<ClientResult>& results) {
    Worker& wk = workers[0];
    wk.agg->reset(aggregator->clip());
    wk.control_sum.clear();
    aggregation::ContextMap ctxs = round_ctxs;  // per-client edits stay local
    for (ClientResult& r : results) {           // ids ascend
      store->put(r.client, std::move(r.state));
      if (r.kept) fold(wk, r.update, r.control_delta, ctxs);
      r.update.clear();
      r.control_delta.clear();
    }
  }

  // Ranks other than 0: one round's task from rank 0, trained on this rank's
  // workers, the results back. False when rank 0 ends the run.
  bool serve_round() {
    std::string h;
    cluster->broadcast(h);
    In in{h};
    if (in.u64() == 0) return false;
    const int t = static_cast<int>(in.u64());
    const int n_sel = static_cast<int>(in.u64());
    load_weights(in.str(), gm->broadcast(), "the round's model");
    gm->control() = weights_from(in.str());
    gm->shared() = weights_from(in.str());
    round_ctxs = gm->contexts(static_cast<uint64_t>(t) + 1, n_sel);
    const auto r0 = Clock::now();
    std::string& task = msg_in;
    cluster->receive(0, task);
    const double recv_s = seconds_since(r0);
    In tin{task};
    const size_t nw = workers.size();
    std::vector<std::vector<int64_t>> wids(nw);
    std::vector<std::vector<std::string>> states(nw);
    size_t total = 0;
    for (size_t w = 0; w < nw; ++w) {
      const uint64_t n = tin.u64();
      SPARROW_CHECK_T(FormatError, n <= static_cast<uint64_t>(cfg.clients), "rank message: " << n << " clients");
      for (uint64_t j = 0; j < n; ++j) {
        const auto c = static_cast<int64_t>(tin.u64());
        SPARROW_CHECK_T(FormatError, c >= 0 && c < cfg.clients, "rank message: client " << c);
        wids[w].push_back(c);
        states[w].push_back(tin.str());
      }
      total += n;
    }
    std::vector<ClientResult> results(total);
    std::vector<std::vector<ClientResult*>> wout(nw);
    size_t k = 0;
    for (size_t w = 0; w < nw; ++w)
      for (size_t j = 0; j < wids[w].size(); ++j, ++k) {
        ClientResult& r = results[k];
        r.client = wids[w][j];  // also for a client a stop leaves untrained: rank 0 checks every id
        r.state = states[w][j].empty() ? state::ClientState{} : state::ClientState::deserialize(states[w][j]);
        wout[w].push_back(&r);
      }
    const double unpack_s = seconds_since(r0) - recv_s;
    run_local(t, wids, wout);
    const double train_s = seconds_since(r0) - recv_s - unpack_s;
    Out& o = msg_out;
    o.b.clear();
    for (size_t w = 0; w < nw; ++w)
      for (const ClientResult* r : wout[w]) put_result(o, *r);
    const double pack_s = seconds_since(r0) - recv_s - unpack_s - train_s;
    cluster->send(0, o.b);
    spdlog::debug(
        "round {}: rank {}: task received in {:.3f} s, unpacked {:.3f} s, trained {:.3f} s, packed {:.3f} s, "
        "sent {:.3f} s",
        t + 1, cluster->rank(), recv_s, unpack_s, train_s, pack_s,
        seconds_since(r0) - recv_s - unpack_s - train_s - pack_s);
    return true;
  }

  RoundMetrics step() {
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
    round_ctxs = gm->contexts(static_cast<uint64_t>(t) + 1, n_sel);  // rounds are 1-based in the engine
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
    const bool all_trained =
        std::all_of(results.begin(), results.end(), [](const ClientResult& r) { return r.trained; });
    if (!all_trained) {
      // Stopped in the middle: the round did not happen. The client states
      // its clients put are forgotten, so a checkpoint now is the state after
      // round t (and --resume runs round t + 1 as an uninterrupted run would).
      store->rollback_to_mark();
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

    aggregation::Accumulator agg = aggregator->make_accumulator(shapes);
    agg.reset(aggregator->clip());
    client::Weights control_sum;
    for (auto& wk : workers) {
      agg.merge(*wk.agg);
      for (const auto& [n, v] : wk.control_sum) {
        auto it = control_sum.find(n);
        if (it == control_sum.end())
          control_sum[n] = v.clone();
        else
          it->second.add_(v);
      }
    }
    if (sa) {
      end_secagg(t, agg, ids);
      for (auto& r : results) r.bytes_up += sa->up[r.client];
    }
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
    if (agg.total_weight() > 0) {
      aggregation::AggregateStats st;
      // The global step (federation::GlobalModel, as in sparrow-server): all or
      // nothing; a non-finite aggregate leaves the model as it was (the round
      // is abandoned, as the server abandons it). SCAFFOLD's c averages over
      // the population, `clients`.
      const federation::StepResult step =
          gm->step(*aggregator, agg, control_sum, static_cast<uint64_t>(t) + 1, static_cast<double>(cfg.clients), &st);
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
    const bool eval = (t + 1) % cfg.eval_every == 0 || t + 1 == cfg.rounds;
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

  void commit(const RoundMetrics& m) {
    db.exec("BEGIN IMMEDIATE;");
    try {
      Stmt r{db.prepare("INSERT OR REPLACE INTO rounds VALUES(?,?,?,?,?,?,?,?,?,?,?,?)")};
      auto bind_real = [&](int i, double v) {
        if (std::isnan(v))
          sqlite3_bind_null(r.st, i);
        else
          sqlite3_bind_double(r.st, i, v);
      };
      sqlite3_bind_int(r.st, 1, m.round);
      bind_real(2, m.accuracy);
      bind_real(3, m.loss);
      bind_real(4, m.train_loss);
      sqlite3_bind_int64(r.st, 5, static_cast<sqlite3_int64>(m.bytes_up));
      sqlite3_bind_int64(r.st, 6, static_cast<sqlite3_int64>(m.bytes_down));
      bind_real(7, m.sim_round_s);
      bind_real(8, m.real_s);
      sqlite3_bind_int(r.st, 9, m.clients);
      sqlite3_bind_int(r.st, 10, m.dropped);
      bind_real(11, m.epsilon);
      bind_real(12, m.clip);
      SPARROW_CHECK(sqlite3_step(r.st) == SQLITE_DONE, "run.db: " << sqlite3_errmsg(db.db));
      db.exec("COMMIT;");
    } catch (...) {
      sqlite3_exec(db.db, "ROLLBACK;", nullptr, nullptr, nullptr);
      throw;
    }
    std::ofstream(dir / "metrics.csv", std::ios::app) << csv_row(m);
  }
};

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
  if (s.remote()) return;  // no run folder: rank 0 keeps it
  s.open_db(resume);
  if (resume) {
    s.check_resume_config();
    s.load_checkpoint();
    std::ofstream(s.dir / "config.toml") << to_toml(s.cfg);  // records a changed `rounds`
  }
}

Simulator::~Simulator() {
  // Rank 0 ends the other ranks' serve(); not while an exception unwinds (a
  // rank may be blocked mid-round then: the caller aborts the job).
  Impl& s = *impl_;
  if (s.distributed() && !s.remote() && std::uncaught_exceptions() == 0) {
    try {
      Out o;
      o.u64(0);
      s.cluster->broadcast(o.b);
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
  return impl_->step();
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

std::pair<std::map<std::string, at::Tensor>, int> load_run_model(const std::string& run_dir) {
  const fs::path cs = fs::path(run_dir) / "client_state.db";
  SPARROW_CHECK_T(ConfigError, fs::exists(cs), "export: " << run_dir << " holds no run (no client_state.db)");
  auto store = state::ClientStateStore::open(cs.string());
  const std::optional<int> round = checkpoint_round(*store, "export");
  const std::optional<std::string> global = store->get_meta("checkpoint.global");
  SPARROW_CHECK_T(ConfigError, round && global, "export: " << run_dir << " has no checkpoint yet");
  return {deserialize_weights(*global), *round};
}

void Simulator::checkpoint_now() {
  if (impl_->round > 0) impl_->checkpoint(impl_->round, /*wait=*/true);
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
