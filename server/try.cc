#include "server/try.h"

#include <fcntl.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "core/cli.h"
#include "core/error.h"
#include "core/threads.h"
#include "server/config.h"
#include "server/server.h"
#include "server/store.h"
#include "wire/net.h"

namespace sparrow::server {
namespace fs = std::filesystem;
namespace {

void write(const fs::path& p, const std::string& text) {
  std::ofstream f(p);
  f << text;
  SPARROW_CHECK_T(Error, f.good(), "try: cannot write " << p.string());
}

// sparrow-client from the same folder as this program.
std::string client_binary() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  const fs::path bin = (ec ? fs::path(".") : self.parent_path()) / "sparrow-client";
  SPARROW_CHECK_T(ConfigError, fs::exists(bin),
                  "try: " << bin.string() << " not found (build it next to sparrow-server)");
  return bin.string();
}

// This process's environment with `name` set to `value`.
std::vector<std::string> environment_with(const std::string& name, const std::string& value) {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e)
    if (std::strncmp(*e, name.c_str(), name.size()) != 0 || (*e)[name.size()] != '=') env.emplace_back(*e);
  env.push_back(name + "=" + value);
  return env;
}

// The compute threads of each client: the cores this process may run on,
// divided between the clients (at least one each), or OMP_NUM_THREADS when the
// environment sets it. Each client would otherwise take every core (one ATen
// and BLAS thread per core, core/threads.h): 3 clients x 2 spinning threads on
// 2 cores made a 3-round try take 40 s, against 4 s with one thread each.
int client_threads(int clients) {
  if (const int t = core::env_threads(); t > 0) return t;
  return std::max(1, core::available_cores() / std::max(1, clients));
}

// fork + exec with only async-signal-safe calls in the child (the parent has
// threads): argv, the environment and the log's descriptor are made before the fork.
pid_t spawn(const std::vector<std::string>& argv, const std::vector<std::string>& env, const std::string& log) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<char*> envp;
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  SPARROW_CHECK_T(Error, fd >= 0, "try: cannot write " << log);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fd, 1);  // the copies do not inherit O_CLOEXEC
    ::dup2(fd, 2);
    ::execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  ::close(fd);
  SPARROW_CHECK(pid >= 0, "try: fork failed");
  return pid;
}

// The client processes: stopped and reaped on every way out.
struct Children {
  std::vector<pid_t> pids;
  std::vector<int> status;  // per pid, -1 while running: exit code, or 128 + signal
  Children() = default;
  Children(const Children&) = delete;
  Children& operator=(const Children&) = delete;
  ~Children() {
    for (size_t i = 0; i < pids.size(); ++i)
      if (status[i] < 0) ::kill(pids[i], SIGTERM);
    for (size_t i = 0; i < pids.size(); ++i)
      if (status[i] < 0) ::waitpid(pids[i], nullptr, 0);
  }
  void add(pid_t p) {
    pids.push_back(p);
    status.push_back(-1);
  }
  void signal_running(int sig) {
    for (size_t i = 0; i < pids.size(); ++i)
      if (status[i] < 0) ::kill(pids[i], sig);
  }
  // Reaps the clients that exited; returns how many are still running.
  size_t poll() {
    size_t running = 0;
    for (size_t i = 0; i < pids.size(); ++i) {
      if (status[i] >= 0) continue;
      int st = 0;
      if (::waitpid(pids[i], &st, WNOHANG) == pids[i])
        status[i] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
      else
        ++running;
    }
    return running;
  }
};

// Only what `try` writes, so --force never removes anything else in the folder.
void remove_earlier_try(const fs::path& dir) {
  fs::remove_all(dir / "keys");
  std::vector<fs::path> ours;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string n = entry.path().filename().string();
    const bool client_file =
        n.rfind("client", 0) == 0 && (n.find(".toml") != std::string::npos || n.find(".db") != std::string::npos ||
                                      n.find(".log") != std::string::npos);
    if (n.rfind("server.db", 0) == 0 || n == "server.toml" || client_file) ours.push_back(entry.path());
  }
  for (const auto& p : ours) fs::remove(p);
}

}  // namespace

int run_try(const TryOptions& o, std::atomic<bool>& stop) {
  SPARROW_CHECK_T(ConfigError, o.clients >= 1 && o.clients <= 64, "try: --clients must be in [1, 64]");
  SPARROW_CHECK_T(ConfigError, o.rounds >= 1, "try: --rounds must be >= 1");
  SPARROW_CHECK_T(ConfigError, o.shards >= o.clients, "try: --shards must be >= --clients");
  const fs::path dir = fs::absolute(o.dir);
  if (fs::exists(dir / "server.db")) {
    SPARROW_CHECK_T(ConfigError, o.force,
                    "try: " << dir.string() << " holds an earlier try: remove it, pick another --dir, or --force");
    remove_earlier_try(dir);
  }
  fs::create_directories(dir / "keys");
  const std::string client_bin = client_binary();

  // Keys: the server's, one per client, and the allow-list naming the clients.
  net::write_keypair((dir / "keys").string(), "server", net::generate_keypair());
  const std::string allow = net::write_client_keys((dir / "keys").string(), o.clients);

  ServerConfig cfg;
  cfg.listen = "tcp://127.0.0.1:0";
  cfg.server_key = (dir / "keys" / "server.key_secret").string();
  cfg.allow = allow;
  cfg.db = (dir / "server.db").string();
  cfg.model = o.model;
  cfg.compression = o.compression;
  cfg.rounds = o.rounds;
  cfg.clients_per_round = o.clients;
  cfg.quorum = o.clients;
  cfg.round_deadline_s = 300;
  cfg.eval_every = 1;
  cfg.workers = 1;
  cfg.http = o.http;
  Server server(cfg);
  write(dir / "server.toml", to_toml(cfg));  // what ran, for `sparrow-server --config` later

  const int threads = client_threads(o.clients);
  const std::vector<std::string> env = environment_with("OMP_NUM_THREADS", std::to_string(threads));
  Children kids;
  for (int i = 1; i <= o.clients; ++i) {
    const std::string n = std::to_string(i);
    write(dir / ("client" + n + ".toml"),
          "server = \"" + server.endpoint() + "\"\nserver_key = \"" + (dir / "keys" / "server.key").string() +
              "\"\nkey = \"" + (dir / "keys" / ("client" + n + ".key_secret")).string() + "\"\nclient_id = \"client" +
              n + "\"\nmodel = \"" + o.model + "\"\ndata = \"fashion-mnist\"\npartition = \"iid\"\nclients = " +
              std::to_string(o.shards) + "\nindex = " + std::to_string(i - 1) + "\nstate_db = \"" +
              (dir / ("client" + n + ".db")).string() + "\"\n");
    // The clients log as this process does (level and format).
    const auto name = spdlog::level::to_string_view(spdlog::get_level());
    const std::string level =
        spdlog::get_level() == spdlog::level::warn ? "warn" : std::string(name.data(), name.size());
    kids.add(spawn({client_bin, "--config", (dir / ("client" + n + ".toml")).string(), "--log-level", level,
                    "--log-format", cli::log_format_option()},
                   env, (dir / ("client" + n + ".log")).string()));
  }
  spdlog::info(
      "event=try_started clients={} rounds={} threads_per_client={} endpoint={} dir=\"{}\" msg=\"a server and {} "
      "clients on {}, {} rounds of {} with {}, {} compute thread{} per client on {} cores; everything is in {} "
      "(Ctrl-C stops it)\"",
      o.clients, o.rounds, threads, server.endpoint(), dir.string(), o.clients, server.endpoint(), o.rounds, o.model,
      o.compression, threads, threads == 1 ? "" : "s", core::available_cores(), dir.string());
  if (!server.dashboard_url().empty())
    spdlog::info("event=dashboard url={} msg=\"dashboard at {}\"", server.dashboard_url(), server.dashboard_url());

  // This thread turns a signal (which only sets `stop`) into Server::stop(),
  // and stops the server when a client dies before the run is over (the
  // server would wait for it forever): its log says why.
  std::atomic<bool> over{false}, client_died{false};
  std::thread watcher([&] {
    while (!stop.load() && !over.load()) {
      if (kids.poll() < kids.pids.size()) {
        client_died.store(true);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!over.load()) server.stop();
  });
  try {
    server.run();
  } catch (...) {
    over.store(true);
    watcher.join();
    throw;  // ~Children stops and reaps the clients
  }
  const bool finished = server.completed_rounds() >= cfg.rounds;
  over.store(true);
  watcher.join();
  // Clients exit on the server's Bye "run finished"; otherwise (Ctrl-C, a
  // client died) they are told to stop. A client that never heard the Bye
  // (it was reconnecting) is told to stop after a grace period.
  bool termed = !finished;
  if (termed) kids.signal_running(SIGTERM);
  const auto grace = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  const auto until = grace + std::chrono::seconds(20);
  while (kids.poll() > 0) {
    const auto now = std::chrono::steady_clock::now();
    if (!termed && now > grace) {
      kids.signal_running(SIGTERM);
      termed = true;
    }
    if (now > until) kids.signal_running(SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // 0 after the run, or a stop by our SIGTERM (130 from the client's handler,
  // 143 when it came before the client installed one) are clean.
  int failed = 0;
  std::string first_failed;
  for (size_t i = 0; i < kids.pids.size(); ++i) {
    const int code = kids.status[i];
    const bool clean = code == 0 || (termed && (code == cli::kInterrupted || code == 128 + SIGTERM));
    if (clean) continue;
    ++failed;
    if (first_failed.empty())
      first_failed =
          (dir / ("client" + std::to_string(i + 1) + ".log")).string() + " (exit " + std::to_string(code) + ")";
  }
  const Counters c = server.counters();
  std::string accuracy;
  {
    const auto rows = ServerStore::open_readonly(cfg.db)->rounds();
    if (!rows.empty() && std::isfinite(rows.back().eval_accuracy)) {
      char buf[64];
      std::snprintf(buf, sizeof buf, ", test accuracy %.2f%%", 100 * rows.back().eval_accuracy);
      accuracy = buf;
    }
  }
  spdlog::info(
      "event=try_done rounds={} updates_accepted={} failed_clients={} db=\"{}\" msg=\"{} of {} rounds, {} updates "
      "accepted{}{}. Server database: {} (sparrow-server status --db {}); client logs: {}\"",
      server.completed_rounds(), c.updates_accepted, failed, cfg.db, server.completed_rounds(), cfg.rounds,
      c.updates_accepted, accuracy, failed ? ", " + std::to_string(failed) + " client(s) failed" : "", cfg.db, cfg.db,
      (dir / "client*.log").string());
  if (client_died.load() || (finished && failed)) {
    spdlog::error("event=client_failed log=\"{}\" msg=\"a client stopped early; see {}\"", first_failed, first_failed);
    return cli::kFailure;
  }
  return finished ? cli::kOk : cli::kInterrupted;
}

}  // namespace sparrow::server
