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
};

// One JSON line per (clients, degree): per-round compute of the server, per
// client compute, and wire bytes per client, with and without SecAgg+; the
// plain FedAvg baseline (dense update serialised, parsed and folded, as
// sparrow-server does) is measured in the same run at each population.
int bench_secagg(const SecAggBenchOptions& o);

}  // namespace sparrow::bench
