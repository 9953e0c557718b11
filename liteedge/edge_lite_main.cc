// sparrow-edge-lite: the split fine-tuning device on the lite runtime, linking
// no LibTorch (docs/split.md, "A device without LibTorch").
//   sparrow-edge-lite --config edge.toml [--insecure] [--set key=value]...
// The cloud stays `sparrow-edge serve`. Exit status (core/cli.h): 0 when the
// run finished (the summary JSON line on stdout), 2 for a bad command line,
// config, weights, data or progress file, 1 when the cloud refused the
// device or stayed unreachable, 130 when stopped by SIGINT/SIGTERM (progress saved).
#include <spdlog/spdlog.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <CLI/CLI.hpp>
#include <atomic>
#include <iostream>

#include "core/cli.h"
#include "core/error.h"
#include "core/error_text.h"
#include "core/paths.h"
#include "edge/device/files.h"
#include "liteedge/config.h"
#include "liteedge/data.h"
#include "liteedge/device.h"
#include "lite/model.h"

SPARROW_STOP_HANDLERS_AT_LOAD();

namespace {

std::atomic<sparrow::liteedge::EdgeDevice*> g_device{nullptr};

void stop_device() {
  if (auto* d = g_device.load()) d->stop();  // stop() only stores an atomic
}

int interrupted(const std::string& what, const std::string& resume) {
  spdlog::info("event=interrupted msg=\"{}; continue with: {}\"", what, resume);
  return sparrow::cli::kInterrupted;
}

}  // namespace

int main(int argc, char** argv) {
  namespace le = sparrow::liteedge;
#if defined(__GLIBC__)
  mallopt(M_ARENA_MAX, 1);  // one arena: ZeroMQ's I/O threads keep none of their own (liteclient/client_main.cc)
#endif
  sparrow::cli::install_stop_handlers();
  CLI::App app{"sparrow-edge-lite: the split fine-tuning device on the lite runtime (no LibTorch; docs/split.md)"};
  std::string config_path, log_level = "info";
  bool insecure = false;
  std::vector<std::string> overrides;
  app.add_option("--config,-c", config_path, "device TOML config (sparrow-edge's keys)")->required();
  app.add_flag("--insecure", insecure, "plain TCP without CurveZMQ (logs a warning)");
  app.add_option("--set", overrides, "override a config key: key=value (repeatable)");
  sparrow::cli::add_common_options(app, "sparrow-edge-lite", &log_level);
  if (const int rc = sparrow::cli::parse(app, argc, argv); rc >= 0) return rc;
  sparrow::cli::setup_logging("sparrow-edge-lite", log_level);
  sparrow::cli::on_stop(stop_device);
  std::string command = "sparrow-edge-lite";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  return sparrow::cli::run_main([&] {
    if (insecure) overrides.push_back("insecure=true");
    // Config validation demands weights and data = "folder:PATH" or "fashion-mnist".
    le::DeviceConfig cfg = le::load_device_config(config_path, overrides);
    sparrow::edge::device::check_device_files(cfg);
    if (sparrow::cli::stop_requested()) return interrupted("stopped before the device started", command);
    const int64_t input_size = sparrow::lite::Model(sparrow::lite::builtin_spec(cfg.model)).input_size();
    le::DeviceData data = le::load_device_data(cfg, input_size);
    spdlog::info("event=data train={} test={} data=\"{}\"", data.train.size(), data.test.size(), cfg.data);
    if (sparrow::cli::stop_requested()) return interrupted("stopped after loading the data", command);
    le::EdgeDevice device(cfg, std::move(data));
    g_device.store(&device);
    if (sparrow::cli::stop_requested()) device.stop();
    sparrow::edge::device::Summary summary;
    try {
      summary = device.run();
    } catch (const le::Stopped&) {  // a signal: run() saved the progress
      g_device.store(nullptr);
      spdlog::info("event=stopped msg=\"progress saved\"");
      return interrupted("stopped; progress saved", command);
    }
    g_device.store(nullptr);
    std::cout << summary.json() << std::endl;
    return sparrow::cli::kOk;
  });
}
