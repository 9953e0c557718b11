// The hand-driven server that server_test.cc and async_server_test.cc share:
// the tiny model's weights, a dense encoding, the server run on a thread and
// a fake client speaking the protocol over ZeroMQ, so that each test decides
// the order of arrivals itself.
#pragma once

#include "tests/sparrow_test.h"

#include <chrono>
#include <cstring>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>
#include <zmq.hpp>

#include "compression/encoded.h"
#include "server/server.h"
#include "wire/net.h"
#include "wire/wire.h"

namespace sparrow::server_fixture {

// A database path of the test's own (tests run in parallel in one directory),
// with any file a previous run left removed.
inline std::string fresh_db_file(const std::string& prefix, const std::string& name) {
  const std::string p = prefix + name + ".db";
  for (const char* s : {"", "-wal", "-shm"}) std::filesystem::remove(p + s);
  return p;
}

inline server::Weights tiny_weights() {
  server::Weights w;
  w["fc.weight"] = at::arange(12, at::kFloat).reshape({4, 3}) / 10;
  w["fc.bias"] = at::ones({4});
  return w;
}

inline compression::Encoded dense(const at::Tensor& t) {
  at::Tensor c = t.contiguous().to(at::kFloat);
  compression::Encoded e;
  e.shape = c.sizes().vec();
  e.values.resize(static_cast<size_t>(c.numel()) * 4);
  std::memcpy(e.values.data(), c.data_ptr<float>(), e.values.size());
  return e;
}

inline wire::Message message(wire::Body b) {
  wire::Message m;
  m.body = std::move(b);
  return m;
}

// Runs server.run() on a thread; stops and joins on scope exit (also when a
// REQUIRE fails).
struct Running {
  server::Server& server;
  std::thread thread;
  std::exception_ptr error;
  explicit Running(server::Server& s) : server(s) {
    thread = std::thread([this] {
      try {
        server.run();
      } catch (...) {
        error = std::current_exception();
      }
    });
  }
  void join() {
    if (thread.joinable()) thread.join();
  }
  ~Running() {
    server.stop();
    join();
  }
};

// A DEALER speaking the protocol by hand. A wait of ms < 0 is wait_ms.
struct FakeClient {
  zmq::socket_t s;
  std::string id;
  std::string model = "tiny";
  int wait_ms = 5000;
  FakeClient(zmq::context_t& ctx, const std::string& endpoint, std::string client_id,
             const net::KeyPair* keys = nullptr, const std::string& server_public = "")
      : s(ctx, zmq::socket_type::dealer), id(std::move(client_id)) {
    if (keys) net::make_curve_client(s, *keys, server_public);
    s.set(zmq::sockopt::linger, 0);
    s.connect(endpoint);
  }
  void send(const wire::Message& m) { net::send(s, m); }
  void send_raw(const std::string& bytes) { s.send(zmq::buffer(bytes), zmq::send_flags::none); }
  std::optional<wire::Message> next(int ms = -1) {
    if (ms < 0) ms = wait_ms;
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      auto m = net::receive(s, static_cast<int>(left.count()));
      if (!m) return std::nullopt;
      if (std::holds_alternative<wire::Heartbeat>(m->body)) continue;
      return m;
    }
  }
  template <class T>
  T expect(int ms = -1) {
    auto m = next(ms);
    REQUIRE_MESSAGE(m.has_value(), id << ": nothing received");
    if (auto* e = std::get_if<wire::ErrorBody>(&m->body)) FAIL_CHECK(id << ": unexpected Error: " << e->message);
    REQUIRE_MESSAGE(std::holds_alternative<T>(m->body), id << ": got " << std::string(wire::body_name(m->body)));
    return std::get<T>(m->body);
  }
  wire::ErrorBody expect_error(int ms = -1) {
    auto m = next(ms);
    REQUIRE_MESSAGE(m.has_value(), id << ": no Error received");
    REQUIRE_MESSAGE(std::holds_alternative<wire::ErrorBody>(m->body),
                    id << ": got " << std::string(wire::body_name(m->body)));
    return std::get<wire::ErrorBody>(m->body);
  }
  // last_round nullopt: the client holds no model, its first task carries
  // the whole model.
  wire::Welcome hello(uint64_t digest, uint64_t samples = 10, std::optional<uint64_t> last_round = 0) {
    wire::Hello h;
    h.client_id = id;
    h.num_samples = samples;
    h.model = model;
    h.model_digest = digest;
    h.last_round = last_round;
    h.software = "fake";
    send(message(h));
    return expect<wire::Welcome>();
  }
  void update(uint64_t round, const server::Weights& delta, uint64_t samples,
              std::vector<std::pair<std::string, double>> metrics = {{"train_loss", 1.0}}) {
    wire::ModelUpdate u;
    u.round = round;
    u.client_id = id;
    u.num_samples = samples;
    for (const auto& [k, v] : delta) u.tensors.push_back({k, dense(v)});
    u.metrics = std::move(metrics);
    send(message(u));
  }
};

}  // namespace sparrow::server_fixture
