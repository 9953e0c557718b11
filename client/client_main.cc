// sparrow-client: one federated-learning client (docs/client.md).
//   sparrow-client --config client.toml [--set key=value ...] [--insecure]
// Exit status (core/cli.h, the same in every program): 0 when the server
// finished the run, 2 for a bad command line, config or data, 1 when the server
// refused the client or the session failed, 130 when stopped by SIGINT/SIGTERM.

#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <iostream>
#include <memory>

#include "core/cli.h"
#include "core/error_text.h"
#include "client/data_folder.h"
#include "client/session.h"
#include "core/error.h"
#include "core/models.h"
#include "core/paths.h"
#include "core/threads.h"

SPARROW_STOP_HANDLERS_AT_LOAD();

namespace {

std::atomic<sparrow::client::ClientSession*> g_session{nullptr};

// Called by the first SIGINT/SIGTERM (core/cli.h).
void stop_session() {
  if (auto* s = g_session.load()) s->stop();  // stop() only stores an atomic
}

}  // namespace

int main(int argc, char** argv) {
  sparrow::cli::install_stop_handlers();  // done at load already (above); here for the record
  // Before any thread: received messages reuse heap blocks (core/threads.h).
  sparrow::core::tune_allocator_for_messages();
  CLI::App app{"sparrow-client: trains tasks from a Sparrow server and sends compressed updates"};
  std::string config_path;
  std::vector<std::string> overrides;
  bool insecure = false;
  std::string log_level = "info";
  app.add_option("--config", config_path, "client TOML file")->required();
  app.add_option("--set", overrides, "override a config key (key=value); repeatable");
  app.add_flag("--insecure", insecure, "plain TCP without CURVE (testing only)");
  std::string fault;
  app.add_option("--fault", fault, "testing: exit as a crash would at a secure-aggregation stage")
      ->check(CLI::IsMember({"secagg-keys", "secagg-shares", "secagg-masked", "secagg-reveal"}))
      ->group("Testing");
  int update_delay_ms = 0;
  app.add_option("--update-delay-ms", update_delay_ms, "testing: wait this long after training before sending")
      ->check(CLI::Range(0, 60000))
      ->group("Testing");
  sparrow::cli::add_common_options(app, "sparrow-client", &log_level);
  if (const int rc = sparrow::cli::parse(app, argc, argv); rc >= 0) return rc;
  sparrow::cli::setup_logging("sparrow-client", log_level);
  sparrow::cli::on_stop(stop_session);
  // The command that goes on after a signal: this one (the state database holds the session).
  std::string command = "sparrow-client";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  auto interrupted = [&](const std::string& what) {
    spdlog::info("event=interrupted msg=\"{}; continue with: {}\"", what, command);
    return sparrow::cli::kInterrupted;
  };

  std::unique_ptr<sparrow::client::ClientSession> session;
  const int setup = sparrow::cli::run_main([&] {
    if (insecure) overrides.push_back("insecure=true");
    sparrow::client::SessionConfig cfg = sparrow::client::load_session_config(config_path, overrides);
    cfg.fault = fault;
    cfg.update_delay_ms = update_delay_ms;
    // Paths before anything starts: a bad one is a config error naming its key.
    sparrow::core::check_file_path("state_db", cfg.state_db);
    if (!cfg.insecure) {
      sparrow::core::check_input_file("server_key", cfg.server_key);
      sparrow::core::check_input_file("key", cfg.key);
    }
    if (cfg.data.data.rfind("folder:", 0) == 0)
      sparrow::core::check_data_folder("data", cfg.data.data.substr(7));
    else if (cfg.data.data.rfind("fashion-mnist", 0) == 0)
      sparrow::core::check_data_folder("data_dir", cfg.data.data_dir);
    if (const std::string w = cfg.insecure ? "" : sparrow::core::secret_file_warning("key", cfg.key); !w.empty())
      spdlog::warn("event=key_file_warning msg=\"{}\"", w);
    sparrow::core::configure_threads(1);
    spdlog::info("event=threads msg=\"{}\"", sparrow::core::threads_summary(1));
    spdlog::info("event=allocator msg=\"{}\"", sparrow::core::allocator_tuned_for_messages()
                                                   ? "received messages reuse heap blocks"
                                                   : "glibc default (SPARROW_SYSTEM_MALLOC)");
    if (const std::string w = sparrow::core::blas_warning(); !w.empty())
      spdlog::warn("event=blas_warning msg=\"{}\"", w);
    if (sparrow::cli::stop_requested()) return interrupted("stopped before loading the data");
    sparrow::core::Dataset data = sparrow::client::load_client_data(cfg.data, cfg.model);
    if (sparrow::cli::stop_requested()) return interrupted("stopped after loading the data");
    spdlog::info("event=data samples={} data=\"{}\"", data.size(), cfg.data.data);
    // The model against the data, before any connection: one forward pass.
    sparrow::client::check_model_on_data(*sparrow::core::make_model(cfg.model, 0), data, cfg.model);
    session = std::make_unique<sparrow::client::ClientSession>(cfg, std::move(data));
    return sparrow::cli::kOk;
  });
  if (setup != sparrow::cli::kOk) return setup;
  g_session.store(session.get());
  if (sparrow::cli::stop_requested()) session->stop();  // a signal before the session existed
  const int status = sparrow::cli::run_started([&] {
    return session->run() ? sparrow::cli::kOk : sparrow::cli::kInterrupted;  // false: stopped by a signal
  });
  g_session.store(nullptr);
  const auto c = session->counters();
  spdlog::info("event=client_done tasks={} refused={} updates_acked={} updates_rejected={} reconnects={}", c.tasks_done,
               c.tasks_refused, c.updates_acked, c.updates_rejected, c.reconnects);
  if (status == sparrow::cli::kInterrupted) return interrupted("stopped");
  return status;
}
