#pragma once
// sparrow-bench sim (see sim_bench.cc).

#include <string>

namespace sparrow::bench {

// Prints the "efficiency" line, then one "scale" line per population (each from
// a child process running bench_sim_scale_child). Run folders go under tmp.
int bench_sim(int rounds, int workers, const std::string& tmp);
int bench_sim_scale_child(int clients, int rounds, int workers, const std::string& tmp);

}  // namespace sparrow::bench
