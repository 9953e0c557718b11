// sparrow-bench sim: the simulator against a bare LibTorch loop (efficiency),
// and its memory and time per round as the population grows (scale).
#include "bench/sim_bench.h"

#include <torch/torch.h>
#include <torch/version.h>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

#include "core/error.h"
#include "core/json.h"
#include "core/threads.h"
#include "core/datasets.h"
#include "core/models.h"
#include "simulator/config.h"
#include "simulator/simulator.h"

namespace sparrow::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double peak_rss_mb() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / 1024.0;  // Linux: kilobytes
}

simulator::SimConfig base_config(int clients, int per_round, int rounds, int workers, const std::string& out) {
  simulator::SimConfig c = simulator::parse_config_string("");
  c.seed = 1;
  c.dataset = "fashion-mnist";
  c.partition = "dirichlet:alpha=0.5";
  c.clients = clients;
  c.clients_per_round = per_round;
  c.rounds = rounds;
  c.model = "mlp";
  c.algorithm = "fedavg";
  c.local_epochs = 1;
  c.batch_size = 32;
  c.lr = 0.05;
  c.compression = "dgc:ratio=0.001";
  c.workers = workers;
  c.eval_every = 1000000;  // evaluate only after the last round
  c.out = out;
  return c;
}

// The same work without the simulator: the same model and batch size over the
// same number of samples, forward/backward/SGD step and nothing else. Run in
// segments, each right after the simulator round it is compared with, so that
// both see the same machine load (the machine this runs on is shared).
class RawLoop {
 public:
  RawLoop(int batch, double lr)
      : train_(core::load_fashion_mnist(core::kFashionMnistDir, "train")),
        model_(core::make_model("mlp", 1)),
        opt_(model_->parameters(), torch::optim::SGDOptions(lr)),
        batch_(batch) {
    order_ = torch::randperm(train_.x.size(0), torch::TensorOptions().dtype(torch::kLong));
  }
  // Trains on the next `samples` samples; returns the seconds it took.
  double run(int64_t samples) {
    const int64_t n = train_.x.size(0);
    int64_t done = 0;
    auto t0 = Clock::now();
    while (done < samples) {
      const int64_t b = std::min<int64_t>({batch_, samples - done, n - pos_});
      at::Tensor idx = order_.narrow(0, pos_, b);
      at::Tensor x = train_.x.index_select(0, idx), y = train_.y.index_select(0, idx);
      opt_.zero_grad();
      at::Tensor loss = torch::nn::functional::cross_entropy(model_->forward(x), y);
      loss.backward();
      opt_.step();
      done += b;
      pos_ = (pos_ + b) % n;
    }
    return seconds_since(t0);
  }

 private:
  core::Dataset train_;
  std::shared_ptr<core::Model> model_;
  torch::optim::SGD opt_;
  at::Tensor order_;
  int64_t batch_;
  int64_t pos_ = 0;
};

// ---- peer: sparrow-sim against plain PyTorch on the workload -------------

// Multiply-accumulates per sample of one forward pass (`forward`), and those
// of the first layer (`first`: its input gradient is not needed).
struct Macs {
  double forward = 0;
  double first = 0;
};
Macs builtin_macs(const std::string& model) {
  if (model == "mlp") return {784.0 * 200 + 200.0 * 200 + 200.0 * 10, 784.0 * 200};
  // cnn: conv1 28x28x32 outputs of 25 MACs, conv2 14x14x64 of 800, fc1, fc2.
  return {28.0 * 28 * 32 * 25 + 14.0 * 14 * 64 * 800 + 3136.0 * 512 + 512.0 * 10, 28.0 * 28 * 32 * 25};
}
// FLOPs of training on one sample: forward (2 MACs), weight gradients (2 MACs)
// and input gradients of every layer but the first (2 MACs).
double train_flops(const Macs& m) { return 2 * m.forward + 2 * m.forward + 2 * (m.forward - m.first); }

// Users' own models (examples/models/user_models.py), scripted for sparrow-sim
// and eager in the peer.
bool is_user_model(const std::string& model) { return model == "user_cnn" || model == "user_resnet"; }

struct PeerRun {
  double train_s = 0;
  int64_t samples = 0;
  int64_t clients = 0;  // clients trained in the timed rounds
  double eval_s = 0;
  double accuracy = 0;
};

simulator::SimConfig peer_config(const PeerOptions& o, const std::string& model, int rounds, const std::string& out) {
  simulator::SimConfig c = base_config(100, 10, rounds, 1, out);
  c.model = model;
  c.compression = "none";
  c.partition = "dirichlet:alpha=0.5";
  c.seed = 1;
  c.lr = 0.05;
  c.batch_size = 32;
  c.checkpoint_every = 1000000;
  c.data_dir = o.data_dir;
  return c;
}

// One sparrow-sim run; training time is every round's wall-clock minus its
// evaluation, over the rounds after the first `warmup` (untimed) ones.
PeerRun run_sparrow(simulator::SimConfig c, int workers, int threads, int client_batch, int warmup = 0) {
  c.workers = workers;
  c.threads = threads;
  c.client_batch = client_batch;
  core::configure_threads(workers, threads);
  simulator::Simulator sim(c);
  PeerRun r;
  for (int t = 0; !sim.done(); ++t) {
    const simulator::RoundMetrics m = sim.run_round();
    if (!std::isnan(m.accuracy)) r.accuracy = m.accuracy;
    r.eval_s += m.eval_s;
    if (t < warmup) continue;
    r.train_s += m.real_s - m.eval_s;
    r.samples += m.samples;
    r.clients += m.clients;
  }
  sim.wait_for_checkpoint();
  return r;
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char ch : s) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

// The Python peer in a child process; nullopt (and a note on stderr) when
// python3-torch is missing or the script fails.
std::optional<PeerRun> run_python(const PeerOptions& o, const std::string& model, int threads, const std::string& files,
                                  std::string* error, const std::string& extra = "") {
  // The same environment as this process (OPENBLAS_CORETYPE included, so both
  // run the same BLAS kernels), with the BLAS and OpenMP pools at `threads`.
  const std::string env =
      "OPENBLAS_NUM_THREADS=" + std::to_string(threads) + " OMP_NUM_THREADS=" + std::to_string(threads);
  const std::string cmd = "env " + env + " " + shell_quote(o.python) + " " + shell_quote(o.peer_script) + " --data " +
                          shell_quote(o.data_dir) + " --partition " + shell_quote(files + "/partition.txt") +
                          " --selection " + shell_quote(files + "/selection_" + model + ".txt") + " --model " + model +
                          (is_user_model(model) ? " --init " + shell_quote(o.model_dir + "/" + model + ".pt") : "") +
                          " --threads " + std::to_string(threads) + extra + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) {
    *error = "popen failed";
    return std::nullopt;
  }
  std::string out;
  char line[4096];
  while (std::fgets(line, sizeof(line), p)) out += line;
  const int rc = pclose(p);
  const auto field = [&](const std::string& key) {
    const auto at = out.find("\"" + key + "\": ");
    SPARROW_CHECK(at != std::string::npos, "peer output lacks " << key);
    return std::stod(out.substr(at + key.size() + 4));
  };
  if (rc != 0 || out.find("\"train_s\"") == std::string::npos) {
    *error = out.size() > 300 ? out.substr(out.size() - 300) : out;
    for (char& ch : *error)
      if (ch == '"' || ch == '\n' || ch == '\\') ch = ' ';
    return std::nullopt;
  }
  PeerRun r;
  r.train_s = field("train_s");
  r.samples = static_cast<int64_t>(field("samples"));
  r.eval_s = field("eval_s");
  r.accuracy = field("accuracy");
  r.clients = static_cast<int64_t>(field("clients"));
  return r;
}

// The time of one at::mm doing `flops` floating-point operations (n x n by
// n x n with 2 n^3 = flops) on `threads` threads, best of 3.
double mm_seconds(double flops, int threads) {
  core::configure_threads(1, threads);
  const auto n = static_cast<int64_t>(std::cbrt(flops / 2));
  const at::Tensor a = at::randn({n, n}), b = at::randn({n, n});
  at::Tensor c = at::mm(a, b);  // warm-up
  double best = 1e300;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Clock::now();
    at::mm_out(c, a, b);
    best = std::min(best, seconds_since(t0));
  }
  return best * flops / (2.0 * static_cast<double>(n) * n * n);
}

// The same clients' data and the same clients per round for the Python peer:
// dir/partition.txt and dir/selection_<model>.txt.
void write_peer_files(const simulator::SimConfig& cfg, const std::string& dir, const std::string& model) {
  simulator::SimConfig c = cfg;
  c.device = "cpu";  // only the partition and the selection are read
  simulator::Simulator sim(c);
  std::ofstream part(dir + "/partition.txt");
  for (const auto& idx : sim.partition()) {
    for (size_t i = 0; i < idx.size(); ++i) part << (i ? " " : "") << idx[i];
    part << '\n';
  }
  std::ofstream sel(dir + "/selection_" + model + ".txt");
  for (int t = 0; t < cfg.rounds; ++t) {
    const auto ids = sim.selection(t);
    for (size_t i = 0; i < ids.size(); ++i) sel << (i ? " " : "") << ids[i];
    sel << '\n';
  }
}

// Writes the user models' TorchScript files into `dir` with models_script and
// reads the MACs it counts (one "NAME FORWARD FIRST" line per model); an
// error text instead when the script fails.
std::map<std::string, Macs> write_user_models(const PeerOptions& o, const std::string& dir, std::string* error) {
  const std::string cmd = "env OMP_NUM_THREADS=1 " + shell_quote(o.python) + " " + shell_quote(o.models_script) +
                          " --out " + shell_quote(dir) + " --seed 1 --macs 2>&1";
  std::map<std::string, Macs> out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) {
    *error = "popen failed";
    return out;
  }
  std::string text;
  char line[4096];
  while (std::fgets(line, sizeof(line), p)) text += line;
  const int rc = pclose(p);
  std::istringstream lines(text);
  std::string name;
  Macs m;
  while (lines >> name >> m.forward >> m.first) out[name] = m;
  if (rc != 0 || out.empty()) {
    *error = text.size() > 300 ? text.substr(text.size() - 300) : text;
    for (char& ch : *error)
      if (ch == '"' || ch == '\n' || ch == '\\') ch = ' ';
    out.clear();
  }
  return out;
}

void print_run(const std::string& model, const std::string& tool, const std::string& setting, int workers, int threads,
               int client_batch, const PeerRun& r, const PeerRun* baseline, double limit_s, int rounds,
               const PeerRun* best = nullptr) {
  const double sps = static_cast<double>(r.samples) / r.train_s;
  std::cout << "{\"bench\":\"sim\",\"case\":\"peer\",\"model\":\"" << model << "\",\"tool\":\"" << tool
            << "\",\"setting\":\"" << setting << "\",\"workers\":" << workers << ",\"threads\":" << threads
            << ",\"client_batch\":" << client_batch << ",\"rounds\":" << rounds << ",\"samples\":" << r.samples
            << ",\"train_s\":" << json_number(r.train_s) << ",\"s_per_round\":" << json_number(r.train_s / rounds)
            << ",\"samples_per_s\":" << json_number(sps) << ",\"eval_s\":" << json_number(r.eval_s)
            << ",\"accuracy\":" << json_number(r.accuracy);
  if (baseline)
    std::cout << ",\"speedup_vs_pytorch_1core\":"
              << json_number(sps / (static_cast<double>(baseline->samples) / baseline->train_s));
  if (best)
    std::cout << ",\"speedup_vs_pytorch_best\":"
              << json_number(sps / (static_cast<double>(best->samples) / best->train_s));
  if (limit_s > 0) std::cout << ",\"fraction_of_mm_limit\":" << json_number(limit_s / r.train_s);
  std::cout << "}" << std::endl;
}

}  // namespace

int bench_sim_peer(const PeerOptions& opts) {
  PeerOptions o = opts;
  std::filesystem::create_directories(o.tmp);
  const int cores = core::available_cores();
  std::cout << "{\"bench\":\"sim\",\"case\":\"machine\",\"cores\":" << cores << ",\"blas\":\""
            << core::blas_info().detail << "\",\"torch_threads_default\":" << at::get_num_threads() << "}" << std::endl;
  // The user models' files (always written, for their MACs: the model folder
  // holds the same models, perhaps from another seed).
  std::map<std::string, Macs> user_macs;
  std::string user_err;
  if (std::any_of(o.models.begin(), o.models.end(), is_user_model)) {
    const std::string written = std::filesystem::absolute(o.tmp + "/models").string();
    user_macs = write_user_models(o, written, &user_err);
    o.model_dir = o.model_dir.empty() ? written : std::filesystem::absolute(o.model_dir).string();
  }
  for (const std::string& model : o.models) {
    const bool user = is_user_model(model);
    if (user && user_macs.count(model) == 0) {
      std::cout << "{\"bench\":\"sim\",\"case\":\"peer\",\"model\":\"" << model
                << "\",\"tool\":\"sparrow\",\"error\":\"" << (user_err.empty() ? "not written" : user_err) << "\"}"
                << std::endl;
      continue;
    }
    const int rounds = model == "mlp" ? o.mlp_rounds : user ? o.user_rounds : o.cnn_rounds;
    simulator::SimConfig cfg = peer_config(o, model, rounds, o.tmp + "/peer_" + model);
    if (user) cfg.model = "torchscript:" + o.model_dir + "/" + model + ".pt";
    write_peer_files(cfg, o.tmp, model);
    // limit: the whole run's training FLOPs as one large GEMM.
    std::optional<PeerRun> py1;
    std::string err;
    py1 = run_python(o, model, 1, o.tmp, &err);
    if (!py1) {
      std::cout << "{\"bench\":\"sim\",\"case\":\"peer\",\"model\":\"" << model
                << "\",\"tool\":\"pytorch\",\"error\":\"" << err << "\"}" << std::endl;
    }
    const int64_t samples = py1 ? py1->samples : 0;
    double limit1 = 0, limit_all = 0;
    if (samples > 0) {
      const double flops = train_flops(user ? user_macs.at(model) : builtin_macs(model)) * static_cast<double>(samples);
      limit1 = mm_seconds(flops, 1);
      limit_all = mm_seconds(flops, cores);
      std::cout << "{\"bench\":\"sim\",\"case\":\"limit\",\"model\":\"" << model
                << "\",\"train_flops\":" << json_number(flops) << ",\"mm_s_1core\":" << json_number(limit1)
                << ",\"gflops_1core\":" << json_number(flops / limit1 / 1e9)
                << ",\"mm_s_all\":" << json_number(limit_all)
                << ",\"gflops_all\":" << json_number(flops / limit_all / 1e9) << ",\"threads_all\":" << cores << "}"
                << std::endl;
    }
    const PeerRun* base = py1 ? &*py1 : nullptr;
    if (py1) print_run(model, "pytorch", "1 core", 1, 1, 1, *py1, base, limit1, rounds);
    // PyTorch at its best on the whole machine: the faster of 1 core and all.
    std::optional<PeerRun> pyn;
    if (cores > 1) pyn = run_python(o, model, cores, o.tmp, &err);
    const PeerRun* best = base;
    if (pyn && (!best ||
                static_cast<double>(pyn->samples) / pyn->train_s > static_cast<double>(best->samples) / best->train_s))
      best = &*pyn;
    if (pyn) print_run(model, "pytorch", "whole machine", 1, cores, 1, *pyn, base, limit_all, rounds, best);
    const int k = cfg.clients_per_round;
    print_run(model, "sparrow", "1 core, sequential", 1, 1, 1, run_sparrow(cfg, 1, 1, 1), base, limit1, rounds);
    print_run(model, "sparrow", "1 core, batched", 1, 1, k, run_sparrow(cfg, 1, 1, k), base, limit1, rounds);
    if (cores > 1) {
      print_run(model, "sparrow", "whole machine, sequential", cores, 1, 1, run_sparrow(cfg, cores, 1, 1), base,
                limit_all, rounds, best);
      const int kw = (k + cores - 1) / cores;
      print_run(model, "sparrow", "whole machine, batched", cores, 1, kw, run_sparrow(cfg, cores, 1, kw), base,
                limit_all, rounds, best);
      print_run(model, "sparrow", "whole machine, batched, 1 worker", 1, cores, k, run_sparrow(cfg, 1, cores, k), base,
                limit_all, rounds, best);
    }
  }
  core::configure_threads(1, 0);
  return 0;
}

namespace {

void print_gpu_run(const std::string& kase, const std::string& model, const std::string& tool,
                   const std::string& setting, int client_batch, const simulator::SimConfig& cfg, int warmup,
                   const PeerRun& r, const PeerRun* pytorch, const PeerRun* sequential, int workers = 1) {
  const double sps = static_cast<double>(r.samples) / r.train_s;
  const double cpm = 60.0 * static_cast<double>(r.clients) / r.train_s;
  std::cout << "{\"bench\":\"sim\",\"case\":\"" << kase << "\",\"device\":\"" << cfg.device << "\",\"model\":\""
            << model << "\",\"tool\":\"" << tool << "\",\"setting\":\"" << setting << "\",\"clients\":" << cfg.clients
            << ",\"clients_per_round\":" << cfg.clients_per_round << ",\"compression\":\""
            << (tool == "pytorch" ? std::string("none") : cfg.compression) << "\",\"workers\":" << workers
            << ",\"client_batch\":" << client_batch << ",\"rounds_timed\":" << cfg.rounds - warmup
            << ",\"clients_trained\":" << r.clients << ",\"samples\":" << r.samples
            << ",\"train_s\":" << json_number(r.train_s) << ",\"samples_per_s\":" << json_number(sps)
            << ",\"clients_per_min\":" << json_number(cpm) << ",\"accuracy\":" << json_number(r.accuracy);
  if (pytorch)
    std::cout << ",\"speedup_vs_pytorch\":"
              << json_number(sps / (static_cast<double>(pytorch->samples) / pytorch->train_s));
  if (sequential)
    std::cout << ",\"speedup_vs_sequential\":"
              << json_number(sps / (static_cast<double>(sequential->samples) / sequential->train_s));
  std::cout << "}" << std::endl;
}

// PyTorch on the GPU (`p`: the Python peer), sparrow one client at a time,
// sparrow batched (K = `batch`) on one worker and on `o.workers` sharing the
// GPU, and, for a compressed `cfg`, both batched runs uncompressed: one line
// each.
void gpu_runs(const GpuOptions& o, const PeerOptions& p, const std::string& kase, const std::string& model,
              const simulator::SimConfig& cfg, int batch, const std::string& files) {
  constexpr int kWarmup = 1;
  const int threads = core::available_cores();
  std::filesystem::create_directories(files);
  write_peer_files(cfg, files, model);
  std::string err;
  const std::optional<PeerRun> py = run_python(p, model, threads, files, &err,
                                               " --device " + o.device + " --warmup-rounds " + std::to_string(kWarmup));
  if (py)
    print_gpu_run(kase, model, "pytorch", "plain PyTorch loop", 1, cfg, kWarmup, *py, nullptr, nullptr);
  else
    std::cout << "{\"bench\":\"sim\",\"case\":\"" << kase << "\",\"model\":\"" << model
              << "\",\"tool\":\"pytorch\",\"error\":\"" << err << "\"}" << std::endl;
  const PeerRun* base = py ? &*py : nullptr;
  const PeerRun seq = run_sparrow(cfg, 1, threads, 1, kWarmup);
  print_gpu_run(kase, model, "sparrow", "one client at a time", 1, cfg, kWarmup, seq, base, nullptr);
  const PeerRun bat = run_sparrow(cfg, 1, threads, batch, kWarmup);
  print_gpu_run(kase, model, "sparrow", "batched", batch, cfg, kWarmup, bat, base, &seq);
  // W worker threads sharing the GPU, each on a CUDA stream of its own, each
  // batching its share of the round's clients: their host-side work (the
  // update's copy to the host, encoding, the state store, the fold) overlaps.
  const int w = o.workers > 0 ? o.workers : std::min(8, threads);
  const int wbatch = (batch + w - 1) / w;
  const int wthreads = std::max(1, threads / w);
  if (w > 1) {
    simulator::SimConfig many = cfg;
    many.out += "_w";
    const PeerRun r = run_sparrow(many, w, wthreads, wbatch, kWarmup);
    print_gpu_run(kase, model, "sparrow", "batched, workers sharing the GPU", wbatch, many, kWarmup, r, base, &seq, w);
  }
  if (cfg.compression != "none") {
    // What the codec and the client states cost: the same runs uncompressed.
    simulator::SimConfig plain = cfg;
    plain.compression = "none";
    plain.out += "_none";
    const PeerRun r = run_sparrow(plain, 1, threads, batch, kWarmup);
    print_gpu_run(kase, model, "sparrow", "batched, no compression", batch, plain, kWarmup, r, base, &seq);
    if (w > 1) {
      plain.out += "_w";
      const PeerRun rw = run_sparrow(plain, w, wthreads, wbatch, kWarmup);
      print_gpu_run(kase, model, "sparrow", "batched, workers sharing the GPU, no compression", wbatch, plain, kWarmup,
                    rw, base, &seq, w);
    }
  }
}

}  // namespace

int bench_sim_gpu(const GpuOptions& o) {
  if (!torch::cuda::is_available()) {
    std::cout << "{\"bench\":\"sim\",\"case\":\"gpu\",\"error\":\"no CUDA device, or this build's LibTorch has no "
                 "CUDA\"}"
              << std::endl;
    return 1;
  }
  std::filesystem::create_directories(o.tmp);
  std::cout << "{\"bench\":\"sim\",\"case\":\"gpu_machine\",\"device\":\"" << o.device
            << "\",\"gpus\":" << static_cast<int>(torch::cuda::device_count())
            << ",\"cores\":" << core::available_cores() << ",\"torch\":\"" << TORCH_VERSION << "\"}" << std::endl;
  PeerOptions po;
  po.python = o.python;
  po.peer_script = o.peer_script;
  po.data_dir = o.data_dir;
  for (const std::string& model : o.models) {
    const int rounds = model == "mlp" ? o.mlp_rounds : o.cnn_rounds;
    simulator::SimConfig cfg = peer_config(po, model, rounds, o.tmp + "/peer_" + model);
    cfg.device = o.device;
    gpu_runs(o, po, "gpu_peer", model, cfg, cfg.clients_per_round, o.tmp + "/peer_files_" + model);
  }
  if (o.population > 0) {
    simulator::SimConfig cfg = base_config(o.population, o.per_round, o.population_rounds, 1, o.tmp + "/population");
    cfg.partition = "iid";  // every one of 10,000 clients holds data (6 images each)
    cfg.model = o.population_model;
    cfg.compression = o.compression;
    cfg.device = o.device;
    cfg.checkpoint_every = 1000000;
    cfg.data_dir = o.data_dir;
    gpu_runs(o, po, "gpu_population", o.population_model, cfg, o.per_round, o.tmp + "/population_files");
  }
  return 0;
}

int bench_sim(int rounds, int workers, const std::string& tmp, bool efficiency, bool scale) {
  core::configure_threads(workers);
  // efficiency: 1,000 clients, DGC on, MLP; rounds after the first (warm-up)
  // and before the last (evaluation) are timed, each as the whole run_round()
  // call plus its checkpoint's background writes (training, state store,
  // metrics commit, checkpoint), and
  // after each the bare loop trains on as many samples (after round 1 too,
  // untimed, as its warm-up).
  if (efficiency) {
    simulator::Simulator sim(base_config(1000, 50, rounds, workers, tmp + "/efficiency"));
    RawLoop raw(32, 0.05);
    int64_t samples = 0;
    double secs = 0, raw_secs = 0;
    for (int r = 0; r < rounds; ++r) {
      const auto t0 = Clock::now();
      simulator::RoundMetrics m = sim.run_round();
      // The round's checkpoint writes are the simulator's work: finish them
      // before the bare loop runs (it would otherwise compete with them).
      sim.wait_for_checkpoint();
      const double s = seconds_since(t0);
      if (r == rounds - 1) continue;
      const double rs = raw.run(m.samples);
      if (r == 0) continue;
      samples += m.samples;
      secs += s;
      raw_secs += rs;
    }
    const double sim_sps = static_cast<double>(samples) / secs;
    const double raw_sps = static_cast<double>(samples) / raw_secs;
    std::cout
        << "{\"bench\":\"sim\",\"case\":\"efficiency\",\"model\":\"mlp\",\"clients\":1000,\"clients_per_round\":50,"
        << "\"compression\":\"dgc:ratio=0.001\",\"workers\":" << workers << ",\"samples\":" << samples
        << ",\"sim_samples_per_s\":" << json_number(sim_sps) << ",\"raw_samples_per_s\":" << json_number(raw_sps)
        << ",\"efficiency\":" << json_number(sim_sps / raw_sps) << "}" << std::endl;
  }
  // scale: each population in its own process, so peak RSS is its own.
  for (int clients : {100, 1000, 10000}) {
    if (!scale) break;
    const std::string cmd = "\"" + std::string(std::filesystem::read_symlink("/proc/self/exe")) +
                            "\" sim-scale-child --clients " + std::to_string(clients) + " --rounds " +
                            std::to_string(rounds) + " --workers " + std::to_string(workers) + " --tmp \"" + tmp + "\"";
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) return 1;
    char line[1024];
    while (std::fgets(line, sizeof(line), p)) std::cout << line;
    if (pclose(p) != 0) return 1;
  }
  return 0;
}

namespace {

// Median real_s of rounds 2..R-1 of a run folder's metrics.csv (the first is
// a warm-up, the last evaluates and waits for its checkpoint).
double timed_round_s(const std::string& dir) {
  std::ifstream in(std::filesystem::path(dir) / "metrics.csv");
  std::string line;
  std::getline(in, line);  // header
  std::vector<double> real;
  while (std::getline(in, line)) {
    std::stringstream ss(line);
    std::string f;
    for (int i = 0; i < 8 && std::getline(ss, f, ','); ++i) {
    }
    real.push_back(std::stod(f));  // the 8th column: real_s
  }
  SPARROW_CHECK(real.size() >= 3, dir << "/metrics.csv: fewer than 3 rounds");
  std::vector<double> timed(real.begin() + 1, real.end() - 1);
  std::sort(timed.begin(), timed.end());
  const size_t n = timed.size();
  return n % 2 ? timed[n / 2] : 0.5 * (timed[n / 2 - 1] + timed[n / 2]);
}

// Runs `cmd`, returns its last stdout line (sparrow-sim's summary).
std::string last_line(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  SPARROW_CHECK(p != nullptr, "cannot run " << cmd);
  char buf[4096];
  std::string last;
  while (std::fgets(buf, sizeof buf, p))
    if (buf[0] == '{') last = buf;
  SPARROW_CHECK(pclose(p) == 0, "failed: " << cmd);
  while (!last.empty() && (last.back() == '\n' || last.back() == '\r')) last.pop_back();
  return last;
}

std::string json_field(const std::string& json, const std::string& key) {
  const auto at = json.find("\"" + key + "\":");
  if (at == std::string::npos) return "null";
  size_t b = at + key.size() + 3, e = b;
  if (json[b] == '[')
    e = json.find(']', b) + 1;
  else
    while (e < json.size() && json[e] != ',' && json[e] != '}') ++e;
  return json.substr(b, e - b);
}

}  // namespace

int bench_sim_mpi(const MpiOptions& o) {
  const std::string sim = (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "sparrow-sim").string();
  std::filesystem::create_directories(o.tmp);
  for (const std::string& workload : o.workloads) {
    const std::string model = workload.substr(0, workload.find(':'));
    const std::string codec = workload.substr(workload.find(':') + 1);
    simulator::SimConfig cfg = base_config(1000, 50, o.rounds, 1, "");
    cfg.model = model;
    cfg.compression = codec;
    cfg.client_batch = 1;
    cfg.threads = 1;
    const std::string tag = model + "_" + codec.substr(0, codec.find(':'));
    const std::string toml = o.tmp + "/" + tag + ".toml";
    std::ofstream(toml) << simulator::to_toml(cfg);
    struct Variant {
      const char* name;
      int ranks;  // 0: no mpirun
      int workers;
    };
    double base_s = 0;
    for (const Variant v : {Variant{"one process", 0, 1}, Variant{"one process, 2 workers", 0, 2},
                            Variant{"mpirun -np 1", 1, 1}, Variant{"mpirun -np 2", 2, 1}}) {
      const std::string out = o.tmp + "/" + tag + "_" + std::to_string(v.ranks) + "r" + std::to_string(v.workers) + "w";
      std::string cmd = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
      if (v.ranks > 0) cmd += o.mpirun + " -np " + std::to_string(v.ranks) + " --oversubscribe ";
      cmd += "\"" + sim + "\" --config \"" + toml + "\" --force --set out=\"" + out +
             "\" --set workers=" + std::to_string(v.workers) + " 2>/dev/null";
      const std::string summary = last_line(cmd);
      const double s = timed_round_s(out);
      if (base_s == 0) base_s = s;
      std::cout << "{\"bench\":\"sim\",\"case\":\"mpi\",\"model\":\"" << model << "\",\"compression\":\"" << codec
                << "\",\"clients\":1000,\"clients_per_round\":50,\"variant\":\"" << v.name
                << "\",\"ranks\":" << std::max(1, v.ranks) << ",\"workers_per_rank\":" << v.workers
                << ",\"s_per_round\":" << json_number(s) << ",\"rounds_per_s\":" << json_number(1.0 / s)
                << ",\"speedup_vs_one_process\":" << json_number(base_s / s)
                << ",\"rank_bytes_per_round\":" << json_field(summary, "rank_bytes_per_round")
                << ",\"rank0_send_s\":" << json_field(summary, "rank0_send_s")
                << ",\"rank0_wait_s\":" << json_field(summary, "rank0_wait_s")
                << ",\"rank0_fold_s\":" << json_field(summary, "rank0_fold_s")
                << ",\"bytes_up_total\":" << json_field(summary, "bytes_up")
                << ",\"accuracy\":" << json_field(summary, "accuracy") << "}" << std::endl;
    }
  }
  return 0;
}

namespace {
// The number after `key=` in a key=value log line (NaN when absent).
double log_value(const std::string& line, const std::string& key) {
  const auto at = line.find(" " + key + "=");
  if (at == std::string::npos) return std::nan("");
  return std::strtod(line.c_str() + at + key.size() + 2, nullptr);
}
}  // namespace

int bench_sim_host(const HostOptions& o) {
  const std::string sim =
      !o.sim.empty() ? o.sim : (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "sparrow-sim").string();
  std::filesystem::create_directories(o.tmp);
  for (const std::string& model : o.models) {
    simulator::SimConfig cfg = base_config(o.clients, o.per_round, o.rounds, 1, "");
    cfg.model = model;
    cfg.compression = o.compression;
    cfg.client_batch = 1;
    cfg.threads = 1;
    const std::string toml = o.tmp + "/" + model + ".toml";
    std::ofstream(toml) << simulator::to_toml(cfg);
    const std::string out = o.tmp + "/" + model;
    std::string cmd = "\"" + sim + "\" --config \"" + toml + "\" --force --log-level debug --set out=\"" + out + "\"";
    std::string sets_json;
    for (const std::string& kv : o.sets) {
      cmd += " --set '" + kv + "'";
      sets_json += std::string(sets_json.empty() ? "" : ",") + "\"" + kv + "\"";
    }
    cmd += " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    SPARROW_CHECK(p != nullptr, "cannot run " << cmd);
    const char* stages[] = {"get", "encode", "message", "put", "parse", "fold"};
    double sum[6] = {}, wall = 0, eval = 0, train = 0, clients = 0;
    int timed = 0;
    std::string summary;
    char buf[8192];
    while (std::fgets(buf, sizeof buf, p)) {
      const std::string line = buf;
      if (line[0] == '{') summary = line;
      if (line.find("event=host_stages") == std::string::npos) continue;
      if (log_value(line, "round") < 2) continue;  // no client has a state yet
      ++timed;
      wall += log_value(line, "wall_s");
      eval += log_value(line, "eval_s");
      train += log_value(line, "train_s");
      clients += log_value(line, "clients");
      for (int i = 0; i < 6; ++i) sum[i] += log_value(line, std::string(stages[i]) + "_s");
    }
    SPARROW_CHECK(pclose(p) == 0, "failed: " << cmd);
    SPARROW_CHECK(timed > 0 && clients > 0, sim << " logged no event=host_stages lines (a build without them?)");
    auto ms = [&](double s) { return json_number(1000.0 * s / clients); };
    const double host = wall - eval - train;
    double staged = 0;
    for (double v : sum) staged += v;
    std::cout << "{\"bench\":\"sim\",\"case\":\"host\",\"model\":\"" << model << "\",\"compression\":\""
              << o.compression << "\",\"clients\":" << o.clients << ",\"clients_per_round\":" << o.per_round
              << ",\"timed_rounds\":" << timed << ",\"sets\":[" << sets_json << "],\"sim\":\"" << sim
              << "\",\"train_ms_per_client\":" << ms(train) << ",\"host_ms_per_client\":" << ms(host);
    for (int i = 0; i < 6; ++i) std::cout << ",\"" << stages[i] << "_ms\":" << ms(sum[i]);
    std::cout << ",\"round_serial_ms_per_client\":" << ms(host - staged)
              << ",\"s_per_round\":" << json_number((wall - eval) / timed)
              << ",\"accuracy\":" << json_field(summary, "accuracy") << "}" << std::endl;
  }
  return 0;
}

int bench_sim_scale_child(int clients, int rounds, int workers, const std::string& tmp) {
  core::configure_threads(workers);
  // IID, so that 10,000 clients can each hold data (Dirichlet(0.5) cannot give
  // every one of 10,000 clients a sample of Fashion-MNIST's 60,000).
  simulator::SimConfig cfg = base_config(clients, 20, rounds, workers, tmp + "/scale_" + std::to_string(clients));
  cfg.partition = "iid";
  simulator::Simulator sim(cfg);
  double secs = 0;
  int timed = 0;
  int64_t samples = 0;
  for (int r = 0; r < rounds; ++r) {
    simulator::RoundMetrics m = sim.run_round();
    if (r == 0 || r == rounds - 1) continue;
    secs += m.real_s;
    samples += m.samples;
    ++timed;
  }
  std::cout << "{\"bench\":\"sim\",\"case\":\"scale\",\"model\":\"mlp\",\"compression\":\"dgc:ratio=0.001\","
            << "\"clients\":" << clients << ",\"clients_per_round\":20,\"rounds\":" << rounds
            << ",\"peak_rss_mb\":" << json_number(peak_rss_mb())
            << ",\"s_per_round\":" << json_number(secs / std::max(1, timed))
            << ",\"samples_per_round\":" << samples / std::max(1, timed)
            << ",\"ms_per_client\":" << json_number(1000.0 * secs / std::max(1, timed) / 20) << "}" << std::endl;
  return 0;
}

}  // namespace sparrow::bench
