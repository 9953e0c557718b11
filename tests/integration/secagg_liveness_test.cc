// SecAgg+ liveness (issue 47, item 1): one client on the allow-list that
// breaks the protocol at any stage costs at most the round it is in. The
// attacker is a RawPeer in this process playing a secagg::Client honestly up
// to the stage it breaks; four real sparrow-client processes are the honest
// ones. docs/security.md, "One bad participant".
#include "tests/integration/fixtures.h"
// (fixtures.h first: glog/doctest CHECK clash.)
#include <string>
#include <vector>

#include "core/model_digest.h"
#include "secagg/secagg.h"

using namespace sparrow::testing::integ;  // NOLINT(google-build-using-namespace)

namespace {

using sparrow::wire::SecAgg;
using sparrow::wire::SecAggStage;

// What the attacker breaks: "keys" (an unusable public key), "shares" (every
// encrypted pair garbage), "masked" (a masked update of the wrong length),
// "reveal" (shares of the wrong kind).
struct Attack {
  std::string stage;
  std::string server_reason;  // in the server's event=secagg_offender line
};

size_t model_numel() {
  size_t n = 0;
  for (const auto& [k, v] : initial_weights(1)) n += static_cast<size_t>(v.numel());
  return n;
}

}  // namespace

TEST_CASE("secagg liveness: a malicious client at any stage costs one round and is held out") {
  const std::vector<Attack> attacks = {{"keys", "broke the protocol"},
                                       {"shares", "its encrypted pairs were rejected by neighbours"},
                                       {"masked", "broke the protocol"},
                                       {"reveal", "broke the protocol"}};
  for (const Attack& attack : attacks) {
    CAPTURE(attack.stage);
    const std::string dir = fresh_dir("secagg_liveness_" + attack.stage);
    keygen(dir, 5);
    // 5 clients, complete graph (degree 4), t = 3: the 4 honest ones meet the
    // threshold alone. Round 2 has the 4 honest clients only.
    server_toml(dir,
                "rounds = 2\nclients_per_round = 5\nmin_clients = 5\nquorum = 4\nround_deadline_s = 20\n"
                "max_round_wait_s = 40\nheartbeat_ms = 1000\nholdout_after = 2\nholdout_rounds = 4\n"
                "secagg = \"secagg+:degree=4,threshold=3,timeout=5\"\n");
    auto server = start_server(dir, dir + "/server.log");
    const std::string ep = server_endpoint(*server);
    INFO(log_tail(*server));
    const Weights w0 = initial_weights(1);

    std::vector<std::unique_ptr<Process>> honest;
    for (int i = 2; i <= 5; ++i) honest.push_back(start_client(dir, i, ep, 60, i));
    // The attacker says Hello last (it sends no heartbeat while it waits).
    REQUIRE(server->wait_for_log("sessions=4", 60s));
    RawPeer attacker(ep, dir);  // client1's key, id "attacker"
    const sparrow::wire::Task task = attacker.hello_until_task(sparrow::core::model_digest(w0));
    REQUIRE(task.round == 1);
    REQUIRE(task.secagg);
    sparrow::secagg::Client party(*task.secagg, 1, "attacker");
    auto secagg_msg = [](SecAgg m) { return as_message(std::move(m)); };

    SecAgg keys = party.keys();
    if (attack.stage == "keys") keys.peers[0].enc_key = std::string(32, '\0');  // a low-order point
    attacker.send(secagg_msg(keys));

    bool selected_again = false;
    int errors = 0;
    const auto until = std::chrono::steady_clock::now() + 90s;
    auto last_beat = std::chrono::steady_clock::now();
    while (server->running() && std::chrono::steady_clock::now() < until) {
      if (std::chrono::steady_clock::now() - last_beat > 300ms) {
        attacker.send(as_message(sparrow::wire::Heartbeat{1}));
        last_beat = std::chrono::steady_clock::now();
      }
      auto m = attacker.receive(100);
      if (!m) continue;
      if (auto* t = std::get_if<sparrow::wire::Task>(&m->body)) selected_again |= t->round >= 2;
      if (std::holds_alternative<sparrow::wire::ErrorBody>(m->body)) ++errors;
      const auto* sm = std::get_if<SecAgg>(&m->body);
      if (!sm || sm->round != 1) continue;
      try {
        if (sm->stage == SecAggStage::kNeighbours) {
          SecAgg out = party.shares(*sm);
          if (attack.stage == "shares")
            for (auto& sh : out.shares) sh.data[30] ^= 0x42;  // no longer authenticates
          attacker.send(secagg_msg(out));
        } else if (sm->stage == SecAggStage::kSharesIn) {
          party.receive_shares(*sm);
          SecAgg out = party.masked(std::vector<uint32_t>(model_numel(), 0));
          if (attack.stage == "masked") out.masked.resize(out.masked.size() - 1);
          attacker.send(secagg_msg(out));
        } else if (sm->stage == SecAggStage::kUnmask) {
          SecAgg out = party.reveal(*sm);
          if (attack.stage == "reveal")
            for (auto& sh : out.shares) sh.kind = sh.kind == 1 ? 2 : 1;
          attacker.send(secagg_msg(out));
        }
      } catch (const sparrow::Error& e) {
        FAIL_CHECK("the attacker's own protocol step failed: " << e.what());
      }
    }
    REQUIRE(server->wait(30s) == 0);
    const std::string slog = server->log();
    // The run completed both rounds, none abandoned: the attacker cost nothing
    // beyond its own update of round 1.
    CHECK(slog.find("event=round_abandoned") == std::string::npos);
    Db db(dir + "/server.db");
    const auto rounds = db.rounds();
    REQUIRE(rounds.size() == 2);
    CHECK(rounds[0].selected == 5);
    // After the reveal its masked update is in the sum (it is unmasked with the
    // honest clients' shares); at any earlier stage only the 4 honest ones.
    CHECK(rounds[0].updates == (attack.stage == "reveal" ? 5 : 4));
    CHECK(rounds[1].selected == 4);
    CHECK(rounds[1].updates == 4);
    CHECK_FALSE(selected_again);
    // Named with its key, at the stage it broke, and held out.
    const std::string key = [&] {
      std::smatch km;
      const std::string line = slog.substr(slog.find("event=secagg_offender"));
      REQUIRE(std::regex_search(line, km, std::regex("key=(\\S+)")));
      return km[1].str();
    }();
    CHECK(key != "-");
    CHECK(slog.find("event=secagg_offender client=attacker key=" + key) != std::string::npos);
    CHECK(slog.find("stage=" + attack.stage + " reason=\"" + attack.server_reason) != std::string::npos);
    CHECK(slog.find("event=client_held_out client=attacker key=" + key) != std::string::npos);
    if (attack.stage != "shares") CHECK(errors >= 1);  // the refused message got an Error
    // The honest clients saw the bad pairs and said so; none stopped.
    const std::string index = std::to_string(task.secagg->index);
    for (auto& c : honest) {
      CHECK(c->wait(15s) == 0);
      if (attack.stage == "shares")
        CHECK(c->log().find("does not decrypt: client " + index + " treated as dropped") != std::string::npos);
    }
    CHECK(slog.find("secagg_offender client=c") == std::string::npos);  // no honest client blamed
    fs::remove_all(dir);
  }
}
