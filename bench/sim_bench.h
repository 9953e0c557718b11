#pragma once
// sparrow-bench sim (see sim_bench.cc).

#include <string>
#include <vector>

namespace sparrow::bench {

// Prints the "efficiency" line, then one "scale" line per population (each from
// a child process running bench_sim_scale_child). Run folders go under tmp.
// The issue-10 comparison: FedAvg on Fashion-MNIST (100 clients, Dirichlet(0.5),
// 10 per round, 1 local epoch, batch 32, lr 0.05, no compression) in plain
// PyTorch (bench/peer_fedavg.py on python3-torch, same partition and clients)
// and in sparrow-sim sequential and batched, at 1 core and on the whole
// machine; plus the same FLOPs as one large at::mm ("limit").
// Models "user_cnn" and "user_resnet" are users' own models
// (examples/models/user_models.py): sparrow-sim loads them scripted
// (model = "torchscript:FILE", the files that script writes into tmp/models, or
// those in model_dir), the peer builds them eagerly from the same weights.
struct PeerOptions {
  std::vector<std::string> models{"mlp", "cnn"};
  int mlp_rounds = 20;
  int cnn_rounds = 3;
  int user_rounds = 3;
  std::string python = "/usr/bin/python3";
  std::string peer_script;
  std::string models_script;  // examples/models/user_models.py
  std::string model_dir;      // empty: models_script writes them into tmp/models
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string tmp = "bench-sim-runs/peer";
};
int bench_sim_peer(const PeerOptions& o);

// The GPU case (device = "cuda"; needs a CUDA-enabled build and a GPU): the
// issue-10 workload per model in plain PyTorch on the GPU (peer_fedavg.py
// --device cuda), sparrow-sim one client at a time, batched, and batched on
// `workers` threads sharing the GPU; then a population of `population`
// stateful clients (IID, CNN, `compression` on, `per_round` per round),
// clients trained per minute, the same ways and both batched runs
// uncompressed (the PyTorch loop has no compression and no client state). The first round
// of every run is a warm-up (cuDNN's algorithm search) and not timed.
struct GpuOptions {
  std::vector<std::string> models{"mlp", "cnn"};
  int mlp_rounds = 20;  // sparrow-bench passes --mlp-rounds / --cnn-rounds (at least 2)
  int cnn_rounds = 3;
  int population = 10000;
  int per_round = 100;
  int population_rounds = 4;
  std::string population_model = "cnn";
  std::string compression = "dgc:ratio=0.001";
  std::string device = "cuda";
  // Worker threads sharing the GPU in the extra rows (0: min(8, cores); 1:
  // no such rows).
  int workers = 0;
  std::string python = "python3";
  std::string peer_script;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string tmp = "bench-sim-runs/gpu";
};
int bench_sim_gpu(const GpuOptions& o);

int bench_sim(int rounds, int workers, const std::string& tmp, bool efficiency = true, bool scale = true);
// The MPI case: the same run (Fashion-MNIST, Dirichlet(0.5), 1,000 clients,
// 50 per round) as one process (1 and 2 worker threads), and under
// `mpirun -np 1` and `-np 2` (one worker per rank), per workload MODEL:CODEC:
// seconds per round (median of the rounds after the first and before the
// last), the bytes each rank sent per round and rank 0's serial work
// (sparrow-sim's summary). sparrow-sim is the binary next to sparrow-bench.
struct MpiOptions {
  int rounds = 6;
  std::vector<std::string> workloads{"mlp:dgc:ratio=0.001", "mlp:none", "cnn:none"};
  std::string mpirun = "mpirun";
  std::string tmp = "bench-sim-runs/mpi";
};
int bench_sim_mpi(const MpiOptions& o);

// The host case: the per-client host path (everything of a client but
// training: its state from and to the store, encoding, the wire message, the
// fold) of a stateful run, per stage, from sparrow-sim's event=host_stages
// debug lines. One line per model: Fashion-MNIST, Dirichlet(0.5), `clients`
// clients, `per_round` a round, one worker, one thread, `client_batch = 1`,
// `compression`; rounds 2..rounds timed (the first, with no client state yet,
// is not). `sim`: the sparrow-sim binary to time (default: the one next to
// sparrow-bench), so that an older build can be timed by the same code;
// `sets`: extra `--set key=value` for both.
struct HostOptions {
  int rounds = 10;
  int clients = 1000;
  int per_round = 50;
  std::vector<std::string> models{"cnn", "mlp"};
  std::string compression = "dgc:ratio=0.001";
  std::string sim;
  std::vector<std::string> sets;
  std::string tmp = "bench-sim-runs/host";
};
int bench_sim_host(const HostOptions& o);

int bench_sim_scale_child(int clients, int rounds, int workers, const std::string& tmp);

}  // namespace sparrow::bench
