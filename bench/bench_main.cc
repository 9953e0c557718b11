// sparrow-bench: benchmarks that print one JSON object per line and measure
// their baselines in the same run (these machines are noisy; only ratios are
// stable).
//
//   sparrow-bench compress [--elements N] [--repeat R] [--methods a,b,...] [--device cpu|cuda]
//   sparrow-bench server [--clients C] [--rounds R] [--repeat N] [--cases ingest,dense,dashboard,async]
//   sparrow-bench secagg [--clients 10,100,1000] [--degrees 8,16,0] [--dropout 0.1] [--cases protocol,service]
//   sparrow-bench kernels [--images N] [--repeat R]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>

#include "core/cli.h"
#include "core/error_text.h"
#include "bench/kernel_bench.h"
#include "bench/resnet50.h"
#include "bench/secagg_bench.h"
#include "bench/server_bench.h"
#include "bench/sim_bench.h"
#include "core/threads.h"
#include "bench/split_bench.h"
#include "compression/compressor.h"
#include "core/json.h"
#include "core/error.h"
#include "wire/roundtrip.h"

#if SPARROW_WITH_CUDA
#include "compression/cuda/device_codec.h"
#include "compression/cuda/kernels.h"
#endif

namespace {

using namespace sparrow;
using Clock = std::chrono::steady_clock;
using Named = std::vector<std::pair<std::string, at::Tensor>>;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Case {
  std::string name;  // the "case" field
  std::string spec;
  bool resnet;  // low-rank cases run on ResNet-50's layer shapes
};

// The methods at the parameters the targets name.
std::vector<Case> default_cases() {
  return {
      {"none", "none", false},
      {"fp16", "fp16", false},
      {"bf16", "bf16", false},
      {"topk", "topk:ratio=0.001", false},
      {"topk_rice_int8", "topk:ratio=0.001,index=rice,values=int8", false},
      {"stc", "stc:ratio=0.001", false},
      // From the second step on, int8 values at the RoundTrip aggregator's mask (no index bits).
      {"tcs", "tcs:ratio=0.001,extra=0.0002", false},
      // docs/results.md's 264x setting: a random 15% share of a 60% mask, one bit each (protocol 1.6).
      {"tcs_keep", "tcs:ratio=0.6,keep=0.15,extra=0.0008,values=sign,ef=0", false},
      {"randomk", "randomk:ratio=0.001", false},
      {"threshold", "threshold:tau=3.3", false},  // ~0.1% of N(0,1) values pass
      {"dgc", "dgc:ratio=0.001", false},
      {"qsgd", "qsgd:levels=16", false},
      {"terngrad", "terngrad", false},
      {"sign", "sign", false},
      {"powersgd", "powersgd:rank=4", true},
      // docs/results.md's rank-4 settings: int8 factors, two power steps, and with a
      // 1.8% sparse correction (protocol 1.5).
      {"powersgd_int8", "powersgd:rank=4,values=int8,iters=2", true},
      {"powersgd_sparse", "powersgd:rank=4,values=int8,iters=2,sparse=0.018", true},
      {"acp", "acp:rank=4", true},
  };
}

// A flat gradient-like tensor viewed as a matrix (DGC sends 1-D tensors dense).
at::Tensor flat_input(int64_t n) {
  at::manual_seed(1);
  at::Tensor x = at::randn({n});
  return n % 1000 == 0 ? x.view({n / 1000, 1000}) : x.view({n, 1});
}

Named resnet_input() {
  at::manual_seed(2);
  Named t;
  for (auto& [name, shape] : bench::resnet50_shapes()) t.emplace_back(name, at::randn(shape));
  return t;
}

int bench_compress(int64_t n, int repeat, const std::string& only) {
  const int threads = at::get_num_threads();
  const at::Tensor x = flat_input(n);
  const double dense_bytes = 4.0 * static_cast<double>(n);

  // Baseline 1: memcpy of the fp32 buffer.
  {
    at::Tensor dst = at::empty_like(x);
    std::vector<double> t;
    for (int r = 0; r < repeat + 1; ++r) {
      auto t0 = Clock::now();
      std::memcpy(dst.data_ptr<float>(), x.data_ptr<float>(), static_cast<size_t>(n) * 4);
      if (r) t.push_back(ms_since(t0));
    }
    std::cout << "{\"bench\":\"compress\",\"case\":\"memcpy\",\"elements\":" << n
              << ",\"encode_ms\":" << json_number(median(t))
              << ",\"gb_per_s\":" << json_number(dense_bytes / median(t) / 1e6) << ",\"threads\":" << threads
              << ",\"malloc\":\"" << (core::allocator_tuned_for_messages() ? "reuse" : "system") << "\"}" << std::endl;
  }
  // Baseline 2: torch::topk of |g| with DGC's k.
  {
    const int64_t k = static_cast<int64_t>(std::ceil(0.001 * static_cast<double>(n)));
    std::vector<double> t;
    for (int r = 0; r < std::max(2, repeat / 2 + 1); ++r) {
      auto t0 = Clock::now();
      auto top = at::topk(x.reshape(-1).abs(), k);
      if (r) t.push_back(ms_since(t0));
    }
    std::cout << "{\"bench\":\"compress\",\"case\":\"torch_topk\",\"elements\":" << n << ",\"k\":" << k
              << ",\"encode_ms\":" << json_number(median(t)) << ",\"threads\":" << threads << "}" << std::endl;
  }

  Named flat = {{"grad", x}};
  Named resnet;
  for (const Case& c : default_cases()) {
    if (!only.empty() && ("," + only + ",").find("," + c.name + ",") == std::string::npos) continue;
    if (c.resnet && resnet.empty()) resnet = resnet_input();
    const Named& input = c.resnet ? resnet : flat;
    int64_t elements = 0;
    for (auto& t : input) elements += t.second.numel();

    auto compressor = compression::make_compressor(c.spec);
    wire::RoundTrip trip(*compressor, 7);
    std::vector<double> enc, dec;
    size_t wire_bytes = 0;
    double err = 0;
    for (int r = 0; r < repeat + 1; ++r) {  // step 0 allocates state: not timed
      wire::RoundTripResult res = trip.step(input);
      wire_bytes = res.wire_bytes;
      if (r == 0) continue;
      enc.push_back(res.encode_ms);
      dec.push_back(res.decode_ms);
      if (r == repeat) {
        double e2 = 0, x2 = 0;
        for (size_t i = 0; i < input.size(); ++i) {
          e2 += (res.decoded[i] - input[i].second).pow(2).sum().item<double>();
          x2 += input[i].second.pow(2).sum().item<double>();
        }
        err = std::sqrt(e2 / x2);
      }
    }
    std::cout << "{\"bench\":\"compress\",\"case\":\"" << c.name << "\",\"spec\":\"" << c.spec
              << "\",\"elements\":" << elements << ",\"tensors\":" << input.size()
              << ",\"encode_ms\":" << json_number(median(enc)) << ",\"decode_ms\":" << json_number(median(dec))
              << ",\"wire_bytes\":" << wire_bytes
              << ",\"ratio\":" << json_number(4.0 * static_cast<double>(elements) / static_cast<double>(wire_bytes))
              << ",\"rel_error\":" << json_number(err) << ",\"threads\":" << threads << "}" << std::endl;
  }
  return 0;
}

// compress --device cuda: the codecs with CUDA kernels (dgc, sign) encoding a
// device tensor (payload copied to the host included) against a device-to-device
// copy of the same buffer and at::topk of |g| on the device, with the device
// synchronised around every timing; every line carries x_copy and x_topk, its
// time over those two. Targets: DGC within 3x the copy and faster than topk.
//
// dgc_device is the device-level encode (compression/cuda/device_codec.h: no
// host copy, no synchronisation inside a call), timed over `calls` calls in a
// row with one synchronisation at the end; dgc_device_fold adds the fold of
// each result into a dense device accumulator; dgc_device_unchecked skips the
// finiteness check of g (encode_device's check_finite = false). Bytes moved
// per element: the
// copy reads g and writes the copy (8); the DGC step must read g, u, v and
// write u, v (20, 2.5x the copy: the floor of any DGC step that keeps u and v
// in memory), plus 4 for the finiteness check of g and 4 for the selection's
// second read of v (its threshold is known only after the whole update): 28,
// 3.5x the copy, plus a few microseconds per launch (about 17 per call).
// dgc_device_fused is encode_device(..., fused = true): one pass reads g, u, v
// and writes the new u, v to a second pair of buffers with the finiteness flag
// and the candidates above the sampled threshold (20 bytes per element, 2.5x
// the copy, plus the candidates), the selection reading only the candidates.
int bench_compress_cuda(int64_t n, int repeat, const std::string& only) {
#if SPARROW_WITH_CUDA
  if (!at::hasCUDA()) {
    std::cerr << "sparrow-bench: error: --device cuda, but no CUDA device is available\n";
    return 2;
  }
  const at::Tensor x = flat_input(n).to(at::Device(at::kCUDA));
  const double dense_bytes = 4.0 * static_cast<double>(n);
  auto timed = [](int reps, const auto& fn) {
    std::vector<double> t;
    for (int r = 0; r < reps + 1; ++r) {  // run 0 warms up (allocator, state): not timed
      compression::cuda::device_synchronize();
      auto t0 = Clock::now();
      fn();
      compression::cuda::device_synchronize();
      if (r) t.push_back(ms_since(t0));
    }
    return median(t);
  };
  double copy_ms = 0.0, topk_ms = 0.0;
  auto ratios = [&](double ms) {
    return ",\"x_copy\":" + json_number(ms / copy_ms) + ",\"x_topk\":" + json_number(ms / topk_ms);
  };
  {
    at::Tensor dst = at::empty_like(x);
    copy_ms = timed(repeat, [&] { dst.copy_(x); });
    std::cout << "{\"bench\":\"compress\",\"device\":\"cuda\",\"case\":\"d2d_copy\",\"elements\":" << n
              << ",\"encode_ms\":" << json_number(copy_ms)
              << ",\"gb_per_s\":" << json_number(dense_bytes / copy_ms / 1e6) << "}" << std::endl;
  }
  {
    const int64_t k = static_cast<int64_t>(std::ceil(0.001 * static_cast<double>(n)));
    topk_ms = timed(repeat, [&] { auto top = at::topk(x.reshape(-1).abs(), k); });
    std::cout << "{\"bench\":\"compress\",\"device\":\"cuda\",\"case\":\"torch_topk\",\"elements\":" << n
              << ",\"k\":" << k << ",\"encode_ms\":" << json_number(topk_ms) << ratios(topk_ms) << "}" << std::endl;
  }
  std::string dgc_spec;
  for (const Case& c : default_cases()) {
    if (c.name != "dgc" && c.name != "sign") continue;  // the codecs with CUDA kernels
    if (c.name == "dgc") dgc_spec = c.spec;
    if (!only.empty() && ("," + only + ",").find("," + c.name + ",") == std::string::npos) continue;
    auto compressor = compression::make_compressor(c.spec);
    compression::State state;
    compression::Context ctx;
    ctx.name = "grad";
    size_t payload = 0;
    const double ms = timed(repeat, [&] { payload = compressor->encode(x, state, ctx).values.size(); });
    std::cout << "{\"bench\":\"compress\",\"device\":\"cuda\",\"case\":\"" << c.name << "\",\"spec\":\"" << c.spec
              << "\",\"elements\":" << n << ",\"encode_ms\":" << json_number(ms) << ratios(ms)
              << ",\"value_bytes\":" << payload << "}" << std::endl;
  }
  if (!dgc_spec.empty() && (only.empty() || ("," + only + ",").find(",dgc,") != std::string::npos)) {
    // The device-level encode, alone and with the fold (x is 2-D: flat_input).
    const at::Tensor& x2 = x;
    auto compressor = compression::make_compressor(dgc_spec);
    constexpr int kCalls = 20;
    // dgc_device, dgc_device_fold, dgc_device_unchecked, dgc_device_fused
    for (const int variant : {0, 1, 2, 3}) {
      const bool fold = variant == 1, check = variant != 2, fused = variant == 3;
      compression::State state;
      compression::Context ctx;
      ctx.name = "grad";
      at::Tensor acc = at::zeros_like(x2);
      const double ms = timed(repeat,
                              [&] {
                                for (int c = 0; c < kCalls; ++c) {
                                  const auto d =
                                      compression::cuda::encode_device(*compressor, x2, state, ctx, check, fused);
                                  if (fold) compression::cuda::fold_device(d, 1.0f, acc);
                                }
                              }) /
                        kCalls;
      std::cout << "{\"bench\":\"compress\",\"device\":\"cuda\",\"case\":\""
                << (variant == 0 ? "dgc_device"
                    : fold       ? "dgc_device_fold"
                    : fused      ? "dgc_device_fused"
                                 : "dgc_device_unchecked")
                << "\",\"spec\":\"" << dgc_spec << "\",\"elements\":" << n << ",\"calls\":" << kCalls
                << ",\"encode_ms\":" << json_number(ms) << ratios(ms) << "}" << std::endl;
    }
  }
  return 0;
#else
  (void)n;
  (void)repeat;
  (void)only;
  std::cerr << "sparrow-bench: error: --device cuda needs a build with CUDA (SPARROW_CUDA=ON, a CUDA-enabled "
               "LibTorch and nvcc; see docs/gpu.md); this build is CPU-only\n";
  return 2;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  // The server case runs sparrow-server in this process: its allocator policy,
  // set before any thread as sparrow-server's main() does (SPARROW_SYSTEM_MALLOC=1
  // measures glibc's default instead). The bare-ZeroMQ baselines share it.
  for (int i = 1; i < argc; ++i) {  // the subcommand: the first argument that is not an option or its value
    const std::string a = argv[i];
    if (a == "--threads") {
      ++i;
      continue;
    }
    if (a.rfind("-", 0) == 0) continue;
    // compress: the programs that encode large updates for the wire
    // (sparrow-client, sparrow-edge, sparrow-server's downlink) run with it.
    if (a == "server" || a == "compress") sparrow::core::tune_allocator_for_messages();
    break;
  }
  CLI::App app{"sparrow-bench: JSON-lines benchmarks with same-run baselines"};
  app.require_subcommand(1);
  int64_t elements = 25000000;
  int repeat = 5;
  std::string methods;
  int threads = 0;
  auto* compress = app.add_subcommand("compress", "every compressor against memcpy and torch::topk");
  compress->add_option("--elements", elements, "elements of the flat gradient (default 25,000,000, ~ResNet-50)")
      ->check(CLI::Range(int64_t{1000}, int64_t{1} << 31));
  compress->add_option("--repeat", repeat, "timed repetitions per case (median reported)")->check(CLI::Range(1, 1000));
  compress->add_option("--methods", methods, "comma-separated subset of cases to run");
  std::string compress_device = "cpu";
  compress->add_option("--device", compress_device, "cpu (default) or cuda (dgc and sign on the GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--threads", threads, "intra-op threads (default: LibTorch's choice, one per physical core)")
      ->check(CLI::Range(0, 1024));
  int sim_rounds = 6, sim_workers = 1, child_clients = 100;
  std::string sim_tmp = "bench-sim-runs";
  auto* sim =
      app.add_subcommand("sim", "simulator vs a bare LibTorch loop (efficiency); RSS and s/round vs population");
  sim->add_option("--rounds", sim_rounds, "rounds per run (first and last are not timed)")->check(CLI::Range(3, 1000));
  sim->add_option("--workers", sim_workers, "simulator workers")->check(CLI::Range(1, 64));
  sim->add_option("--tmp", sim_tmp, "folder for the benchmark's run folders");
  std::string sim_cases = "peer,efficiency,scale";
  sim->add_option("--cases,--case", sim_cases, "comma-separated subset of peer,efficiency,scale,mpi,gpu,host");
  sparrow::bench::HostOptions host_opts;
  std::string host_models = "cnn,mlp";
  sim->add_option("--host-models", host_models, "host case: comma-separated subset of cnn,mlp");
  sim->add_option("--host-clients", host_opts.clients, "host case: clients of the population")
      ->check(CLI::Range(2, 1000000));
  sim->add_option("--host-per-round", host_opts.per_round, "host case: clients per round")
      ->check(CLI::Range(1, 100000));
  sim->add_option("--sim", host_opts.sim, "host case: the sparrow-sim binary to time (default: the one next to this)");
  sim->add_option("--host-set", host_opts.sets, "host case: extra KEY=VALUE for the runs (repeatable)");
  sparrow::bench::MpiOptions mpi_opts;
  sim->add_option("--mpirun", mpi_opts.mpirun, "mpi case: the MPI launcher");
  sparrow::bench::PeerOptions peer;
  peer.peer_script = std::string(SPARROW_SOURCE_DIR) + "/bench/peer_fedavg.py";
  std::string peer_models = "mlp,cnn";
  peer.models_script = std::string(SPARROW_SOURCE_DIR) + "/examples/models/user_models.py";
  sim->add_option("--models", peer_models,
                  "peer case: comma-separated subset of mlp,cnn,user_cnn,user_resnet (the last two: users' own "
                  "models, scripted, from examples/models/user_models.py)");
  sim->add_option("--mlp-rounds", peer.mlp_rounds, "peer case: rounds of the MLP runs")->check(CLI::Range(1, 10000));
  sim->add_option("--cnn-rounds", peer.cnn_rounds, "peer case: rounds of the CNN runs")->check(CLI::Range(1, 10000));
  sim->add_option("--user-rounds", peer.user_rounds, "peer case: rounds of the user_cnn and user_resnet runs")
      ->check(CLI::Range(1, 10000));
  sim->add_option("--model-dir", peer.model_dir,
                  "peer case: folder holding user_cnn.pt and user_resnet.pt (default: written by "
                  "examples/models/user_models.py into the run folder)");
  auto* python_opt = sim->add_option("--python", peer.python, "peer case: the python3 that has torch (python3-torch)");
  sparrow::bench::GpuOptions gpu;
  gpu.peer_script = peer.peer_script;
  gpu.python = "python3";
  sim->add_option("--population", gpu.population, "gpu case: stateful clients of the population run (0: skip it)")
      ->check(CLI::Range(0, 1000000));
  sim->add_option("--per-round", gpu.per_round, "gpu case: clients per round (and per pass) of the population run")
      ->check(CLI::Range(1, 100000));
  sim->add_option("--population-rounds", gpu.population_rounds,
                  "gpu case: rounds of the population run (first untimed)")
      ->check(CLI::Range(2, 10000));
  sim->add_option("--population-compression", gpu.compression, "gpu case: the population's uplink codec");
  sim->add_option("--device", gpu.device, "gpu case: cuda or cuda:N");
  sim->add_option("--gpu-workers", gpu.workers,
                  "gpu case: worker threads sharing the GPU in the extra rows (0: min(8, cores); 1: no such rows)")
      ->check(CLI::NonNegativeNumber);
  auto* child = app.add_subcommand("sim-scale-child", "internal: one population of the scale case");
  child->group("");  // hidden
  child->add_option("--clients", child_clients)->required();
  child->add_option("--rounds", sim_rounds);
  child->add_option("--workers", sim_workers);
  child->add_option("--tmp", sim_tmp);
  sparrow::bench::SplitBenchOptions split_opts;
  std::string split_cases;
  auto* split = app.add_subcommand(
      "split", "split fine-tuning (CNN on Fashion-MNIST, cut after conv2): each activation codec vs uncompressed");
  split->add_option("--steps", split_opts.steps, "fine-tuning steps per case")->check(CLI::Range(1, 1000000));
  split->add_option("--pretrain-steps", split_opts.pretrain_steps, "pre-training steps on classes 0-4")
      ->check(CLI::Range(0, 1000000));
  split->add_option("--batch", split_opts.batch, "batch size")->check(CLI::Range(2, 65536));
  split->add_option("--eval-samples", split_opts.eval_samples, "test images to evaluate (first N)")
      ->check(CLI::Range(1, 10000));
  split->add_option("--lr", split_opts.lr, "SGD learning rate (momentum 0.9)")->check(CLI::Range(1e-6, 10.0));
  split->add_flag("--freeze-bottom", split_opts.freeze_bottom, "freeze the device's bottom (no gradient goes back)");
  split->add_option("--cases", split_cases,
                    "';'-separated activation codec specs (default: lowrank r32 streaming, lowrank r4, q8, q4, topk)");
  split->add_option("--data", split_opts.data_dir, "Fashion-MNIST folder");
  sparrow::bench::ServerBenchOptions server_opts;
  auto* server = app.add_subcommand(
      "server", "sparrow-server in-process: ingest of DGC updates from many CURVE clients; dense update throughput");
  server->add_option("--clients", server_opts.clients, "concurrent client connections (ingest)")
      ->check(CLI::Range(1, 20000));
  server->add_option("--rounds", server_opts.rounds, "ingest rounds (median reported)")->check(CLI::Range(1, 1000));
  server->add_option("--repeat", server_opts.repeat, "dense updates per transport (median reported)")
      ->check(CLI::Range(1, 100));
  server->add_option("--workers", server_opts.workers, "the server's decode/aggregate threads")
      ->check(CLI::Range(1, 256));
  server->add_option("--cases", server_opts.cases, "comma-separated subset of ingest,dense,dashboard,async");
  server->add_option("--tmp", server_opts.tmp, "parent folder of the temporary keys and databases");
  sparrow::bench::SecAggBenchOptions secagg_opts;
  auto* secagg = app.add_subcommand(
      "secagg", "SecAgg+ per round: server and client compute, wire bytes per client, vs plain FedAvg");
  secagg->add_option("--clients", secagg_opts.clients, "clients per round (repeatable list)")
      ->delimiter(',')
      ->check(CLI::Range(3, 100000));
  secagg->add_option("--degrees", secagg_opts.degrees, "neighbourhood sizes; 0 = complete graph (original SecAgg)")
      ->delimiter(',');
  secagg->add_option("--complete-max", secagg_opts.complete_max, "largest round run with the complete graph");
  secagg->add_option("--dropout", secagg_opts.dropout, "share of clients dropping after their shares")
      ->check(CLI::Range(0.0, 0.5));
  secagg->add_option("--elements", secagg_opts.elements, "update size (0 = the MLP's parameters)");
  secagg->add_option("--cases", secagg_opts.cases, "protocol, service (default both)")->delimiter(',');
  secagg->add_option("--rounds", secagg_opts.rounds, "service: rounds per configuration")->check(CLI::Range(1, 100));
  secagg->add_option("--degree", secagg_opts.degree, "service: the SecAgg+ degree")->check(CLI::Range(2, 254));
  secagg->add_option("--tmp", secagg_opts.tmp, "service: folder for the servers' databases");
  sparrow::bench::KernelBenchOptions kernel_opts;
  auto* kernels = app.add_subcommand("kernels",
                                     "the CNN's CPU kernels (Winograd conv2, pooling, fused conv1, conv1 gradient, "
                                     "inference) vs ATen and a large at::mm");
  kernels->add_option("--images", kernel_opts.images, "images per timing")->check(CLI::Range(1, 100000));
  kernels->add_option("--repeat", kernel_opts.repeat, "timings per kernel (median reported)")
      ->check(CLI::Range(1, 1000));
  // --version, --log-level and --log-format as in every program (docs/cli.md).
  std::string log_level = "info";
  sparrow::cli::add_common_options(app, "sparrow-bench", &log_level);
  if (const int rc = sparrow::cli::parse(app, argc, argv); rc >= 0) return rc;
  sparrow::cli::setup_logging("sparrow-bench", log_level);
  if (threads > 0) sparrow::core::configure_threads(1, threads);
  return sparrow::cli::run_main([&] {
    if (*compress)
      return compress_device == "cuda" ? bench_compress_cuda(elements, repeat, methods)
                                       : bench_compress(elements, repeat, methods);
    if (*server) return sparrow::bench::bench_server(server_opts);
    if (*secagg) return sparrow::bench::bench_secagg(secagg_opts);
    if (*kernels) return sparrow::bench::bench_kernels(kernel_opts);
    if (*sim) {
      auto has = [&](const char* c) {
        return ("," + sim_cases + ",").find("," + std::string(c) + ",") != std::string::npos;
      };
      peer.models.clear();
      std::stringstream models(peer_models);
      for (std::string m; std::getline(models, m, ',');)
        if (!m.empty()) peer.models.push_back(m);
      if (has("peer")) {
        peer.tmp = sim_tmp + "/peer";
        if (int rc = sparrow::bench::bench_sim_peer(peer); rc != 0) return rc;
      }
      if (has("gpu")) {
        gpu.models = peer.models;
        // The first round is untimed: at least two.
        gpu.mlp_rounds = std::max(peer.mlp_rounds, 2);
        gpu.cnn_rounds = std::max(peer.cnn_rounds, 2);
        if (python_opt->count() > 0) gpu.python = peer.python;  // else the PATH's python3 (a GPU machine's)
        gpu.data_dir = peer.data_dir;
        gpu.tmp = sim_tmp + "/gpu";
        if (int rc = sparrow::bench::bench_sim_gpu(gpu); rc != 0) return rc;
      }
      if (has("mpi")) {
        mpi_opts.rounds = sim_rounds;
        mpi_opts.tmp = sim_tmp + "/mpi";
        if (int rc = sparrow::bench::bench_sim_mpi(mpi_opts); rc != 0) return rc;
      }
      if (has("host")) {
        host_opts.rounds = sim_rounds;
        host_opts.tmp = sim_tmp + "/host";
        host_opts.models.clear();
        std::stringstream hm(host_models);
        for (std::string m; std::getline(hm, m, ',');)
          if (!m.empty()) host_opts.models.push_back(m);
        if (int rc = sparrow::bench::bench_sim_host(host_opts); rc != 0) return rc;
      }
      if (has("efficiency") || has("scale"))
        return sparrow::bench::bench_sim(sim_rounds, sim_workers, sim_tmp, has("efficiency"), has("scale"));
      return 0;
    }
    if (*split) {
      split_opts.cases = sparrow::bench::split_bench_default_cases();
      if (!split_cases.empty()) {
        split_opts.cases.clear();
        std::stringstream ss(split_cases);
        for (std::string c; std::getline(ss, c, ';');)
          if (!c.empty() && c != "none") split_opts.cases.push_back(c);
      }
      return sparrow::bench::bench_split(split_opts);
    }
    if (*child) return sparrow::bench::bench_sim_scale_child(child_clients, sim_rounds, sim_workers, sim_tmp);
    return sparrow::cli::kOk;
  });
}
