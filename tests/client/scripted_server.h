#pragma once
// The scripted server of the sparrow-client session tests that talk to a real
// ROUTER socket (session_test.cc, catchup_session_test.cc), with what they
// share around it: the small "mlp" data, dense task tensors, the update a
// LocalTrainer would send, and a tolerance check. Include after
// tests/sparrow_test.h.

#include <zmq.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "client/trainer.h"
#include "compression/compressor.h"
#include "core/models.h"
#include "wire/net.h"

namespace sparrow::testing::scripted_server {

using client::Weights;

// The model seed the Welcome names: the client builds round 0 from it.
constexpr uint64_t kModelSeed = 7;

// Small deterministic data that fits "mlp": 16 samples of 1x28x28.
inline core::Dataset make_data(int64_t n = 16) {
  core::Dataset d;
  d.x = at::sin(at::arange(n * 784).to(at::kFloat) * 0.37f).reshape({n, 1, 28, 28});
  d.y = at::arange(n, at::kLong).remainder(10);
  return d;
}

inline std::vector<wire::NamedTensor> dense(const Weights& w) {
  auto none = compression::make_compressor("none");
  std::vector<wire::NamedTensor> out;
  for (const auto& [k, v] : w) {
    compression::State s;
    out.push_back({k, none->encode(v.contiguous(), s, {})});
  }
  return out;
}

inline Weights decode(const std::vector<wire::NamedTensor>& ts) {
  Weights w;
  for (const auto& t : ts) w[t.name] = compression::decode(t.tensor);
  return w;
}

inline Weights model_weights(uint64_t seed) { return client::get_weights(*core::make_model("mlp", seed)); }

inline wire::TrainSettings train_settings() {
  wire::TrainSettings t;
  t.local_epochs = 1;
  t.batch_size = 8;
  t.lr = 0.05;
  return t;
}

inline client::TrainConfig train_config() {
  client::TrainConfig c;
  c.local_epochs = 1;
  c.batch_size = 8;
  c.lr = 0.05;
  return c;
}

// What LocalTrainer gives for the same model, data and seed.
inline Weights expected_delta(const Weights& global, uint64_t seed) {
  client::LocalTrainer t(core::make_model("mlp", 0), train_config());
  const core::Dataset d = make_data();
  return t.train(global, d.x, d.y, seed).delta;
}

inline bool all_close(const Weights& a, const Weights& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, v] : a)
    if (!b.count(k) || !at::allclose(v.cpu(), b.at(k).cpu(), 1e-5, 1e-6)) return false;
  return true;
}

// A real ROUTER socket the test drives (plain, or CURVE with a ZAP allow-list).
struct FakeServer {
  zmq::context_t ctx;
  std::unique_ptr<net::ZapHandler> zap;
  zmq::socket_t router{ctx, zmq::socket_type::router};
  std::string endpoint;
  std::string peer;      // routing id of the last message
  std::string peer_key;  // its CURVE key
  int heartbeats = 0;

  explicit FakeServer(const net::KeyPair* server_keys = nullptr, std::set<std::string> allowed = {}) {
    if (server_keys) {
      zap = std::make_unique<net::ZapHandler>(ctx, std::move(allowed));
      net::make_curve_server(router, *server_keys);
    }
    net::set_limits(router, uint64_t{64} << 20);
    router.bind("tcp://127.0.0.1:*");
    endpoint = router.get(zmq::sockopt::last_endpoint);
  }
  ~FakeServer() { router.close(); }

  std::optional<wire::Message> recv(int timeout_ms) {
    zmq::pollitem_t item{static_cast<void*>(router), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(timeout_ms)) <= 0) return std::nullopt;
    zmq::message_t id, body;
    REQUIRE(router.recv(id));
    REQUIRE(router.recv(body));
    peer = id.to_string();
    peer_key = net::peer_key(body);
    return wire::parse(body.data(), body.size());
  }

  // The next message of type T; heartbeats are answered (when `answer`) and
  // skipped. Fails the test after timeout_ms.
  template <class T>
  T expect(int timeout_ms = 10000, bool answer = true) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < until) {
      auto m = recv(100);
      if (!m) continue;
      if (auto* t = std::get_if<T>(&m->body)) return *t;
      if (auto* h = std::get_if<wire::Heartbeat>(&m->body)) {
        ++heartbeats;
        if (answer) send(wire::Heartbeat{h->round});
        continue;
      }
      const auto* err = std::get_if<wire::ErrorBody>(&m->body);
      FAIL("expected another message, got " << std::string(wire::body_name(m->body)) << ": "
                                            << (err ? err->message : std::string()));
    }
    FAIL("timed out waiting for a message");
    return T{};
  }

  void send(wire::Body body) {
    wire::Message m;
    m.body = std::move(body);
    REQUIRE(net::send_to(router, peer, m, false));
  }

  void welcome(uint32_t heartbeat_ms = 200, const std::string& run = "run-1") {
    wire::Welcome w;
    w.run_id = run;
    w.heartbeat_ms = heartbeat_ms;
    w.max_message_bytes = uint64_t{64} << 20;
    w.model_seed = kModelSeed;
    send(w);
  }
};

}  // namespace sparrow::testing::scripted_server
