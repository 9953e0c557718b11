// SecAgg+ without transport: the parties of secagg/secagg.h exchanging their
// messages in memory, with clients dropping at each stage.
#include "secagg/secagg.h"

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <set>

#include "core/error.h"
#include "core/rng.h"
#include "secagg/verify.h"

using namespace sparrow;
using namespace sparrow::secagg;

namespace {

Params params(uint32_t degree, uint32_t threshold, double clip = 1) {
  Params p;
  p.enabled = true;
  p.degree = degree;
  p.threshold = threshold;
  p.clip = clip;
  return p;
}

// One round: n clients with random updates x_u in [-0.5, 0.5]; `drop_at[u]`
// = the stage (1 keys, 2 shares, 3 masked, 4 reveal) before which client u
// stops answering (0 = never). Returns the unmasked sum dequantised, and the
// plain weighted sum of the clients whose masked update arrived.
struct Outcome {
  std::vector<float> secure, plain;
  std::set<uint32_t> u3;
  bool completed = false;
  std::string error;
  std::vector<std::vector<uint32_t>> masked_inputs, quantised;  // per client (index - 1), when sent
  std::map<uint32_t, std::set<uint32_t>> wrong;                 // Server::wrong_shares() after the reveals
  std::map<uint32_t, Offence> offenders;                        // Server::offenders() at the end
  std::string failure;                                          // Server::failure() after reconstruct()
};

Outcome run_round(uint32_t n, const Params& p, size_t len, const std::map<uint32_t, int>& drop_at, uint64_t seed = 7) {
  Outcome o;
  const uint64_t round = 3;
  Server server(p, round, n, seed, len);
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::vector<float>> x(n, std::vector<float>(len));
  const double scale = ring_scale(n, p.clip);
  auto alive = [&](uint32_t u, int stage) {
    auto it = drop_at.find(u);
    return it == drop_at.end() || it->second == 0 || it->second > stage;
  };
  for (uint32_t u = 1; u <= n; ++u) {
    wire::SecAggSetup s;
    s.index = u;
    s.clients = n;
    s.degree = p.degree_for(n);
    s.threshold = p.effective_threshold();
    s.graph_seed = seed;
    s.clip = p.clip;
    s.weight = 1.0 / n;
    clients.push_back(std::make_unique<Client>(s, round, "c" + std::to_string(u)));
    for (size_t i = 0; i < len; ++i) x[u - 1][i] = rng::uniform01(rng::derive(seed, u), i) - 0.5f;
  }
  o.masked_inputs.resize(n);
  o.quantised.resize(n);
  try {
    for (uint32_t u = 1; u <= n; ++u)
      if (alive(u, 1)) server.add_keys(u, clients[u - 1]->keys());
    std::map<uint32_t, wire::SecAgg> shares;
    for (auto& [u, m] : server.neighbour_messages())
      if (alive(u, 2)) shares[u] = clients[u - 1]->shares(m);
    for (auto& [u, m] : shares) server.add_shares(u, m);
    for (auto& [u, m] : server.shares_in_messages()) {
      if (!alive(u, 3)) continue;
      clients[u - 1]->receive_shares(m);
      std::vector<uint32_t> q(len);
      quantise(x[u - 1].data(), len, 1.0 / n, p.clip, scale, rng::derive(seed, 100 + u), q.data());
      o.quantised[u - 1] = q;
      wire::SecAgg y = clients[u - 1]->masked(q);
      o.masked_inputs[u - 1] = y.masked;
      server.add_masked(u, y);
    }
    for (auto& [u, m] : server.unmask_messages())
      if (alive(u, 4)) server.add_reveal(u, clients[u - 1]->reveal(m));
    o.u3 = server.masked();
    std::vector<uint32_t> sum = server.unmask();
    o.secure.resize(len);
    dequantise(sum.data(), len, scale, o.secure.data());
    o.plain.assign(len, 0.f);
    for (uint32_t u : o.u3)
      for (size_t i = 0; i < len; ++i) o.plain[i] += x[u - 1][i] / static_cast<float>(n);
    o.completed = true;
  } catch (const Error& e) {
    o.error = e.what();
  }
  return o;
}

float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

}  // namespace

TEST_CASE("secagg: Shamir shares reconstruct from any t and a wrong set does not") {
  Secret s;
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<uint8_t>(i * 7 + 1);
  const std::vector<std::string> sh = shamir_split(s, 3, {1, 2, 3, 4, 5});
  CHECK(shamir_combine({sh[0], sh[1], sh[2]}, 3) == s);
  CHECK(shamir_combine({sh[4], sh[2], sh[0]}, 3) == s);
  CHECK(shamir_combine({sh[1], sh[3], sh[4], sh[0]}, 3) == s);
  // Two shares of a 3-of-5 say nothing: combined as if t were 2 they give junk.
  CHECK(shamir_combine({sh[0], sh[1]}, 2) != s);
  CHECK_THROWS_AS(shamir_combine({sh[0], sh[0], sh[1]}, 3), Error);
  CHECK_THROWS_AS(shamir_combine({sh[0], sh[1]}, 3), Error);
}

TEST_CASE("secagg: the graph is k-regular and symmetric and complete below k + 1 clients") {
  const Graph g(100, 8, 42);
  for (uint32_t u = 1; u <= 100; ++u) {
    CHECK(g.neighbours(u).size() == 8);
    for (uint32_t v : g.neighbours(u)) CHECK(g.linked(v, u));
  }
  const Graph small(5, 4, 1);
  for (uint32_t u = 1; u <= 5; ++u) CHECK(small.neighbours(u).size() == 4);
  CHECK(Graph(100, 8, 43).neighbours(1) != g.neighbours(1));  // the seed draws the ring
}

TEST_CASE("secagg: quantisation is unbiased within one step and clips") {
  std::vector<float> x = {0.25f, -0.125f, 3.f, -3.f, 1e-9f};
  std::vector<uint32_t> q(x.size());
  const double scale = ring_scale(10, 1.0);
  CHECK(quantise(x.data(), x.size(), 0.5, 1.0, scale, 9, q.data()) == 2);
  std::vector<float> back(x.size());
  dequantise(q.data(), q.size(), scale, back.data());
  CHECK(back[0] == doctest::Approx(0.125).epsilon(1e-6));
  CHECK(back[1] == doctest::Approx(-0.0625).epsilon(1e-6));
  CHECK(back[2] == doctest::Approx(0.5).epsilon(1e-6));
  CHECK(back[3] == doctest::Approx(-0.5).epsilon(1e-6));
  std::vector<float> bad = {1.f, std::nanf("")};
  CHECK_THROWS_AS(quantise(bad.data(), 2, 1, 1, scale, 1, q.data()), Error);
}

TEST_CASE("secagg: the unmasked sum equals the plain sum to the quantisation step") {
  for (uint32_t n : {3u, 10u, 40u}) {
    CAPTURE(n);
    const Params p = params(8, n > 4 ? 4 : 2);
    Outcome o = run_round(n, p, 1000, {});
    REQUIRE_MESSAGE(o.completed, o.error);
    CHECK(o.u3.size() == n);
    // n roundings of at most one step each.
    CHECK(max_diff(o.secure, o.plain) <= static_cast<float>(n / ring_scale(n, p.clip)) + 1e-7f);
  }
}

TEST_CASE("secagg: a masked update reveals nothing of the update by itself") {
  Outcome o = run_round(10, params(8, 4), 4096, {});
  REQUIRE(o.completed);
  size_t same = 0;
  for (size_t i = 0; i < 4096; ++i) same += o.masked_inputs[0][i] == o.quantised[0][i];
  CHECK(same < 5);  // uniform masks: a coordinate survives with probability 2^-32
  // The masked words look uniform: their mean is near 2^31 (the update's are near 0 or 2^32).
  double mean = 0;
  for (uint32_t w : o.masked_inputs[0]) mean += w;
  mean /= 4096;
  CHECK(std::fabs(mean / 4294967296.0 - 0.5) < 0.03);
}

TEST_CASE("secagg: clients dropping at every stage below the threshold") {
  // 12 clients, degree 8, t = 3. Drop one before keys, one before shares, two
  // before their masked update and one before revealing: every neighbourhood
  // of 8 keeps at least 3 revealing members.
  const Params p = params(8, 3);
  Outcome o = run_round(12, p, 500, {{2, 1}, {5, 2}, {7, 3}, {8, 3}, {11, 4}});
  REQUIRE_MESSAGE(o.completed, o.error);
  CHECK(o.u3.size() == 8);  // 11 went silent after its masked update: its update counts
  CHECK(max_diff(o.secure, o.plain) <= static_cast<float>(12 / ring_scale(12, p.clip)) + 1e-7f);
}

TEST_CASE("secagg: too many silent survivors leave a secret short of t shares and the round fails cleanly") {
  // 5 clients, complete graph (degree 4), t = 4: two survivors silent at the
  // reveal leave every self-mask with 2 shares.
  Outcome o = run_round(5, params(4, 4), 100, {{1, 4}, {2, 4}});
  CHECK_FALSE(o.completed);
  CHECK(o.error.find("cannot unmask") != std::string::npos);
  CHECK(o.error.find("self-mask shares") != std::string::npos);
  // Too few neighbours for a client's own secrets: it refuses to go on.
  Outcome few = run_round(5, params(4, 4), 100, {{1, 1}, {2, 1}});
  CHECK_FALSE(few.completed);
  CHECK(few.error.find("threshold") != std::string::npos);
}

TEST_CASE("secagg: a client never reveals both shares of one client") {
  const uint32_t n = 5;
  const Params p = params(4, 3);
  Server server(p, 1, n, 5, 16);
  std::vector<std::unique_ptr<Client>> c;
  for (uint32_t u = 1; u <= n; ++u) {
    wire::SecAggSetup s{u, n, p.degree_for(n), p.effective_threshold(), 5, 1.0, 0.2};
    c.push_back(std::make_unique<Client>(s, 1, "c" + std::to_string(u)));
    server.add_keys(u, c.back()->keys());
  }
  for (auto& [u, m] : server.neighbour_messages()) server.add_shares(u, c[u - 1]->shares(m));
  for (auto& [u, m] : server.shares_in_messages()) {
    c[u - 1]->receive_shares(m);
    server.add_masked(u, c[u - 1]->masked(std::vector<uint32_t>(16, 1)));
  }
  wire::SecAgg ask = server.unmask_messages().at(1);
  wire::SecAgg both = ask;
  both.dropped.push_back(2);  // 2 is also a survivor
  CHECK_THROWS_WITH_AS(c[0]->reveal(both), doctest::Contains("survivor and as dropped"), Error);
  wire::SecAgg self_dropped = ask;
  self_dropped.survivors = {2, 3};
  self_dropped.dropped = {1};
  CHECK_THROWS_AS(c[0]->reveal(self_dropped), Error);
  // The honest request is answered once; asking again with 2 now "dropped" is refused.
  const wire::SecAgg r = c[0]->reveal(ask);
  CHECK(r.shares.size() == 4);
  for (const auto& sh : r.shares) CHECK(sh.kind == 1);
  wire::SecAgg again = ask;
  again.survivors = {1, 3, 4, 5};
  again.dropped = {2};
  CHECK_THROWS_WITH_AS(c[0]->reveal(again), doctest::Contains("second unmask request"), Error);
}

TEST_CASE("secagg: the server refuses out-of-order, foreign and incomplete messages") {
  const Params p = params(4, 3);
  Server server(p, 9, 6, 2, 8);
  wire::SecAggSetup s{1, 6, 4, 3, 2, 1.0, 0.1};
  Client a(s, 9, "a");
  wire::SecAgg k = a.keys();
  CHECK_THROWS_AS(server.add_keys(2, k), Error);  // index says 1
  wire::SecAgg wrong_round = k;
  wrong_round.round = 8;
  CHECK_THROWS_AS(server.add_keys(1, wrong_round), Error);
  wire::SecAgg zero = k;
  zero.peers[0].enc_key = std::string(32, '\0');  // a low-order point: every party would agree on 0
  CHECK_THROWS_WITH_AS(server.add_keys(1, zero), doctest::Contains("unusable public key"), Error);
  server.add_keys(1, k);
  CHECK_THROWS_AS(server.add_keys(1, k), Error);  // twice
  wire::SecAgg copy = k;                          // another client replaying 1's keys
  copy.index = 2;
  copy.peers[0].index = 2;
  CHECK_THROWS_WITH_AS(server.add_keys(2, copy), doctest::Contains("already sent"), Error);
  std::vector<std::unique_ptr<Client>> c;
  for (uint32_t u = 2; u <= 6; ++u) {
    c.push_back(std::make_unique<Client>(wire::SecAggSetup{u, 6, 4, 3, 2, 1.0, 0.1}, 9, "c"));
    server.add_keys(u, c.back()->keys());
  }
  auto nb = server.neighbour_messages();
  CHECK_THROWS_AS(server.add_keys(1, k), Error);  // closed
  wire::SecAgg sh = a.shares(nb.at(1));
  wire::SecAgg partial = sh;
  partial.shares.pop_back();
  CHECK_THROWS_WITH_AS(server.add_shares(1, partial), doctest::Contains("one pair to each"), Error);
  server.add_shares(1, sh);
  // A client refuses keys of a non-neighbour.
  Client b(wire::SecAggSetup{2, 6, 4, 3, 2, 1.0, 0.1}, 9, "b");
  b.keys();
  wire::SecAgg forged = nb.at(2);
  forged.peers.push_back(forged.peers.front());
  CHECK_THROWS_AS(b.shares(forged), Error);
  // Masked update of the wrong length.
  for (uint32_t u = 2; u <= 6; ++u) server.add_shares(u, c[u - 2]->shares(nb.at(u)));
  auto in = server.shares_in_messages();
  a.receive_shares(in.at(1));
  wire::SecAgg y = a.masked(std::vector<uint32_t>(7, 0));
  CHECK_THROWS_WITH_AS(server.add_masked(1, y), doctest::Contains("the model has 8"), Error);
}

TEST_CASE("secagg: parameters are checked") {
  CHECK_FALSE(Params::parse("none").enabled);
  const Params p = Params::parse("secagg+:degree=10,clip=2");
  CHECK(p.enabled);
  CHECK(p.effective_threshold() == 6);
  CHECK(p.min_clients() == 7);
  CHECK(Params::parse(p.text()).text() == p.text());
  CHECK_THROWS_AS(Params::parse("secagg+:degree=7"), ConfigError);
  CHECK_THROWS_AS(Params::parse("secagg+:degree=4,threshold=5"), ConfigError);
  CHECK_THROWS_AS(Params::parse("secagg+:threshold=1"), ConfigError);
  CHECK_THROWS_AS(Params::parse("secagg+:clip=0"), ConfigError);
  CHECK_THROWS_AS(Params::parse("secagg+:bits=3"), ConfigError);
  CHECK_THROWS_AS(Params::parse("secagg:degree=4"), ConfigError);
}

TEST_CASE("secagg: half the ring drops before its masked update") {
  for (uint64_t seed : {1u, 2u, 3u, 4u, 5u}) {
    CAPTURE(seed);
    Outcome o = run_round(6, params(4, 2), 50, {{1, 3}, {2, 3}, {4, 3}}, seed);
    if (!o.completed) {
      CHECK(o.error.find("cannot unmask") != std::string::npos);
      continue;
    }
    CHECK(max_diff(o.secure, o.plain) <= static_cast<float>(6 / ring_scale(6, 1.0)) + 1e-7f);
  }
}

namespace {

// One round of n clients (len coordinates, weight 1/n) where `tamper` may
// change the Shares message of a client before the server routes it, and
// `exclude` names a client the server takes out after its Shares. Returns
// the outcome with u3 = the survivors.
Outcome run_tampered(uint32_t n, const Params& p, size_t len,
                     const std::function<void(uint32_t, wire::SecAgg&)>& tamper,
                     std::map<uint32_t, std::map<uint32_t, std::string>>* rejected = nullptr,
                     uint32_t exclude_after_shares = 0, uint64_t seed = 11,
                     const std::function<void(uint32_t, wire::SecAgg&)>& tamper_reveal = {},
                     const std::function<void(uint32_t, wire::SecAgg&)>& tamper_in = {}) {
  Outcome o;
  const uint64_t round = 2;
  Server server(p, round, n, seed, len);
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::vector<float>> x(n, std::vector<float>(len));
  const double scale = ring_scale(n, p.clip);
  for (uint32_t u = 1; u <= n; ++u) {
    wire::SecAggSetup s{u, n, p.degree_for(n), p.effective_threshold(), seed, p.clip, 1.0 / n};
    clients.push_back(std::make_unique<Client>(s, round, "c" + std::to_string(u)));
    for (size_t i = 0; i < len; ++i) x[u - 1][i] = rng::uniform01(rng::derive(seed, u), i) - 0.5f;
    server.add_keys(u, clients[u - 1]->keys());
  }
  try {
    for (auto& [u, m] : server.neighbour_messages()) {
      wire::SecAgg sh = clients[u - 1]->shares(m);
      tamper(u, sh);
      server.add_shares(u, sh);
    }
    auto in = server.shares_in_messages();
    if (exclude_after_shares) server.exclude(exclude_after_shares);
    for (auto& [u, m] : in) {
      if (tamper_in) tamper_in(u, m);
      const auto bad = clients[u - 1]->receive_shares(m);
      if (rejected && !bad.empty()) (*rejected)[u] = bad;
      std::vector<uint32_t> q(len);
      quantise(x[u - 1].data(), len, 1.0 / n, p.clip, scale, rng::derive(seed, 100 + u), q.data());
      wire::SecAgg y = clients[u - 1]->masked(q);
      if (u == exclude_after_shares) {
        CHECK_THROWS_WITH_AS(server.add_masked(u, y), doctest::Contains("excluded"), Error);
        continue;
      }
      server.add_masked(u, y);
    }
    CHECK(server.stage_complete());
    for (auto& [u, m] : server.unmask_messages()) {
      wire::SecAgg rv = clients[u - 1]->reveal(m);
      if (tamper_reveal) tamper_reveal(u, rv);
      server.add_reveal(u, rv);
    }
    CHECK(server.stage_complete());
    o.u3 = server.survivors();
    const bool ok = server.reconstruct();
    o.wrong = server.wrong_shares();
    o.offenders = server.offenders();
    o.failure = server.failure();
    if (!ok) CHECK_FALSE(server.failure().empty());
    std::vector<uint32_t> sum = server.unmask();
    o.secure.resize(len);
    dequantise(sum.data(), len, scale, o.secure.data());
    o.plain.assign(len, 0.f);
    for (uint32_t u : o.u3)
      for (size_t i = 0; i < len; ++i) o.plain[i] += x[u - 1][i] / static_cast<float>(n);
    o.completed = true;
  } catch (const Error& e) {
    o.error = e.what();
    o.offenders = server.offenders();
  }
  return o;
}

std::string offence_text(const Offence& o) {
  return o.text([](uint32_t i) { return std::to_string(i); });
}

}  // namespace

TEST_CASE("secagg: a client whose pairs do not decrypt is rejected and the others' round completes") {
  const Params p = params(4, 3);
  const uint32_t n = 7;  // a ring of degree 4: client 3 has 4 neighbours
  SUBCASE("garbage pairs to every neighbour") {
    std::map<uint32_t, std::map<uint32_t, std::string>> rejected;
    Outcome o = run_tampered(
        n, p, 200,
        [](uint32_t u, wire::SecAgg& m) {
          if (u == 3)
            for (auto& sh : m.shares) sh.data[40] ^= 0x5a;
        },
        &rejected);
    REQUIRE_MESSAGE(o.completed, o.error);
    CHECK(o.u3.size() == n - 1);
    CHECK_FALSE(o.u3.count(3));
    CHECK(rejected.size() == 4);  // each neighbour of 3, and only 3
    for (const auto& [u, bad] : rejected) {
      CHECK(bad.size() == 1);
      CHECK(bad.begin()->first == 3);
      CHECK(bad.begin()->second.find("does not decrypt") != std::string::npos);
    }
    // Each report carried evidence: the server opened the pairs and blames 3 alone.
    REQUIRE(o.offenders.size() == 1);
    CHECK(o.offenders.begin()->first == 3);
    CHECK(std::string(o.offenders.begin()->second.stage) == "shares");
    CHECK(offence_text(o.offenders.begin()->second).find("its encrypted pair to client") != std::string::npos);
    CHECK(max_diff(o.secure, o.plain) <= static_cast<float>(n / ring_scale(n, p.clip)) + 1e-7f);
  }
  SUBCASE("one garbage pair and three good ones: the holders reveal its mask key") {
    Outcome o = run_tampered(n, p, 200, [](uint32_t u, wire::SecAgg& m) {
      if (u == 3) m.shares[0].data.resize(10);
    });
    REQUIRE_MESSAGE(o.completed, o.error);
    CHECK_FALSE(o.u3.count(3));
    CHECK(o.u3.size() == n - 1);
    CHECK(max_diff(o.secure, o.plain) <= static_cast<float>(n / ring_scale(n, p.clip)) + 1e-7f);
  }
  SUBCASE("good pairs to fewer than t neighbours: that round cannot unmask (it costs this round only)") {
    // Two pairs swapped: two neighbours reject 3, two hold its pair and masked
    // with it, and 2 shares of its mask key are too few for t = 3.
    Outcome o = run_tampered(n, p, 64, [](uint32_t u, wire::SecAgg& m) {
      if (u == 3) std::swap(m.shares[0].data, m.shares[1].data);
    });
    CHECK_FALSE(o.completed);
    CHECK(o.error.find("dropped client 3: 2 of 3 mask-key shares") != std::string::npos);
  }
  SUBCASE("a client excluded after its shares is a dropout, its masked update refused") {
    Outcome o = run_tampered(
        n, p, 64, [](uint32_t, wire::SecAgg&) {}, nullptr, 5);
    REQUIRE_MESSAGE(o.completed, o.error);
    CHECK_FALSE(o.u3.count(5));
    CHECK(o.u3.size() == n - 1);
    CHECK(max_diff(o.secure, o.plain) <= static_cast<float>(n / ring_scale(n, p.clip)) + 1e-7f);
  }
}

TEST_CASE("secagg: the server refuses a rejection of a client that sent no pair, and waits for no excluded client") {
  const Params p = params(4, 3);
  const uint32_t n = 5;
  Server server(p, 1, n, 3, 8);
  std::vector<std::unique_ptr<Client>> c;
  for (uint32_t u = 1; u <= n; ++u) {
    c.push_back(std::make_unique<Client>(wire::SecAggSetup{u, n, 4, 3, 3, 1.0, 0.2}, 1, "c"));
    if (u != 5) server.add_keys(u, c.back()->keys());
  }
  CHECK(server.open_for(wire::SecAggStage::kKeys));
  CHECK_FALSE(server.open_for(wire::SecAggStage::kShares));
  CHECK_FALSE(server.stage_complete());
  server.exclude(5);
  CHECK(server.stage_complete());
  CHECK(server.excluded(5));
  for (auto& [u, m] : server.neighbour_messages()) server.add_shares(u, c[u - 1]->shares(m));
  auto in = server.shares_in_messages();
  for (auto& sh : in.at(1).shares)
    if (sh.peer == 2) sh.data[20] ^= 0x10;  // 2's pair to 1 spoilt on the way: 1 rejects 2, with evidence
  CHECK(c[0]->receive_shares(in.at(1)).count(2) == 1);
  wire::SecAgg y = c[0]->masked(std::vector<uint32_t>(8, 1));
  REQUIRE(y.evidence.size() == 1);
  wire::SecAgg no_pair = y;
  no_pair.rejected = {5};  // 5 sent no keys, hence no pair
  CHECK_THROWS_WITH_AS(server.add_masked(1, no_pair), doctest::Contains("sent it no pair"), Error);
  wire::SecAgg bare = y;
  bare.evidence.clear();
  CHECK_THROWS_WITH_AS(server.add_masked(1, bare), doctest::Contains("without the evidence"), Error);
  wire::SecAgg forged = y;
  forged.evidence[0].data[40] ^= 1;
  CHECK_THROWS_WITH_AS(server.add_masked(1, forged), doctest::Contains("does not verify"), Error);
  // The pair as the server holds it is good (it was spoilt after routing),
  // so this report is false: 1 is the offender and out, 2 stays in.
  server.add_masked(1, y);
  CHECK(server.reported().count(2) == 0);
  CHECK(server.excluded(1));
  REQUIRE(server.offenders().count(1) == 1);
  CHECK(std::string(server.offenders().at(1).stage) == "masked");
  CHECK(server.offenders().count(2) == 0);
}

TEST_CASE("secagg: Shamir with wrong shares: outvoted when the redundancy allows, never a wrong secret") {
  Secret s{};
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<uint8_t>(7 * i + 1);
  auto corrupt = [](std::string& sh) { sh[1 + 9] = static_cast<char>(sh[1 + 9] ^ 0x21); };
  SUBCASE("all shares right: the secret, nobody named") {
    const auto sh = shamir_split(s, 3, {1, 2, 3, 4, 5});
    std::vector<size_t> wrong{99};
    CHECK(shamir_combine_robust(sh, 3, &wrong) == s);
    CHECK(wrong.empty());
  }
  SUBCASE("t + 2 shares, one wrong: corrected and the wrong one named") {
    for (size_t bad = 0; bad < 5; ++bad) {
      auto sh = shamir_split(s, 3, {1, 2, 3, 4, 5});
      corrupt(sh[bad]);
      std::vector<size_t> wrong;
      CHECK(shamir_combine_robust(sh, 3, &wrong) == s);
      CHECK(wrong == std::vector<size_t>{bad});
    }
  }
  SUBCASE("t + 1 shares, one wrong: detected, no secret") {
    auto sh = shamir_split(s, 3, {1, 2, 3, 4});
    corrupt(sh[1]);
    CHECK_FALSE(shamir_combine_robust(sh, 3).has_value());
  }
  SUBCASE("16 shares, t = 9, three wrong: corrected (a search over t-subsets)") {
    std::vector<uint8_t> xs;
    for (uint8_t x = 1; x <= 16; ++x) xs.push_back(x);
    auto sh = shamir_split(s, 9, xs);
    for (size_t bad : {0, 4, 11}) corrupt(sh[bad]);
    std::vector<size_t> wrong;
    CHECK(shamir_combine_robust(sh, 9, &wrong) == s);
    CHECK(wrong == std::vector<size_t>{0, 4, 11});
  }
  SUBCASE("more wrong shares than it corrects: no secret rather than a wrong one") {
    auto sh = shamir_split(s, 3, {1, 2, 3, 4, 5});
    corrupt(sh[0]);
    sh[3][1 + 2] = static_cast<char>(sh[3][1 + 2] ^ 0x40);
    CHECK_FALSE(shamir_combine_robust(sh, 3).has_value());
  }
}

TEST_CASE("secagg: a survivor revealing wrong shares is named by the digests and never unmasked into the sum") {
  // Client 2 flips a byte of every share it reveals (well formed, so add_reveal takes it).
  auto liar = [](uint32_t u, wire::SecAgg& m) {
    if (u == 2)
      for (auto& sh : m.shares) sh.data[5] = static_cast<char>(sh.data[5] ^ 0x11);
  };
  const uint32_t n = 7;
  SUBCASE("six holders per secret, t = 3: the sum is right and client 2 is named for each of its neighbours") {
    const Params p = params(6, 3);
    Outcome o = run_tampered(
        n, p, 200, [](uint32_t, wire::SecAgg&) {}, nullptr, 0, 11, liar);
    REQUIRE_MESSAGE(o.completed, o.error);
    CHECK(o.u3.size() == n);
    CHECK(max_diff(o.secure, o.plain) <= static_cast<float>(n / ring_scale(n, p.clip)) + 1e-7f);
    REQUIRE(o.wrong.size() == 1);
    CHECK(o.wrong.begin()->first == 2);
    CHECK(o.wrong.begin()->second == std::set<uint32_t>{1, 3, 4, 5, 6, 7});
  }
  SUBCASE("four holders per secret, t = 3: the wrong share does not match its digest, the sum is right") {
    const Params p = params(4, 3);
    Outcome o = run_tampered(
        n, p, 64, [](uint32_t, wire::SecAgg&) {}, nullptr, 0, 11, liar);
    REQUIRE_MESSAGE(o.completed, o.error);
    CHECK(o.u3.size() == n);
    CHECK(max_diff(o.secure, o.plain) <= static_cast<float>(n / ring_scale(n, p.clip)) + 1e-7f);
    REQUIRE(o.wrong.size() == 1);
    CHECK(o.wrong.begin()->first == 2);
    REQUIRE(o.offenders.size() == 1);
    CHECK(offence_text(o.offenders.at(2)).rfind("it revealed a wrong share of client ", 0) == 0);
  }
  SUBCASE("exactly t holders per secret: no verified reconstruction, the round fails, the liar is still named") {
    const Params p = params(4, 4);  // 5 clients, complete graph: 4 holders per secret, t = 4
    Outcome o = run_tampered(
        5, p, 64, [](uint32_t, wire::SecAgg&) {}, nullptr, 0, 11, liar);
    CHECK_FALSE(o.completed);
    CHECK(o.failure.find("3 of the 4 self-mask shares revealed are the ones dealt, 4 needed") != std::string::npos);
    REQUIRE(o.wrong.size() == 1);
    CHECK(o.wrong.at(2) == std::set<uint32_t>{1, 3, 4, 5});
    REQUIRE(o.offenders.size() == 1);
    CHECK(o.offenders.count(2) == 1);
  }
}

TEST_CASE("secagg: a false report is disproven and its maker taken out, the accused stays in the sum") {
  const Params p = params(6, 3);  // complete: 1 and 3 are neighbours of 2
  const uint32_t n = 7;
  // Client 2 spoils the pairs of 1 and 3 it was sent, then rejects their
  // senders with (true) evidence of its key agreement: the server opens the
  // pairs it routed, finds them good, and blames 2.
  Outcome o = run_tampered(
      n, p, 200, [](uint32_t, wire::SecAgg&) {}, nullptr, 0, 11, {},
      [](uint32_t u, wire::SecAgg& m) {
        if (u == 2)
          for (auto& sh : m.shares)
            if (sh.peer == 1 || sh.peer == 3) sh.data[30] ^= 0x42;
      });
  REQUIRE_MESSAGE(o.completed, o.error);
  CHECK(o.u3 == std::set<uint32_t>{1, 3, 4, 5, 6, 7});  // 2 is a dropout; 1 and 3 are in
  CHECK(max_diff(o.secure, o.plain) <= static_cast<float>(n / ring_scale(n, p.clip)) + 1e-7f);
  REQUIRE(o.offenders.size() == 1);
  CHECK(std::string(o.offenders.at(2).stage) == "masked");
  INFO(offence_text(o.offenders.at(2)));
  CHECK(offence_text(o.offenders.at(2)).rfind("it falsely rejected the pair of client 1,3", 0) == 0);
}

TEST_CASE("secagg: a dealer whose digests or commitment do not fit its shares is caught, never unmasked wrong") {
  const Params p = params(4, 3);
  const uint32_t n = 7;
  SUBCASE("a digest that does not match the share dealt: the holder rejects the pair, the evidence blames the dealer") {
    std::map<uint32_t, std::map<uint32_t, std::string>> rejected;
    Outcome o = run_tampered(
        n, p, 64,
        [](uint32_t u, wire::SecAgg& m) {
          if (u == 3) m.shares[0].digest[5] ^= 1;
        },
        &rejected);
    REQUIRE_MESSAGE(o.completed, o.error);
    REQUIRE(rejected.size() == 1);
    CHECK(rejected.begin()->second.at(3).find("does not match the digests") != std::string::npos);
    CHECK_FALSE(o.u3.count(3));
    REQUIRE(o.offenders.size() == 1);
    CHECK(std::string(o.offenders.at(3).stage) == "shares");
    CHECK(max_diff(o.secure, o.plain) <= static_cast<float>(n / ring_scale(n, p.clip)) + 1e-7f);
  }
  SUBCASE("a commitment to another seed: the reconstruction fails its check and the round is not unmasked") {
    Outcome o = run_tampered(n, p, 64, [](uint32_t u, wire::SecAgg& m) {
      if (u == 3) m.commitment[0] ^= 1;
    });
    CHECK_FALSE(o.completed);
    CHECK(o.failure.find("client 3 dealt do not reconstruct its committed seed") != std::string::npos);
    REQUIRE(o.offenders.size() == 1);
    CHECK(offence_text(o.offenders.at(3)).find("self-mask seed it committed to") != std::string::npos);
  }
  SUBCASE("Shares without the commitment or the digests (a client before protocol 1.8) are refused") {
    Outcome a = run_tampered(n, p, 8, [](uint32_t u, wire::SecAgg& m) {
      if (u == 1) m.commitment.clear();
    });
    CHECK(a.error.find("before protocol 1.8") != std::string::npos);
    Outcome b = run_tampered(n, p, 8, [](uint32_t u, wire::SecAgg& m) {
      if (u == 1) m.shares[1].digest.clear();
    });
    CHECK(b.error.find("without the digests") != std::string::npos);
  }
}

TEST_CASE("secagg: evidence proves one key agreement and nothing else") {
  const EncKeyPair holder = EncKeyPair::fresh(), owner = EncKeyPair::fresh(), other = EncKeyPair::fresh();
  const std::string ev = make_evidence(holder.sk, holder.pk, owner.pk, 5, 2, 7);
  REQUIRE(ev.size() == kEvidenceBytes);
  const auto point = check_evidence(ev, holder.pk, owner.pk, 5, 2, 7);
  REQUIRE(point.has_value());
  // The point is the key agreement both ends compute: it opens the owner's pair.
  const std::string b(kShareBytes, '\x01'), s(kShareBytes, '\x02');
  std::string bx = b, sx = s;
  bx[0] = sx[0] = 4;  // x = 4
  const std::string ct = seal_pair(owner.sk, holder.pk, 5, 2, 7, bx, sx);
  const std::string dg = share_digest(bx, 1, 5, 2, 7) + share_digest(sx, 2, 5, 2, 7);
  const OpenedPair o = open_pair_with_point(*point, 5, 2, 7, 4, ct, dg);
  CHECK(o.error.empty());
  CHECK(o.b_share == bx);
  CHECK(open_pair(holder.sk, owner.pk, 5, 2, 7, 4, ct, dg).s_share == sx);
  // Bound to the keys, the round and the pair.
  CHECK_FALSE(check_evidence(ev, other.pk, owner.pk, 5, 2, 7));
  CHECK_FALSE(check_evidence(ev, holder.pk, other.pk, 5, 2, 7));
  CHECK_FALSE(check_evidence(ev, holder.pk, owner.pk, 6, 2, 7));
  CHECK_FALSE(check_evidence(ev, holder.pk, owner.pk, 5, 3, 7));
  // A point that is not the agreement (a liar's) does not verify, whatever the proof.
  std::string forged = ev;
  forged.replace(0, 32, other.pk);
  CHECK_FALSE(check_evidence(forged, holder.pk, owner.pk, 5, 2, 7));
  // The pair opened with another point fails: a false point cannot frame the owner.
  CHECK(open_pair_with_point(other.pk, 5, 2, 7, 4, ct, dg).error.find("does not decrypt") != std::string::npos);
  // Digests: a share other than the one dealt does not match.
  std::string wrong = bx;
  wrong[9] ^= 1;
  CHECK(share_digest(wrong, 1, 5, 2, 7) != share_digest(bx, 1, 5, 2, 7));
  CHECK(share_digest(bx, 1, 5, 2, 7) != share_digest(bx, 2, 5, 2, 7));
  CHECK(share_digest(bx, 1, 5, 2, 7) != share_digest(bx, 1, 5, 2, 8));
  CHECK_FALSE(usable_enc_key(std::string(32, '\0')));
  CHECK(usable_enc_key(holder.pk));
}
