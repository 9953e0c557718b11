// sparrow-bench sim: the simulator against a bare LibTorch loop (efficiency),
// and its memory and time per round as the population grows (scale).
#include "bench/sim_bench.h"

#include <torch/torch.h>

#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>

#include "core/json.h"
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

}  // namespace

int bench_sim(int rounds, int workers, const std::string& tmp) {
  // efficiency: 1,000 clients, DGC on, MLP; rounds after the first (warm-up)
  // and before the last (evaluation) are timed, each as the whole run_round()
  // call plus its checkpoint's background writes (training, state store,
  // metrics commit, checkpoint), and
  // after each the bare loop trains on as many samples (after round 1 too,
  // untimed, as its warm-up).
  {
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

int bench_sim_scale_child(int clients, int rounds, int workers, const std::string& tmp) {
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
