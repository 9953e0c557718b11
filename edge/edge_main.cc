// sparrow-edge: networked split fine-tuning (docs/split.md, "Networked device and cloud").
//   sparrow-edge --config edge.toml [--insecure] [--set key=value]...        the device
//   sparrow-edge serve --config cloud.toml [--insecure] [--set key=value]... the cloud
// Keys: `sparrow-server keygen --out keys --name cloud --clients N` writes the
// cloud's key pair, N device key pairs and an allow-list.
#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <iostream>

#include "core/cli.h"
#include "core/error_text.h"
#include "core/error.h"
#include "core/paths.h"
#include "core/threads.h"
#include "edge/cloud.h"
#include "edge/device.h"
#include "edge/device/files.h"

SPARROW_STOP_HANDLERS_AT_LOAD();

namespace {

std::atomic<sparrow::edge::CloudServer*> g_cloud{nullptr};
std::atomic<sparrow::edge::EdgeDevice*> g_device{nullptr};

// Called by the first SIGINT/SIGTERM (core/cli.h): both only store to an atomic flag.
void stop_all() {
  if (auto* c = g_cloud.load()) c->stop();
  if (auto* d = g_device.load()) d->stop();
}

// A signal came: what was saved and the command that goes on from it.
int interrupted(const std::string& what, const std::string& resume) {
  spdlog::info("event=interrupted msg=\"{}; continue with: {}\"", what, resume);
  return sparrow::cli::kInterrupted;
}

}  // namespace

int main(int argc, char** argv) {
  sparrow::cli::install_stop_handlers();  // done at load already (above); here for the record
  // Before any thread: received messages reuse heap blocks (core/threads.h).
  sparrow::core::tune_allocator_for_messages();
  CLI::App app{"sparrow-edge: split fine-tuning between an edge device and the cloud (docs/split.md)"};
  std::string config_path, log_level = "info";
  bool insecure = false;
  std::vector<std::string> overrides;
  app.add_option("--config,-c", config_path, "device TOML config");
  app.add_flag("--insecure", insecure, "plain TCP without CurveZMQ (logs a warning)");
  app.add_option("--set", overrides, "override a config key: key=value (repeatable)");
  sparrow::cli::add_common_options(app, "sparrow-edge", &log_level);

  auto* serve = app.add_subcommand("serve", "run the cloud half (one ROUTER socket, the top model)");
  std::string serve_config;
  std::vector<std::string> serve_overrides;
  bool serve_insecure = false;
  serve->add_option("--config,-c", serve_config, "cloud TOML config")->required();
  serve->add_flag("--insecure", serve_insecure, "plain TCP without CurveZMQ (logs a warning)");
  serve->add_option("--set", serve_overrides, "override a config key: key=value (repeatable)");
  if (const int rc = sparrow::cli::parse(app, argc, argv); rc >= 0) return rc;
  sparrow::cli::setup_logging("sparrow-edge", log_level);
  sparrow::cli::on_stop(stop_all);
  // The command that continues after a signal: this one.
  std::string command = "sparrow-edge";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  if (const std::string w = sparrow::core::blas_warning(); !w.empty()) spdlog::warn("event=blas msg=\"{}\"", w);
  // Before any compute, after the config (its `threads` key).
  auto threads = [](int64_t n) {
    sparrow::core::configure_threads(1, static_cast<int>(n));
    spdlog::info("event=threads msg=\"{}\"", sparrow::core::threads_summary(1));
    spdlog::info("event=allocator malloc={}", sparrow::core::allocator_tuned_for_messages() ? "reuse" : "system");
  };
  return sparrow::cli::run_main([&] {
    if (*serve) {
      // --insecure before validation, which otherwise demands key and allow.
      if (serve_insecure) serve_overrides.push_back("insecure=true");
      sparrow::edge::CloudConfig cfg = sparrow::edge::load_cloud_config(serve_config, serve_overrides);
      if (!cfg.state.empty()) sparrow::core::check_file_path("state", cfg.state);
      if (!cfg.insecure) {
        sparrow::core::check_input_file("key", cfg.key);
        sparrow::core::check_input_path("allow", cfg.allow);
      }
      if (!cfg.weights.empty()) sparrow::core::check_input_file("weights", cfg.weights);
      if (const std::string w = cfg.insecure ? "" : sparrow::core::secret_file_warning("key", cfg.key); !w.empty())
        spdlog::warn("event=key_permissions msg=\"{}\"", w);
      threads(cfg.threads);
      if (sparrow::cli::stop_requested()) return interrupted("stopped before the cloud started", command);
      sparrow::edge::CloudServer cloud(cfg);  // a signal while it builds: noticed by run() at once
      g_cloud.store(&cloud);
      if (sparrow::cli::stop_requested()) cloud.stop();
      cloud.run();
      g_cloud.store(nullptr);
      const auto c = cloud.counters();
      spdlog::info("event=stopped steps_applied={} duplicates={} evals={} errors_sent={}", c.steps_applied,
                   c.duplicates, c.evals, c.errors_sent);
      // The cloud serves until a signal: ending is always an interruption.
      return interrupted(cfg.state.empty() ? "stopped (no state file: the top is lost)"
                                           : "stopped; the top and the sessions are in " + cfg.state,
                         command);
    }
    if (config_path.empty()) {
      spdlog::error("event=usage_error msg=\"--config FILE is required (or: sparrow-edge serve --config FILE)\"");
      return 2;
    }
    if (insecure) overrides.push_back("insecure=true");
    sparrow::edge::DeviceConfig cfg = sparrow::edge::load_device_config(config_path, overrides);
    sparrow::edge::device::check_device_files(cfg);
    threads(cfg.threads);
    if (sparrow::cli::stop_requested()) return interrupted("stopped before the device started", command);
    sparrow::edge::DeviceData data = sparrow::edge::load_device_data(cfg);
    if (sparrow::cli::stop_requested()) return interrupted("stopped after loading the data", command);
    sparrow::edge::EdgeDevice device(cfg, std::move(data));
    g_device.store(&device);
    if (sparrow::cli::stop_requested()) device.stop();
    sparrow::edge::device::Summary summary;
    try {
      summary = device.run();
    } catch (const sparrow::edge::Stopped&) {  // a signal: run() saved the progress
      g_device.store(nullptr);
      spdlog::info("event=stopped msg=\"progress saved\"");
      return interrupted("stopped; progress saved", command);
    }
    g_device.store(nullptr);
    std::cout << summary.json() << std::endl;
    return sparrow::cli::kOk;
  });
}
