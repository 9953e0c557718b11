// sparrow-sim: runs a federated-learning experiment described by a TOML file.
//
//   sparrow-sim --config FILE.toml [--set key=value]... [--force] [--resume RUN_DIR]
//               [--http HOST:PORT [--http-token FILE] [--http-linger S]]
//   sparrow-sim report RUN_DIR [--compare OTHER_RUN_DIR]...
//   sparrow-sim export RUN_DIR [--out DIR]
//
// Log lines go to stderr (core/log.h); so does the progress bar, redrawn with
// \r on a terminal (an event=round_completed log line per round otherwise);
// the LAST stdout line is a JSON summary. Exit codes: 0 done,
// 2 bad command line or config, 1 any other failure, 130 interrupted (Ctrl-C or
// SIGTERM: the clients in training finish, the unfinished round is given up,
// the last completed round is checkpointed and the --resume command printed;
// a second signal exits at once).

#include <signal.h>
#include <unistd.h>

#include <atomic>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <thread>
#include <iostream>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "core/cli.h"
#include "core/error_text.h"
#include "core/export.h"
#include "core/paths.h"
#include "core/error.h"
#include "simulator/cluster.h"
#include "simulator/config.h"
#include "simulator/report.h"
#include "core/threads.h"
#include "federation/client_pipeline.h"
#include "simulator/simulator.h"
#include "monitor/board.h"
#include "simulator/board.h"
#include "monitor/http.h"

SPARROW_STOP_HANDLERS_AT_LOAD();

namespace {

std::atomic<sparrow::simulator::Simulator*> g_sim{nullptr};

// Called by the first SIGINT/SIGTERM (core/cli.h): the clients in training
// finish, the unfinished round is given up.
void stop_sim() {
  if (auto* s = g_sim.load()) s->request_stop();  // stores atomics only
}

// mpirun kills its ranks on SIGINT/SIGTERM but forwards SIGUSR1: the graceful
// stop of a run over MPI ranks (docs/simulator.md), handled as SIGINT is.
void install_rank0_usr1_handler() {
  struct sigaction sa {};
  sa.sa_handler = sparrow::cli::stop_signal_handler;
  sa.sa_flags = SA_RESTART;  // an interrupted write of the progress line is resumed, not failed
  sigemptyset(&sa.sa_mask);
  sigaction(SIGUSR1, &sa, nullptr);
}

// SIGUSR1 on a rank other than 0 (mpirun forwards it to every rank): stop
// after the clients in training; rank 0 then gives the round up and ends the run.
extern "C" void on_rank_stop(int) {
  if (auto* s = g_sim.load()) s->request_stop();  // atomics only
}

// A rank other than 0 of a run over MPI: builds its simulator from rank 0's
// config and trains the clients rank 0 sends until the run ends.
int serve_rank(sparrow::simulator::Cluster& cluster) {
  using namespace sparrow::simulator;
  std::string text;
  cluster.broadcast(text);
  if (text.empty()) return 0;  // rank 0 did not start the run (it says why)
  try {
    const SimConfig cfg = parse_config_string(text);
    sparrow::core::configure_threads(cfg.workers * local_ranks(), cfg.threads);
    Simulator sim(cfg, false, &cluster);
    g_sim.store(&sim);
    struct sigaction sa {};
    sa.sa_handler = on_rank_stop;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, nullptr);
    sim.serve();
    signal(SIGUSR1, SIG_IGN);
    g_sim.store(nullptr);
    return 0;
  } catch (const std::exception& e) {
    // The same exit status as rank 0 gives the same error (both may abort first).
    spdlog::error("event={} rank={} msg=\"{}\"", sparrow::cli::error_event(e), cluster.rank(),
                  sparrow::core::error_text(e));
    cluster.abort(sparrow::cli::exit_status(e));
  }
  return 1;  // not reached: abort ends the job
}

std::string clock_text(double s) {
  if (!std::isfinite(s) || s < 0) return "--:--";
  const long t = static_cast<long>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%02ld:%02ld", t / 60, t % 60);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  sparrow::cli::install_stop_handlers();  // done at load already (above); here for the record
  using namespace sparrow::simulator;
  CLI::App app{"sparrow-sim: simulate a federated-learning experiment"};
  std::string config_path, resume_dir;
  std::vector<std::string> overrides;
  bool force = false;
  app.add_option("--config", config_path, "experiment TOML file");
  app.add_option("--set", overrides, "override a config key (key=value); repeatable")->take_all();
  app.add_option("--resume", resume_dir, "continue the run in RUN_DIR after its last completed round");
  app.add_flag("--force", force, "start afresh in a run folder that already holds a run (replacing it)");
  std::string http, http_token;
  double http_linger = 0;
  app.add_option("--http", http, "serve the live dashboard and /metrics on HOST:PORT (e.g. 127.0.0.1:8080)");
  app.add_option("--http-token", http_token, "file with the dashboard's bearer token (needed off loopback)");
  app.add_option("--http-linger", http_linger, "keep serving the dashboard this many seconds after the run")
      ->check(CLI::Range(0.0, 86400.0));
  std::string log_level = "info";
  sparrow::cli::add_common_options(app, "sparrow-sim", &log_level);
  std::string report_dir;
  std::vector<std::string> compare;
  auto* report = app.add_subcommand("report", "plot accuracy against rounds, bytes and simulated time (SVG)");
  report->add_option("run_dir", report_dir, "the run folder (holds metrics.csv)")->required();
  report->add_option("--compare", compare, "other run folders to overlay")->take_all();
  std::string report_out;
  report->add_option("--out", report_out, "folder for the plots (default: the run folder)");
  std::string export_dir, export_out;
  auto* exp = app.add_subcommand("export", "write a run's global model as TorchScript (model.pt) and .npy weights");
  exp->add_option("run_dir", export_dir, "the run folder")->required();
  exp->add_option("--out", export_out, "output folder (default RUN_DIR/export)");
  if (const int rc = sparrow::cli::parse(app, argc, argv); rc >= 0) return rc;
  sparrow::cli::setup_logging("sparrow-sim", log_level);
  sparrow::cli::on_stop(stop_sim);
  if (*exp) {
    return sparrow::cli::run_main(
        [&] {
          const SimConfig rc = load_config((std::filesystem::path(export_dir) / "config.toml").string());
          auto [weights, round] = load_run_model(export_dir);
          const std::string out =
              export_out.empty() ? (std::filesystem::path(export_dir) / "export").string() : export_out;
          const sparrow::core::ExportResult r = sparrow::core::export_model(rc.model, weights, out);
          spdlog::info("event=exported round={} run=\"{}\" model=\"{}\" parameters={} out=\"{}\"", round, export_dir,
                       rc.model, r.npy.size(), out);
          if (!r.note.empty()) spdlog::info("event=export_note msg=\"{}\"", r.note);
          if (!r.torchscript.empty()) std::cout << r.torchscript << "\n" << r.state_dict << "\n";
          std::cout << (std::filesystem::path(out) / "weights").string() << "/\n";
          return sparrow::cli::kOk;
        },
        "export: ");
  }
  if (*report) {
    return sparrow::cli::run_main(
        [&] {
          for (const std::string& path : write_report(report_dir, compare, report_out)) std::cout << path << '\n';
          return sparrow::cli::kOk;
        },
        "report: ");
  }
  // Several ranks (mpirun -np R): rank 0 runs what follows, the others serve.
  // mpirun forwards SIGUSR1 to every rank: ignored until a rank can act on it
  // (its default action would end the job).
  signal(SIGUSR1, SIG_IGN);
  std::unique_ptr<Cluster> cluster;
  try {
    cluster = join_mpi(&argc, &argv);
  } catch (const std::exception& e) {
    spdlog::error("event=config_error msg=\"{}\"", sparrow::core::error_text(e));
    return sparrow::cli::kBadInput;
  }
  const bool ranked = cluster && cluster->size() > 1;
  if (ranked && cluster->rank() != 0) return serve_rank(*cluster);
  // Until rank 0 sends the config, the other ranks wait: a refusal before
  // that sends them an empty one (they exit quietly); a failure after it
  // aborts the job (they may be mid-round).
  bool started = false;
  struct Release {
    Cluster* c;
    const bool& started;
    ~Release() {
      if (c && !started) {
        std::string none;
        c->broadcast(none);
      }
    }
  } release{ranked ? cluster.get() : nullptr, started};
  auto fail = [&](int rc) {
    if (started) cluster->abort(rc);
    return rc;
  };
  try {
    SimConfig cfg;
    const bool resume = !resume_dir.empty();
    if (resume) {
      // The run's own config, then --set (e.g. rounds=100 to extend a run).
      // --config is not needed; if given it must not disagree (checked by Simulator).
      cfg = load_config((std::filesystem::path(resume_dir) / "config.toml").string(), overrides);
      cfg.out = resume_dir;
    } else {
      if (config_path.empty()) {
        spdlog::error("event=usage_error msg=\"--config FILE.toml (or --resume RUN_DIR) is required\"");
        return 2;
      }
      cfg = load_config(config_path, overrides);
    }
    // Before anything starts: a file, /proc, a read-only folder is a config error naming the key.
    sparrow::core::check_output_folder(resume ? "--resume" : "out", cfg.out);
    if (cfg.dataset.rfind("folder:", 0) == 0)
      sparrow::core::check_data_folder("dataset", cfg.dataset.substr(7));
    else if (cfg.dataset.rfind("fashion-mnist", 0) == 0)
      sparrow::core::check_data_folder("data_dir", cfg.data_dir);
    const std::filesystem::path run_db = std::filesystem::path(cfg.out) / "run.db";
    if (!resume && !force && std::filesystem::exists(run_db)) {
      spdlog::error(
          "event=config_error msg=\"the run folder {} already holds a run (run.db): continue it with --resume {}, "
          "start it over with --force, or set another out (--set out=DIR)\"",
          cfg.out, cfg.out);
      return 2;
    }
    // The dashboard binds before the run starts (a taken port is a config
    // error that changes nothing) and serves while the simulator builds.
    auto board = std::make_shared<sparrow::monitor::Board>();
    std::unique_ptr<sparrow::monitor::HttpEndpoint> endpoint;
    if (!http.empty()) {
      endpoint = std::make_unique<sparrow::monitor::HttpEndpoint>(http, http_token, board);
      spdlog::info("event=dashboard url={} msg=\"dashboard at {}\"", endpoint->url(), endpoint->url());
    }
    sparrow::simulator::SimBoard sim_board(board);
    sparrow::core::configure_threads(cfg.workers * (ranked ? local_ranks() : 1), cfg.threads);
    spdlog::info("event=threads msg=\"{}\"", sparrow::core::threads_summary(cfg.workers));
    if (ranked) {
      spdlog::info("event=ranks ranks={} workers={} msg=\"{} MPI ranks x {} {}; rank 0 keeps the run folder\"",
                   cluster->size(), cfg.workers, cluster->size(), cfg.workers, cfg.workers == 1 ? "worker" : "workers");
      std::string text = to_toml(cfg);
      cluster->broadcast(text);
      started = true;
    }
    if (const std::string w = sparrow::core::blas_warning(); !w.empty())
      spdlog::warn("event=blas_warning msg=\"{}\"", w);
    // A signal before the simulator exists: nothing was started (a resumed run is as it was).
    if (sparrow::cli::stop_requested() && !ranked) {
      spdlog::info("event=interrupted msg=\"interrupted before the run started; nothing was written{}\"",
                   resume ? "; continue with: sparrow-sim --resume " + cfg.out : std::string());
      return sparrow::cli::kInterrupted;
    }
    const auto start = std::chrono::steady_clock::now();
    // A signal while it builds (data, partition, model): the loop below does no
    // round, the run is checkpointed as it stands and the --resume command printed.
    Simulator sim(cfg, resume, cluster.get());
    spdlog::info("event=run_folder out=\"{}\" resumed={} training=\"{}\"", cfg.out, resume, sim.training_mode());
    spdlog::info("event=disk_estimate msg=\"{}\"", disk_estimate_text(estimate_disk(sim), cfg));
    // What a deployed client needs to hold simulated client i's shard
    // (sparrow-client: partition, clients, index = i, partition_seed).
    spdlog::info("event=partition partition=\"{}\" clients={} partition_seed={}", cfg.partition, cfg.clients,
                 sparrow::federation::partition_seed(cfg.seed));
    install_rank0_usr1_handler();
    sim_board.start(sim);
    // Clients finished in the round in progress, for the dashboard's progress bar.
    std::atomic<bool> ticking{endpoint != nullptr};
    std::thread ticker([&] {
      while (ticking.load()) {
        sim_board.received(sim.clients_finished());
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    });
    struct Join {
      std::atomic<bool>& flag;
      std::thread& t;
      ~Join() {
        flag.store(false);
        if (t.joinable()) t.join();
      }
    } join_ticker{ticking, ticker};
    const int first = sim.completed_rounds();
    // The bar on a terminal with text logs at info; otherwise (a file, a
    // pipe, JSON logs) one log line per round, quieted by --log-level warn.
    const bool tty = isatty(2) != 0 && sparrow::cli::text_logs() && sparrow::cli::logs(spdlog::level::info);
    double last_acc = NAN;
    auto progress = [&](const RoundMetrics& m) {
      const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const int done = m.round - first, total = cfg.rounds - first;
      const double eta = done > 0 ? el / done * (total - done) : NAN;
      const int width = 30, filled = total > 0 ? width * done / total : width;
      std::string bar(filled, '#');
      bar.resize(width, '.');
      if (!std::isnan(m.accuracy)) last_acc = m.accuracy;
      // The last known accuracy (evaluations run every eval_every rounds).
      const std::string acc = std::isnan(last_acc) ? "  -   " : (std::to_string(last_acc * 100).substr(0, 5) + "%");
      char line[256];
      std::snprintf(line, sizeof line, "[%s] round %d/%d  acc %s  train_loss %.4f  ETA %s", bar.c_str(), m.round,
                    cfg.rounds, acc.c_str(), m.train_loss, clock_text(eta).c_str());
      if (tty)
        std::cerr << '\r' << line << "\033[K" << std::flush;
      else
        spdlog::info(
            "event=round_completed round={} rounds={} eval_accuracy={} train_loss={:.4f} bytes_up={} bytes_down={} "
            "seconds={:.3f} eta_s={:.0f}",
            m.round, cfg.rounds, m.accuracy, m.train_loss, m.bytes_up, m.bytes_down, m.real_s, eta);
    };
    g_sim.store(&sim);
    if (sparrow::cli::stop_requested()) sim.request_stop();
    while (!sim.done() && !sparrow::cli::stop_requested()) {
      // The clients this round trains (availability may leave fewer than clients_per_round).
      sim_board.round_started(sim.completed_rounds() + 1,
                              static_cast<int>(sim.selection(sim.completed_rounds()).size()));
      const RoundMetrics m = sim.run_round();
      if (sim.interrupted()) break;  // the round was given up: it does not count
      sim_board.round_done(m, sim.done());
      progress(m);
    }
    g_sim.store(nullptr);
    if (tty) std::cerr << '\n';
    if (!sim.done()) {
      sim_board.stopped();
      sim.checkpoint_now();
      spdlog::info(
          "event=interrupted round={} msg=\"interrupted after round {} of {} (checkpointed); continue with: "
          "sparrow-sim --resume {}\"",
          sim.completed_rounds(), sim.completed_rounds(), cfg.rounds, cfg.out);
      std::cout << summary_json(sim.summary()) << std::endl;
      return 130;
    }
    std::cout << summary_json(sim.summary()) << std::endl;
    if (endpoint && http_linger > 0) {
      spdlog::info(
          "event=dashboard_linger url={} seconds={} msg=\"the dashboard stays at {} for {} s (Ctrl-C ends it)\"",
          endpoint->url(), http_linger, endpoint->url(), http_linger);
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(http_linger);
      while (!sparrow::cli::stop_requested() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return 0;
  } catch (const std::exception& e) {  // after `started`, the other ranks are ended with the same status
    return fail(sparrow::cli::report_error(e));
  }
}
