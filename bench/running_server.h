#pragma once
// A sparrow::server::Server running on its own thread, for benchmarks that
// drive it from the same process; stop() and join on destruction.

#include <atomic>
#include <string>
#include <thread>

#include "server/server.h"

namespace sparrow::bench {

class RunningServer {
 public:
  RunningServer(server::ServerConfig cfg, server::Weights w) : server_(std::move(cfg), std::move(w)) { start(); }
  explicit RunningServer(server::ServerConfig cfg) : server_(std::move(cfg)) { start(); }
  ~RunningServer() {
    server_.stop();
    if (thread_.joinable()) thread_.join();
  }
  RunningServer(const RunningServer&) = delete;
  RunningServer& operator=(const RunningServer&) = delete;
  server::Server& get() { return server_; }
  bool done() const { return done_.load(); }
  const std::string& error() const { return error_; }

 private:
  void start() {
    thread_ = std::thread([this] {
      try {
        server_.run();
      } catch (const std::exception& e) {
        error_ = e.what();
      }
      done_ = true;
    });
  }
  server::Server server_;
  std::thread thread_;
  std::atomic<bool> done_{false};
  std::string error_;
};

}  // namespace sparrow::bench
