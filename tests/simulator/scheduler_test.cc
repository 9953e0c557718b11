#include "tests/sparrow_test.h"

#include <cmath>
#include <set>

#include "core/error.h"
#include "core/rng.h"
#include "simulator/scheduler.h"

using namespace sparrow::simulator;

TEST_CASE("cost model: fits a per-worker line and ignores garbage") {
  CostModel m(2);
  CHECK_FALSE(m.fitted(0));
  CHECK(m.predict(0, 50) == 50);  // no history anywhere: the sample count
  for (double n : {10.0, 20.0, 40.0, 80.0}) {
    m.observe(0, n, 0.5 + 0.01 * n);  // fast worker
  }
  m.observe(0, 30, std::nan(""));
  m.observe(0, -1, 3);
  CHECK(m.fitted(0));
  CHECK(m.predict(0, 100) == doctest::Approx(1.5));
  // An unfitted worker borrows the fitted ones' mean.
  CHECK(m.predict(1, 100) == doctest::Approx(1.5));
  m.observe(1, 100, 4.0);  // one observation: proportional
  CHECK(m.predict(1, 50) == doctest::Approx(2.0));
  CHECK_THROWS_AS(m.observe(2, 1, 1), sparrow::Error);
  CHECK_THROWS_AS(CostModel(0), sparrow::Error);
}

TEST_CASE("scheduler: every job exactly once, deterministic") {
  CostModel m(3);
  std::vector<double> jobs;
  for (int i = 0; i < 100; ++i) jobs.push_back(1 + static_cast<double>(sparrow::rng::below(3, i, 500)));
  Assignment a = schedule_lpt(jobs, m);
  Assignment b = schedule_lpt(jobs, m);
  CHECK(a.per_worker == b.per_worker);
  std::multiset<int64_t> seen;
  for (auto& w : a.per_worker) seen.insert(w.begin(), w.end());
  CHECK(seen.size() == jobs.size());
  for (int64_t i = 0; i < static_cast<int64_t>(jobs.size()); ++i) CHECK(seen.count(i) == 1);
}

TEST_CASE("scheduler: LPT makespan beats round-robin on skewed jobs and heterogeneous workers") {
  // Worker 1 is three times slower; job sizes are heavy-tailed (lognormal-like).
  CostModel m(4);
  for (int w = 0; w < 4; ++w)
    for (double n : {10.0, 100.0, 400.0}) m.observe(w, n, (w == 1 ? 3.0 : 1.0) * 0.002 * n + 0.01);
  std::vector<double> jobs;
  for (int i = 0; i < 200; ++i) jobs.push_back(std::round(std::exp(3.0 + 1.2 * sparrow::rng::normal(11, i))));
  const Assignment lpt = schedule_lpt(jobs, m);
  const Assignment rr = schedule_round_robin(jobs, m);
  CHECK(lpt.makespan < rr.makespan);
  CHECK(lpt.makespan < 0.8 * rr.makespan);
  // LPT is within 4/3 of the lower bound (total work over total speed).
  double work_fast = 0;
  for (double n : jobs) work_fast += m.predict(0, n);
  // speeds: three workers at 1, one at 1/3: total 10/3 fast-worker equivalents
  CHECK(lpt.makespan <= 4.0 / 3.0 * work_fast / (10.0 / 3.0) + m.predict(1, 2000));
  // The slow worker gets less work.
  double slow = 0, fast = 0;
  for (int64_t j : lpt.per_worker[1]) slow += jobs[static_cast<size_t>(j)];
  for (int64_t j : lpt.per_worker[0]) fast += jobs[static_cast<size_t>(j)];
  CHECK(slow < fast);
}
