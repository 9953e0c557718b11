// sparrow._Simulation: simulator::Simulator driven from Python, as
// sparrow-sim's main drives it (the same config loading and checks, the same
// refusal of a run folder that holds a run, the same dashboard), one round
// per call so that Python can look at each round.
//
// A round runs on a thread of its own while the caller's thread waits with the
// GIL released and checks for signals every 100 ms: Ctrl-C (KeyboardInterrupt)
// then asks the simulator to stop after the clients in training, gives the
// round up, checkpoints the last completed round and raises KeyboardInterrupt,
// so a notebook's run stops at the next safe point and resumes from there.

#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <exception>
#include <filesystem>
#include <fstream>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/paths.h"
#include "core/threads.h"
#include "monitor/board.h"
#include "monitor/http.h"
#include "python/bindings.h"
#include "simulator/board.h"
#include "simulator/config.h"
#include "simulator/simulator.h"

namespace sparrow::python {
namespace {

namespace fs = std::filesystem;
using simulator::RoundMetrics;
using simulator::SimConfig;
using simulator::Simulator;

py::dict round_dict(const RoundMetrics& m) {
  py::dict d;
  d["round"] = m.round;
  d["accuracy"] = m.accuracy;
  d["loss"] = m.loss;
  d["train_loss"] = m.train_loss;
  d["bytes_up"] = m.bytes_up;
  d["bytes_down"] = m.bytes_down;
  d["sim_round_s"] = m.sim_round_s;
  d["real_s"] = m.real_s;
  d["clients"] = m.clients;
  d["dropped"] = m.dropped;
  d["abandoned"] = m.abandoned;
  d["samples"] = m.samples;
  d["eval_s"] = m.eval_s;
  d["epsilon"] = m.epsilon;
  d["clip"] = m.clip;
  py::list ids;
  for (const auto& p : m.participants)
    if (p.kept) ids.append(p.client);
  d["participants"] = ids;
  return d;
}

// One thread that runs every round of a simulation, tasks in order: the
// same thread each round, as in sparrow-sim, so its malloc arena and ATen's
// thread-local state stay warm (a fresh thread per round cost a few percent).
class RoundThread {
 public:
  RoundThread() : thread_([this] { loop(); }) {}
  ~RoundThread() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  // Runs `task` on the thread; the caller waits for its result (a future).
  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return quit_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool quit_ = false;
  std::thread thread_;
};

class PySimulation {
 public:
  // source: TOML text (is_path false) or a TOML file; with resume, the run
  // folder to continue (its config.toml, then the overrides).
  PySimulation(const std::string& source, bool is_path, const std::vector<std::string>& overrides, bool resume,
               bool force, const std::string& http, const std::string& http_token) {
    if (resume) {
      cfg_ = simulator::load_config((fs::path(source) / "config.toml").string(), overrides);
      cfg_.out = source;
    } else {
      cfg_ = is_path ? simulator::load_config(source, overrides) : simulator::parse_config_string(source, overrides);
    }
    core::check_output_folder(resume ? "resume" : "out", cfg_.out);
    if (cfg_.dataset.rfind("folder:", 0) == 0)
      core::check_data_folder("dataset", cfg_.dataset.substr(7));
    else if (cfg_.dataset.rfind("fashion-mnist", 0) == 0)
      core::check_data_folder("data_dir", cfg_.data_dir);
    if (!resume && !force && fs::exists(fs::path(cfg_.out) / "run.db"))
      throw ConfigError("the run folder " + cfg_.out +
                        " already holds a run (run.db): continue it with Simulation.resume('" + cfg_.out +
                        "'), start it over with force=True, or set another out");
    auto board = std::make_shared<monitor::Board>();
    board_ = std::make_unique<simulator::SimBoard>(board);
    if (!http.empty()) endpoint_ = std::make_unique<monitor::HttpEndpoint>(http, http_token, board);
    core::configure_threads(cfg_.workers, cfg_.threads);
    // After configure_threads, as sparrow-sim's rounds (its malloc settings
    // first); the round thread sizes its own OpenMP team, a per-thread setting.
    rounds_ = std::make_unique<RoundThread>();
    rounds_->post([this] { core::configure_threads(cfg_.workers, cfg_.threads); });
    {
      py::gil_scoped_release nogil;
      sim_ = std::make_unique<Simulator>(cfg_, resume);
    }
    board_->start(*sim_);
  }

  ~PySimulation() {
    py::gil_scoped_release nogil;
    sim_.reset();
    endpoint_.reset();
  }

  // The next round's metrics; KeyboardInterrupt (after a checkpoint) when
  // Ctrl-C came while it ran.
  py::dict run_round() {
    Simulator& sim = live();
    SPARROW_CHECK(!stopped_, "this simulation was interrupted after round "
                                 << sim.completed_rounds() << "; continue it with Simulation.resume('" << cfg_.out
                                 << "')");
    SPARROW_CHECK_T(ConfigError, !sim.done(),
                    "all " << cfg_.rounds << " rounds are done (rounds = " << cfg_.rounds
                           << "; continue with Simulation.resume(out, rounds=N))");
    const int round = sim.completed_rounds() + 1;
    set_current_round(round);
    // The selection too runs on the round's thread: a Python sampler is never
    // called on the thread where Python's signal handlers run.
    auto task = std::make_shared<std::packaged_task<RoundMetrics()>>([this, &sim, round] {
      board_->round_started(round, static_cast<int>(sim.selection(round - 1).size()));
      return sim.run_round();
    });
    std::future<RoundMetrics> done = task->get_future();
    rounds_->post([task] { (*task)(); });
    std::unique_ptr<py::error_already_set> interrupt;  // the KeyboardInterrupt, raised once the round is given up
    for (;;) {
      {
        py::gil_scoped_release nogil;
        if (done.wait_for(std::chrono::milliseconds(100)) == std::future_status::ready) break;
        board_->received(sim.clients_finished());
      }
      if (!interrupt && PyErr_CheckSignals() != 0) {
        interrupt = std::make_unique<py::error_already_set>();  // fetches (and clears) the error
        sim.request_stop();
      }
    }
    set_current_round(0);
    if (interrupt || sim.interrupted()) {
      board_->stopped();
      {
        py::gil_scoped_release nogil;
        sim.checkpoint_now();
      }
      stopped_ = true;
      if (interrupt) throw *interrupt;
      throw Error("the round was stopped; continue with Simulation.resume('" + cfg_.out + "')");
    }
    RoundMetrics m = done.get();  // rethrows the round's exception
    board_->round_done(m, sim.done());
    return round_dict(m);
  }

  bool done() const { return sim_ && sim_->done(); }
  bool stopped() const { return stopped_; }
  int completed_rounds() const { return sim_ ? sim_->completed_rounds() : 0; }
  int total_rounds() const { return cfg_.rounds; }
  std::string out() const { return cfg_.out; }
  std::string model_name() const { return cfg_.model; }
  std::string config_toml() const { return simulator::to_toml(cfg_); }
  std::string url() const { return endpoint_ ? endpoint_->url() : std::string(); }

  py::list history() {
    py::list l;
    for (const auto& m : live().history()) l.append(round_dict(m));
    return l;
  }

  // Copies: the simulator steps its tensors in place next round.
  py::dict model() {
    py::dict d;
    for (const auto& [name, t] : live().global()) d[py::str(name)] = to_torch(t.detach().clone());
    return d;
  }

  py::dict summary() {
    const simulator::Summary s = live().summary();
    py::dict d;
    d["rounds"] = s.rounds;
    d["accuracy"] = s.accuracy;
    d["loss"] = s.loss;
    d["bytes_up"] = s.bytes_up;
    d["bytes_down"] = s.bytes_down;
    d["sim_wall_s"] = s.sim_wall_s;
    d["real_s"] = s.real_s;
    d["epsilon"] = s.epsilon;
    return d;
  }

  std::vector<int64_t> selection(int round) { return live().selection(round - 1); }

  void checkpoint() {
    Simulator& sim = live();
    py::gil_scoped_release nogil;
    sim.checkpoint_now();
  }

  // Closes the run folder (its databases and their locks) now rather than when
  // Python collects the object.
  void close() {
    py::gil_scoped_release nogil;
    sim_.reset();
    endpoint_.reset();
  }

 private:
  Simulator& live() {
    SPARROW_CHECK(sim_ != nullptr, "the simulation is closed");
    return *sim_;
  }

  SimConfig cfg_;
  std::unique_ptr<simulator::SimBoard> board_;
  std::unique_ptr<monitor::HttpEndpoint> endpoint_;
  std::unique_ptr<Simulator> sim_;
  std::unique_ptr<RoundThread> rounds_;
  bool stopped_ = false;
};

}  // namespace

void init_simulation(py::module_& m) {
  py::class_<PySimulation>(m, "_Simulation")
      .def(py::init<const std::string&, bool, const std::vector<std::string>&, bool, bool, const std::string&,
                    const std::string&>(),
           py::arg("source"), py::arg("is_path"), py::arg("overrides"), py::arg("resume"), py::arg("force"),
           py::arg("http"), py::arg("http_token"))
      .def("run_round", &PySimulation::run_round)
      .def("done", &PySimulation::done)
      .def("stopped", &PySimulation::stopped)
      .def("completed_rounds", &PySimulation::completed_rounds)
      .def("total_rounds", &PySimulation::total_rounds)
      .def("out", &PySimulation::out)
      .def("model_name", &PySimulation::model_name)
      .def("config_toml", &PySimulation::config_toml)
      .def("url", &PySimulation::url)
      .def("history", &PySimulation::history)
      .def("model", &PySimulation::model)
      .def("summary", &PySimulation::summary)
      .def("selection", &PySimulation::selection)
      .def("checkpoint", &PySimulation::checkpoint)
      .def("close", &PySimulation::close);
  m.def("load_run_model", [](const std::string& run_dir) {
    auto [weights, round] = simulator::load_run_model(run_dir);
    py::dict d;
    for (const auto& [name, t] : weights) d[py::str(name)] = to_torch(t);
    return py::make_tuple(d, round);
  });
}

}  // namespace sparrow::python
