// Admission under the default `aggregator = "mean"` (issue 48, item 1): an
// update whose low-rank factors are finite but whose product overflows float32
// is refused before its Ack, changes nothing, and does not stop the round; its
// sender, refused again, is held out of the next selections; a claimed
// num_samples above the Hello's is capped. Real server and clients on loopback.
#include "tests/integration/fixtures.h"

#include "core/model_digest.h"

using namespace sparrow::testing::integ;  // NOLINT(google-build-using-namespace)

namespace {

// fp32 factors P = Q = 1e20 (rank 1): finite on the wire, 1e40 once multiplied.
sparrow::compression::Encoded overflowing_lowrank(const at::Tensor& t) {
  sparrow::compression::Encoded e;
  e.format = sparrow::compression::Format::kLowRank;
  e.shape = t.sizes().vec();
  e.value_type = sparrow::compression::ValueType::kF32;
  const int64_t rows = t.size(0), cols = t.numel() / t.size(0);
  e.params = {static_cast<uint32_t>(rows), static_cast<uint32_t>(cols), 1};
  const std::vector<float> v(static_cast<size_t>(rows + cols), 1e20f);
  e.values.resize(v.size() * 4);
  std::memcpy(e.values.data(), v.data(), e.values.size());
  return e;
}

}  // namespace

TEST_CASE("admission: an overflowing low-rank update under the default mean is refused before its Ack") {
  const std::string dir = fresh_dir("admission");
  keygen(dir, 3);
  server_toml(dir,
              "rounds = 3\nclients_per_round = 3\nmin_clients = 3\nquorum = 2\nround_deadline_s = 4\n"
              "heartbeat_ms = 1000\nholdout_after = 2\nholdout_rounds = 4\n");
  auto server = start_server(dir, dir + "/server.log");
  const std::string ep = server_endpoint(*server);
  INFO(log_tail(*server));
  const Weights w0 = initial_weights(1);

  RawPeer attacker(ep, dir);  // client1's key, id "attacker", 600 samples at Hello
  auto c2 = start_client(dir, 2, ep, 3, 1);
  auto c3 = start_client(dir, 3, ep, 3, 2);
  const sparrow::wire::Task task = attacker.hello_until_task(sparrow::core::model_digest(w0));
  REQUIRE(task.round == 1);

  sparrow::wire::ModelUpdate bad;
  bad.round = 1;
  bad.client_id = "attacker";
  bad.num_samples = 1000000000;  // far above the Hello's 600: capped
  for (const auto& [name, t] : w0)
    bad.tensors.push_back({name, t.dim() == 2 ? overflowing_lowrank(t) : dense_f32(at::zeros_like(t))});
  const std::string bytes = sparrow::wire::serialize(as_message(bad));
  // Refused, with an Error and not an Ack (error_for fails on anything else), twice.
  CHECK(attacker.error_for(bytes).has_value());
  CHECK(attacker.error_for(bytes).has_value());
  CHECK(server->wait_for_log("event=client_held_out client=attacker", 10s));
  CHECK(server->log().find("event=samples_capped client=attacker") != std::string::npos);

  // The attacker stays connected (heartbeats) and is not selected again.
  bool selected_again = false;
  const auto until = std::chrono::steady_clock::now() + 90s;
  while (server->running() && std::chrono::steady_clock::now() < until) {
    attacker.send(as_message(sparrow::wire::Heartbeat{1}));
    if (auto m = attacker.receive(300))
      if (auto* t = std::get_if<sparrow::wire::Task>(&m->body)) selected_again |= t->round >= 2;
  }
  REQUIRE(server->wait(30s) == 0);
  CHECK_FALSE(selected_again);
  const std::string log = server->log();
  CHECK(log.find("event=round_abandoned") == std::string::npos);
  Db db(dir + "/server.db");
  const auto rounds = db.rounds();
  REQUIRE(rounds.size() == 3);
  CHECK(rounds[0].updates == 2);
  CHECK(rounds[0].rejected >= 2);
  CHECK(rounds[1].selected == 2);  // held out
  CHECK(rounds[2].selected == 2);
  // The model moved only by the honest updates: every value finite.
  const std::string ck = db.checkpoint(3);
  REQUIRE_FALSE(ck.empty());
  for (const auto& [key, t] : sparrow::compression::deserialize_weights(ck)) {
    const std::string name = key;  // (a structured binding cannot be captured before C++20: clang)
    CHECK_MESSAGE(at::isfinite(t).all().item<bool>(), name);
  }
  c2->signal(SIGTERM);
  c3->signal(SIGTERM);
}
