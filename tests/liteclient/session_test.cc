// The lite client's session against a scripted server on the in-process
// transport (mem://), with a fake SessionTrainer: the protocol logic alone,
// whatever trains. Hello (digest, no last_round while it holds no model),
// a Task answered with the encoded update and the state file written, a Task
// with a codec that needs LibTorch refused with an Error naming the round, a
// Delta it cannot apply answered with a Hello reporting what it holds, and
// Bye "run finished". Also the state file's bindings to a client and a model.
// LibTorch-free: also built and run in a device build (SPARROW_LITE_ONLY), on arm64 under qemu.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <optional>
#include <thread>

#include "compression/flat_codec.h"
#include "core/error.h"
#include "liteclient/config.h"
#include "liteclient/session.h"
#include "liteclient/state_file.h"
#include "tests/liteclient/scripted_session.h"
#include "transport/transport.h"
#include "wire/wire.h"

namespace {

using namespace sparrow;
using namespace std::chrono_literals;
namespace flat = compression::flat;
namespace fs = std::filesystem;
using namespace sparrow::testing::lite_script;  // NOLINT(google-build-using-namespace)

std::string scratch(const std::string& name) {
  return (fs::temp_directory_path() / ("liteclient_session_" + name + "_" + std::to_string(::getpid()))).string();
}

liteclient::Config config(const std::string& endpoint, const std::string& state, const std::string& id = "dev1") {
  liteclient::Config c = liteclient::parse_config("server = \"" + endpoint + "\"\ninsecure = true\nclient_id = \"" +
                                                  id + "\"\nmodel_file = \"fake.lite\"\ndata = \"folder:/none\"\n" +
                                                  "state_file = \"" + state + "\"\nheartbeat_ms = 1000\n");
  return c;
}

wire::Task task(uint64_t round, const std::string& compression, const std::vector<float>& global) {
  wire::Task t;
  t.round = round;
  t.compression = compression;
  t.seed = 100 + round;
  t.clients = 2;
  if (!global.empty()) {
    t.weights.push_back(dense("w", {2, 3}, global.data()));
    t.weights.push_back(dense("b", {3}, global.data() + 6));
  }
  return t;
}

}  // namespace

TEST_CASE("liteclient session: Hello, a Task and its update, refusals, re-Hello and the run's end") {
  const std::string ep = "mem://liteclient_session_" + std::to_string(::getpid());
  const std::string state = scratch("run");
  fs::remove(state);
  Script server(ep);
  auto trainer = std::make_unique<FakeTrainer>();
  FakeTrainer* fake = trainer.get();
  const uint64_t digest = liteclient::model_digest(trainer->layout());
  liteclient::Session session(config(ep, state), std::move(trainer));
  REQUIRE(fs::exists(state));  // bound to this client and model from the start
  std::optional<bool> finished;
  std::thread client([&] { finished = session.run(); });

  wire::Message m = server.next();
  auto* hello = std::get_if<wire::Hello>(&m.body);
  REQUIRE(hello != nullptr);
  CHECK(hello->client_id == "dev1");
  CHECK(hello->model == "mlp");
  CHECK(hello->model_digest == digest);
  CHECK(hello->num_samples == 10);
  CHECK_FALSE(hello->last_round.has_value());  // holds no model: the server sends it whole
  wire::Welcome w;
  w.run_id = "run-1";
  w.heartbeat_ms = 1000;
  server.send(w);

  // Round 1: the whole model; the update is the trainer's delta, encoded.
  const std::vector<float> global = {1, 2, 3, 4, 5, 6, -1, -2, -3};
  server.send(task(1, "none", global));
  m = server.next();
  auto* u = std::get_if<wire::ModelUpdate>(&m.body);
  REQUIRE(u != nullptr);
  CHECK(u->round == 1);
  CHECK(u->client_id == "dev1");
  CHECK(u->num_samples == 10);
  REQUIRE(u->tensors.size() == 2);
  CHECK(u->tensors[0].name == "w");
  CHECK(u->tensors[1].name == "b");
  std::vector<float> got(9, 0.0f);
  flat::decode_add(u->tensors[0].tensor, got.data(), 6, 1.0f);
  flat::decode_add(u->tensors[1].tensor, got.data() + 6, 3, 1.0f);
  for (size_t i = 0; i < 9; ++i) CHECK(got[i] == FakeTrainer::expected(global[i], i, 101));
  server.send(wire::Ack{1});

  // Round 2: a codec it does not know: an Error naming the round, no crash.
  server.send(task(2, "bogus:rank=2", global));
  m = server.next();
  auto* e = std::get_if<wire::ErrorBody>(&m.body);
  REQUIRE(e != nullptr);
  CHECK(e->round == std::optional<uint64_t>(2));
  CHECK(e->message.find("unknown compression method 'bogus'") != std::string::npos);
  CHECK(fake->calls == 1);

  // Round 3: an empty Delta against round 2, which it does not hold (it holds
  // B_0 from round 1's task): it says so with a Hello.
  wire::Task d = task(3, "none", {});
  d.model_encoding = wire::ModelEncoding::kDelta;
  d.base_round = 2;
  server.send(d);
  m = server.next();
  hello = std::get_if<wire::Hello>(&m.body);
  REQUIRE(hello != nullptr);
  CHECK(hello->last_round == std::optional<uint64_t>(0));
  server.send(w);

  server.send(wire::Bye{"run finished"});
  client.join();
  CHECK(finished == std::optional<bool>(true));
  const auto c = session.counters();
  CHECK(c.tasks_done == 1);
  CHECK(c.updates_acked == 1);
  CHECK(c.tasks_refused == 2);

  // What a restart reads back.
  const auto st = liteclient::load_state(state);
  REQUIRE(st.has_value());
  CHECK(st->client_id == "dev1");
  CHECK(st->digest == digest);
  CHECK(st->run_id == "run-1");
  CHECK(st->holds_model);
  CHECK(st->held_round == 0);
  CHECK(st->held == global);
  CHECK(st->rounds == 1);
  CHECK(st->codec.size() == 2);
  CHECK(st->committed_round == 1);
  CHECK(st->answered);  // the Ack
  fs::remove(state);
}

TEST_CASE("liteclient session: a state file of another client or model is refused naming state_file") {
  const std::string state = scratch("bound");
  fs::remove(state);
  const std::string ep = "mem://liteclient_session_bound_" + std::to_string(::getpid());
  { liteclient::Session s(config(ep, state, "dev1"), std::make_unique<FakeTrainer>()); }
  std::string msg;
  try {
    liteclient::Session s(config(ep, state, "dev2"), std::make_unique<FakeTrainer>());
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  CHECK(msg.find("state_file") != std::string::npos);
  CHECK(msg.find("dev1") != std::string::npos);

  liteclient::ClientState other = *liteclient::load_state(state);
  other.digest ^= 1;
  liteclient::save_state(state, other);
  msg.clear();
  try {
    liteclient::Session s(config(ep, state, "dev1"), std::make_unique<FakeTrainer>());
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  CHECK(msg.find("another model") != std::string::npos);

  // A damaged file: FormatError, never a silent fresh start.
  std::string bytes = liteclient::encode_state(other);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 4);
  {
    std::FILE* f = std::fopen(state.c_str(), "wb");
    REQUIRE(f != nullptr);
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
  }
  CHECK_THROWS_AS(liteclient::Session(config(ep, state, "dev1"), std::make_unique<FakeTrainer>()), FormatError);
  fs::remove(state);
}

TEST_CASE("liteclient session: a silent server is left and Hello sent again after a backoff") {
  const std::string ep = "mem://liteclient_session_silent_" + std::to_string(::getpid());
  const std::string state = scratch("silent");
  fs::remove(state);
  Script server(ep);
  liteclient::Config cfg = config(ep, state);
  cfg.heartbeat_ms = 50;  // silence after 150 ms
  cfg.backoff_initial_ms = 20;
  liteclient::Session session(cfg, std::make_unique<FakeTrainer>());
  std::optional<bool> finished;
  std::thread client([&] { finished = session.run(); });
  wire::Message m = server.next();
  REQUIRE(std::holds_alternative<wire::Hello>(m.body));
  wire::Welcome w;
  w.run_id = "run-s";
  w.heartbeat_ms = 50;
  server.send(w);
  // No answer to its heartbeats: a new connection and a new Hello.
  const auto t0 = std::chrono::steady_clock::now();
  m = server.next();
  const auto waited = std::chrono::steady_clock::now() - t0;
  REQUIRE(std::holds_alternative<wire::Hello>(m.body));
  CHECK(waited >= 100ms);
  CHECK(session.counters().reconnects >= 1);
  server.send(w);
  server.send(wire::Bye{"run finished"});
  client.join();
  CHECK(finished == std::optional<bool>(true));
  fs::remove(state);
}

TEST_CASE("liteclient session: a round asked again after a restart sends the update that was lost") {
  // The update of round 1 is committed (the residual of topk's error feedback
  // advanced) but never answered; the client stops; a new process gets the
  // same Task again and must send the same update, not one with the residual
  // applied twice.
  const std::string ep = "mem://liteclient_session_replay_" + std::to_string(::getpid());
  const std::string state = scratch("replay");
  fs::remove(state);
  Script server(ep);
  const std::vector<float> global = {1, -2, 3, -4, 5, -6, 7, -8, 9};
  auto round1 = [&](liteclient::Session& session) {
    std::optional<bool> finished;
    std::thread client([&] { finished = session.run(); });
    wire::Message m = server.next();
    REQUIRE(std::holds_alternative<wire::Hello>(m.body));
    wire::Welcome w;
    w.run_id = "run-r";
    w.heartbeat_ms = 1000;
    server.send(w);
    server.send(task(1, "topk:ratio=0.3,ef=1", global));
    m = server.next();
    auto* u = std::get_if<wire::ModelUpdate>(&m.body);
    REQUIRE(u != nullptr);
    std::vector<float> got(9, 0.0f);
    flat::decode_add(u->tensors[0].tensor, got.data(), 6, 1.0f);
    flat::decode_add(u->tensors[1].tensor, got.data() + 6, 3, 1.0f);
    session.stop();  // no Ack: as if the update never arrived
    client.join();
    CHECK(finished == std::optional<bool>(false));
    (void)server.next();  // its Bye
    return got;
  };
  std::vector<float> first, again;
  {
    liteclient::Session s(config(ep, state), std::make_unique<FakeTrainer>());
    first = round1(s);
  }
  const auto st = liteclient::load_state(state);
  REQUIRE(st.has_value());
  CHECK(st->committed_round == 1);
  CHECK_FALSE(st->answered);
  {
    liteclient::Session s(config(ep, state), std::make_unique<FakeTrainer>());
    again = round1(s);
  }
  CHECK(again == first);
  // Had the state after round 1 been used, the residual would have been sent too.
  CHECK(std::count(first.begin(), first.end(), 0.0f) > 0);
  fs::remove(state);
}
