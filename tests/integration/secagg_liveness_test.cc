// SecAgg+ liveness (issue 47, item 1): one client on the allow-list that
// breaks the protocol at any stage costs at most the round it is in. The
// attacker is a RawPeer in this process playing a secagg::Client honestly up
// to the stage it breaks; four real sparrow-client processes are the honest
// ones. docs/security.md, "One bad participant".
#include "tests/integration/fixtures.h"
// (fixtures.h first: glog/doctest CHECK clash.)
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "core/model_digest.h"
#include "secagg/secagg.h"

using namespace sparrow::testing::integ;  // NOLINT(google-build-using-namespace)

namespace {

using sparrow::wire::SecAgg;
using sparrow::wire::SecAggStage;

// What the attacker breaks: "keys" (an unusable public key), "shares" (every
// encrypted pair garbage: its receivers prove it), "masked" (a masked update
// of the wrong length), "reveal" (shares of the wrong kind), "wrong_shares"
// (well-formed shares with wrong values: they do not match the digests their
// dealers published, so the 3 honest holders of each secret unmask it at
// t = 3), "false_reports" (it spoils two good pairs it received and rejects
// their senders: its evidence opens the pairs as the server routed them,
// good, so it is the one taken out and held out, the two stay in),
// "wrong_shares_at_t" (the same among 6 clients on a ring of degree 4 at
// t = 4: its neighbours' secrets have t - 1 honest holders, so round 1 is
// abandoned, never unmasked wrong, and runs again without it).
struct Attack {
  std::string stage;
  std::string server_reason;  // in the server's event=secagg_offender line
  int threshold = 3;
  int quorum = 4;
  int honest = 4;  // sparrow-client processes besides the attacker
};

size_t model_numel() {
  size_t n = 0;
  for (const auto& [k, v] : initial_weights(1)) n += static_cast<size_t>(v.numel());
  return n;
}

}  // namespace

TEST_CASE("secagg liveness: a malicious client at any stage costs one round and is held out") {
  const std::vector<Attack> attacks = {{"keys", "broke the protocol"},
                                       {"shares", "its encrypted pair to client c"},
                                       {"masked", "broke the protocol"},
                                       {"reveal", "broke the protocol"},
                                       {"wrong_shares", "it revealed a wrong share of client"},
                                       {"false_reports", "it falsely rejected the pair of client"},
                                       {"wrong_shares_at_t", "it revealed a wrong share of client", 4, 5, 5}};
  // Round 1's model per attack: the attacker's update (zeros) is in the sum
  // after "reveal" and "wrong_shares", in no other; the honest clients train
  // the same way every run, so each group must end round 1 with one model.
  std::map<std::string, Weights> round1;
  for (const Attack& attack : attacks) {
    CAPTURE(attack.stage);
    const std::string dir = fresh_dir("secagg_liveness_" + attack.stage);
    const bool at_t = attack.stage == "wrong_shares_at_t";
    const int n = attack.honest + 1;
    keygen(dir, n);
    // 5 clients, complete graph (degree 4), t = 3: the 4 honest ones meet the
    // threshold alone. Round 2 has the honest clients only.
    server_toml(dir, "rounds = 2\nclients_per_round = " + std::to_string(n) + "\nmin_clients = " + std::to_string(n) +
                         "\nquorum = " + std::to_string(attack.quorum) +
                         "\nround_deadline_s = 20\n"
                         "max_round_wait_s = 40\nheartbeat_ms = 1000\nholdout_after = 2\nholdout_rounds = 4\n"
                         "secagg = \"secagg+:degree=4,threshold=" +
                         std::to_string(attack.threshold) + ",timeout=5\"\n");
    auto server = start_server(dir, dir + "/server.log");
    const std::string ep = server_endpoint(*server);
    INFO(log_tail(*server));
    const Weights w0 = initial_weights(1);

    std::vector<std::unique_ptr<Process>> honest;
    for (int i = 2; i <= n; ++i) honest.push_back(start_client(dir, i, ep, 60, i));
    // The attacker says Hello last (it sends no heartbeat while it waits).
    REQUIRE(server->wait_for_log("sessions=" + std::to_string(attack.honest), 60s));
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
          SecAgg in = *sm;
          if (attack.stage == "false_reports")  // two good pairs made bad: it rejects their senders, masks without them
            for (size_t i = 0; i < 2 && i < in.shares.size(); ++i) in.shares[i].data[30] ^= 0x42;
          party.receive_shares(in);
          SecAgg out = party.masked(std::vector<uint32_t>(model_numel(), 0));
          if (attack.stage == "masked") out.masked.resize(out.masked.size() - 1);
          attacker.send(secagg_msg(out));
        } else if (sm->stage == SecAggStage::kUnmask) {
          SecAgg out = party.reveal(*sm);
          if (attack.stage == "reveal")
            for (auto& sh : out.shares) sh.kind = sh.kind == 1 ? 2 : 1;
          if (attack.stage == "wrong_shares" || at_t)
            for (auto& sh : out.shares) sh.data[7] = static_cast<char>(sh.data[7] ^ 0x24);  // well formed, wrong
          attacker.send(secagg_msg(out));
        }
      } catch (const sparrow::Error& e) {
        FAIL_CHECK("the attacker's own protocol step failed: " << e.what());
      }
    }
    REQUIRE(server->wait(30s) == 0);
    const std::string slog = server->log();
    // The run completed both rounds, none abandoned: the attacker cost nothing
    // beyond its own update of round 1 (at t: round 1 once).
    if (at_t) {
      CHECK(slog.find("event=round_abandoned round=1 secagg=1 stage=reveal") != std::string::npos);
      CHECK(slog.find("self-mask shares revealed are the ones dealt, 4 needed") != std::string::npos);
      CHECK(slog.find("event=round_abandoned round=2") == std::string::npos);
    } else {
      CHECK(slog.find("event=round_abandoned") == std::string::npos);
    }
    Db db(dir + "/server.db");
    const auto rounds = db.rounds();
    REQUIRE(rounds.size() == 2);
    CHECK(rounds[0].selected == (at_t ? attack.honest : n));  // at t: the run of round 1 without it
    // After the reveal its masked update is in the sum (it is unmasked with the
    // honest clients' shares); at any earlier stage only the honest ones.
    const bool revealed = attack.stage == "reveal" || attack.stage == "wrong_shares";
    CHECK(rounds[0].updates == (revealed ? n : attack.honest));
    CHECK(rounds[1].selected == attack.honest);
    CHECK(rounds[1].updates == attack.honest);
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
    const std::string stage = attack.stage == "wrong_shares" || at_t ? "reveal"
                              : attack.stage == "false_reports"      ? "masked"
                                                                     : attack.stage;
    CHECK(slog.find("stage=" + stage + " reason=\"" + attack.server_reason) != std::string::npos);
    CHECK(slog.find("event=client_held_out client=attacker key=" + key) != std::string::npos);
    if (attack.stage != "shares" && attack.stage != "wrong_shares" && attack.stage != "false_reports" && !at_t)
      CHECK(errors >= 1);  // the refused message got an Error (wrong values and reports are found by checks)
    // The aggregate was unmasked right: with a wrong self-mask seed it would be
    // ChaCha20 noise of the ring's full range, far above any honest step.
    const std::string ck = db.checkpoint(2);
    REQUIRE_FALSE(ck.empty());
    const std::string ck1 = db.checkpoint(1);
    REQUIRE_FALSE(ck1.empty());
    round1[attack.stage] = sparrow::compression::deserialize_weights(ck1);
    for (const auto& [key, t] : sparrow::compression::deserialize_weights(ck)) {
      const std::string name = key;  // (a structured binding cannot be captured before C++20: clang)
      const double moved = (t - w0.at(name)).abs().max().item<double>();
      CHECK_MESSAGE(moved < 1.0, name << " moved by " << moved);
    }
    // The honest clients saw the bad pairs and said so; none stopped.
    const std::string index = std::to_string(task.secagg->index);
    for (auto& c : honest) {
      CHECK(c->wait(15s) == 0);
      if (attack.stage == "shares")
        CHECK(c->log().find("does not decrypt: client " + index + " treated as dropped") != std::string::npos);
    }
    CHECK(slog.find("secagg_offender client=c") == std::string::npos);  // no honest client blamed
    CHECK(slog.find("client_held_out client=c") == std::string::npos);  // nor held out
    fs::remove_all(dir);
  }
  // The unmasked aggregate is the honest survivors' whatever the attack: equal
  // (to the SecAgg rounding) to the run whose attacker broke no secret.
  auto worst = [&](const std::string& a, const std::string& b) {
    double m = 0;
    for (const auto& [key, t] : round1.at(a)) {
      const std::string name = key;  // (not captured by the CHECK below: clang)
      m = std::max(m, (t - round1.at(b).at(name)).abs().max().item<double>());
    }
    return m;
  };
  const double moved = [&] {
    double m = 0;
    const Weights w0 = initial_weights(1);
    for (const auto& [key, t] : round1.at("masked")) {
      const std::string name = key;
      m = std::max(m, (t - w0.at(name)).abs().max().item<double>());
    }
    return m;
  }();
  CHECK(moved > 1e-3);  // round 1 trained
  for (const char* a : {"keys", "shares", "false_reports"}) {
    const double d = worst(a, "masked");
    CHECK_MESSAGE(d < 1e-5, a << " vs masked: max |diff| = " << d);
  }
  const double d = worst("wrong_shares", "reveal");
  CHECK_MESSAGE(d < 1e-5, "wrong_shares vs reveal: max |diff| = " << d);
}
