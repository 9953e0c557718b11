// sparrow-sim in mode = "async" (docs/async.md): buffered asynchronous steps on
// the simulated clock. A run depends on the seed only (not on workers or the
// machine's speed); with every client in every step and no discount it is
// synchronous FedAvg up to the order of the float sums; the clock, the
// staleness discount and resume behave as documented.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "core/error.h"
#include "simulator/config.h"
#include "simulator/scheduler.h"
#include "simulator/simulator.h"
#include "tests/simulator/sim_test_util.h"

using namespace sparrow::simulator;
namespace fs = std::filesystem;

namespace {

using testing::TempDir;

SimConfig tiny_async(const std::string& out) {
  SimConfig c;
  c.seed = 7;
  c.dataset = "synthetic:alpha=1,beta=1";
  c.clients = 8;
  c.clients_per_round = 3;
  c.rounds = 6;
  c.model = "logreg";
  c.batch_size = 16;
  c.lr = 0.05;
  c.eval_every = 3;
  c.out = out;
  c.mode = "async";
  c.buffer = 3;
  c.max_concurrency = 5;
  c.staleness = "poly:a=0.5";
  c.profiles.compute_speed = 1.0;  // heterogeneous devices: arrivals out of hand-out order
  return c;
}

bool same_weights(const Simulator::Weights& a, const Simulator::Weights& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, v] : a)
    if (!at::equal(v, b.at(k))) return false;
  return true;
}

}  // namespace

TEST_CASE("async sim: the task time is download, samples x epochs / speed, upload") {
  const TaskTime t = task_time(/*speed=*/2, /*down_bps=*/8e6, /*up_bps=*/1e6, /*sample_epochs=*/1000,
                               /*down_bytes=*/2000000, /*up_bytes=*/250000);
  CHECK(t.down_s == doctest::Approx(2.0));
  CHECK(t.compute_s == doctest::Approx(1000 * kSampleSeconds / 2));
  CHECK(t.up_s == doctest::Approx(2.0));
  CHECK(t.total() == doctest::Approx(4.0 + 1000 * kSampleSeconds / 2));
}

TEST_CASE("async sim: the run depends on the seed, not on the workers") {
  TempDir d1("w1"), d2("w2"), d3("seed");
  SimConfig c = tiny_async(d1.path);
  // One client per pass: batched passes of other sizes reduce the bias
  // gradient in another order (the last bit; synchronous runs alike).
  c.client_batch = 1;
  Simulator one(c);
  one.run();
  c.out = d2.path;
  c.workers = 2;
  Simulator two(c);
  two.run();
  REQUIRE(one.history().size() == 6);
  REQUIRE(two.history().size() == 6);
  double clock = 0;
  for (size_t i = 0; i < 6; ++i) {
    const RoundMetrics& m = one.history()[i];
    CAPTURE(i);
    CHECK(m.round == static_cast<int>(i) + 1);
    CHECK(m.clients == 3);  // one step: `buffer` updates
    CHECK(m.participants.size() == 3);
    CHECK(m.sim_round_s >= 0);
    CHECK(m.sim_round_s == two.history()[i].sim_round_s);  // the simulated clock, not this machine's
    CHECK(m.bytes_up == two.history()[i].bytes_up);
    clock += m.sim_round_s;
  }
  CHECK(clock > 0);
  CHECK(one.summary().sim_wall_s == doctest::Approx(clock));
  CHECK(same_weights(one.global(), two.global()));
  // Another seed: other devices, other arrivals, another model.
  c.out = d3.path;
  c.seed = 8;
  Simulator other(c);
  other.run();
  CHECK_FALSE(same_weights(one.global(), other.global()));
}

TEST_CASE("async sim: every client every step, const staleness, is synchronous FedAvg up to the sum's order") {
  TempDir ds("sync"), da("async");
  SimConfig c = tiny_async(ds.path);
  c.mode = "sync";
  c.buffer = c.max_concurrency = 0;  // async keys: refused in sync mode
  c.staleness = SimConfig{}.staleness;
  c.clients = 4;
  c.clients_per_round = 4;
  c.rounds = 3;
  Simulator sync(c);
  sync.run();
  c.out = da.path;
  c.mode = "async";
  c.buffer = 4;
  c.max_concurrency = 4;
  c.staleness = "const";
  Simulator async(c);
  async.run();
  for (size_t i = 0; i < 3; ++i) {
    CHECK(sync.history()[i].bytes_up == async.history()[i].bytes_up);
    CHECK(sync.history()[i].train_loss == doctest::Approx(async.history()[i].train_loss).epsilon(1e-5));
  }
  for (const auto& entry : sync.global()) {
    const auto& k = entry.first;
    CAPTURE(k);
    CHECK(at::allclose(async.global().at(k), entry.second, 1e-4, 1e-6));
  }
  // And the discount matters once updates are stale: the same run with
  // fewer slots than clients and a discount moves elsewhere.
  TempDir dd("discount");
  c.out = dd.path;
  c.buffer = 2;
  c.max_concurrency = 3;
  c.staleness = "poly:a=4";
  Simulator disc(c);
  disc.run();
  bool differs = false;
  for (const auto& [k, v] : disc.global()) differs = differs || !at::allclose(v, sync.global().at(k), 1e-4, 1e-6);
  CHECK(differs);
}

TEST_CASE("async sim: resume reproduces the uninterrupted run, tasks in flight included") {
  for (const std::string comp : {"none", "topk:ratio=0.3"}) {
    CAPTURE(comp);
    TempDir full("resume_full"), part("resume_part");
    SimConfig c = tiny_async(full.path);
    c.compression = comp;  // topk: each client's residual, in the store
    c.algorithm = comp == "none" ? "scaffold" : "fedavg";
    c.server_optimizer = "fedadam:lr=0.05";
    Simulator a(c);
    a.run();
    SimConfig h = c;
    h.out = part.path;
    h.rounds = 3;
    {
      Simulator b(h);
      b.run();
    }
    h.rounds = 6;
    Simulator r(h, /*resume=*/true);
    CHECK(r.completed_rounds() == 3);
    r.run();
    REQUIRE(r.history().size() == 6);
    for (size_t i = 0; i < 6; ++i) {
      CAPTURE(i);
      CHECK(r.history()[i].train_loss == a.history()[i].train_loss);
      CHECK(r.history()[i].bytes_up == a.history()[i].bytes_up);
      CHECK(r.history()[i].sim_round_s == a.history()[i].sim_round_s);
    }
    CHECK(r.history()[5].accuracy == a.history()[5].accuracy);
    CHECK(same_weights(r.global(), a.global()));
  }
}

TEST_CASE("sim: a stop before the first round ends checkpoints round 0, and resume equals the uninterrupted run") {
  // sparrow-sim says "continue with: --resume" after any stop; before this,
  // a stop in round 1 wrote no checkpoint and the resume it named failed.
  for (const std::string mode : {"sync", "async"}) {
    CAPTURE(mode);
    TempDir full("stop0_full"), part("stop0_part");
    SimConfig c = tiny_async(full.path);
    if (mode == "sync") {
      const SimConfig defaults;
      c.mode = defaults.mode;
      c.buffer = defaults.buffer;
      c.max_concurrency = defaults.max_concurrency;
      c.staleness = defaults.staleness;
      c.client_batch = 1;  // one client at a time, so that the stop comes after the first
    }
    c.compression = "topk:ratio=0.3";
    c.rounds = 3;
    Simulator a(c);
    a.run();
    SimConfig h = c;
    h.out = part.path;
    {
      Simulator b(h);
      b.request_stop(1);  // round 1 is given up after one client
      b.run_round();
      CHECK(b.interrupted());
      CHECK(b.completed_rounds() == 0);
      b.checkpoint_now();
    }
    Simulator r(h, /*resume=*/true);
    CHECK(r.completed_rounds() == 0);
    r.run();
    REQUIRE(r.history().size() == 3);
    for (size_t i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(r.history()[i].train_loss == a.history()[i].train_loss);
      CHECK(r.history()[i].bytes_up == a.history()[i].bytes_up);
    }
    CHECK(same_weights(r.global(), a.global()));
  }
}

TEST_CASE("async sim: what has no meaning without rounds is refused by key") {
  TempDir d("bad");
  auto error_of = [&](SimConfig c) -> std::string {
    try {
      Simulator s(c);
    } catch (const sparrow::ConfigError& e) {
      return e.what();
    }
    return "";
  };
  SimConfig c = tiny_async(d.path);
  c.deadline_s = 3;
  CHECK(error_of(c).find("deadline_s") != std::string::npos);
  c = tiny_async(d.path);
  c.attack = "alie";
  c.adversaries = 0.25;
  CHECK(error_of(c).find("alie") != std::string::npos);
  CHECK_THROWS_WITH_AS(parse_config_string("mode = \"async\"\nsecagg = \"secagg+\"\nclients = 20\n"),
                       doctest::Contains("'secagg'"), sparrow::ConfigError);
  CHECK_THROWS_WITH_AS(parse_config_string("mode = \"async\"\ncompression = \"acp:rank=2\"\n"),
                       doctest::Contains("'compression'"), sparrow::ConfigError);
  CHECK_THROWS_WITH_AS(parse_config_string("buffer = 5\n"), doctest::Contains("'buffer' has no effect"),
                       sparrow::ConfigError);
}
