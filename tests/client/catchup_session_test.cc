// sparrow-client applies the catch-up tasks of protocol 1.9 (docs/protocol.md,
// Task): a Chain adds its deltas in order to the model of base_round, a Patch
// sets the changed positions' values; a chain or a patch that does not fit the
// model is refused with an Error and leaves the held model as it was.
#include "tests/sparrow_test.h"

#include <chrono>
#include <memory>
#include <optional>
#include <zmq.hpp>

#include "client/session.h"
#include "client/trainer.h"
#include "compression/compressor.h"
#include "core/models.h"
#include "federation/catchup.h"
#include "tests/client/session_fixture.h"
#include "wire/net.h"

using namespace sparrow;
using client::ClientSession;
using client::Weights;
using namespace sparrow::testing::client_fixture;  // NOLINT(google-build-using-namespace)

namespace {

constexpr uint64_t kModelSeed = 7;

core::Dataset make_data(int64_t n = 16) {
  core::Dataset d;
  d.x = at::sin(at::arange(n * 784).to(at::kFloat) * 0.37f).reshape({n, 1, 28, 28});
  d.y = at::arange(n, at::kLong).remainder(10);
  return d;
}

std::vector<wire::NamedTensor> dense(const Weights& w) {
  std::vector<wire::NamedTensor> out;
  for (const auto& [k, v] : w) out.push_back({k, compression::dense_encoded(v)});
  return out;
}

Weights decode(const std::vector<wire::NamedTensor>& ts) {
  Weights w;
  for (const auto& t : ts) w[t.name] = compression::decode(t.tensor);
  return w;
}

Weights model_weights(uint64_t seed) { return client::get_weights(*core::make_model("mlp", seed)); }

wire::TrainSettings train_settings() {
  wire::TrainSettings t;
  t.local_epochs = 1;
  t.batch_size = 8;
  t.lr = 0.05;
  return t;
}

// What LocalTrainer gives for this model, the data and the seed: the update
// shows the model the client trained from.
Weights expected_delta(const Weights& global, uint64_t seed) {
  client::TrainConfig c;
  c.local_epochs = 1;
  c.batch_size = 8;
  c.lr = 0.05;
  client::LocalTrainer t(core::make_model("mlp", 0), c);
  const core::Dataset d = make_data();
  return t.train(global, d.x, d.y, seed).delta;
}

bool all_close(const Weights& a, const Weights& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, v] : a)
    if (!b.count(k) || !at::allclose(v.cpu(), b.at(k).cpu(), 1e-5, 1e-6)) return false;
  return true;
}

struct FakeServer {
  zmq::context_t ctx;
  zmq::socket_t router{ctx, zmq::socket_type::router};
  std::string endpoint, peer;
  FakeServer() {
    net::set_limits(router, uint64_t{64} << 20);
    router.bind("tcp://127.0.0.1:*");
    endpoint = router.get(zmq::sockopt::last_endpoint);
  }
  template <class T>
  T expect(int timeout_ms = 20000) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < until) {
      zmq::pollitem_t item{static_cast<void*>(router), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, std::chrono::milliseconds(100)) <= 0) continue;
      zmq::message_t id, body;
      REQUIRE(router.recv(id));
      REQUIRE(router.recv(body));
      peer = id.to_string();
      wire::Message m = wire::parse(body.data(), body.size());
      if (auto* t = std::get_if<T>(&m.body)) return *t;
      if (auto* h = std::get_if<wire::Heartbeat>(&m.body)) {
        send(wire::Heartbeat{h->round});
        continue;
      }
      const auto* err = std::get_if<wire::ErrorBody>(&m.body);
      FAIL("expected another message, got " << std::string(wire::body_name(m.body)) << ": "
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
};

wire::Task task(uint64_t round, wire::ModelEncoding enc, uint64_t base, uint64_t seed) {
  wire::Task t;
  t.round = round;
  t.model_encoding = enc;
  t.base_round = base;
  t.train = train_settings();
  t.compression = "none";
  t.seed = seed;
  return t;
}

Weights constant_like(const Weights& w, float v) {
  Weights out;
  for (const auto& [k, x] : w) out[k] = at::full_like(x, v);
  return out;
}

}  // namespace

TEST_CASE("session: Chain and Patch tasks bring the held model up to B_{r-1}, and bad ones change nothing") {
  const std::string dir = fresh_dir("sparrow_catchup_session_test", "chain");
  FakeServer server;
  ClientSession session(session_config(server.endpoint, dir, "alice", 200, 100), make_data());
  Running run(session);
  const wire::Hello hello = server.expect<wire::Hello>();
  wire::Welcome w;
  w.run_id = "run-1";
  w.heartbeat_ms = 200;
  w.max_message_bytes = uint64_t{64} << 20;
  w.model_seed = kModelSeed;
  server.send(w);
  (void)hello;

  // Round 4, a Chain from the seed-built B_0: B_3 = B_0 + C_1 + C_2 + C_3.
  const Weights b0 = model_weights(kModelSeed);
  wire::Task t4 = task(4, wire::ModelEncoding::kChain, 0, 41);
  Weights b3 = b0;
  for (float step : {0.01f, -0.02f, 0.005f}) {
    const Weights c = constant_like(b0, step);
    t4.chain.push_back(dense(c));
    Weights next;
    for (const auto& [k, v] : b3) next[k] = v + c.at(k);
    b3 = next;
  }
  server.send(t4);
  wire::ModelUpdate u = server.expect<wire::ModelUpdate>();
  CHECK(u.round == 4);
  CHECK(all_close(decode(u.tensors), expected_delta(b3, 41)));
  CHECK(session.last_round() == 3);
  server.send(wire::Ack{4});

  // Round 7, a Patch from B_3: positions 2, 5 and 7 of fc1.bias set to B_6's values.
  Weights b6;
  for (const auto& [k, v] : b3) b6[k] = v.clone();
  at::Tensor bias = b6.at("fc1.bias");
  std::vector<uint32_t> changed(static_cast<size_t>(bias.numel()), 0);
  for (int64_t i : {2, 5, 7}) {
    bias[i] = 0.25f * static_cast<float>(i);
    changed[static_cast<size_t>(i)] = 5;
  }
  wire::Task t7 = task(7, wire::ModelEncoding::kPatch, 3, 71);
  const at::Tensor bc = bias.contiguous();
  t7.weights.push_back(
      {"fc1.bias", *federation::make_patch(bc.sizes().vec(), changed.data(), bc.data_ptr<float>(), bc.numel(), 3)});
  const wire::Task good_patch = t7;
  server.send(t7);
  u = server.expect<wire::ModelUpdate>();
  CHECK(u.round == 7);
  CHECK(all_close(decode(u.tensors), expected_delta(b6, 71)));
  CHECK(session.last_round() == 6);
  server.send(wire::Ack{7});

  // A patch of fc1.bias sent as fc3.bias (another shape), and a chain with a
  // step naming no parameter: each refused, the held B_6 untouched.
  wire::Task bad_patch = good_patch;
  bad_patch.round = 9;
  bad_patch.base_round = 6;
  bad_patch.weights[0].name = "fc3.bias";
  server.send(bad_patch);
  wire::ErrorBody e = server.expect<wire::ErrorBody>();
  CHECK(e.round == std::optional<uint64_t>(9));
  wire::Task bad_chain = task(9, wire::ModelEncoding::kChain, 6, 91);
  bad_chain.chain = {dense(constant_like(b0, 0.5f)), {{"nope", compression::dense_encoded(at::ones({3}))}}};
  server.send(bad_chain);
  e = server.expect<wire::ErrorBody>();
  CHECK(e.round == std::optional<uint64_t>(9));
  CHECK(e.message.find("nope") != std::string::npos);
  // The held model is still B_6: an empty Delta against it trains from it.
  server.send(task(7, wire::ModelEncoding::kDelta, 6, 72));
  u = server.expect<wire::ModelUpdate>();
  CHECK(all_close(decode(u.tensors), expected_delta(b6, 72)));
  server.send(wire::Bye{"run finished"});
  run.join();
  REQUIRE_FALSE(run.error);
}
