#include "simulator/scheduler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace sparrow::simulator {

CostModel::CostModel(int workers, int window) : window_(window), history_(workers), fit_(workers) {
  SPARROW_CHECK(workers >= 1, "CostModel: need at least one worker, got " << workers);
  SPARROW_CHECK(window >= 2, "CostModel: window must be >= 2, got " << window);
}

void CostModel::observe(int worker, double samples, double seconds) {
  SPARROW_CHECK(worker >= 0 && worker < workers(), "CostModel: no worker " << worker);
  if (!std::isfinite(samples) || !std::isfinite(seconds) || samples < 0 || seconds < 0) return;
  auto& h = history_[worker];
  h.emplace_back(samples, seconds);
  while (static_cast<int>(h.size()) > window_) h.pop_front();
  refit(worker);
}

void CostModel::refit(int worker) {
  const auto& h = history_[worker];
  Fit f;
  double sn = 0, st = 0;
  for (const auto& [n, t] : h) {
    sn += n;
    st += t;
  }
  const double k = static_cast<double>(h.size());
  const double mn = sn / k, mt = st / k;
  double snn = 0, snt = 0;
  for (const auto& [n, t] : h) {
    snn += (n - mn) * (n - mn);
    snt += (n - mn) * (t - mt);
  }
  if (h.size() >= 2 && snn > 1e-12 * std::max(1.0, mn * mn)) {
    f.a = snt / snn;
    f.b = mt - f.a * mn;
    // A negative slope is noise (more samples never take less time): fall back to proportional.
    if (f.a < 0) {
      f.a = sn > 0 ? st / sn : 0;
      f.b = 0;
    }
  } else {
    // One distinct workload so far: assume time proportional to samples.
    f.a = sn > 0 ? st / sn : 0;
    f.b = sn > 0 ? 0 : mt;
  }
  f.ok = true;
  fit_[worker] = f;
}

bool CostModel::fitted(int worker) const { return fit_.at(static_cast<size_t>(worker)).ok; }

double CostModel::predict(int worker, double samples) const {
  const Fit& f = fit_.at(static_cast<size_t>(worker));
  if (f.ok) return std::max(0.0, f.a * samples + f.b);
  // No history: the mean of the fitted workers, or the sample count itself.
  double a = 0, b = 0;
  int fitted = 0;
  for (const Fit& g : fit_)
    if (g.ok) {
      a += g.a;
      b += g.b;
      ++fitted;
    }
  if (fitted == 0) return samples;
  return std::max(0.0, (a * samples + b) / fitted);
}

namespace {

Assignment finish(Assignment a) {
  a.makespan = a.predicted.empty() ? 0 : *std::max_element(a.predicted.begin(), a.predicted.end());
  return a;
}

}  // namespace

Assignment schedule_lpt(const std::vector<double>& jobs, const CostModel& model) {
  const int w = model.workers();
  Assignment a;
  a.per_worker.resize(w);
  a.predicted.assign(w, 0.0);
  std::vector<int64_t> order(jobs.size());
  std::iota(order.begin(), order.end(), 0);
  // Largest job first, by its mean predicted cost over workers (the workload proxy).
  std::vector<double> size(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    double s = 0;
    for (int k = 0; k < w; ++k) s += model.predict(k, jobs[i]);
    size[i] = s;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return size[x] > size[y]; });
  for (int64_t j : order) {
    int best = 0;
    double best_finish = a.predicted[0] + model.predict(0, jobs[j]);
    for (int k = 1; k < w; ++k) {
      const double f = a.predicted[k] + model.predict(k, jobs[j]);
      if (f < best_finish) {
        best_finish = f;
        best = k;
      }
    }
    a.per_worker[best].push_back(j);
    a.predicted[best] = best_finish;
  }
  return finish(std::move(a));
}

Assignment schedule_round_robin(const std::vector<double>& jobs, const CostModel& model) {
  const int w = model.workers();
  Assignment a;
  a.per_worker.resize(w);
  a.predicted.assign(w, 0.0);
  for (size_t j = 0; j < jobs.size(); ++j) {
    const int k = static_cast<int>(j % static_cast<size_t>(w));
    a.per_worker[k].push_back(static_cast<int64_t>(j));
    a.predicted[k] += model.predict(k, jobs[j]);
  }
  return finish(std::move(a));
}

TaskTime task_time(double speed, double down_bps, double up_bps, int64_t sample_epochs, uint64_t down_bytes,
                   uint64_t up_bytes) {
  TaskTime t;
  t.down_s = static_cast<double>(down_bytes) * 8 / down_bps;
  t.compute_s = static_cast<double>(sample_epochs) * kSampleSeconds / speed;
  t.up_s = static_cast<double>(up_bytes) * 8 / up_bps;
  return t;
}

}  // namespace sparrow::simulator
