// Downlink catch-up over loopback (docs/server.md, "Send tasks"): three
// clients, one a round, so each returns after missing two rounds. Whatever
// the downlink_catchup policy, each client rebuilds B_{r-1} bit for bit from
// what it was sent (a chain, a patch, or the dense model); a client of
// protocol 1.8 gets the dense model.
#include "tests/server/server_fixture.h"

#include <cstring>
#include <map>

#include "compression/compressor.h"
#include "core/models.h"
#include "server/server.h"
#include "server/store.h"
#include "wire/wire.h"

using namespace sparrow;
using namespace sparrow::server;
using namespace sparrow::server_fixture;

namespace {

struct Held {
  uint64_t round = 0;
  Weights w;
};

struct Seen {
  std::map<uint64_t, Weights> model_at;  // round r: the B_{r-1} its client rebuilt
  std::map<wire::ModelEncoding, int> kinds;
  std::map<std::string, std::map<wire::ModelEncoding, int>> kinds_of;  // per client
  double chains = 0, patches = 0;                                      // the rounds' downlink.* metrics
  std::map<std::string, std::map<bool, int>> packed_of;  // per client: catch-up tasks packed (1.10) or not
};

Weights copy(const Weights& w) {
  Weights out;
  for (const auto& [k, v] : w) out[k] = v.clone();
  return out;
}

bool same_bits(const Weights& x, const Weights& y) {
  if (x.size() != y.size()) return false;
  for (const auto& [n, v] : x) {
    if (!y.count(n)) return false;
    const at::Tensor& u = y.at(n);
    if (u.numel() != v.numel() || std::memcmp(u.data_ptr<float>(), v.data_ptr<float>(), 4 * v.numel()) != 0)
      return false;
  }
  return true;
}

// The client's side of a Task (both clients' rule; the base must be the one held).
Weights rebuild(const wire::Task& t, const Held& h) {
  if (t.model_encoding == wire::ModelEncoding::kFull) {
    Weights w;
    for (const auto& nt : t.weights) w[nt.name] = compression::decode(nt.tensor).contiguous();
    return w;
  }
  REQUIRE(t.base_round == h.round);
  Weights w = copy(h.w);
  if (t.model_encoding == wire::ModelEncoding::kPatch) {
    for (const auto& nt : t.weights)
      wire::apply_patch(nt.tensor, w.at(nt.name).data_ptr<float>(), w.at(nt.name).numel());
  } else if (t.model_encoding == wire::ModelEncoding::kChain) {
    for (const auto& step : t.chain)
      for (const auto& nt : step) compression::decode_add(nt.tensor, w.at(nt.name), 1.0f);
  } else {
    for (const auto& nt : t.weights) compression::decode_add(nt.tensor, w.at(nt.name), 1.0f);
  }
  return w;
}

// The MLP (199,210 parameters): on the tiny model a chain's framing alone
// outweighs the dense model.
Weights mlp_weights() {
  Weights w0;
  for (const auto& p : core::make_model("mlp", 1)->named_parameters(true))
    w0[p.key()] = p.value().detach().to(at::kFloat).contiguous().clone();
  return w0;
}

// `old_minor` > 0: client "c" speaks protocol 1.old_minor.
Seen run_policy(const std::string& policy, const std::string& name, uint16_t old_minor = 0) {
  ServerConfig c;
  c.listen = "tcp://127.0.0.1:*";
  c.model = "mlp";
  c.insecure = true;
  c.rounds = 8;
  c.clients_per_round = 1;
  c.quorum = 1;
  c.round_deadline_s = 10;
  c.heartbeat_ms = 10000;
  c.workers = 2;
  c.downlink = "topk:ratio=0.01";
  c.downlink_catchup = policy;
  c.db = fresh_db_file("server_test_catchup_", name);
  const Weights w0 = mlp_weights();
  Server server(c, w0);
  zmq::context_t ctx;
  std::vector<std::unique_ptr<FakeClient>> clients;
  std::map<std::string, Held> held;
  for (const char* id : {"a", "b", "c"}) {
    clients.push_back(std::make_unique<FakeClient>(ctx, server.endpoint(), id));
    held[id] = Held{0, copy(w0)};
    clients.back()->model = "mlp";
  }
  Running run(server);
  for (auto& cl : clients) {
    if (old_minor > 0 && cl->id == "c") {
      wire::Hello h;
      h.client_id = "c";
      h.num_samples = 1;
      h.model = "mlp";
      h.model_digest = server.model_digest();
      h.last_round = 0;
      wire::Message m = message(h);
      m.minor = old_minor;
      cl->send(m);
      cl->expect<wire::Welcome>();
    } else {
      cl->hello(server.model_digest(), 1, 0);
    }
  }
  Seen seen;
  for (uint64_t r = 1; r <= static_cast<uint64_t>(c.rounds); ++r) {
    std::optional<wire::Task> task;
    FakeClient* who = nullptr;
    for (int tries = 0; tries < 400 && !task; ++tries)
      for (auto& cl : clients) {
        auto m = cl->next(10);
        if (!m) continue;
        if (auto* t = std::get_if<wire::Task>(&m->body)) {
          task = *t;
          who = cl.get();
          break;
        }
      }
    REQUIRE_MESSAGE(task.has_value(), "no task for round " << r);
    REQUIRE(task->round == r);
    Held& h = held[who->id];
    Weights w = rebuild(*task, h);
    seen.model_at[r] = copy(w);
    seen.kinds[task->model_encoding]++;
    seen.kinds_of[who->id][task->model_encoding]++;
    if (task->model_encoding != wire::ModelEncoding::kFull) seen.packed_of[who->id][task->packed]++;
    h = Held{r - 1, std::move(w)};
    Weights d;
    for (const auto& [k, v] : w0) d[k] = at::full_like(v, 0.01f * static_cast<float>(r)) * v.cos();
    who->update(r, d, 1);
  }
  for (int i = 0; i < 1000 && server.completed_rounds() < c.rounds; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE(server.completed_rounds() == c.rounds);
  server.stop();
  run.join();
  auto store = ServerStore::open_readonly(c.db);
  for (int64_t r = 1; r <= c.rounds; ++r)
    for (const auto& [k, v] : store->metrics(r)) {
      if (k == "downlink.chain") seen.chains += v;
      if (k == "downlink.patch") seen.patches += v;
    }
  return seen;
}

}  // namespace

TEST_CASE("catch-up: clients that missed rounds rebuild B_{r-1} bit for bit from a chain, a patch or the model") {
  const Seen full = run_policy("full", "full"), chain = run_policy("chain", "chain"),
             patch = run_policy("patch", "patch"), autop = run_policy("auto", "auto");
  REQUIRE(full.model_at.size() == 8);
  for (const Seen* s : {&chain, &patch, &autop}) {
    REQUIRE(s->model_at.size() == 8);
    for (const auto& kv : full.model_at) {
      const uint64_t round = kv.first;
      CAPTURE(round);
      CHECK(same_bits(s->model_at.at(round), kv.second));
    }
  }
  // Three clients, one a round: from round 4 on each holds B_{r-4}.
  CHECK(full.kinds.count(wire::ModelEncoding::kChain) == 0);
  CHECK(full.kinds.count(wire::ModelEncoding::kPatch) == 0);
  CHECK(full.kinds.at(wire::ModelEncoding::kFull) >= 4);
  CHECK(chain.kinds.at(wire::ModelEncoding::kChain) >= 4);
  CHECK(patch.kinds.at(wire::ModelEncoding::kPatch) >= 4);
  CHECK(autop.kinds.count(wire::ModelEncoding::kFull) == 0);
  // The rounds' metrics count them.
  CHECK(chain.chains == chain.kinds.at(wire::ModelEncoding::kChain));
  CHECK(patch.patches == patch.kinds.at(wire::ModelEncoding::kPatch));
}

TEST_CASE("catch-up: a client of protocol 1.8 gets the dense model where a chain would go") {
  const Seen s = run_policy("chain", "old", wire::kCatchupMinor - 1);
  REQUIRE(s.kinds_of.count("c"));
  CHECK(s.kinds_of.at("c").count(wire::ModelEncoding::kChain) == 0);
  CHECK(s.kinds_of.at("c").count(wire::ModelEncoding::kFull) >= 1);
  CHECK(s.kinds.at(wire::ModelEncoding::kChain) >= 2);  // the others still get chains
}

TEST_CASE(
    "catch-up: clients of 1.10 get catch-up tasks packed, a client of 1.9 as tables, and all rebuild the same models") {
  const Seen now = run_policy("auto", "packed"), old = run_policy("auto", "tables", wire::kPackedMinor - 1);
  REQUIRE(now.model_at.size() == 8);
  REQUIRE(old.model_at.size() == 8);
  for (const auto& kv : now.model_at) {
    const uint64_t round = kv.first;
    CAPTURE(round);
    CHECK(same_bits(old.model_at.at(round), kv.second));
  }
  for (const char* id : {"a", "b", "c"}) {
    CAPTURE(id);
    REQUIRE(now.packed_of.count(id));
    CHECK(now.packed_of.at(id).count(false) == 0);
    CHECK(now.packed_of.at(id).at(true) >= 1);
  }
  REQUIRE(old.packed_of.count("c"));
  CHECK(old.packed_of.at("c").count(true) == 0);
  CHECK(old.packed_of.at("c").at(false) >= 1);
  CHECK(old.packed_of.at("a").at(true) >= 1);
  // The old client still gets chains or patches (it reads 1.9), just not packed.
  CHECK(old.kinds_of.at("c").count(wire::ModelEncoding::kChain) +
            old.kinds_of.at("c").count(wire::ModelEncoding::kPatch) >=
        1);
}
