// sparrow-server: the aggregator daemon (docs/server.md).
//   sparrow-server --config server.toml [--insecure] [--set key=value]... [--http HOST:PORT [--http-token FILE]]
//   sparrow-server keygen --out DIR [--name NAME] [--clients N]
//   sparrow-server status --db FILE [--json]
//   sparrow-server export --db FILE [--out DIR]
//   sparrow-server try [--clients 3] [--rounds 5] [--dir sparrow-try]
#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "core/cli.h"
#include "core/json.h"
#include "core/paths.h"
#include "core/peer_text.h"
#include "core/error_text.h"
#include "core/export.h"
#include "core/error.h"
#include "core/threads.h"
#include "server/config.h"
#include "server/gateway.h"
#include "server/server.h"
#include "server/store.h"
#include "server/try.h"
#include "wire/net.h"

SPARROW_STOP_HANDLERS_AT_LOAD();

namespace {

std::atomic<sparrow::server::Server*> g_server{nullptr};

// Called by the first SIGINT/SIGTERM (core/cli.h).
void stop_server() {
  sparrow::server::Server* s = g_server.load();
  if (s) s->stop();                 // stores to an atomic flag only: async-signal-safe
  sparrow::server::stop_gateway();  // atomic stores too
}

std::atomic<bool> g_try_stop{false};
void stop_try() { g_try_stop.store(true); }

std::string num(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream os;
  os.precision(10);
  os << v;
  return os.str();
}

using sparrow::json_string;  // core/json.h
using sparrow::core::printable;

// The newest intact checkpoint's global model, as model.pt and .npy files.
int export_model(const std::string& db, const std::string& out) {
  sparrow::core::check_file_path("--db", db);
  auto store = sparrow::server::ServerStore::open_readonly(db);
  const auto run = store->run();
  SPARROW_CHECK_T(sparrow::ConfigError, run.has_value(), "export: '" << db << "' holds no run");
  // The run's identity text is TOML of the server's own keys (server/config.cc).
  const std::string model = sparrow::server::parse_server_config(run->config).model;
  const auto ck = store->latest_checkpoint();
  SPARROW_CHECK_T(sparrow::ConfigError, ck.has_value(), "export: '" << db << "' has no intact checkpoint yet");
  const auto r = sparrow::core::export_model(model, sparrow::server::deserialize_weights(ck->weights), out);
  spdlog::info("event=exported db={} round={} model={} parameters={}", db, ck->round, model, r.npy.size());
  if (!r.note.empty()) spdlog::warn("event=export_note msg=\"{}\"", r.note);
  if (!r.torchscript.empty()) std::cout << r.torchscript << "\n" << r.state_dict << "\n";
  std::cout << out << "/weights/\n";
  return 0;
}

int status(const std::string& db, bool json) {
  sparrow::core::check_file_path("--db", db);
  auto store = sparrow::server::ServerStore::open_readonly(db);
  auto run = store->run();
  auto rounds = store->rounds();
  auto clients = store->clients();
  const int64_t last = rounds.empty() ? 0 : rounds.back().round;
  auto metrics = store->metrics(last);
  if (json) {
    std::ostringstream os;
    os << "{\"run_id\":" << json_string(run ? run->run_id : "")
       << ",\"config_hash\":" << json_string(run ? run->config_hash : "") << ",\"completed_rounds\":" << last
       << ",\"rounds\":[";
    for (size_t i = 0; i < rounds.size(); ++i) {
      const auto& r = rounds[i];
      os << (i ? "," : "") << "{\"round\":" << r.round << ",\"selected\":" << r.selected << ",\"updates\":" << r.updates
         << ",\"rejected\":" << r.rejected << ",\"stale\":" << r.stale << ",\"bytes_in\":" << r.bytes_in
         << ",\"bytes_out\":" << r.bytes_out << ",\"train_loss\":" << num(r.train_loss)
         << ",\"eval_loss\":" << num(r.eval_loss) << ",\"eval_accuracy\":" << num(r.eval_accuracy)
         << ",\"seconds\":" << num(r.finished - r.started) << "}";
    }
    os << "],\"clients\":[";
    for (size_t i = 0; i < clients.size(); ++i) {
      const auto& c = clients[i];
      // Peer text (ids, software, metric names) printable() here and below (docs/security.md).
      os << (i ? "," : "") << "{\"client_id\":" << json_string(printable(c.client_id))
         << ",\"public_key\":" << json_string(c.public_key) << ",\"last_seen\":" << c.last_seen
         << ",\"last_selected\":" << c.last_selected << ",\"selected\":" << c.selected << ",\"updates\":" << c.updates
         << ",\"rejects\":" << c.rejects << ",\"num_samples\":" << c.num_samples << ",\"bytes_up\":" << c.bytes_up
         << ",\"bytes_down\":" << c.bytes_down << ",\"software\":" << json_string(printable(c.software)) << "}";
    }
    os << "],\"latest_metrics\":{";
    bool first = true;
    for (const auto& [k, v] : metrics) {
      os << (first ? "" : ",") << json_string(printable(k)) << ":" << num(v);
      first = false;
    }
    os << "}}";
    std::cout << os.str() << "\n";
    return 0;
  }
  std::cout << "run " << (run ? run->run_id : "(none)") << "  config_hash " << (run ? run->config_hash : "-")
            << "\ncompleted rounds: " << last << "\n\nrounds:\n";
  std::printf("%6s %8s %8s %8s %6s %12s %12s %10s %10s %9s\n", "round", "selected", "updates", "rejected", "stale",
              "bytes_in", "bytes_out", "train_loss", "eval_loss", "eval_acc");
  for (const auto& r : rounds)
    std::printf("%6lld %8lld %8lld %8lld %6lld %12llu %12llu %10.4f %10.4f %9.4f\n", static_cast<long long>(r.round),
                static_cast<long long>(r.selected), static_cast<long long>(r.updates),
                static_cast<long long>(r.rejected), static_cast<long long>(r.stale),
                static_cast<unsigned long long>(r.bytes_in), static_cast<unsigned long long>(r.bytes_out), r.train_loss,
                r.eval_loss, r.eval_accuracy);
  std::cout << "\nclients (" << clients.size() << "):\n";
  std::printf("%-24s %8s %8s %8s %8s %10s %12s %12s  %-40s  %s\n", "client_id", "selected", "updates", "rejects",
              "last_sel", "samples", "bytes_up", "bytes_down", "public_key", "software");
  for (const auto& c : clients)
    std::printf("%-24s %8lld %8lld %8lld %8lld %10llu %12llu %12llu  %-40s  \"%s\"\n", printable(c.client_id).c_str(),
                static_cast<long long>(c.selected), static_cast<long long>(c.updates),
                static_cast<long long>(c.rejects), static_cast<long long>(c.last_selected),
                static_cast<unsigned long long>(c.num_samples), static_cast<unsigned long long>(c.bytes_up),
                static_cast<unsigned long long>(c.bytes_down), c.public_key.empty() ? "-" : c.public_key.c_str(),
                printable(c.software).c_str());
  std::cout << "\nlatest metrics (round " << last << "):\n";
  for (const auto& [k, v] : metrics) std::cout << "  " << printable(k) << " = " << num(v) << "\n";
  return 0;
}

int keygen(const std::string& out, const std::string& name, int clients) {
  namespace net = sparrow::net;
  const std::string allow = out + "/allow.txt";
  SPARROW_CHECK_T(sparrow::ConfigError, clients <= 0 || !std::ifstream(allow).good(),
                  "keygen: '" << allow << "' exists; not overwritten");
  net::KeyPair server = net::generate_keypair();
  net::write_keypair(out, name, server);
  const std::string secret = out + "/" + name + ".key_secret", pub = out + "/" + name + ".key";
  std::cout << secret << "  (" << name << "'s secret key: keep it private, on that machine only)\n"
            << pub << "  (" << name << "'s public key: give it to the clients)\n";
  if (clients > 0) {
    net::write_client_keys(out, clients);
    for (int i = 1; i <= clients; ++i)
      std::cout << out << "/client" << i << ".key_secret  (client " << i
                << "'s secret key: give it to that client only)\n";
    std::cout << allow << "  (allow-list of the clients' public keys)\n";
  }
  // The same key names in every program: `key` is the program's own secret
  // key, `allow` the keys it admits, `server_key`/`cloud_key` the peer's public key.
  std::cout << "\n# sparrow-server config (or sparrow-edge serve's cloud config):\n"
            << "key = \"" << secret << "\"\n";
  if (clients > 0) std::cout << "allow = \"" << allow << "\"\n";
  const std::string client_key = clients > 0 ? out + "/client1.key_secret" : "CLIENT.key_secret";
  std::cout << "\n# sparrow-client config" << (clients > 1 ? " (client 1; the others use their own key file)" : "")
            << ":\nserver_key = \"" << pub << "\"\nkey = \"" << client_key << "\"\n"
            << "\n# sparrow-edge device config:\ncloud_key = \"" << pub << "\"\nkey = \"" << client_key << "\"\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  sparrow::cli::install_stop_handlers();  // done at load already (above); here for the record
  // Before any thread: received messages reuse heap blocks (core/threads.h).
  sparrow::core::tune_allocator_for_messages();
  CLI::App app{"sparrow-server: federated-learning aggregator (docs/server.md)"};
  std::string config_path;
  bool insecure = false;
  std::vector<std::string> overrides;
  std::string log_level = "info";
  app.add_option("--config,-c", config_path, "server TOML config");
  app.add_flag("--insecure", insecure, "plain TCP without CurveZMQ (logs a warning)");
  app.add_option("--set", overrides, "override a config key: key=value (repeatable)");
  std::string http, http_token;
  app.add_option("--http", http, "serve the live dashboard and /metrics on HOST:PORT (e.g. 127.0.0.1:8080)");
  app.add_option("--http-token", http_token, "file with the dashboard's bearer token (needed off loopback)");
  double http_linger = 0;
  app.add_option("--http-linger", http_linger, "keep serving the dashboard this many seconds after the run")
      ->check(CLI::Range(0.0, 86400.0));
  sparrow::cli::add_common_options(app, "sparrow-server", &log_level);

  auto* kg = app.add_subcommand("keygen", "write CurveZMQ key pairs for the server and N clients");
  std::string kg_out, kg_name = "server";
  int kg_clients = 0;
  kg->add_option("--out", kg_out, "directory")->required();
  kg->add_option("--name", kg_name, "server key name")->capture_default_str();
  kg->add_option("--clients", kg_clients, "client key pairs to write")->check(CLI::Range(0, 100000));

  auto* ex = app.add_subcommand("export", "write the global model as TorchScript (model.pt) and .npy weights");
  std::string ex_db, ex_out = "export";
  ex->add_option("--db", ex_db, "database file")->required();
  ex->add_option("--out", ex_out, "output folder")->capture_default_str();

  auto* tr = app.add_subcommand("try", "a server and N clients on this machine, keys and data shards made for you");
  sparrow::server::TryOptions try_opts;
  tr->add_option("--clients", try_opts.clients, "clients to start")->capture_default_str();
  tr->add_option("--rounds", try_opts.rounds, "rounds to run")->capture_default_str();
  tr->add_option("--dir", try_opts.dir, "folder for keys, configs, database and logs")->capture_default_str();
  tr->add_option("--model", try_opts.model, "model")->capture_default_str();
  tr->add_option("--compression", try_opts.compression, "what clients send")->capture_default_str();
  tr->add_option("--shards", try_opts.shards, "Fashion-MNIST is cut into this many shards; client i takes shard i")
      ->capture_default_str();
  tr->add_flag("--force", try_opts.force, "replace an earlier try in --dir");
  tr->add_option("--http", try_opts.http, "serve the live dashboard on HOST:PORT (loopback)");

  auto* st = app.add_subcommand("status", "print rounds, clients and the latest metrics of a server database");
  std::string st_db;
  bool st_json = false;
  st->add_option("--db", st_db, "database file")->required();
  st->add_flag("--json", st_json, "one JSON object");
  if (const int rc = sparrow::cli::parse(app, argc, argv); rc >= 0) return rc;
  sparrow::cli::setup_logging("sparrow-server", log_level);
  return sparrow::cli::run_main([&] {
    if (*kg) return keygen(kg_out, kg_name, kg_clients);
    if (*st) return status(st_db, st_json);
    if (*ex) return export_model(ex_db, ex_out);
    if (*tr) {
      sparrow::cli::on_stop(stop_try);
      return sparrow::server::run_try(try_opts, g_try_stop);
    }
    if (config_path.empty()) {
      spdlog::error(
          "event=usage_error msg=\"--config FILE is required (or a subcommand: keygen, status, export, try)\"");
      return 2;
    }
    sparrow::cli::on_stop(stop_server);
    // The command that resumes after a signal: this one (the database holds the run).
    std::string command = "sparrow-server";
    for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
    auto interrupted = [&](const std::string& what) {
      spdlog::info("event=interrupted msg=\"{}; continue with: {}\"", what, command);
      return sparrow::cli::kInterrupted;
    };
    sparrow::server::ServerConfig cfg = sparrow::server::load_server_config(config_path, overrides);
    cfg.insecure = insecure;
    if (!http.empty()) cfg.http = http;
    if (!http_token.empty()) cfg.http_token = http_token;
    // Ranges and paths before anything starts: a bad one is a config error naming its key.
    sparrow::server::validate(cfg);
    sparrow::core::check_file_path("db", cfg.db);
    if (cfg.gateway() && !cfg.upstream_state_db.empty())
      sparrow::core::check_file_path("upstream_state_db", cfg.upstream_state_db);
    if (!cfg.insecure) {
      sparrow::core::check_input_file("key", cfg.server_key);
      sparrow::core::check_input_path("allow", cfg.allow);
      if (cfg.gateway()) {
        sparrow::core::check_input_file("upstream_server_key", cfg.upstream_server_key);
        sparrow::core::check_input_file("upstream_key", cfg.upstream_key);
      }
    }
    if (!cfg.http_token.empty()) sparrow::core::check_input_file("http_token", cfg.http_token);
    if (!cfg.eval_data.empty()) sparrow::core::check_data_folder("eval_data", cfg.eval_data);
    if (cfg.eval_every > 0 && cfg.eval_data.empty()) sparrow::core::check_data_folder("data_dir", cfg.data_dir);
    auto check_key = [&](const char* key, const std::string& file) {
      if (const std::string w = cfg.insecure ? "" : sparrow::core::secret_file_warning(key, file); !w.empty())
        spdlog::warn("event=key_permissions msg=\"{}\"", w);
    };
    check_key("key", cfg.server_key);
    if (cfg.gateway()) check_key("upstream_key", cfg.upstream_key);
    // The decode/aggregate pool runs cfg.workers threads: each gets its share.
    sparrow::core::configure_threads(cfg.workers);
    spdlog::info("event=threads msg=\"{}\"", sparrow::core::threads_summary(cfg.workers));
    spdlog::info("event=allocator malloc={}", sparrow::core::allocator_tuned_for_messages() ? "reuse" : "system");
    if (const std::string w = sparrow::core::blas_warning(); !w.empty()) spdlog::warn("event=blas msg=\"{}\"", w);
    if (sparrow::cli::stop_requested()) return interrupted("stopped before the server started");
    sparrow::server::Server server(cfg);  // builds the model, opens the database, loads evaluation data
    g_server.store(&server);
    if (sparrow::cli::stop_requested()) {
      g_server.store(nullptr);
      return interrupted("stopped before the first round (the database holds the run)");
    }
    bool done = false;
    if (cfg.gateway()) {
      spdlog::info(
          "event=gateway upstream={} id={} msg=\"each round of the root runs here with this server's clients\"",
          cfg.upstream, cfg.upstream_id);
      done = sparrow::server::run_gateway(server, cfg);
    } else {
      server.run();
      done = server.completed_rounds() >= cfg.rounds;
    }
    if (http_linger > 0 && !server.dashboard_url().empty() && !sparrow::cli::stop_requested()) {
      // The run is over (socket closed, database written); its final state
      // stays on the dashboard for a while. A signal ends it.
      spdlog::info("event=http_linger url={} seconds={}", server.dashboard_url(), http_linger);
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(http_linger);
      while (!sparrow::cli::stop_requested() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    g_server.store(nullptr);
    // Stopped by a signal before the last round: interrupted (the last
    // completed round is on disk; the same config resumes after it).
    if (done) return sparrow::cli::kOk;
    return interrupted("stopped after round " + std::to_string(server.completed_rounds()) + " of " +
                       std::to_string(cfg.rounds));
  });
}
