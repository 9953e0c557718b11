#include "tests/sparrow_test.h"

#include <torch/torch.h>

#include <cstddef>
#include <string>

#include "simulator/config.h"
#include "simulator/simulator.h"
#include "tests/simulator/sim_test_util.h"

using namespace sparrow::simulator;

namespace {

using testing::TempDir;

// Batched passes on two workers: Dirichlet client sizes (ragged passes, short
// last minibatches) and the downlink codec with server momentum that the
// failing report ran. A batched pass pads each step to its widest minibatch, so
// a client's bits depend on its pass mates: the assignment must not follow the
// measured training times.
SimConfig two_workers(const std::string& out) {
  SimConfig c;
  c.seed = 3;
  c.dataset = "folder:" + testing::mlp_data("determinism_test_data", 0.011, true);
  c.model = "mlp";
  c.partition = "dirichlet:alpha=0.5";
  c.clients = 12;
  c.clients_per_round = 8;
  c.rounds = 16;
  c.eval_every = 16;
  c.checkpoint_every = 4;
  c.local_epochs = 1;
  c.batch_size = 16;
  c.lr = 0.1;
  c.workers = 2;
  c.threads = 1;
  c.downlink = "stc:ratio=0.01";
  c.downlink_catchup = "full";
  c.server_optimizer = "fedavgm:lr=1,momentum=0.7";
  c.out = out;
  return c;
}

void check_same_run(const Simulator& a, const Simulator& b) {
  REQUIRE(a.history().size() == b.history().size());
  for (size_t i = 0; i < a.history().size(); ++i) {
    INFO("round " << i + 1);
    CHECK(a.history()[i].train_loss == b.history()[i].train_loss);
    CHECK(a.history()[i].bytes_up == b.history()[i].bytes_up);
  }
  for (const auto& entry : a.global()) CHECK(at::equal(entry.second, b.global().at(entry.first)));
}

}  // namespace

TEST_CASE("simulator: batched passes on two workers are bit-reproducible, run to run and on resume") {
  TempDir d1("det_a"), d2("det_b"), d3("det_c");
  Simulator a(two_workers(d1.path));
  REQUIRE(a.training_mode().find("batched clients: up to 4 per pass on each of 2 workers") != std::string::npos);
  a.run();
  Simulator b(two_workers(d2.path));
  b.run();
  check_same_run(a, b);

  // A resumed run starts with no measured times: the same assignment again.
  SimConfig half = two_workers(d3.path);
  half.rounds = 8;
  Simulator(half).run();
  Simulator resumed(two_workers(d3.path), /*resume=*/true);
  resumed.run();
  for (const auto& entry : a.global()) CHECK(at::equal(entry.second, resumed.global().at(entry.first)));
}
