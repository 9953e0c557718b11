#pragma once
// What every Sparrow program does the same way on its command line
// (docs/cli.md): exit statuses, --version, --log-level and one log format.
//
// Header only: each program is built with SPARROW_VERSION defined (its
// CMakeLists), and links CLI11 and spdlog already.

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <string>

#ifndef SPARROW_VERSION
#error "SPARROW_VERSION must be defined for programs that include core/cli.h"
#endif

namespace sparrow::cli {

// Exit statuses, the same in every program.
constexpr int kOk = 0;             // done
constexpr int kFailure = 1;        // a failure at run time (the peer refused us, a write failed, ...)
constexpr int kBadInput = 2;       // bad command line, config or data: nothing was done
constexpr int kInterrupted = 130;  // stopped by SIGINT/SIGTERM before the work was done (state saved)

inline std::string version_text(const std::string& program) { return program + " " + SPARROW_VERSION; }

// --version and --log-level on `app`; `level` holds the default.
inline void add_common_options(CLI::App& app, const std::string& program, std::string* level) {
  app.fallthrough();  // `PROGRAM SUBCOMMAND --log-level debug` works as well
  app.set_version_flag("--version", version_text(program));
  app.add_option("--log-level", *level, "trace, debug, info, warn, error, off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->capture_default_str();
}

// Parses the command line: -1 to go on, otherwise the exit status (0 after
// --help or --version, kBadInput for a usage error, which CLI11 has printed).
inline int parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kOk : kBadInput;
  }
  return -1;
}

// One log format for every program, on stderr:
//   2026-11-25T08:00:00.123 level=info event=... key=value ... msg="..."
inline void setup_logging(const std::string& program, const std::string& level) {
  auto logger = spdlog::get(program);
  if (!logger) logger = spdlog::stderr_color_mt(program);
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e level=%l %v");
  spdlog::set_level(spdlog::level::from_str(level));
}

}  // namespace sparrow::cli
