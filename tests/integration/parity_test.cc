// The contract of the round engine: the same config and seed run in
// sparrow-sim and as sparrow-server with real sparrow-client processes on
// loopback (each client holding the partition the simulator gives its id) end
// with the same model. The cases and their keys: parity_cases.h (also run in
// one process over mem:// by parity_inproc_test.cc).
#include "tests/integration/fixtures.h"
#include "tests/integration/parity_cases.h"

#include <cmath>

#include "simulator/simulator.h"

using namespace sparrow::testing::integ;   // NOLINT(google-build-using-namespace)
using namespace sparrow::testing::parity;  // NOLINT(google-build-using-namespace)

namespace {

const std::string kSimBin = kBin + "/sparrow-sim";

struct Result {
  Weights sim, service;
};

Result run_both(const std::string& name, const std::string& extra_keys, int rounds = kRounds) {
  const std::string dir = fresh_dir("parity_" + name);
  const std::string extra = extra_keys + "rounds = " + std::to_string(rounds) + "\n";
  // (a) the simulator: one client at a time (sparrow-client's trainer).
  write_file(dir + "/sim.toml", kShared + with_round_size(extra) + kSimKeys + "out = \"" + dir + "/sim\"\n");
  REQUIRE(run_tool({kSimBin, "--config", dir + "/sim.toml"}, dir + "/sim.log") == 0);
  Result out;
  out.sim = sparrow::simulator::load_run_model(dir + "/sim").first;
  // (b) the service: the same keys plus the deployment's.
  keygen(dir, kClients);
  server_toml(dir, kShared + with_round_size(extra) + kServerKeys);
  auto server = start_server(dir, dir + "/server.log");
  const std::string ep = server_endpoint(*server);
  std::vector<std::unique_ptr<Process>> clients;
  for (int i = 0; i < kClients; ++i) {
    const std::string path = dir + "/client" + std::to_string(i) + ".toml";
    write_file(path, "server = \"" + ep + "\"\nserver_key = \"" + dir + "/keys/server.key\"\nkey = \"" + dir +
                         "/keys/client" + std::to_string(i + 1) + ".key_secret\"\n" + client_keys(i) + "state_db = \"" +
                         dir + "/client" + std::to_string(i) + ".db\"\n");
    clients.push_back(std::make_unique<Process>(
        std::vector<std::string>{kClientBin, "--config", path, "--update-delay-ms", std::to_string(update_delay_ms(i))},
        dir + "/client" + std::to_string(i) + ".log"));
  }
  INFO(log_tail(*server));
  REQUIRE(server->wait(120s) == 0);
  Db db(dir + "/server.db");
  const std::string ck = db.checkpoint(rounds);
  REQUIRE_FALSE(ck.empty());
  out.service = sparrow::compression::deserialize_weights(ck);
  return out;
}

void check_same(const std::string& name, const std::string& extra) {
  const Result r = run_both(name, extra);
  const double gap = relative_gap(r.sim, r.service);
  MESSAGE(name << ": relative gap " << gap);
  CHECK(gap <= kMaxGap);
}

}  // namespace

TEST_CASE("simulator and service end with the same model: fedavg dense") { check_same("fedavg", kFedAvg); }

TEST_CASE("simulator and service end with the same model: dgc") { check_same("dgc", kDgc); }

TEST_CASE("simulator and service end with the same model: tcs share=mean") { check_same("tcs", kTcs); }

TEST_CASE("simulator and service end with the same model: scaffold") { check_same("scaffold", kScaffold); }

TEST_CASE("simulator and service end with the same model: fednova") { check_same("fednova", kFedNova); }

TEST_CASE("simulator and service end with the same model: feddyn (client state across rounds)") {
  check_same("feddyn", kFedDyn);
}

TEST_CASE("simulator and service end with the same model: acp rank 2") { check_same("acp", kAcp); }

TEST_CASE("simulator and service end with the same model: powersgd with a compressed downlink") {
  check_same("powersgd_down", kPowerSgdDown);
}

TEST_CASE("simulator and service end with the same model: multikrum") { check_same("multikrum", kMultiKrum); }

TEST_CASE("simulator and service end with the same model: central dp") { check_same("central_dp", kCentralDp); }

TEST_CASE("simulator and service end with the same model: 2 of 3 clients a round, the simulator's sampler") {
  check_same("sampled", kSampled);
}

// One round: see kSecAggMaxDiff.
TEST_CASE("simulator and service end with the same model: secagg+ (to the rounding of one round)") {
  const Result one = run_both("secagg", kSecAgg, 1);
  const double worst = max_difference(one.sim, one.service);
  MESSAGE("secagg: max |sim - service| after one round " << worst);
  CHECK(worst < kSecAggMaxDiff);
}
