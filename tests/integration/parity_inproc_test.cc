// The parity matrix (parity_cases.h) through the in-process transport: the
// Server library and 3 ClientSessions in threads of this process over
// mem://, with keys, against the Simulator library's run of the same config.
// parity_test.cc proves the simulator equal to the service on loopback; this
// proves the service over mem:// equal to the simulator, so the round
// engine's tests can run many clients in one process without sockets.
#include "tests/integration/fixtures.h"
#include "tests/integration/inproc_service.h"
#include "tests/integration/parity_cases.h"

#include <algorithm>

#include <ATen/Parallel.h>

#include "federation/sampler.h"
#include "server/config.h"
#include "server/server.h"
#include "simulator/config.h"
#include "simulator/simulator.h"

using namespace sparrow::testing::integ;   // NOLINT(google-build-using-namespace)
using namespace sparrow::testing::parity;  // NOLINT(google-build-using-namespace)
namespace net = sparrow::net;

namespace {

Weights copy(const Weights& w) {
  Weights out;
  for (const auto& [n, t] : w) out[n] = t.clone();
  return out;
}

Weights run_simulator(const std::string& dir, const std::string& keys) {
  sparrow::simulator::Simulator sim(sparrow::simulator::parse_config_string(kShared + with_round_size(keys) + kSimKeys +
                                                                            "out = \"" + dir + "/sim\"\n"));
  sim.run();
  return copy(sim.global());
}

// The service in this process over mem://; the final global model.
Weights run_service(const std::string& dir, const std::string& name, const std::string& keys, int rounds) {
  const InprocRun run = run_inproc_service(dir, "mem://parity_" + name + "_" + std::to_string(::getpid()),
                                           kShared + with_round_size(keys) + kServerKeys, update_delay_ms);
  CHECK(run.finished == kClients);
  REQUIRE(run.completed_rounds == rounds);
  CHECK(run.updates_accepted == static_cast<uint64_t>(run.clients_per_round * rounds));
  return run.global;
}

struct Result {
  Weights sim, service;
};

Result run_both(const std::string& name, const std::string& case_keys, int rounds = kRounds) {
  at::set_num_threads(1);  // as each client process on loopback (fresh_dir sets OMP_NUM_THREADS for children)
  const std::string dir = fresh_dir("parity_inproc_" + name);
  const std::string keys = case_keys + "rounds = " + std::to_string(rounds) + "\n";
  Result out;
  out.sim = run_simulator(dir, keys);
  out.service = run_service(dir, name, keys, rounds);
  return out;
}

bool same_bytes(const Weights& a, const Weights& b) {
  return sparrow::compression::serialize_weights(a) == sparrow::compression::serialize_weights(b);
}

void check_same(const std::string& name, const std::string& keys) {
  const Result r = run_both(name, keys);
  const double gap = relative_gap(r.sim, r.service);
  MESSAGE(name << " over mem://: relative gap " << gap
               << std::string(same_bytes(r.sim, r.service) ? " (the same bytes)" : ""));
  CHECK(gap <= kMaxGap);
}

}  // namespace

TEST_CASE("the in-process service ends with the simulator's model: fedavg dense") { check_same("fedavg", kFedAvg); }

TEST_CASE("the in-process service ends with the simulator's model: dgc") { check_same("dgc", kDgc); }

TEST_CASE("the in-process service ends with the simulator's model: tcs share=mean") { check_same("tcs", kTcs); }

TEST_CASE("the in-process service ends with the simulator's model: scaffold") { check_same("scaffold", kScaffold); }

TEST_CASE("the in-process service ends with the simulator's model: fednova") { check_same("fednova", kFedNova); }

TEST_CASE("the in-process service ends with the simulator's model: feddyn (client state across rounds)") {
  check_same("feddyn", kFedDyn);
}

TEST_CASE("the in-process service ends with the simulator's model: acp rank 2") { check_same("acp", kAcp); }

TEST_CASE("the in-process service ends with the simulator's model: powersgd with a compressed downlink") {
  check_same("powersgd_down", kPowerSgdDown);
}

TEST_CASE("the in-process service ends with the simulator's model: multikrum") { check_same("multikrum", kMultiKrum); }

TEST_CASE("the in-process service ends with the simulator's model: central dp") {
  check_same("central_dp", kCentralDp);
}

TEST_CASE("the in-process service ends with the simulator's model: 2 of 3 clients a round, the simulator's sampler") {
  // The case can tell the rules apart: the service's own rule (least_recent)
  // selects other clients in these rounds than the simulator's.
  std::map<std::string, int64_t> last = {{"0", 0}, {"1", 0}, {"2", 0}};
  bool differ = false;
  for (uint64_t r = 1; r <= static_cast<uint64_t>(kRounds); ++r) {
    std::vector<sparrow::federation::Candidate> c;
    for (const auto& [id, l] : last) c.push_back({id, l});
    auto own = sparrow::federation::sampler("least_recent")(kSeed, r, c, 2);
    auto sim = sparrow::federation::sampler("uniform")(kSeed, r, c, 2);
    std::sort(own.begin(), own.end());
    differ |= own != sim;
    for (const auto& id : sim) last[id] = static_cast<int64_t>(r);
  }
  CHECK(differ);
  check_same("sampled", kSampled);
}

// One round: see kSecAggMaxDiff.
TEST_CASE("the in-process service ends with the simulator's model: secagg+ (to the rounding of one round)") {
  const Result one = run_both("secagg", kSecAgg, 1);
  const double worst = max_difference(one.sim, one.service);
  MESSAGE("secagg over mem://: max |sim - service| after one round " << worst);
  CHECK(worst < kSecAggMaxDiff);
}
