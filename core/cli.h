#pragma once
// What every Sparrow program does the same way on its command line
// (docs/cli.md): exit statuses, --version, --log-level, --log-format and one
// log format (core/log.h).
//
// Header only: each program is built with SPARROW_VERSION defined (its
// CMakeLists), and links CLI11 and spdlog already.

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <exception>
#include <string>
#include <string_view>

#include "core/error.h"
#include "core/error_text.h"
#include "core/log.h"

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

// The value of --log-format, read by setup_logging (one per process: every
// program parses one command line).
inline std::string& log_format_option() {
  static std::string format = "text";
  return format;
}

// --version, --log-level and --log-format on `app`; `level` holds the default.
inline void add_common_options(CLI::App& app, const std::string& program, std::string* level) {
  app.fallthrough();  // `PROGRAM SUBCOMMAND --log-level debug` works as well
  app.set_version_flag("--version", version_text(program));
  app.add_option("--log-level", *level, "trace, debug, info, warn, error, off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->capture_default_str();
  app.add_option("--log-format", log_format_option(), "text (key=value lines) or json (one object per line)")
      ->check(CLI::IsMember({"text", "json"}))
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

// ---- The exception that ends a program: one mapping for all (docs/cli.md) -----
//
// ConfigError: kBadInput, logged as event=config_error (a key or value of the
// command line or config). FormatError: kBadInput, event=bad_input (a damaged
// or foreign file). Any other exception: kFailure, event=fatal. The message is
// error_text(e), which names the key or file; the failed check's source file
// and line only at --log-level debug or trace (setup_logging). Stopping on a
// signal is not an exception here: a program returns kInterrupted itself, at
// the safe point where it stopped, with the command that goes on.

// The exit status `e` ends a program with.
inline int exit_status(const std::exception& e) {
  return dynamic_cast<const ConfigError*>(&e) || dynamic_cast<const FormatError*>(&e) ? kBadInput : kFailure;
}

// The `event=` of the line that reports `e` (exit_status says the status).
inline const char* error_event(const std::exception& e) {
  if (dynamic_cast<const ConfigError*>(&e)) return "config_error";
  return dynamic_cast<const FormatError*>(&e) ? "bad_input" : "fatal";
}

// Logs `e` as the line that ends the program and returns its exit status.
// `what`, when given, starts the message ("export: " for a subcommand's work).
inline int report_error(const std::exception& e, std::string_view what = {}) {
  spdlog::error("event={} msg=\"{}{}\"", error_event(e), what, core::error_text(e));
  return exit_status(e);
}

// A program's work: the status `body()` returns, or, when it throws, the
// status of the exception (report_error logs it). Every program's main runs
// its work through this once the command line is parsed and logging is set up.
template <class F>
int run_main(F&& body, std::string_view what = {}) {
  try {
    return body();
  } catch (const std::exception& e) {
    return report_error(e, what);
  }
}

// Work that has begun to change state (a client's session, once connected):
// any exception is kFailure, logged as event=fatal, whatever its type, since
// kBadInput promises that nothing was done.
template <class F>
int run_started(F&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    spdlog::error("event=fatal msg=\"{}\"", core::error_text(e));
    return kFailure;
  }
}

// ---- SIGINT and SIGTERM, the same in every program (docs/cli.md) ----------------
//
// The handlers are installed before anything else runs: SPARROW_STOP_HANDLERS_AT_LOAD
// in a program's main file puts install_stop_handlers in the executable's
// .preinit_array, which the loader runs before the libraries' static
// initialisers (LibTorch's take about 0.3 s, during which a signal would
// otherwise kill the process, or be ignored when the shell started it in the
// background with SIGINT ignored). Before that, while the loader maps the
// libraries, the launcher (core/launcher.cc) keeps both signals blocked, so
// one sent then waits for these handlers. The first signal sets stop_requested() and
// calls the function given to on_stop(); the program stops at its next safe
// point, saves what it has and exits kInterrupted. A second signal exits
// kInterrupted at once (the last saved state stands).

namespace stop_detail {
inline std::atomic<bool> requested{false};
inline std::atomic<void (*)()> callback{nullptr};
}  // namespace stop_detail

// The handler of SIGINT and SIGTERM (also usable for other signals that mean
// "stop", as sparrow-sim's SIGUSR1 over MPI).
inline void stop_signal_handler(int) {
  using namespace stop_detail;
  if (requested.exchange(true)) _exit(kInterrupted);
  if (auto* f = callback.load()) f();  // stores to atomics only: async-signal-safe
  const char msg[] = "\nstopping at the next safe point (a second Ctrl-C quits at once)\n";
  (void)!write(2, msg, sizeof msg - 1);
}

// SIGINT and SIGTERM to the handler above (idempotent). SA_RESTART: an
// interrupted write of a log line is resumed, not failed.
inline void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = stop_signal_handler;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}
// At load: the handlers, then SIGINT and SIGTERM unblocked. The launcher
// (core/launcher.cc) execs the program with both blocked, so a signal sent
// while the loader mapped the libraries is pending and is delivered here.
inline void install_stop_handlers_at_load(int, char**, char**) {
  install_stop_handlers();
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  sigprocmask(SIG_UNBLOCK, &stop, nullptr);
}

// Whether a signal asked the program to stop.
inline bool stop_requested() { return stop_detail::requested.load(); }

// `f` (which must only store to atomics) is called by the first signal; called
// at once if a signal came already. nullptr: none.
inline void on_stop(void (*f)()) {
  stop_detail::callback.store(f);
  if (f && stop_requested()) f();
}

// One line per program main file, at namespace scope.
#define SPARROW_STOP_HANDLERS_AT_LOAD()                                                                \
  __attribute__((section(".preinit_array"), used)) static void (*const sparrow_stop_handlers_at_load)( \
      int, char**, char**) = &::sparrow::cli::install_stop_handlers_at_load

// One log format for every program, on stderr (core/log.h):
//   2026-11-25T08:00:00.123 level=info event=... key=value ... msg="..."
// or one JSON object per line with --log-format json. Errors name the failed
// check's source file and line only at --log-level debug or trace.
inline void setup_logging(const std::string& program, const std::string& level) {
  auto logger = spdlog::get(program);
  if (!logger) logger = spdlog::stderr_color_mt(program);
  spdlog::set_default_logger(logger);
  core::install_log_format(core::parse_log_format(log_format_option()));
  const auto lvl = spdlog::level::from_str(level);
  spdlog::set_level(lvl);
  set_check_locations(lvl <= spdlog::level::debug);
}

// Whether a line at `lvl` would be written (for output that is not a log
// line, such as sparrow-sim's progress bar, that --log-level should quiet too).
inline bool logs(spdlog::level::level_enum lvl) { return spdlog::default_logger_raw()->should_log(lvl); }

// Whether log lines are text (the progress bar may share the terminal).
inline bool text_logs() { return log_format_option() == "text"; }

}  // namespace sparrow::cli
