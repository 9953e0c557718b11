// sparrow-client-lite applies the catch-up tasks of protocol 1.9 (docs/protocol.md,
// Task) without LibTorch: a Chain adds its deltas in order (flat::decode_add)
// to the model of base_round, a Patch sets the changed positions' values; a
// chain or a patch that does not fit the model is refused with an Error and
// leaves the held model as it was. LibTorch-free (the device build runs it too).
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <thread>

#include "compression/codec_bits.h"
#include "compression/flat_codec.h"
#include "core/error.h"
#include "liteclient/config.h"
#include "liteclient/session.h"
#include "tests/liteclient/scripted_session.h"
#include "transport/transport.h"
#include "wire/wire.h"

namespace {

using namespace sparrow;
using namespace std::chrono_literals;
namespace flat = compression::flat;
namespace fs = std::filesystem;
using namespace sparrow::testing::lite_script;  // NOLINT(google-build-using-namespace)

std::vector<wire::NamedTensor> dense_model(const std::vector<float>& m) {
  return {dense("w", {2, 3}, m.data()), dense("b", {3}, m.data() + 6)};
}

wire::Task task(uint64_t round, wire::ModelEncoding enc, uint64_t base) {
  wire::Task t;
  t.round = round;
  t.model_encoding = enc;
  t.base_round = base;
  t.compression = "none";
  t.seed = 100 + round;
  t.clients = 1;
  return t;
}

// The update's values, checked against the trainer's function of `model`.
void check_trained_from(const wire::Message& m, uint64_t round, const std::vector<float>& model) {
  const auto* u = std::get_if<wire::ModelUpdate>(&m.body);
  REQUIRE_MESSAGE(u != nullptr, "got " << std::string(wire::body_name(m.body)));
  CHECK(u->round == round);
  REQUIRE(u->tensors.size() == 2);
  std::vector<float> got(9, 0.0f);
  flat::decode_add(u->tensors[0].tensor, got.data(), 6, 1.0f);
  flat::decode_add(u->tensors[1].tensor, got.data() + 6, 3, 1.0f);
  for (size_t i = 0; i < 9; ++i) CHECK(got[i] == FakeTrainer::expected(model[i], i, 100 + round));
}

}  // namespace

TEST_CASE("liteclient session: Chain and Patch tasks bring the held model up to B_{r-1}, and bad ones change nothing") {
  const std::string ep = "mem://liteclient_catchup_" + std::to_string(::getpid());
  const std::string state = (fs::temp_directory_path() / ("liteclient_catchup_" + std::to_string(::getpid()))).string();
  fs::remove(state);
  Script server(ep);
  liteclient::Session session(
      liteclient::parse_config("server = \"" + ep +
                               "\"\ninsecure = true\nclient_id = \"dev1\"\nmodel_file = \"fake.lite\"\n"
                               "data = \"folder:/none\"\nstate_file = \"" +
                               state + "\"\nheartbeat_ms = 1000\n"),
      std::make_unique<FakeTrainer>());
  std::optional<bool> finished;
  std::thread client([&] { finished = session.run(); });
  REQUIRE(std::holds_alternative<wire::Hello>(server.next().body));
  wire::Welcome w;
  w.run_id = "run-1";
  w.heartbeat_ms = 1000;
  server.send(w);

  // Round 1: the whole model B_0.
  std::vector<float> b = {1, 2, 3, 4, 5, 6, -1, -2, -3};
  wire::Task t1 = task(1, wire::ModelEncoding::kFull, 0);
  t1.weights = dense_model(b);
  server.send(t1);
  check_trained_from(server.next(), 1, b);
  server.send(wire::Ack{1});

  // Round 4: a Chain from B_0, three steps added in order.
  wire::Task t4 = task(4, wire::ModelEncoding::kChain, 0);
  for (float step : {0.25f, -0.125f, 0.0625f}) {
    std::vector<float> c(9);
    for (size_t i = 0; i < 9; ++i) c[i] = step * static_cast<float>(i + 1);
    t4.chain.push_back(dense_model(c));
    for (size_t i = 0; i < 9; ++i) b[i] += c[i];
  }
  server.send(t4);
  check_trained_from(server.next(), 4, b);
  server.send(wire::Ack{4});

  // Round 7: a Patch from B_3, b[0] and b[2] set.
  const std::vector<int64_t> idx = {0, 2};
  const std::vector<float> vals = {7.5f, -0.0f};
  wire::Task t7 = task(7, wire::ModelEncoding::kPatch, 3);
  t7.weights.push_back(
      {"b", compression::detail::make_sparse({3}, idx.data(), vals.data(), 2, compression::ValueType::kF32, 0.0f,
                                             compression::detail::IndexMode::kRice)});
  server.send(t7);
  b[6] = 7.5f;
  b[8] = -0.0f;
  check_trained_from(server.next(), 7, b);
  server.send(wire::Ack{7});

  // A patch of b's shape sent as w, and a chain with a parameter the model
  // lacks: both refused naming the round; the held B_6 is unchanged.
  wire::Task bad = t7;
  bad.round = 9;
  bad.base_round = 6;
  bad.weights[0].name = "w";
  server.send(bad);
  wire::Message m = server.next();
  auto* e = std::get_if<wire::ErrorBody>(&m.body);
  REQUIRE(e != nullptr);
  CHECK(e->round == std::optional<uint64_t>(9));
  wire::Task bad_chain = task(9, wire::ModelEncoding::kChain, 6);
  bad_chain.chain = {dense_model(b), {dense("nope", {3}, b.data())}};
  server.send(bad_chain);
  m = server.next();
  e = std::get_if<wire::ErrorBody>(&m.body);
  REQUIRE(e != nullptr);
  CHECK(e->message.find("nope") != std::string::npos);
  server.send(task(7, wire::ModelEncoding::kDelta, 6));  // an empty Delta against B_6
  check_trained_from(server.next(), 7, b);
  server.send(wire::Bye{"run finished"});
  client.join();
  CHECK(finished == std::optional<bool>(true));
  fs::remove(state);
}
