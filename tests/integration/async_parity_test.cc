// mode = "async": the simulator's run and the service's (the Server library
// and 3 ClientSessions in this process over mem://) on one config and seed.
// Both drive federation::AsyncEngine; the service folds in the order updates
// arrive, so each client's update is delayed to arrive in the order the
// simulator's clock produced (its step's participants, in fold order).
#include "tests/integration/fixtures.h"
#include "tests/integration/inproc_service.h"
#include "tests/integration/parity_cases.h"

#include <algorithm>

#include <ATen/Parallel.h>

#include "compression/state.h"
#include "server/config.h"
#include "server/server.h"
#include "simulator/config.h"
#include "simulator/simulator.h"

using namespace sparrow::testing::integ;   // NOLINT(google-build-using-namespace)
using namespace sparrow::testing::parity;  // NOLINT(google-build-using-namespace)
namespace net = sparrow::net;

namespace {

// buffer = max_concurrency = the clients: every step folds each client's
// update of the current version.
const std::string kAsync =
    "mode = \"async\"\nbuffer = 3\nmax_concurrency = 3\nstaleness = \"poly:a=0.5\"\nclients_per_round = 3\n";

struct SimRun {
  Weights global;
  std::vector<std::vector<int64_t>> order;  // per step: the clients in fold order
};

SimRun run_simulator(const std::string& dir, int steps) {
  sparrow::simulator::Simulator sim(sparrow::simulator::parse_config_string(
      kShared + kAsync + "rounds = " + std::to_string(steps) + "\n" + kSimKeys + "out = \"" + dir + "/sim\"\n"));
  SimRun out;
  for (int s = 0; s < steps; ++s) {
    const sparrow::simulator::RoundMetrics m = sim.run_round();
    std::vector<int64_t> ids;
    for (const auto& p : m.participants) ids.push_back(p.client);
    out.order.push_back(ids);
  }
  for (const auto& [n, t] : sim.global()) out.global[n] = t.clone();
  return out;
}

// The service, client i's update sent delay_ms[i] after it trained.
Weights run_service(const std::string& dir, int steps, const std::vector<int>& delay_ms) {
  const InprocRun run =
      run_inproc_service(dir, "mem://async_parity_" + std::to_string(steps) + "_" + std::to_string(::getpid()),
                         kShared + kAsync + "rounds = " + std::to_string(steps) + "\n" + kServerKeys,
                         [&](int i) { return delay_ms[static_cast<size_t>(i)]; });
  REQUIRE(run.completed_rounds == steps);
  CHECK(run.updates_accepted == static_cast<uint64_t>(kClients * steps));
  return run.global;
}

// Delays that make the clients' updates arrive in `order` (the first at once).
std::vector<int> delays_for(const std::vector<int64_t>& order) {
  std::vector<int> d(kClients, 0);
  for (size_t k = 0; k < order.size(); ++k) d[static_cast<size_t>(order[k])] = 500 * static_cast<int>(k);
  return d;
}

}  // namespace

TEST_CASE("async: the service on mem:// ends with the simulator's model for the same seed and arrival order") {
  at::set_num_threads(1);
  // One step: the service's updates arrive in the simulator's fold order,
  // so the buffers are summed in the same order: the same bits.
  {
    const std::string dir = fresh_dir("async_parity_1");
    const SimRun sim = run_simulator(dir, 1);
    REQUIRE(sim.order.size() == 1);
    REQUIRE(sim.order[0].size() == static_cast<size_t>(kClients));
    const Weights service = run_service(dir, 1, delays_for(sim.order[0]));
    const double gap = relative_gap(sim.global, service);
    MESSAGE("async, one step, simulator's order " << sim.order[0][0] << "," << sim.order[0][1] << "," << sim.order[0][2]
                                                  << ": relative gap " << gap);
    CHECK(sparrow::compression::serialize_weights(sim.global) == sparrow::compression::serialize_weights(service));
  }
  // Two steps: a client's delay is one per run, so the second step's order
  // is the first one's; where the simulator's second step folded in another
  // order, the sums differ in float rounding only (kMaxGap).
  {
    const std::string dir = fresh_dir("async_parity_2");
    const SimRun sim = run_simulator(dir, 2);
    REQUIRE(sim.order.size() == 2);
    const Weights service = run_service(dir, 2, delays_for(sim.order[0]));
    const double gap = relative_gap(sim.global, service);
    MESSAGE("async, two steps: relative gap " << gap);
    if (sim.order[0] == sim.order[1])
      CHECK(sparrow::compression::serialize_weights(sim.global) == sparrow::compression::serialize_weights(service));
    CHECK(gap <= kMaxGap);
  }
}
