#pragma once
// Heterogeneity-aware scheduling of one round's clients onto workers, as FedML
// Parrot does it (Tang et al., arXiv 2303.01778; FedML seq_train_scheduler.py):
// each worker has a linear cost model t_w(n) = a_w·n + b_w in the client's
// sample count n, fitted by least squares from the times it measured, and the
// round's clients are assigned largest job first to the worker that would
// finish earliest (greedy LPT, Parrot's DP_schedule with pruning). Before a
// worker has history its model is the mean of the fitted ones, or plain
// sample counts when none is fitted, which reduces to LPT on workload.

#include <cstdint>
#include <deque>
#include <vector>

namespace sparrow::simulator {

class CostModel {
 public:
  // Keeps the last `window` observations per worker (Parrot's time_window mode
  // uses recent history so the model follows load changes).
  explicit CostModel(int workers, int window = 64);

  // A measured client: `samples` trained in `seconds` on `worker`. Non-finite
  // or negative values are ignored (a clock hiccup must not poison the model).
  void observe(int worker, double samples, double seconds);
  // Predicted seconds for `samples` on `worker`; never negative.
  double predict(int worker, double samples) const;
  bool fitted(int worker) const;
  int workers() const { return static_cast<int>(history_.size()); }

 private:
  struct Fit {
    double a = 0, b = 0;
    bool ok = false;
  };
  void refit(int worker);

  int window_;
  std::vector<std::deque<std::pair<double, double>>> history_;
  std::vector<Fit> fit_;
};

struct Assignment {
  std::vector<std::vector<int64_t>> per_worker;  // job indices, in the order each worker runs them
  std::vector<double> predicted;                 // predicted busy seconds per worker
  double makespan = 0;                           // max of predicted
};

// Greedy LPT: jobs by predicted cost (largest first, ties by index), each to the
// worker with the smallest predicted finish time (ties to the lower worker).
// Deterministic. jobs[i] is the sample count of job i.
Assignment schedule_lpt(const std::vector<double>& jobs, const CostModel& model);
// Round-robin baseline: job i to worker i mod W (what a naive simulator does).
Assignment schedule_round_robin(const std::vector<double>& jobs, const CostModel& model);

// The simulated duration of one client's task in mode = "async"
// (docs/async.md): download the model, train, upload the update, on the
// client's profile. Training is `sample_epochs` (samples x local epochs) at
// kSampleSeconds each on a device of speed 1, divided by the device's speed:
// deterministic, unlike the synchronous rounds' measured training time,
// because the arrival order decides which updates share a step and so the
// model (a run must not depend on the machine's load).
constexpr double kSampleSeconds = 1e-4;
struct TaskTime {
  double down_s = 0, compute_s = 0, up_s = 0;
  double total() const { return down_s + compute_s + up_s; }
};
TaskTime task_time(double speed, double down_bps, double up_bps, int64_t sample_epochs, uint64_t down_bytes,
                   uint64_t up_bytes);

}  // namespace sparrow::simulator
