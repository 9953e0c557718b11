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
#include "tests/client/scripted_server.h"
#include "tests/client/session_fixture.h"
#include "wire/net.h"

using namespace sparrow;
using client::ClientSession;
using client::Weights;
using namespace sparrow::testing::client_fixture;   // NOLINT(google-build-using-namespace)
using namespace sparrow::testing::scripted_server;  // NOLINT(google-build-using-namespace)

namespace {

// The waits of this test (the shared default is 10 s).
constexpr int kWaitMs = 20000;

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
  const wire::Hello hello = server.expect<wire::Hello>(kWaitMs);
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
  wire::ModelUpdate u = server.expect<wire::ModelUpdate>(kWaitMs);
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
  u = server.expect<wire::ModelUpdate>(kWaitMs);
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
  wire::ErrorBody e = server.expect<wire::ErrorBody>(kWaitMs);
  CHECK(e.round == std::optional<uint64_t>(9));
  wire::Task bad_chain = task(9, wire::ModelEncoding::kChain, 6, 91);
  bad_chain.chain = {dense(constant_like(b0, 0.5f)), {{"nope", compression::dense_encoded(at::ones({3}))}}};
  server.send(bad_chain);
  e = server.expect<wire::ErrorBody>(kWaitMs);
  CHECK(e.round == std::optional<uint64_t>(9));
  CHECK(e.message.find("nope") != std::string::npos);
  // The held model is still B_6: an empty Delta against it trains from it.
  server.send(task(7, wire::ModelEncoding::kDelta, 6, 72));
  u = server.expect<wire::ModelUpdate>(kWaitMs);
  CHECK(all_close(decode(u.tensors), expected_delta(b6, 72)));
  server.send(wire::Bye{"run finished"});
  run.join();
  REQUIRE_FALSE(run.error);
}
