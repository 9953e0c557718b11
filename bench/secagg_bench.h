#pragma once
// sparrow-bench secagg (see secagg_bench.cc).

#include <string>
#include <vector>

namespace sparrow::bench {

struct SecAggBenchOptions {
  std::vector<int> clients{10, 100, 1000};  // clients per round
  std::vector<int> degrees{8, 16};          // neighbourhood sizes (0 = complete graph, run up to --complete-max)
  int complete_max = 100;                   // largest round run with the complete graph (original SecAgg)
  double dropout = 0.1;                     // share of clients that drop after sending their shares
  int64_t elements = 0;                     // update size; 0 = the built-in MLP's parameters
  double clip = 4;
  std::vector<std::string> cases{"protocol", "service"};
  int rounds = 2;                    // service: rounds per configuration
  int degree = 16;                   // service: the SecAgg+ degree
  std::string tmp = "bench-secagg";  // service: the servers' databases
};

// One JSON line per (clients, degree): per-round compute of the server, per
// client compute, and wire bytes per client, with and without SecAgg+; the
// plain FedAvg baseline (dense update serialised, parsed and folded, as
// sparrow-server does) is measured in the same run at each population.
// "protocol": the lines above. "service": a real sparrow-server (in this
// process, plain TCP on loopback) and n load-generating clients that send a
// precomputed update at once (no training), with and without SecAgg+: the
// round time from the first Task to the completed round, and the bytes the
// server received and sent per round.
int bench_secagg(const SecAggBenchOptions& o);

}  // namespace sparrow::bench
