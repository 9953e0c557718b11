#include "tests/sparrow_test.h"

#include <torch/script.h>
#include <torch/torch.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include <cmath>
#include <set>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "core/datasets.h"
#include "core/error.h"
#include "core/models.h"
#include "core/npy.h"
#include "simulator/config.h"
#include "simulator/simulator.h"
#include "tests/integration/process.h"
#include "tests/simulator/sim_test_util.h"

using namespace sparrow::simulator;
namespace fs = std::filesystem;

namespace {

using testing::TempDir;

// A tiny synthetic experiment: 6 clients, 3 per round, logistic regression.
SimConfig tiny(const std::string& out) {
  SimConfig c;
  c.seed = 7;
  c.dataset = "synthetic:alpha=1,beta=1";
  c.clients = 6;
  c.clients_per_round = 3;
  c.rounds = 4;
  c.model = "logreg";
  c.local_epochs = 1;
  c.batch_size = 16;
  c.lr = 0.05;
  c.eval_every = 2;
  c.out = out;
  return c;
}

void check_same_metrics(const RoundMetrics& a, const RoundMetrics& b) {
  CHECK(a.round == b.round);
  CHECK(a.train_loss == b.train_loss);
  CHECK(a.bytes_up == b.bytes_up);
  CHECK(a.bytes_down == b.bytes_down);
  CHECK(a.clients == b.clients);
  CHECK(a.dropped == b.dropped);
  CHECK(std::isnan(a.accuracy) == std::isnan(b.accuracy));
  if (!std::isnan(a.accuracy)) {
    CHECK(a.accuracy == b.accuracy);
    CHECK(a.loss == b.loss);
  }
}

// Runs that differ only in the last bits (batched and one at a time, GPU and
// CPU): the same bytes, train losses and global model within float tolerance.
void check_close_runs(const Simulator& got, const Simulator& want, size_t rounds) {
  for (size_t i = 0; i < rounds; ++i) {
    CHECK(got.history()[i].bytes_up == want.history()[i].bytes_up);
    CHECK(got.history()[i].train_loss == doctest::Approx(want.history()[i].train_loss).epsilon(1e-4));
  }
  for (const auto& entry : want.global()) {
    const auto& k = entry.first;  // CAPTURE's lambda cannot capture a structured binding (C++17)
    CAPTURE(k);
    CHECK(at::allclose(got.global().at(k).to(at::kCPU), entry.second, 1e-4, 1e-6));
  }
}

void check_same_weights(const Simulator::Weights& a, const Simulator::Weights& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& [k, v] : a) CHECK(at::equal(v, b.at(k)));
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("simulator same seed gives identical metrics and weights") {
  TempDir d1("same1"), d2("same2");
  SimConfig c = tiny(d1.path);
  c.compression = "topk:ratio=0.1";
  Simulator a(c);
  a.run();
  c.out = d2.path;
  Simulator b(c);
  b.run();
  REQUIRE(a.history().size() == 4);
  REQUIRE(b.history().size() == 4);
  for (size_t i = 0; i < 4; ++i) check_same_metrics(a.history()[i], b.history()[i]);
  check_same_weights(a.global(), b.global());
  // Evaluation every 2 rounds: rounds 1 and 3 carry NaN, 2 and 4 a value.
  CHECK(std::isnan(a.history()[0].accuracy));
  CHECK(!std::isnan(a.history()[1].accuracy));
  CHECK(std::isnan(a.history()[2].accuracy));
  CHECK(!std::isnan(a.history()[3].accuracy));
  // A different seed gives a different run.
  TempDir d3("same3");
  c.out = d3.path;
  c.seed = 8;
  Simulator other(c);
  other.run();
  CHECK(other.history()[0].train_loss != a.history()[0].train_loss);
}

TEST_CASE("simulator writes csv db and config to the run folder") {
  TempDir d("files");
  SimConfig c = tiny(d.path);
  c.rounds = 2;
  Simulator s(c);
  s.run();
  const std::string csv = read_file(d.path + "/metrics.csv");
  CHECK(
      csv.rfind("round,accuracy,loss,train_loss,bytes_up,bytes_down,sim_round_s,real_s,clients,dropped,epsilon,clip\n",
                0) == 0);
  // Header plus two rows; round 1 is not evaluated, so accuracy and loss are empty.
  CHECK(std::count(csv.begin(), csv.end(), '\n') == 3);
  CHECK(csv.find("\n1,,,") != std::string::npos);
  CHECK(fs::exists(d.path + "/run.db"));
  CHECK(fs::exists(d.path + "/client_state.db"));
  CHECK(load_config(d.path + "/config.toml") == c);
}

TEST_CASE("simulator resume reproduces the uninterrupted run") {
  for (const std::string comp : {"none", "dgc:ratio=0.1,momentum=0.9", "acp:rank=2", "tcs:ratio=0.2,extra=0.05"}) {
    CAPTURE(comp);
    TempDir full("resume_full"), part("resume_part");
    SimConfig c = tiny(full.path);
    c.compression = comp;
    c.algorithm = comp == "none" ? "scaffold" : "fedavg";
    c.server_optimizer = "fedadam:lr=0.05";
    Simulator a(c);
    a.run();

    SimConfig h = c;
    h.out = part.path;
    h.rounds = 2;
    {
      Simulator b(h);
      b.run();
      CHECK(b.completed_rounds() == 2);
    }
    h.rounds = 4;
    Simulator r(h, /*resume=*/true);
    CHECK(r.completed_rounds() == 2);
    r.run();
    REQUIRE(r.history().size() == 4);
    for (size_t i = 0; i < 4; ++i) check_same_metrics(a.history()[i], r.history()[i]);
    check_same_weights(a.global(), r.global());
    // The CSV holds every round once.
    const std::string csv = read_file(part.path + "/metrics.csv");
    CHECK(std::count(csv.begin(), csv.end(), '\n') == 5);
  }
}

TEST_CASE("simulator: tcs clients send values on the server's mask, which goes out with the model") {
  TempDir tdir("tcs"), ddir("tcs_dense");
  SimConfig c = tiny(tdir.path);
  c.compression = "tcs:ratio=0.2,extra=0.05,values=fp32";
  Simulator a(c);
  a.run();
  SimConfig d = c;
  d.out = ddir.path;
  d.compression = "none";
  Simulator plain(d);
  plain.run();
  REQUIRE(a.history().size() == 4);
  // Round 1 has no mask: the model alone goes down, and each client sends only
  // its own top 5%. Later rounds add the mask to the download, and each client
  // sends values on it too.
  CHECK(a.history()[0].bytes_down == plain.history()[0].bytes_down);
  for (size_t t = 1; t < 4; ++t) {
    CAPTURE(t);
    CHECK(a.history()[t].bytes_down > plain.history()[t].bytes_down);
    CHECK(a.history()[t].bytes_up > a.history()[0].bytes_up);
    CHECK(a.history()[t].bytes_up < plain.history()[t].bytes_up);
  }
  // Values land where they belong: with every position kept (a mask of the
  // whole step, the rest as own positions) and fp32 values, tcs is dense FedAvg.
  TempDir fdir("tcs_full");
  SimConfig f = c;
  f.out = fdir.path;
  f.compression = "tcs:ratio=1,extra=1,values=fp32";
  Simulator full(f);
  full.run();
  for (const auto& [k, v] : plain.global()) CHECK(at::allclose(full.global().at(k), v, 1e-5, 1e-6));
}

TEST_CASE("simulator: tcs share=mean divides each carried mask position by the weight that carried it") {
  // Round 1 has no mask, so all runs reach the same model and round 2's
  // clients send the same shares (same data, same keys). With share=sum each
  // share is scaled by m/k = 2.5 and the sum divided by the round's weight W;
  // with share=mean it goes unscaled and a mask position is divided by the
  // weight W_p of the updates that carried it. So per position the two steps
  // have the same sign, off the mask they are equal, and on it their ratio is
  // W·k/(m·W_p) >= k/m: several values, one per W_p. (Were W_p ignored, the
  // ratio would be k/m = 0.4 everywhere on the mask.)
  TempDir d1("share1"), dm("share_mean"), ds("share_sum");
  SimConfig c = tiny(d1.path);
  c.rounds = 1;
  c.compression = "tcs:ratio=0.5,extra=0.05,keep=0.4,share=mean,values=fp32,ef=0";
  Simulator one(c);
  one.run();
  c.rounds = 2;
  c.out = dm.path;
  Simulator mean(c);
  mean.run();
  c.out = ds.path;
  c.compression = "tcs:ratio=0.5,extra=0.05,keep=0.4,values=fp32,ef=0";
  Simulator sum(c);
  sum.run();
  std::set<int64_t> ratios;  // per mille
  for (const auto& [key, w1] : one.global()) {
    const std::string k = key;  // (a structured binding cannot be captured before C++20: clang)
    CAPTURE(k);
    const at::Tensor dmean = mean.global().at(k) - w1, dsum = sum.global().at(k) - w1;
    REQUIRE(at::isfinite(dmean).all().item<bool>());
    CHECK(dmean.ne(0).equal(dsum.ne(0)));
    const at::Tensor moved = dmean.ne(0);
    const at::Tensor r = dmean.index({moved}) / dsum.index({moved});
    CHECK(r.ge(0.4 - 1e-3).all().item<bool>());
    const at::Tensor rd = r.to(at::kDouble).contiguous();
    for (int64_t i = 0; i < rd.numel(); ++i) ratios.insert(std::llround(rd.data_ptr<double>()[i] * 1000));
  }
  CAPTURE(ratios.size());
  CHECK(ratios.count(1000) == 1);  // own positions
  CHECK(ratios.size() >= 3);
}

TEST_CASE("simulator: downlink compression sends the broadcast delta to last round's clients and resumes exactly") {
  TempDir full("downlink_full"), part("downlink_part"), dense("downlink_dense");
  SimConfig c = tiny(full.path);
  c.rounds = 6;
  c.downlink = "topk:ratio=0.2,ef=1";
  c.downlink_catchup = "full";  // the one-step rule; clients further behind: catchup_sim_test.cc
  Simulator a(c);
  a.run();
  SimConfig d = c;
  d.out = dense.path;
  d.downlink = "none";
  Simulator plain(d);
  plain.run();
  // The dense model's bytes: what every client gets without downlink compression.
  const uint64_t model = plain.history()[0].bytes_down / static_cast<uint64_t>(c.clients_per_round);
  REQUIRE(model > 0);
  bool some_delta = false;
  for (int t = 0; t < c.rounds; ++t) {
    CAPTURE(t);
    const auto ids = a.selection(t);
    int repeat = 0;
    if (t > 0)
      for (int64_t id : ids) {
        const auto prev = a.selection(t - 1);
        repeat += std::find(prev.begin(), prev.end(), id) != prev.end();
      }
    const uint64_t got = a.history()[static_cast<size_t>(t)].bytes_down;
    CHECK(plain.history()[static_cast<size_t>(t)].bytes_down == model * ids.size());
    if (t < 2) {
      // Every client holds B_0 (built from model_seed): round 1 is an empty
      // Delta, round 2 the delta C_1 to every client.
      if (t == 0) {
        CHECK(got == 0);
      } else {
        CHECK(got > 0);
        CHECK(got < model * ids.size());
        some_delta = true;
      }
    } else if (repeat == 0) {
      CHECK(got == model * ids.size());
    } else {
      // Each returning client gets the compressed delta: fewer bytes than the model.
      CHECK(got < model * ids.size());
      CHECK(got > model * (ids.size() - static_cast<size_t>(repeat)));
      some_delta = true;
    }
  }
  CHECK(some_delta);  // 3 of 6 clients a round: some client returns the next round
  // The clients trained from the compressed broadcast, not the server's model.
  bool differs = false;
  for (const auto& [k, v] : a.global()) differs = differs || !at::equal(v, plain.global().at(k));
  CHECK(differs);

  SimConfig h = c;
  h.out = part.path;
  h.rounds = 2;  // evaluated (eval_every = 2) and checkpointed, as round 2 of the full run
  {
    Simulator b(h);
    b.run();
  }
  h.rounds = 6;
  Simulator r(h, /*resume=*/true);
  r.run();
  REQUIRE(r.history().size() == 6);
  for (size_t i = 0; i < 6; ++i) check_same_metrics(a.history()[i], r.history()[i]);
  check_same_weights(a.global(), r.global());
  CHECK_THROWS_AS(parse_config_string("downlink = \"acp:rank=2\"\n"), sparrow::ConfigError);
  CHECK_THROWS_AS(parse_config_string("downlink = \"tcs:ratio=0.01\"\n"), sparrow::ConfigError);
  // W - B is the error feedback: the codec's own residual must not count the
  // unsent part again, so ef=1 and ef=0 broadcast the same model.
  TempDir ef1("downlink_ef1"), ef0("downlink_ef0");
  SimConfig e1 = c, e0 = c;
  e1.out = ef1.path;
  e0.out = ef0.path;
  e1.downlink = "topk:ratio=0.3,ef=1";
  e0.downlink = "topk:ratio=0.3,ef=0";
  Simulator s1(e1), s0(e0);
  s1.run();
  s0.run();
  check_same_weights(s1.global(), s0.global());
  TempDir bad_dir("downlink_bad");
  SimConfig bad = c;
  bad.out = bad_dir.path;
  bad.downlink = "nosuchcodec";
  CHECK_THROWS_AS(Simulator(bad, false), sparrow::ConfigError);
}

TEST_CASE("simulator resume restarts from the last checkpoint not the last round") {
  // checkpoint_every = 2: a run stopped after round 3 of 5 has its checkpoint
  // at round 2; round 3's client states must not be on disk (they were never
  // checkpointed), or the resumed round 3 would start from states one round
  // ahead and the results would differ.
  TempDir full("ckpt_full"), part("ckpt_part");
  SimConfig c = tiny(full.path);
  c.rounds = 5;
  c.compression = "dgc:ratio=0.1,momentum=0.9";
  c.checkpoint_every = 2;
  Simulator a(c);
  a.run();

  SimConfig h = c;
  h.out = part.path;
  {
    Simulator b(h);
    for (int r = 0; r < 3; ++r) b.run_round();
    CHECK(b.completed_rounds() == 3);
  }  // "crash": destroyed without a checkpoint of round 3
  Simulator r(h, /*resume=*/true);
  CHECK(r.completed_rounds() == 2);
  REQUIRE(r.history().size() == 2);
  r.run();
  REQUIRE(r.history().size() == 5);
  for (size_t i = 0; i < 5; ++i) check_same_metrics(a.history()[i], r.history()[i]);
  check_same_weights(a.global(), r.global());
  const std::string csv = read_file(part.path + "/metrics.csv");
  CHECK(std::count(csv.begin(), csv.end(), '\n') == 6);
  // A changed checkpoint_every is allowed on resume (it changes no result).
  SimConfig k = h;
  k.checkpoint_every = 1;
  CHECK_NOTHROW(Simulator(k, true));
}

TEST_CASE("simulator resume refuses a changed config or a missing run") {
  TempDir d("resume_bad");
  SimConfig c = tiny(d.path);
  CHECK_THROWS_AS(Simulator(c, true), sparrow::ConfigError);
  c.rounds = 1;
  { Simulator(c).run(); }
  SimConfig changed = c;
  changed.lr = 0.1;
  CHECK_THROWS_AS(Simulator(changed, true), sparrow::ConfigError);
}

TEST_CASE("simulator one client full batch equals centralised SGD") {
  TempDir d("central");
  SimConfig c = tiny(d.path);
  c.clients = 1;
  c.clients_per_round = 1;
  c.rounds = 1;
  c.local_epochs = 1;
  c.batch_size = 100000;  // full batch
  c.lr = 0.5;
  c.compression = "none";
  c.server_optimizer = "fedavg:lr=1";
  c.model = "logreg";
  Simulator s(c);
  s.run();

  sparrow::core::FederatedData fd = sparrow::core::make_synthetic(1, 1, 1, c.seed);
  const at::Tensor x = fd.train[0].x, y = fd.train[0].y;
  auto model = make_sim_model("logreg", c.seed, x.size(1), 10);
  at::Tensor loss = torch::cross_entropy_loss(model->forward(x), y);
  loss.backward();
  {
    torch::NoGradGuard g;
    for (auto& p : model->named_parameters()) p.value().sub_(p.value().grad() * c.lr);
  }
  for (auto& p : model->named_parameters()) {
    CAPTURE(p.key());
    CHECK(at::allclose(s.global().at(p.key()), p.value(), 1e-5, 1e-6));
  }
  // And the update really moved the model.
  CHECK(s.global().at("fc.weight").abs().sum().item<double>() > 0);
}

TEST_CASE("simulator drops stragglers past the deadline") {
  TempDir d1("strag1"), d2("strag2");
  SimConfig c = tiny(d1.path);
  c.rounds = 2;
  c.deadline_s = 1e-9;  // nobody can make it: every update is dropped
  Simulator s(c);
  s.run();
  for (const auto& m : s.history()) {
    CHECK(m.dropped == m.clients);
    CHECK(m.sim_round_s == doctest::Approx(1e-9));
  }
  // Nothing aggregated: logreg stays at its zero initialisation.
  CHECK(s.global().at("fc.weight").abs().sum().item<double>() == 0);

  c.out = d2.path;
  c.deadline_s = 1e6;  // everybody makes it
  Simulator t(c);
  t.run();
  for (const auto& m : t.history()) {
    CHECK(m.dropped == 0);
    CHECK(m.sim_round_s > 0);
    CHECK(m.sim_round_s < 1e6);
  }
}

TEST_CASE("simulator bad config throws ConfigError") {
  TempDir d("badcfg");
  SimConfig c = tiny(d.path);
  SUBCASE("mlp on 60 synthetic features") {
    c.model = "mlp";
    CHECK_THROWS_AS(Simulator{c}, sparrow::ConfigError);
  }
  SUBCASE("unknown compressor") {
    c.compression = "nosuch";
    CHECK_THROWS_AS(Simulator{c}, sparrow::ConfigError);
  }
  SUBCASE("unknown server optimiser key") {
    c.server_optimizer = "fedadam:nokey=1";
    CHECK_THROWS_AS(Simulator{c}, sparrow::ConfigError);
  }
  SUBCASE("missing fashion-mnist folder") {
    c.dataset = "fashion-mnist";
    c.data_dir = "/nonexistent/fmnist";
    c.model = "mlp";
    CHECK_THROWS_AS(Simulator{c}, sparrow::ConfigError);
  }
  CHECK_THROWS_AS(parse_config_string("clients = -1"), sparrow::ConfigError);
}

// The round is summed in client-id order whichever worker finishes first
// (federation::OrderedFold): two workers end with one worker's bits.
TEST_CASE("simulator with two workers ends with one worker's model, bit for bit") {
  TempDir d1("w1"), d2("w2");
  SimConfig c = tiny(d1.path);
  c.clients_per_round = 5;
  c.rounds = 2;
  Simulator one(c);
  one.run();
  c.out = d2.path;
  c.workers = 2;
  Simulator two(c);
  two.run();
  for (size_t i = 0; i < 2; ++i) {
    CHECK(one.history()[i].bytes_up == two.history()[i].bytes_up);
    // The batched passes differ (5 clients, or 3 and 2): the mean loss is
    // reduced in another order, the gradients are not.
    CHECK(one.history()[i].train_loss == doctest::Approx(two.history()[i].train_loss));
  }
  for (const auto& [k, v] : one.global()) {
    CAPTURE(k);
    CAPTURE((v - two.global().at(k)).abs().max().item<double>());
    CHECK(at::equal(v, two.global().at(k)));
  }
}

TEST_CASE("summary json is one valid line") {
  Summary s;
  s.rounds = 3;
  s.accuracy = 0.5;
  s.loss = std::nan("");
  s.bytes_up = 10;
  CHECK(summary_json(s) ==
        "{\"rounds\":3,\"accuracy\":0.5,\"loss\":null,\"bytes_up\":10,\"bytes_down\":0,\"sim_wall_s\":0,\"real_s\":0,"
        "\"epsilon\":0}");
}

TEST_CASE("sparrow-sim cli prints a json summary last and exits 2 on config errors") {
  TempDir d("cli");
  const std::string cfg = d.path + ".toml";
  std::ofstream(cfg) << "dataset = \"synthetic:alpha=1,beta=1\"\nmodel = \"logreg\"\nclients = 4\n"
                        "clients_per_round = 2\nrounds = 2\nout = \""
                     << d.path << "\"\n";
  const std::string bin = std::string(SPARROW_BIN_DIR) + "/sparrow-sim";
  auto run = [](const std::string& cmd, std::string* out) {
    FILE* p = popen(cmd.c_str(), "r");
    REQUIRE(p != nullptr);
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
    const int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  std::string out;
  CHECK(run(bin + " --config " + cfg + " --set eval_every=1 2>/dev/null", &out) == 0);
  while (!out.empty() && out.back() == '\n') out.pop_back();
  const std::string last = out.substr(out.rfind('\n') == std::string::npos ? 0 : out.rfind('\n') + 1);
  CHECK(last.rfind("{\"rounds\":2,\"accuracy\":", 0) == 0);
  for (const char* k : {"\"loss\":", "\"bytes_up\":", "\"bytes_down\":", "\"sim_wall_s\":", "\"real_s\":"})
    CHECK(last.find(k) != std::string::npos);
  CHECK(last.back() == '}');
  CHECK(last.find("nan") == std::string::npos);
  std::string ignored;
  CHECK(run(bin + " --config " + cfg + " --set clients=0 2>/dev/null", &ignored) == 2);
  CHECK(run(bin + " --config " + cfg + " --set nosuchkey=1 2>/dev/null", &ignored) == 2);
  CHECK(run(bin + " 2>/dev/null", &ignored) == 2);
  std::remove(cfg.c_str());
}

TEST_CASE("simulator batched clients equal one client at a time") {
  for (const std::string algo : {"fedavg", "fedprox", "scaffold"}) {
    CAPTURE(algo);
    TempDir d1("seq_" + algo), d2("bat_" + algo);
    SimConfig c = tiny(d1.path);
    c.clients_per_round = 5;  // synthetic clients hold different numbers of samples: ragged passes
    c.rounds = 3;
    c.algorithm = algo;
    c.lr = 0.01;  // tiny() at lr 0.05 with momentum is chaotic: last-bit differences grow to 0.3% in 3 rounds
    c.momentum = 0.5;
    if (algo == "fedprox") c.mu = 0.1;
    c.client_batch = 1;
    Simulator one(c);
    one.run();
    CHECK(one.training_mode().find("one client at a time") != std::string::npos);
    c.out = d2.path;
    c.client_batch = 3;  // passes of 3 and 2
    Simulator bat(c);
    bat.run();
    CHECK(bat.training_mode().find("batched clients: up to 3") != std::string::npos);
    check_close_runs(bat, one, 3);
  }
}

// The CUDA path (device = "cuda": data staged on the GPU once, clients trained
// there, one at a time, batched or by two workers): the same global model as the CPU run; and
// a DGC run on the GPU. Skipped without a CUDA device.
TEST_CASE("simulator on CUDA: one at a time, batched and two workers equal the CPU run") {
  if (!torch::cuda::is_available()) {
    MESSAGE("skipped: no CUDA device");
    return;
  }
  TempDir d0("cuda_cpu"), d1("cuda_seq"), d2("cuda_bat"), d3("cuda_dgc");
  SimConfig c = tiny(d0.path);
  c.clients_per_round = 5;
  c.rounds = 3;
  c.lr = 0.01;
  c.momentum = 0.5;
  c.client_batch = 1;
  Simulator cpu(c);
  cpu.run();
  c.device = "cuda";
  c.out = d1.path;
  Simulator seq(c);
  seq.run();
  CHECK(seq.training_mode().find("on cuda") != std::string::npos);
  c.out = d2.path;
  c.client_batch = 5;
  Simulator bat(c);
  bat.run();
  CHECK(bat.training_mode().find("batched clients: up to 5") != std::string::npos);
  check_close_runs(seq, cpu, 3);
  check_close_runs(bat, cpu, 3);
  // Two workers sharing the GPU, each on a stream of its own: the same model
  // (the partial sums fold in slot order, as on the CPU).
  TempDir d4("cuda_two");
  c.out = d4.path;
  c.workers = 2;
  c.client_batch = 3;
  Simulator two(c);
  two.run();
  CHECK(two.training_mode().find("on each of 2 workers, on cuda") != std::string::npos);
  check_close_runs(two, cpu, 3);
  c.workers = 1;
  c.client_batch = 5;
  // DGC with training on the GPU (updates encoded on the host): the run
  // completes, sends fewer bytes and stays finite.
  c.out = d3.path;
  c.compression = "dgc:ratio=0.1";
  c.rounds = 4;
  Simulator dgc(c);
  dgc.run();
  REQUIRE(dgc.history().size() == 4);
  CHECK(dgc.history().back().bytes_up < cpu.history().back().bytes_up);
  CHECK(std::isfinite(dgc.history().back().accuracy));
}

TEST_CASE("simulator client_batch: automatic choice and models that cannot be batched") {
  TempDir d("auto");
  SimConfig c = tiny(d.path);
  c.rounds = 1;
  Simulator s(c);  // client_batch = 0: the worker's share of a round in one pass
  CHECK(s.training_mode().find("batched clients: up to 3 per pass") != std::string::npos);
  CHECK_THROWS_AS(parse_config_string("client_batch = -1"), sparrow::ConfigError);
  CHECK_THROWS_AS(parse_config_string("device = \"tpu\""), sparrow::ConfigError);
  if (!torch::cuda::is_available()) {
    c.device = "cuda";
    CHECK_THROWS_WITH_AS(Simulator{c}, doctest::Contains("no CUDA device"), sparrow::ConfigError);
  }
}

namespace {
double distance(const Simulator::Weights& a, const Simulator::Weights& b) {
  double sq = 0;
  for (const auto& [k, v] : a) sq += (v - b.at(k)).square().sum().item<double>();
  return std::sqrt(sq);
}
}  // namespace

TEST_CASE("simulator: sign-flip adversaries drag the mean away, krum and median hold") {
  TempDir d0("robust_clean"), d1("robust_mean"), d2("robust_krum"), d3("robust_median");
  SimConfig c = tiny(d0.path);
  c.clients = 10;
  c.clients_per_round = 10;
  c.rounds = 3;
  Simulator clean(c);
  clean.run();
  c.adversaries = 0.2;
  c.attack = "sign_flip:scale=100";  // the mean moves with the attack's scale; krum and median do not
  c.out = d1.path;
  Simulator mean(c);
  mean.run();
  c.out = d2.path;
  c.aggregator = "krum:f=2";
  Simulator krum(c);
  krum.run();
  c.out = d3.path;
  c.aggregator = "median";
  Simulator median(c);
  median.run();
  const double dm = distance(mean.global(), clean.global());
  CHECK(distance(krum.global(), clean.global()) < 0.5 * dm);
  CHECK(distance(median.global(), clean.global()) < 0.5 * dm);
}

TEST_CASE("simulator: every attack runs and is reproducible") {
  for (const std::string attack :
       {"sign_flip", "scale:factor=5", "gaussian:std=0.5", "label_flip", "alie", "alie:z=1"}) {
    CAPTURE(attack);
    TempDir d1("attack_a"), d2("attack_b");
    SimConfig c = tiny(d1.path);
    c.clients = 10;
    c.clients_per_round = 8;
    c.rounds = 2;
    c.adversaries = 0.3;
    c.attack = attack;
    c.aggregator = "trimmed_mean:beta=0.25";
    Simulator a(c);
    a.run();
    c.out = d2.path;
    Simulator b(c);
    b.run();
    check_same_weights(a.global(), b.global());
    for (const auto& [k, v] : a.global()) CHECK(at::isfinite(v).all().item<bool>());
  }
}

TEST_CASE("simulator: central DP reports epsilon, resume reproduces the adaptive clip") {
  TempDir full("dp_full"), part("dp_part");
  SimConfig c = tiny(full.path);
  c.dp = "central:clip=0.5,noise=0.8,adaptive=1,count_noise=1";
  Simulator a(c);
  a.run();
  REQUIRE(a.history().size() == 4);
  for (size_t i = 1; i < 4; ++i) {
    CHECK(a.history()[i].epsilon > a.history()[i - 1].epsilon);
    CHECK(a.history()[i].clip != a.history()[i - 1].clip);  // adaptive
  }
  CHECK(a.history()[0].clip == 0.5);
  CHECK(a.summary().epsilon == a.history()[3].epsilon);
  SimConfig h = c;
  h.out = part.path;
  h.rounds = 2;
  {
    Simulator b(h);
    b.run();
  }
  h.rounds = 4;
  Simulator r(h, /*resume=*/true);
  r.run();
  for (size_t i = 0; i < 4; ++i) {
    check_same_metrics(a.history()[i], r.history()[i]);
    CHECK(a.history()[i].clip == r.history()[i].clip);
    CHECK(a.history()[i].epsilon == r.history()[i].epsilon);
  }
  check_same_weights(a.global(), r.global());
  const std::string csv = read_file(part.path + "/metrics.csv");
  CHECK(csv.find(",0.5\n") != std::string::npos);  // round 1's clip column
}

TEST_CASE("simulator: local DP noises each client's update, epsilon counts participations") {
  TempDir d("ldp"), d2("ldp_off");
  SimConfig c = tiny(d.path);
  c.dp = "local:clip=0.1,noise=1";
  Simulator a(c);
  a.run();
  c.dp = "none";
  c.out = d2.path;
  Simulator b(c);
  b.run();
  CHECK(distance(a.global(), b.global()) > 1e-3);
  CHECK(a.history()[3].epsilon > a.history()[0].epsilon);
  CHECK(std::isnan(b.history()[3].epsilon));
  CHECK(std::isnan(b.summary().epsilon));
}

TEST_CASE("simulator config: robust aggregation, dp and attack keys are checked") {
  auto err = [](const std::vector<std::string>& o) {
    try {
      parse_config_string("", o);
    } catch (const sparrow::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(err({"aggregator=krum:f=4"}).find("needs at least 11") != std::string::npos);  // clients_per_round 10
  CHECK(err({"aggregator=bulyan:f=2", "clients_per_round=10"}).find("needs at least 11") != std::string::npos);
  CHECK(err({"aggregator=bulyan:f=2", "clients_per_round=11"}).empty());
  CHECK(err({"aggregator=median", "dp=central:clip=1,noise=1"}).find("mean") != std::string::npos);
  CHECK(err({"dp=central:clip=1,noise=1", "algorithm=scaffold"}).find("scaffold") != std::string::npos);
  CHECK(err({"aggregator=median", "compression=acp:rank=2"}).find("acp") != std::string::npos);
  CHECK(err({"attack=sign_flop"}).find("attack") != std::string::npos);
  CHECK(err({"attack=gaussian:sd=1"}).find("attack") != std::string::npos);
  CHECK(err({"adversaries=1"}).find("adversaries") != std::string::npos);
  CHECK(err({"dp=local:clip=1"}).find("dp") != std::string::npos);
  CHECK(err({"aggregator=krum:f=3", "dp=none"}).empty());
  CHECK(err({"aggregator=median", "max_buffer_mb=0"}).find("max_buffer_mb") != std::string::npos);
  // The memory bound is checked against the model when the run is built.
  TempDir d("bound");
  SimConfig c = tiny(d.path);
  c.aggregator = "median";
  c.max_buffer_mb = 1e-6;
  CHECK_THROWS_AS(Simulator{c}, sparrow::ConfigError);
}

TEST_CASE("simulator: automatic client_batch batches the built-in models, client_batch = 1 does not") {
  TempDir d("cnn_auto");
  SimConfig c;
  c.clients = 4;
  c.clients_per_round = 4;
  c.rounds = 1;
  c.out = d.path;
  for (const std::string model : {"cnn", "mlp"}) {
    CAPTURE(model);
    c.model = model;
    c.client_batch = 0;
    CHECK(Simulator(c).training_mode().find("batched clients: up to 4 per pass") != std::string::npos);
    c.client_batch = 1;
    CHECK(Simulator(c).training_mode().find("one client at a time") != std::string::npos);
  }
}

TEST_CASE("simulator resume refuses a damaged run database") {
  TempDir d("resume_damaged");
  SimConfig c = tiny(d.path);
  c.rounds = 2;
  { Simulator(c).run(); }
  const std::string db = d.path + "/run.db";
  REQUIRE(std::filesystem::file_size(db) >= 2 * 4096);
  {
    // Page 2 (the rounds table's root) zeroed, as a bad sector reads back.
    std::fstream f(db, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096);
    const std::string zeros(4096, '\0');
    f.write(zeros.data(), static_cast<std::streamsize>(zeros.size()));
  }
  c.rounds = 3;
  CHECK_THROWS_WITH_AS(Simulator(c, true), doctest::Contains("is damaged"), sparrow::FormatError);
}

namespace {

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs a command through the shell; its exit status, stdout+stderr in *out.
int shell(const std::string& cmd, std::string* out) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
  const int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

}  // namespace

TEST_CASE(
    "sparrow-sim: Ctrl-C checkpoints and exits 130, a used run folder needs --resume or --force, "
    "resume names the changed keys") {
  TempDir d("cli_interrupt");
  const std::string cfg = d.path + ".toml", log = d.path + ".log";
  std::ofstream(cfg) << "dataset = \"synthetic:alpha=1,beta=1\"\nmodel = \"logreg\"\nclients = 4\n"
                        "clients_per_round = 2\nrounds = 1000000\neval_every = 1000000\nout = \""
                     << d.path << "\"\n";
  const std::string bin = std::string(SPARROW_BIN_DIR) + "/sparrow-sim";
  {
    sparrow::testing::Process sim({bin, "--config", cfg}, log);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (slurp(log).find("event=round_completed round=3 ") == std::string::npos &&
           std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    sim.signal(SIGINT);
    CHECK(sim.wait(std::chrono::seconds(60)) == std::optional<int>(130));
  }
  const std::string text = slurp(log);
  const auto at = text.find("interrupted after round ");
  REQUIRE(at != std::string::npos);
  const int done = std::stoi(text.substr(at + 24));
  CHECK(done >= 3);
  CHECK(text.find("continue with: sparrow-sim --resume " + d.path) != std::string::npos);

  std::string out;
  CHECK(shell(bin + " --config " + cfg, &out) == 2);  // the folder holds a run
  CHECK(out.find("--resume " + d.path) != std::string::npos);
  CHECK(out.find("--force") != std::string::npos);
  CHECK(fs::exists(fs::path(d.path) / "run.db"));  // untouched

  out.clear();
  CHECK(shell(bin + " --resume " + d.path + " --set lr=0.5 --set momentum=0.5", &out) == 2);
  CHECK(out.find("lr (") != std::string::npos);
  CHECK(out.find("momentum (") != std::string::npos);

  out.clear();
  CHECK(shell(bin + " --resume " + d.path + " --set rounds=" + std::to_string(done + 2), &out) == 0);
  CHECK(out.find("{\"rounds\":" + std::to_string(done + 2) + ",") != std::string::npos);

  out.clear();
  CHECK(shell(bin + " --config " + cfg + " --force --set rounds=2", &out) == 0);
  CHECK(out.find("{\"rounds\":2,") != std::string::npos);
  // The trained model out: TorchScript + .npy, equal to the run's global model.
  out.clear();
  CHECK(shell(bin + " export " + d.path + " --out " + d.path + "/x", &out) == 0);
  {
    const auto [w, round] = load_run_model(d.path);
    CHECK(round == 2);
    torch::jit::Module m = torch::jit::load(d.path + "/x/model.pt");
    const at::Tensor x = at::randn({3, 60});
    const at::Tensor want = at::linear(x, w.at("fc.weight"), w.at("fc.bias"));
    CHECK(at::allclose(m.forward({x}).toTensor(), want, 1e-5, 1e-6));
    CHECK(fs::exists(d.path + "/x/weights/fc.weight.npy"));
  }
  out.clear();
  CHECK(shell(bin + " export " + d.path + "_missing", &out) == 2);
  out.clear();
  CHECK(shell(bin + " --version", &out) == 0);
  CHECK(out.rfind("sparrow-sim ", 0) == 0);
  std::remove(cfg.c_str());
  std::remove(log.c_str());
}

namespace {

// x.npy [n, 784] with pixels from (i, label) and y.npy labels i % 10 (float32
// whole numbers, which the loader accepts).
void write_folder(const std::string& dir, int64_t n, int64_t seed) {
  fs::create_directories(dir);
  at::manual_seed(seed);
  at::Tensor y = at::arange(n, at::kFloat).fmod(10);
  at::Tensor x = at::rand({n, 784}) * 0.1 + y.unsqueeze(1) / 10;  // learnable: brightness = label
  x = x.contiguous();
  sparrow::npy::write(dir + "/x.npy", {n, 784}, x.data_ptr<float>());
  sparrow::npy::write(dir + "/y.npy", {n}, y.data_ptr<float>());
}

void save_linear_script(const std::string& path, int64_t in, int64_t classes) {
  torch::jit::Module m("Linear");
  m.register_parameter("weight", torch::zeros({classes, in}).requires_grad_(), false);
  m.register_parameter("bias", torch::zeros({classes}).requires_grad_(), false);
  m.define(R"(
def forward(self, x):
    return torch.matmul(x.flatten(1), self.weight.t()) + self.bias
)");
  m.save(path);
}

// The tiny experiment on a folder dataset: the MLP, 4 clients, all in every
// round, evaluated every round.
SimConfig folder_mlp(const std::string& out, const std::string& data, int rounds) {
  SimConfig c = tiny(out);
  c.dataset = "folder:" + data;
  c.model = "mlp";
  c.partition = "iid";
  c.clients = 4;
  c.clients_per_round = 4;
  c.rounds = rounds;
  c.eval_every = 1;
  return c;
}

}  // namespace

TEST_CASE("simulator: a folder dataset trains, holds out a test share or uses test/, and the model is checked") {
  TempDir d("folder_data");
  const std::string data = d.path + "_data";
  write_folder(data, 200, 1);
  SimConfig c = folder_mlp(d.path, data, 3);
  c.lr = 0.1;
  {
    Simulator sim(c);
    CHECK(sim.training_mode().find("160 training samples from " + data) != std::string::npos);
    CHECK(sim.training_mode().find("40 samples held out") != std::string::npos);
    sim.run();
    CHECK(std::isfinite(sim.summary().accuracy));
    size_t n = 0;
    for (const auto& p : sim.partition()) n += p.size();
    CHECK(n == 160);
  }
  write_folder(data + "/test", 30, 2);
  {
    Simulator sim(c);
    CHECK(sim.training_mode().find("200 training samples") != std::string::npos);
    CHECK(sim.training_mode().find("test set: " + data + "/test") != std::string::npos);
  }
  // A TorchScript model with 7 classes for labels up to 9, and one that cannot
  // take 784 features: clear errors before the first round.
  const std::string seven = d.path + "_seven.pt", narrow = d.path + "_narrow.pt";
  save_linear_script(seven, 784, 7);
  save_linear_script(narrow, 5, 10);
  c.model = "torchscript:" + seven;
  CHECK_THROWS_WITH_AS(Simulator(c, false), doctest::Contains("has 7 outputs (classes) but the data has label 9"),
                       sparrow::ConfigError);
  c.model = "torchscript:" + narrow;
  CHECK_THROWS_WITH_AS(Simulator(c, false), doctest::Contains("cannot take the data"), sparrow::ConfigError);
  fs::remove_all(data);
  std::remove(seven.c_str());
  std::remove(narrow.c_str());
}

TEST_CASE("simulator: validation holds out training samples and evaluates on them instead of the test set") {
  TempDir d("validation");
  const std::string data = d.path + "_data";
  write_folder(data, 200, 1);
  write_folder(data + "/test", 30, 2);
  SimConfig c = folder_mlp(d.path, data, 2);
  c.validation = 0.25;
  std::vector<std::vector<int64_t>> parts;
  {
    Simulator sim(c);
    CHECK(sim.training_mode().find("evaluating on 50 validation samples held out of the 200 training samples") !=
          std::string::npos);
    CHECK(sim.training_mode().find("the test set is not used") != std::string::npos);
    sim.run();
    CHECK(std::isfinite(sim.summary().accuracy));
    parts = sim.partition();
    size_t n = 0;
    for (const auto& p : parts) n += p.size();
    CHECK(n == 150);
  }
  {
    Simulator again(c);  // the same seed holds out the same samples
    CHECK(again.partition() == parts);
  }
  CHECK_THROWS_AS(parse_config_string("validation = 0.5\n"), sparrow::ConfigError);
  CHECK_THROWS_WITH_AS(parse_config_string("validation = 0.1\ndataset = \"synthetic\"\n"),
                       doctest::Contains("validation"), sparrow::ConfigError);
  CHECK_THROWS_WITH_AS(parse_config_string("validation = -0.1\n"), doctest::Contains("validation"),
                       sparrow::ConfigError);
  fs::remove_all(data);
}

TEST_CASE("simulator: a stop in the middle of a round forgets that round, and resume equals the uninterrupted run") {
  for (const std::string comp : {"dgc:ratio=0.1,momentum=0.9", "none"}) {
    CAPTURE(comp);
    TempDir full("stop_full"), part("stop_part");
    SimConfig c = tiny(full.path);
    c.compression = comp;
    c.algorithm = comp == "none" ? "scaffold" : "fedavg";  // both keep per-client state
    c.client_batch = 1;
    c.checkpoint_every = 3;  // round 2's states are not checkpointed when round 3 stops
    c.rounds = 5;
    Simulator a(c);
    a.run();

    SimConfig h = c;
    h.out = part.path;
    {
      Simulator b(h);
      b.run_round();
      b.run_round();
      b.request_stop(1);  // one client of round 3 trains and puts its state, then the round stops
      b.run_round();
      CHECK(b.interrupted());
      CHECK(b.completed_rounds() == 2);
      CHECK(b.history().size() == 2);
      b.checkpoint_now();
    }
    Simulator r(h, /*resume=*/true);
    CHECK(r.completed_rounds() == 2);
    r.run();
    REQUIRE(r.history().size() == 5);
    for (size_t i = 0; i < 5; ++i) check_same_metrics(a.history()[i], r.history()[i]);
    check_same_weights(a.global(), r.global());
    const std::string csv = read_file(part.path + "/metrics.csv");
    CHECK(std::count(csv.begin(), csv.end(), '\n') == 6);
  }
}

TEST_CASE("simulator: secure aggregation gives plain FedAvg's model and is reproducible") {
  TempDir d1("sa1"), d2("sa2"), d3("sa3");
  SimConfig c = tiny(d1.path);
  c.clients = 10;
  c.clients_per_round = 6;
  Simulator plain(c);
  plain.run();
  c.secagg = "secagg+:degree=4,threshold=3";
  c.out = d2.path;
  Simulator secure(c);
  secure.run();
  c.out = d3.path;
  Simulator again(c);
  again.run();
  REQUIRE(secure.history().size() == 4);
  for (size_t i = 0; i < 4; ++i) {
    // The protocol's messages besides the masked update: keys, shares, reveals up; neighbours, shares, unmask down.
    CHECK(secure.history()[i].bytes_up > plain.history()[i].bytes_up);
    CHECK(secure.history()[i].bytes_down > plain.history()[i].bytes_down);
    CHECK(secure.history()[i].train_loss == doctest::Approx(plain.history()[i].train_loss).epsilon(1e-4));
  }
  double worst = 0;
  for (const auto& [k, v] : plain.global())
    worst = std::max(worst, (secure.global().at(k) - v).abs().max().item<double>());
  CHECK(worst < 1e-5);
  // Masks are random, the unmasked sum is not: seeded rounding gives the same model bit for bit.
  check_same_weights(secure.global(), again.global());
}

TEST_CASE("simulator: secure aggregation recovers from stragglers and a config it cannot serve is refused") {
  TempDir d1("sa4"), d2("sa5"), d3("sa6");
  SimConfig c = tiny(d1.path);
  c.clients = 10;
  c.clients_per_round = 8;
  c.rounds = 1;
  c.secagg = "secagg+:degree=8,threshold=3";
  // Upload time (seeded bandwidths: seconds per client here) dominates the
  // measured training time (milliseconds, more on a loaded machine), so the
  // deadline below drops the same client however fast this machine trains.
  c.profiles.uplink_mbps = 0.0005;
  Simulator probe(c);  // without a deadline: the slowest client's simulated time
  probe.run();
  REQUIRE(probe.history()[0].dropped == 0);
  // A deadline below the slowest client: it sent its shares but no masked
  // update, and the server removes its pairwise masks from the others'.
  c.out = d2.path;
  c.deadline_s = probe.history()[0].sim_round_s * 0.95;
  Simulator late(c);
  late.run();
  const RoundMetrics& m = late.history()[0];
  CHECK(m.dropped >= 1);
  CHECK(m.dropped < m.clients);
  const double moved = late.global().at("fc.weight").abs().sum().item<double>();
  CHECK(std::isfinite(moved));
  CHECK(moved > 0);
  // Its model is the mean of the others' updates: close to the probe's, not equal.
  CHECK_FALSE(at::equal(late.global().at("fc.weight"), probe.global().at("fc.weight")));
  CHECK((late.global().at("fc.weight") - probe.global().at("fc.weight")).abs().max().item<double>() < 0.5);
  c.out = d3.path;
  c.deadline_s = 1e-9;  // everyone is late: nothing to unmask, the model stays
  Simulator none(c);
  none.run();
  CHECK(none.global().at("fc.weight").abs().sum().item<double>() == 0);
  SimConfig bad = tiny(d1.path);
  bad.secagg = "secagg+:degree=4,threshold=3";
  bad.compression = "topk:ratio=0.1";
  CHECK_THROWS_AS(Simulator{bad}, sparrow::ConfigError);
  bad.compression = "none";
  bad.clients_per_round = 3;  // threshold 3 needs 4
  CHECK_THROWS_AS(Simulator{bad}, sparrow::ConfigError);
}
