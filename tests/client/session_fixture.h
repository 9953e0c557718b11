#pragma once
// What the sparrow-client session tests share around their scripted server
// (session_test.cc: a real ROUTER socket; session_replay_test.cc: mem://): a
// folder of the test's own, the client's config, and the session run on its
// own thread. Include after tests/sparrow_test.h.

#include <unistd.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>

#include "client/session.h"

namespace sparrow::testing::client_fixture {

// An empty folder <tmp>/<prefix>_<name>_<pid>: tests run in parallel.
inline std::string fresh_dir(const std::string& prefix, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path p = fs::temp_directory_path() / (prefix + "_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// sparrow-client without CURVE on the "mlp" model, its state in
// dir/state.db, reconnecting within `backoff_max_ms` so a test never waits.
inline client::SessionConfig session_config(const std::string& endpoint, const std::string& dir, const std::string& id,
                                            uint32_t heartbeat_ms, uint32_t backoff_max_ms) {
  client::SessionConfig c;
  c.server = endpoint;
  c.insecure = true;
  c.client_id = id;
  c.model = "mlp";
  c.state_db = dir + "/state.db";
  c.heartbeat_ms = heartbeat_ms;
  c.backoff_initial_ms = 20;
  c.backoff_max_ms = backoff_max_ms;
  return c;
}

// run() on its own thread; what it returned or threw is kept. Destroyed while
// the session still runs, it stops it and waits.
struct Running {
  client::ClientSession& session;
  std::optional<bool> result;
  std::exception_ptr error;
  std::thread th;
  explicit Running(client::ClientSession& s) : session(s) {
    th = std::thread([this] {
      try {
        result = session.run();
      } catch (...) {
        error = std::current_exception();
      }
    });
  }
  ~Running() {
    if (th.joinable()) {
      session.stop();
      th.join();
    }
  }
  Running(const Running&) = delete;
  Running& operator=(const Running&) = delete;
  void join() { th.join(); }
};

}  // namespace sparrow::testing::client_fixture
