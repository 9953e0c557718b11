#pragma once
// The parity matrix of the round engine: one config and seed, run by the
// simulator and by the service, must end with the same model. The cases'
// keys live here, shared by the loopback test (parity_test.cc: sparrow-sim
// against sparrow-server and sparrow-client processes) and the in-process one
// (parity_inproc_test.cc: the same libraries in one process over mem://).
// Small: the MLP, 3 clients, 2 rounds, all clients every round (the service
// then selects the same sample as the simulator).
#include "tests/sparrow_test.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>

#include "federation/client_pipeline.h"

namespace sparrow::testing::parity {

constexpr uint64_t kSeed = 5;
constexpr int kClients = 3;
constexpr int kRounds = 2;
// The clients are given the simulator's partition seed as `partition_seed`,
// so client i holds the simulator's shard i.
inline const uint64_t kPartitionSeed = sparrow::federation::partition_seed(kSeed);

// Keys both programs share, as both spell them.
inline const std::string kShared =
    "seed = 5\nlocal_epochs = 1\nbatch_size = 32\nlr = 0.05\nmomentum = 0.0\n"
    "workers = 2\n";
// The simulator's own keys (its run folder, `out`, comes with each run).
inline const std::string kSimKeys =
    "model = \"mlp\"\ndataset = \"fashion-mnist\"\npartition = \"iid\"\nclients = 3\nclient_batch = 1\n"
    "eval_every = 100\n";
// The server's own keys, besides its endpoint, keys, database and model = "mlp".
inline const std::string kServerKeys = "model_seed = 5\nmin_clients = 3\nround_deadline_s = 60\n";
// Client i's keys, besides its endpoint, keys and state database.
inline std::string client_keys(int i) {
  return "client_id = \"" + std::to_string(i) +
         "\"\nmodel = \"mlp\"\ndata = \"fashion-mnist\"\npartition = \"iid\"\nclients = 3\nindex = " +
         std::to_string(i) + "\npartition_seed = " + std::to_string(kPartitionSeed) + "\n";
}
// Updates arrive in the reverse of client-id order (2 first), and the
// simulator's two workers finish in their own order: both sum a round in id
// order (federation::OrderedFold), so the bits agree. Client i waits this long
// after training before it sends.
inline int update_delay_ms(int i) { return 400 * (kClients - 1 - i); }

// A case's keys with every client in every round unless the case sets its
// own round size (quorum is the server's; the simulator reports it as having
// no effect).
inline std::string with_round_size(const std::string& keys) {
  return keys.find("clients_per_round") != std::string::npos ? keys : keys + "clients_per_round = 3\nquorum = 3\n";
}

// The cases: each one's keys on top of kShared.
inline const std::string kFedAvg;
inline const std::string kDgc = "compression = \"dgc:ratio=0.01\"\n";
inline const std::string kTcs = "compression = \"tcs:ratio=0.1,keep=0.5,share=mean\"\n";
inline const std::string kScaffold = "algorithm = \"scaffold\"\n";
inline const std::string kFedNova = "algorithm = \"fednova\"\n";
inline const std::string kFedDyn = "algorithm = \"feddyn\"\nfeddyn_alpha = 0.01\n";
inline const std::string kAcp = "compression = \"acp:rank=2\"\n";
inline const std::string kPowerSgdDown = "compression = \"powersgd:rank=2\"\ndownlink = \"topk:ratio=0.1\"\n";
inline const std::string kMultiKrum = "aggregator = \"multikrum:f=0,m=2\"\n";
inline const std::string kCentralDp = "dp = \"central:clip=1,noise=0.5\"\n";
// 2 of the 3 clients a round, chosen by the simulator's rule: with every
// client live the service selects what the simulator selects.
inline const std::string kSampled = "clients_per_round = 2\nquorum = 2\nsampler = \"uniform\"\n";
// SecAgg+ is compared after one round (see kSecAggMaxDiff).
inline const std::string kSecAgg = "secagg = \"secagg+:degree=2,threshold=2\"\n";

// Each case allows this relative gap: the float order of the server's sums
// (updates are folded as they arrive, the simulator's in client-id order), a
// few ULPs, far below what any step done differently on one side gives.
constexpr double kMaxGap = 1e-6;
// SecAgg+ quantises each update into the ring with stochastic rounding drawn
// from the device's own randomness (never the task's seed, which the server
// knows: client/session.cc), so the service's sum differs from the
// simulator's by that rounding, 2^-31 of the clip per value. One round is
// compared: SecAgg+ carries no state across rounds, and in a second round such
// a 1e-9 difference can flip a ReLU and grow to 1e-3 (measured 3.8e-3 with
// 20,000 samples a client). A lost, doubled or differently weighted update
// would differ by about 1e-2.
constexpr double kSecAggMaxDiff = 1e-5;

// max |a - b| / max |b| over the whole model.
inline double relative_gap(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  double diff = 0, scale = 0;
  for (const auto& [n, t] : b) {
    REQUIRE(a.count(n));
    diff = std::max(diff, (a.at(n) - t).abs().max().item<double>());
    scale = std::max(scale, t.abs().max().item<double>());
  }
  return diff / scale;
}

// max |a - b| over the whole model.
inline double max_difference(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  double worst = 0;
  for (const auto& [n, t] : b) {
    REQUIRE(a.count(n));
    worst = std::max(worst, (a.at(n) - t).abs().max().item<double>());
  }
  return worst;
}

}  // namespace sparrow::testing::parity
