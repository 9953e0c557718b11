#pragma once
// Shared fixtures of the multi-process integration tests: the real binaries'
// paths, run folders, keys and configs, the server database read back, and a
// raw CurveZMQ peer for attacks. Included by each tests/integration/*_test.cc.
#include "tests/sparrow_test.h"

#include <torch/script.h>
// (sparrow_test.h first: glog/doctest CHECK clash.)

#include <sqlite3.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "compression/state.h"
#include "core/models.h"
#include "tests/integration/process.h"
#include "wire/net.h"
#include "wire/wire.h"

namespace sparrow::testing::integ {

namespace fs = std::filesystem;
using sparrow::testing::Process;
using namespace std::chrono_literals;
using Weights = std::map<std::string, at::Tensor>;

inline const std::string kBin = SPARROW_BIN_DIR;
inline const std::string kServerBin = kBin + "/sparrow-server";
inline const std::string kClientBin = kBin + "/sparrow-client";

// A fresh directory unique to one test case (tests run in parallel).
inline std::string fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("sparrow_integ_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  // One intra-op thread per child: 10 clients share two cores.
  ::setenv("OMP_NUM_THREADS", "1", 1);
  return d.string();
}

// Runs a short command to completion; its exit code (-1 on timeout).
inline int run_tool(const std::vector<std::string>& argv, const std::string& log) {
  Process p(argv, log);
  auto rc = p.wait(60s);
  return rc ? *rc : -1;
}

// Keys: DIR/keys/server.key(_secret), client1..N, allow.txt listing them.
inline void keygen(const std::string& dir, int clients) {
  REQUIRE(run_tool({kServerBin, "keygen", "--out", dir + "/keys", "--clients", std::to_string(clients)},
                   dir + "/keygen.log") == 0);
  // keygen prints the config lines the server and client configs below use,
  // with the key names those configs take.
  std::ifstream in(dir + "/keygen.log");
  const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const std::string& line :
       {"key = \"" + dir + "/keys/server.key_secret\"", "allow = \"" + dir + "/keys/allow.txt\"",
        "server_key = \"" + dir + "/keys/server.key\"", "key = \"" + dir + "/keys/client1.key_secret\"",
        "cloud_key = \"" + dir + "/keys/server.key\""})
    CHECK_MESSAGE(log.find("\n" + line + "\n") != std::string::npos, line);
}

inline void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

// Server TOML: CURVE keys from DIR/keys, database DIR/server.db, plus `extra`.
inline std::string server_toml(const std::string& dir, const std::string& extra) {
  const std::string path = dir + "/server.toml";
  write_file(path,
             "listen = \"tcp://127.0.0.1:*\"\n"
             "key = \"" +
                 dir + "/keys/server.key_secret\"\nallow = \"" + dir + "/keys/allow.txt\"\ndb = \"" + dir +
                 "/server.db\"\nmodel = \"mlp\"\n" + extra);
  return path;
}

inline std::unique_ptr<Process> start_server(const std::string& dir, const std::string& log,
                                             const std::vector<std::string>& sets = {}) {
  std::vector<std::string> argv = {kServerBin, "--config", dir + "/server.toml"};
  for (const auto& s : sets) {
    argv.push_back("--set");
    argv.push_back(s);
  }
  return std::make_unique<Process>(argv, log);
}

// The resolved endpoint from the server's "event=listening endpoint=..." line.
inline std::string server_endpoint(Process& server) {
  REQUIRE(server.wait_for_log("event=listening", 60s));
  std::smatch m;
  const std::string log = server.log();
  REQUIRE(std::regex_search(log, m, std::regex("event=listening endpoint=(\\S+)")));
  return m[1];
}

// Client i (1-based) with key clientI, Fashion-MNIST shard `index` of `shards`.
inline std::unique_ptr<Process> start_client(const std::string& dir, int i, const std::string& endpoint, int shards,
                                             int index, const std::string& key_file = "",
                                             const std::vector<std::string>& args = {}) {
  const std::string path = dir + "/client" + std::to_string(i) + ".toml";
  write_file(path, "server = \"" + endpoint + "\"\nserver_key = \"" + dir + "/keys/server.key\"\nkey = \"" +
                       (key_file.empty() ? dir + "/keys/client" + std::to_string(i) + ".key_secret" : key_file) +
                       "\"\nclient_id = \"c" + std::to_string(i) + "\"\nmodel = \"mlp\"\ndata = \"fashion-mnist\"\n" +
                       "partition = \"iid\"\nclients = " + std::to_string(shards) +
                       "\nindex = " + std::to_string(index) + "\nstate_db = \"" + dir + "/client" + std::to_string(i) +
                       ".db\"\nbackoff_initial_ms = 100\nbackoff_max_ms = 1000\n");
  std::vector<std::string> argv = {kClientBin, "--config", path};
  argv.insert(argv.end(), args.begin(), args.end());
  return std::make_unique<Process>(argv, dir + "/client" + std::to_string(i) + ".log");
}

// ---- the server's database (schema: server/store.cc) --------------------------

struct RoundInfo {
  int64_t round = 0, selected = 0, updates = 0, rejected = 0, stale = 0;
  uint64_t bytes_in = 0, bytes_out = 0;
  double eval_loss = std::numeric_limits<double>::quiet_NaN();
  double eval_accuracy = std::numeric_limits<double>::quiet_NaN();
};

struct ClientInfo {
  int64_t updates = 0, last_seen = 0;
  uint64_t bytes_up = 0, bytes_down = 0, samples = 0;
};

class Db {
 public:
  explicit Db(const std::string& path) {
    REQUIRE(sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READONLY, nullptr) == SQLITE_OK);
    sqlite3_busy_timeout(db_, 5000);
  }
  ~Db() { sqlite3_close(db_); }
  Db(const Db&) = delete;
  Db& operator=(const Db&) = delete;

  std::vector<RoundInfo> rounds() {
    std::vector<RoundInfo> out;
    sqlite3_stmt* st = nullptr;
    REQUIRE(sqlite3_prepare_v2(db_,
                               "SELECT round, selected, updates, rejected, eval_loss, eval_accuracy, stale, bytes_in, "
                               "bytes_out FROM rounds ORDER BY round",
                               -1, &st, nullptr) == SQLITE_OK);
    while (sqlite3_step(st) == SQLITE_ROW) {
      RoundInfo r;
      r.round = sqlite3_column_int64(st, 0);
      r.selected = sqlite3_column_int64(st, 1);
      r.updates = sqlite3_column_int64(st, 2);
      r.rejected = sqlite3_column_int64(st, 3);
      if (sqlite3_column_type(st, 4) != SQLITE_NULL) r.eval_loss = sqlite3_column_double(st, 4);
      if (sqlite3_column_type(st, 5) != SQLITE_NULL) r.eval_accuracy = sqlite3_column_double(st, 5);
      r.stale = sqlite3_column_int64(st, 6);
      r.bytes_in = static_cast<uint64_t>(sqlite3_column_int64(st, 7));
      r.bytes_out = static_cast<uint64_t>(sqlite3_column_int64(st, 8));
      out.push_back(r);
    }
    sqlite3_finalize(st);
    return out;
  }

  // Client rows by id: what the dashboard's client table shows.
  std::map<std::string, ClientInfo> clients() {
    std::map<std::string, ClientInfo> out;
    sqlite3_stmt* st = nullptr;
    REQUIRE(sqlite3_prepare_v2(db_,
                               "SELECT client_id, updates, last_seen, bytes_up, bytes_down, num_samples FROM clients",
                               -1, &st, nullptr) == SQLITE_OK);
    while (sqlite3_step(st) == SQLITE_ROW) {
      ClientInfo c;
      c.updates = sqlite3_column_int64(st, 1);
      c.last_seen = sqlite3_column_int64(st, 2);
      c.bytes_up = static_cast<uint64_t>(sqlite3_column_int64(st, 3));
      c.bytes_down = static_cast<uint64_t>(sqlite3_column_int64(st, 4));
      c.samples = static_cast<uint64_t>(sqlite3_column_int64(st, 5));
      out[reinterpret_cast<const char*>(sqlite3_column_text(st, 0))] = c;
    }
    sqlite3_finalize(st);
    return out;
  }

  // The checkpointed global model bytes after `round` ("" when not stored).
  std::string checkpoint(int64_t round) {
    sqlite3_stmt* st = nullptr;
    REQUIRE(sqlite3_prepare_v2(db_, "SELECT weights FROM checkpoints WHERE round = ?", -1, &st, nullptr) == SQLITE_OK);
    sqlite3_bind_int64(st, 1, round);
    std::string out;
    if (sqlite3_step(st) == SQLITE_ROW)
      out.assign(static_cast<const char*>(sqlite3_column_blob(st, 0)),
                 static_cast<size_t>(sqlite3_column_bytes(st, 0)));
    sqlite3_finalize(st);
    return out;
  }

 private:
  sqlite3* db_ = nullptr;
};

// ---- raw protocol peer for the attacks ------------------------------------------

inline Weights initial_weights(uint64_t seed) {
  auto m = sparrow::core::make_model("mlp", seed);
  Weights w;
  for (const auto& p : m->named_parameters(/*recurse=*/true)) w[p.key()] = p.value().detach().clone();
  return w;
}

inline sparrow::compression::Encoded dense_f32(const at::Tensor& t) {
  sparrow::compression::Encoded e;
  e.format = sparrow::compression::Format::kDense;
  e.shape = t.sizes().vec();
  e.value_type = sparrow::compression::ValueType::kF32;
  const at::Tensor c = t.to(at::kFloat).contiguous();
  e.values.resize(static_cast<size_t>(c.numel()) * 4);
  std::memcpy(e.values.data(), c.data_ptr<float>(), e.values.size());
  return e;
}

inline sparrow::wire::Message as_message(sparrow::wire::Body body) {
  sparrow::wire::Message m;
  m.body = std::move(body);
  return m;
}

class RawPeer {
 public:
  RawPeer(const std::string& endpoint, const std::string& dir) : endpoint_(endpoint), dir_(dir) { connect(); }

  void connect() {
    sock_ = zmq::socket_t(ctx_, zmq::socket_type::dealer);
    sparrow::net::make_curve_client(sock_, sparrow::net::load_keypair(dir_ + "/keys/client1.key_secret"),
                                    sparrow::net::load_public_key(dir_ + "/keys/server.key"));
    sock_.set(zmq::sockopt::linger, 0);
    sock_.connect(endpoint_);
  }

  void send_bytes(const std::string& bytes) { REQUIRE(sock_.send(zmq::buffer(bytes), zmq::send_flags::none)); }
  void send(const sparrow::wire::Message& m) { send_bytes(sparrow::wire::serialize(m)); }

  std::optional<sparrow::wire::Message> receive(int timeout_ms) { return sparrow::net::receive(sock_, timeout_ms); }

  // Hello, then waits for Welcome and the Task of the open round.
  sparrow::wire::Task hello_until_task(uint64_t digest) {
    sparrow::wire::Hello h;
    h.client_id = "attacker";
    h.num_samples = 600;
    h.model = "mlp";
    h.model_digest = digest;
    h.software = "integration-test";
    send(as_message(h));
    bool welcomed = false;
    const auto until = std::chrono::steady_clock::now() + 60s;
    auto beat = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() < until) {
      // Heartbeats while the other clients start (seconds on a loaded
      // machine): the server drops a session silent for 3 heartbeat periods.
      if (std::chrono::steady_clock::now() >= beat) {
        send(as_message(sparrow::wire::Heartbeat{0}));
        beat = std::chrono::steady_clock::now() + 300ms;
      }
      auto m = receive(300);
      if (!m) continue;
      if (std::holds_alternative<sparrow::wire::Welcome>(m->body)) welcomed = true;
      if (auto* t = std::get_if<sparrow::wire::Task>(&m->body)) {
        CHECK(welcomed);
        return *t;
      }
    }
    FAIL("no Task within 60 s");
    return {};
  }

  // Sends `bytes` and returns the Error code of the reply (kUnknown + FAIL on
  // anything else). Heartbeats are skipped.
  std::optional<sparrow::wire::ErrorCode> error_for(const std::string& bytes, int timeout_ms = 10000) {
    send_bytes(bytes);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < until) {
      auto m = receive(200);
      if (!m) continue;
      if (auto* e = std::get_if<sparrow::wire::ErrorBody>(&m->body)) return e->code;
      if (std::holds_alternative<sparrow::wire::Heartbeat>(m->body)) continue;
      FAIL_CHECK("expected an Error, got " << sparrow::wire::body_name(m->body));
      return sparrow::wire::ErrorCode::kUnknown;
    }
    return std::nullopt;
  }

 private:
  zmq::context_t ctx_;
  zmq::socket_t sock_;
  std::string endpoint_, dir_;
};

inline std::string log_tail(Process& p) {
  const std::string s = p.log();
  return s.size() > 3000 ? s.substr(s.size() - 3000) : s;
}

}  // namespace sparrow::testing::integ
