#include "server/try.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>
#include <vector>

#include "core/cli.h"
#include "core/error.h"
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

pid_t spawn(const std::vector<std::string>& argv, const std::string& log) {
  const pid_t pid = ::fork();
  SPARROW_CHECK(pid >= 0, "try: fork failed");
  if (pid == 0) {
    FILE* f = std::freopen(log.c_str(), "w", stderr);
    if (f) ::dup2(::fileno(stderr), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    _exit(127);
  }
  return pid;
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
    fs::remove_all(dir);
  }
  fs::create_directories(dir / "keys");
  const std::string client_bin = client_binary();

  // Keys: the server's, one per client, and the allow-list naming the clients.
  net::write_keypair((dir / "keys").string(), "server", net::generate_keypair());
  std::string allow = "# the clients of this try\n";
  for (int i = 1; i <= o.clients; ++i) {
    net::write_keypair((dir / "keys").string(), "client" + std::to_string(i), net::generate_keypair());
    allow += "client" + std::to_string(i) + ".key\n";
  }
  write(dir / "keys" / "allow.txt", allow);

  ServerConfig cfg;
  cfg.listen = "tcp://127.0.0.1:0";
  cfg.server_key = (dir / "keys" / "server.key_secret").string();
  cfg.allow = (dir / "keys" / "allow.txt").string();
  cfg.db = (dir / "server.db").string();
  cfg.model = o.model;
  cfg.compression = o.compression;
  cfg.rounds = o.rounds;
  cfg.clients_per_round = o.clients;
  cfg.quorum = o.clients;
  cfg.round_deadline_s = 300;
  cfg.eval_every = 1;
  cfg.workers = 1;
  Server server(cfg);
  write(dir / "server.toml", to_toml(cfg));  // what ran, for `sparrow-server --config` later

  std::vector<pid_t> pids;
  for (int i = 1; i <= o.clients; ++i) {
    const std::string n = std::to_string(i);
    write(dir / ("client" + n + ".toml"),
          "server = \"" + server.endpoint() + "\"\nserver_key = \"" + (dir / "keys" / "server.key").string() +
              "\"\nkey = \"" + (dir / "keys" / ("client" + n + ".key_secret")).string() + "\"\nclient_id = \"client" +
              n + "\"\nmodel = \"" + o.model + "\"\ndata = \"fashion-mnist\"\npartition = \"iid\"\nclients = " +
              std::to_string(o.shards) + "\nindex = " + std::to_string(i - 1) + "\nstate_db = \"" +
              (dir / ("client" + n + ".db")).string() + "\"\n");
    pids.push_back(spawn({client_bin, "--config", (dir / ("client" + n + ".toml")).string()},
                         (dir / ("client" + n + ".log")).string()));
  }
  std::cerr << "sparrow-server try: a server and " << o.clients << " clients on " << server.endpoint() << ", "
            << o.rounds << " rounds of " << o.model << " with " << o.compression << "; everything is in "
            << dir.string() << " (Ctrl-C stops it)\n";

  // A signal only sets `stop`; this thread turns it into Server::stop().
  std::atomic<bool> over{false};
  std::thread watcher([&] {
    while (!stop.load() && !over.load()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (stop.load()) server.stop();
  });
  int rc = cli::kOk;
  try {
    server.run();
  } catch (...) {
    over.store(true);
    watcher.join();
    for (pid_t p : pids) ::kill(p, SIGTERM);
    for (pid_t p : pids) ::waitpid(p, nullptr, 0);
    throw;
  }
  const bool finished = server.completed_rounds() >= cfg.rounds;
  over.store(true);
  watcher.join();
  // Clients exit on the server's Bye "run finished"; after a Ctrl-C they are told to stop.
  if (!finished)
    for (pid_t p : pids) ::kill(p, SIGTERM);
  int failed = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (pid_t p : pids) {
    int st = 0;
    while (::waitpid(p, &st, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > until) {
        ::kill(p, SIGKILL);
        ::waitpid(p, &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    if (code != (finished ? 0 : cli::kInterrupted)) ++failed;
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
  std::cerr << "sparrow-server try: " << server.completed_rounds() << " of " << cfg.rounds << " rounds, "
            << c.updates_accepted << " updates accepted" << accuracy
            << (failed ? ", " + std::to_string(failed) + " client(s) failed" : "") << ". Server database: " << cfg.db
            << " (sparrow-server status --db " << cfg.db << "); client logs: " << (dir / "client*.log").string()
            << "\n";
  if (!finished)
    rc = cli::kInterrupted;
  else if (failed)
    rc = cli::kFailure;
  return rc;
}

}  // namespace sparrow::server
