#include "tests/server/server_fixture.h"

#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>
#include <zmq.hpp>

#include "aggregation/robust.h"
#include "compression/compressor.h"
#include "compression/lowrank.h"
#include "core/error.h"
#include "core/npy.h"
#include "server/server.h"
#include "server/store.h"
#include "wire/net.h"
#include "wire/wire.h"

using namespace sparrow;
using namespace sparrow::server;
namespace fs = std::filesystem;
using namespace sparrow::server_fixture;

namespace {

std::string fresh_db(const std::string& name) { return server_fixture::fresh_db_file("server_test_", name); }

ServerConfig base_config(const std::string& name) {
  ServerConfig c;
  c.listen = "tcp://127.0.0.1:*";
  c.model = "tiny";
  c.insecure = true;
  c.rounds = 1;
  c.clients_per_round = 2;
  c.quorum = 1;
  c.round_deadline_s = 5;
  c.heartbeat_ms = 10000;  // the fake clients never heartbeat: no session may expire under a loaded CI machine
  c.workers = 2;
  c.db = fresh_db(name);
  return c;
}

Weights scaled(const Weights& w, float s) {
  Weights out;
  for (const auto& [k, v] : w) out[k] = at::full_like(v, s);
  return out;
}

}  // namespace

TEST_CASE("a round aggregates updates into the weighted average") {
  Server server(base_config("avg"), tiny_weights());
  zmq::context_t ctx;
  FakeClient a(ctx, server.endpoint(), "a"), b(ctx, server.endpoint(), "b");
  Running run(server);
  CHECK(a.hello(server.model_digest(), 1).round == 0);
  b.hello(server.model_digest(), 3);
  const Weights w0 = tiny_weights();
  wire::Task ta = a.expect<wire::Task>(), tb = b.expect<wire::Task>();
  CHECK(ta.round == 1);
  // The client holds the initial model (last_round 0): an empty Delta.
  CHECK(ta.model_encoding == wire::ModelEncoding::kDelta);
  CHECK(ta.base_round == 0);
  CHECK(ta.weights.empty());
  CHECK(ta.seed != tb.seed);
  Weights da, db;
  da["fc.weight"] = at::randn({4, 3});
  da["fc.bias"] = at::randn({4});
  db["fc.weight"] = at::randn({4, 3});
  db["fc.bias"] = at::randn({4});
  a.update(1, da, 1);
  b.update(1, db, 3);
  CHECK(a.expect<wire::Ack>().round == 1);
  CHECK(b.expect<wire::Ack>().round == 1);
  run.join();
  REQUIRE_FALSE(run.error);
  CHECK(server.completed_rounds() == 1);
  Weights g = server.global_weights();
  for (const auto& [k, v] : w0) {
    at::Tensor expected = v + (da[k] * 1 + db[k] * 3) / 4;
    CHECK(at::allclose(g[k], expected, 1e-5, 1e-6));
  }
  const Counters c = server.counters();
  CHECK(c.updates_accepted == 2);
  CHECK(c.rounds_completed == 1);
  CHECK(c.rejected() == 0);
  // The checkpoint holds exactly these bytes.
  auto store = ServerStore::open_readonly(server.config().db);
  CHECK(store->latest_checkpoint()->weights == serialize_weights(g));
  CHECK(store->rounds().at(0).updates == 2);
  CHECK(store->clients().size() == 2);
}

TEST_CASE("stale and repeated updates get an error and change nothing") {
  ServerConfig cfg = base_config("stale");
  cfg.rounds = 2;
  cfg.clients_per_round = 1;
  Server server(cfg, tiny_weights());
  zmq::context_t ctx;
  FakeClient a(ctx, server.endpoint(), "a");
  Running run(server);
  a.hello(server.model_digest(), 2);
  REQUIRE(a.expect<wire::Task>().round == 1);
  const Weights d1 = scaled(tiny_weights(), 0.5f);
  a.update(1, d1, 2);
  a.expect<wire::Ack>();
  // A second update for round 1 (the round closed on the first): never applied.
  a.update(1, scaled(tiny_weights(), 100.f), 2);
  // The Error and round 2's Task may come in either order.
  std::optional<wire::ErrorBody> err;
  std::optional<wire::Task> task;
  for (int i = 0; i < 2; ++i) {
    auto m = a.next();
    REQUIRE(m.has_value());
    if (auto* x = std::get_if<wire::ErrorBody>(&m->body)) err = *x;
    if (auto* x = std::get_if<wire::Task>(&m->body)) task = *x;
  }
  REQUIRE(err.has_value());
  REQUIRE(task.has_value());
  CHECK(err->code == wire::ErrorCode::kRejected);
  CHECK(err->round == std::optional<uint64_t>(1));
  const wire::Task& t2 = *task;
  REQUIRE(t2.round == 2);
  // It holds B_0 (+ its own training), not B_1: without downlink compression, Full.
  CHECK(t2.model_encoding == wire::ModelEncoding::kFull);
  // An update for round 1 in round 2: stale.
  a.update(1, scaled(tiny_weights(), 100.f), 2);
  wire::ErrorBody e = a.expect_error();
  CHECK(e.code == wire::ErrorCode::kRejected);
  CHECK(e.message.find("stale") != std::string::npos);
  CHECK(server.counters().stale == 2);
  const Weights d2 = scaled(tiny_weights(), -0.25f);
  a.update(2, d2, 2);
  a.expect<wire::Ack>();
  run.join();
  REQUIRE_FALSE(run.error);
  Weights g = server.global_weights();
  for (const auto& [k, v] : tiny_weights()) CHECK(at::allclose(g[k], v + d1.at(k) + d2.at(k)));
  CHECK(server.counters().stale == 2);
  CHECK(server.counters().updates_accepted == 2);
}

TEST_CASE("malformed NaN and wrong shape updates are rejected and the server keeps serving") {
  ServerConfig cfg = base_config("malformed");
  cfg.clients_per_round = 1;
  Server server(cfg, tiny_weights());
  zmq::context_t ctx;
  FakeClient a(ctx, server.endpoint(), "a");
  Running run(server);
  a.hello(server.model_digest(), 2);
  REQUIRE(a.expect<wire::Task>().round == 1);
  // Garbage bytes.
  a.send_raw("definitely not a flatbuffer");
  CHECK(a.expect_error().code == wire::ErrorCode::kMalformed);
  // NaN values: caught by verification.
  Weights bad = scaled(tiny_weights(), 1.f);
  bad["fc.bias"][1] = std::nanf("");
  a.update(1, bad, 2);
  CHECK(a.expect_error().code == wire::ErrorCode::kMalformed);
  // Wrong shape.
  Weights shape = scaled(tiny_weights(), 1.f);
  shape["fc.weight"] = at::ones({3, 4});
  a.update(1, shape, 2);
  wire::ErrorBody e = a.expect_error();
  CHECK(e.code == wire::ErrorCode::kRejected);
  CHECK(e.round == std::optional<uint64_t>(1));
  // Missing tensor.
  Weights missing;
  missing["fc.bias"] = at::ones({4});
  a.update(1, missing, 2);
  CHECK(a.expect_error().code == wire::ErrorCode::kRejected);
  // Zero samples.
  a.update(1, scaled(tiny_weights(), 1.f), 0);
  CHECK(a.expect_error().code == wire::ErrorCode::kRejected);
  // Large garbage goes through the pool: still an Error.
  a.send_raw(std::string(200000, 'x'));
  CHECK(a.expect_error().code == wire::ErrorCode::kMalformed);
  // A good one is still accepted and only it is applied.
  const Weights good = scaled(tiny_weights(), 0.125f);
  a.update(1, good, 2);
  a.expect<wire::Ack>();
  run.join();
  REQUIRE_FALSE(run.error);
  Weights g = server.global_weights();
  for (const auto& [k, v] : tiny_weights()) CHECK(at::allclose(g[k], v + good.at(k)));
  const Counters c = server.counters();
  CHECK(c.updates_accepted == 1);
  CHECK(c.rejected_by_code[static_cast<size_t>(wire::ErrorCode::kMalformed)] == 3);
  CHECK(c.rejected_by_code[static_cast<size_t>(wire::ErrorCode::kRejected)] == 3);
}

TEST_CASE("unknown clients and bad hellos are refused") {
  ServerConfig cfg = base_config("unknown");
  cfg.clients_per_round = 1;
  Server server(cfg, tiny_weights());
  zmq::context_t ctx;
  FakeClient x(ctx, server.endpoint(), "x");
  Running run(server);
  x.send(message(wire::Heartbeat{0}));
  wire::ErrorBody e = x.expect_error();
  CHECK(e.message.rfind("unknown client", 0) == 0);
  x.update(1, scaled(tiny_weights(), 1.f), 1);
  CHECK(x.expect_error().message.rfind("unknown client", 0) == 0);
  CHECK(server.counters().unknown == 2);
  // Wrong digest, wrong model, zero samples.
  wire::Hello h;
  h.client_id = "x";
  h.num_samples = 1;
  h.model = "tiny";
  h.model_digest = server.model_digest() + 1;
  x.send(message(h));
  CHECK(x.expect_error().code == wire::ErrorCode::kRejected);
  h.model_digest = server.model_digest();
  h.model = "mlp";
  x.send(message(h));
  CHECK(x.expect_error().code == wire::ErrorCode::kRejected);
  h.model = "tiny";
  h.num_samples = 0;
  x.send(message(h));
  CHECK(x.expect_error().code == wire::ErrorCode::kRejected);
  // A proper Hello then gets a Welcome and a Full task (no last_round).
  x.hello(server.model_digest(), 1, std::nullopt);
  wire::Task t = x.expect<wire::Task>();
  CHECK(t.model_encoding == wire::ModelEncoding::kFull);
  REQUIRE(t.weights.size() == 2);
  x.update(1, scaled(tiny_weights(), 0.f), 1);
  x.expect<wire::Ack>();
}

TEST_CASE("the deadline closes a round with quorum without a silent client") {
  ServerConfig cfg = base_config("deadline");
  cfg.round_deadline_s = 0.3;
  Server server(cfg, tiny_weights());
  zmq::context_t ctx;
  FakeClient a(ctx, server.endpoint(), "a"), silent(ctx, server.endpoint(), "silent");
  Running run(server);
  a.hello(server.model_digest(), 5);
  silent.hello(server.model_digest(), 5);
  a.expect<wire::Task>();
  silent.expect<wire::Task>();
  const Weights d = scaled(tiny_weights(), 2.f);
  a.update(1, d, 5);
  a.expect<wire::Ack>();
  const auto t0 = std::chrono::steady_clock::now();
  run.join();
  REQUIRE_FALSE(run.error);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));
  CHECK(server.completed_rounds() == 1);
  Weights g = server.global_weights();
  for (const auto& [k, v] : tiny_weights()) CHECK(at::allclose(g[k], v + d.at(k)));
  // The silent client's late update is stale.
}

TEST_CASE("restart resumes after the last completed round with identical weights") {
  ServerConfig cfg = base_config("resume");
  cfg.rounds = 2;
  cfg.clients_per_round = 1;
  cfg.server_optimizer = "fedadam:lr=0.1";
  std::string bytes;
  {
    Server server(cfg, tiny_weights());
    zmq::context_t ctx;
    FakeClient a(ctx, server.endpoint(), "a");
    Running run(server);
    a.hello(server.model_digest(), 1);
    for (uint64_t r = 1; r <= 2; ++r) {
      REQUIRE(a.expect<wire::Task>().round == r);
      a.update(r, scaled(tiny_weights(), 0.1f * static_cast<float>(r)), 1);
      a.expect<wire::Ack>();
    }
    run.join();
    REQUIRE_FALSE(run.error);
    bytes = serialize_weights(server.global_weights());
    auto store = ServerStore::open_readonly(cfg.db);
    CHECK(store->latest_checkpoint()->round == 2);
    CHECK(store->latest_checkpoint()->weights == bytes);
  }
  cfg.rounds = 3;  // more rounds: the run goes on
  Server again(cfg, tiny_weights());
  CHECK(again.completed_rounds() == 2);
  CHECK(serialize_weights(again.global_weights()) == bytes);
  CHECK(again.counters().rounds_completed == 2);
  // Round 3 continues from there; the client holding round 2's model gets an empty Delta.
  zmq::context_t ctx;
  FakeClient a(ctx, again.endpoint(), "a");
  Running run(again);
  a.hello(again.model_digest(), 1, 2);
  wire::Task t = a.expect<wire::Task>();
  CHECK(t.round == 3);
  CHECK(t.model_encoding == wire::ModelEncoding::kDelta);
  CHECK(t.base_round == 2);
  a.update(3, scaled(tiny_weights(), 0.f), 1);
  a.expect<wire::Ack>();
  run.join();
  CHECK(again.completed_rounds() == 3);
}

TEST_CASE("downlink compression sends the compressed delta to clients one round behind") {
  ServerConfig cfg = base_config("downlink");
  cfg.rounds = 3;
  cfg.clients_per_round = 1;
  cfg.downlink = "topk:ratio=0.5";
  std::string bytes;
  {
    Server server(cfg, tiny_weights());
    zmq::context_t ctx;
    FakeClient a(ctx, server.endpoint(), "a");
    Running run(server);
    a.hello(server.model_digest(), 1);
    wire::Task t1 = a.expect<wire::Task>();
    CHECK(t1.model_encoding == wire::ModelEncoding::kDelta);
    CHECK(t1.base_round == 0);
    a.update(1, scaled(tiny_weights(), 0.5f), 1);
    a.expect<wire::Ack>();
    wire::Task t2 = a.expect<wire::Task>();
    CHECK(t2.round == 2);
    CHECK(t2.model_encoding == wire::ModelEncoding::kDelta);
    CHECK(t2.base_round == 0);
    REQUIRE(t2.weights.size() == 2);
    CHECK(t2.weights[0].tensor.format == compression::Format::kSparse);
    // B_1 = B_0 + C_1, with C_1 the top half of W_1 - B_0.
    a.update(2, scaled(tiny_weights(), 0.25f), 1);
    a.expect<wire::Ack>();
    for (int i = 0; i < 500 && server.completed_rounds() < 2; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    REQUIRE(server.completed_rounds() == 2);
    server.stop();
    run.join();
    bytes = serialize_weights(server.global_weights());
  }
  Server again(cfg, tiny_weights());
  CHECK(again.completed_rounds() == 2);
  CHECK(serialize_weights(again.global_weights()) == bytes);
  auto store = ServerStore::open_readonly(cfg.db);
  auto ck = store->latest_checkpoint();
  REQUIRE(ck.has_value());
  CHECK_FALSE(ck->broadcast.empty());
  CHECK_FALSE(ck->downlink_last.empty());
  // The downlink codec keeps no state between rounds: each round's encode
  // starts afresh at step r - 1 (federation::GlobalModel, as in sparrow-sim).
  CHECK(ck->downlink_state.empty());
}

TEST_CASE("ACP tasks carry the shared factor and factor updates aggregate") {
  ServerConfig cfg = base_config("acp");
  cfg.clients_per_round = 1;
  cfg.compression = "acp:rank=2";
  Weights w0;
  w0["big"] = at::randn({16, 16});
  w0["bias"] = at::zeros({16});
  Server server(cfg, w0);
  zmq::context_t ctx;
  FakeClient a(ctx, server.endpoint(), "a");
  Running run(server);
  wire::Hello h;
  h.client_id = "a";
  h.num_samples = 4;
  h.model = "tiny";
  h.model_digest = server.model_digest();
  h.last_round = 0;
  a.send(message(h));
  a.expect<wire::Welcome>();
  wire::Task t = a.expect<wire::Task>();
  REQUIRE(t.shared.size() == 1);  // only the compressible tensor
  CHECK(t.shared[0].name == "big");
  at::Tensor shared = compression::acp_factor(t.shared[0].tensor);
  CHECK(shared.sizes().vec() == compression::acp_shared_shape(compression::lowrank_dims({16, 16}, 2), 1));
  auto comp = compression::make_compressor(t.compression);
  wire::ModelUpdate u;
  u.round = 1;
  u.client_id = "a";
  u.num_samples = 4;
  Weights expected;
  for (const auto& [k, v] : w0) {
    compression::State st;
    compression::Context c;
    c.name = k;
    c.seed = t.seed;
    c.round = 1;
    if (k == "big") c.shared_factor = shared;
    compression::Encoded e = comp->encode(at::randn(v.sizes()), st, c);
    expected[k] = v + compression::decode(e, c);
    u.tensors.push_back({k, std::move(e)});
  }
  a.send(message(u));
  a.expect<wire::Ack>();
  run.join();
  REQUIRE_FALSE(run.error);
  Weights g = server.global_weights();
  for (const auto& [k, v] : expected) CHECK(at::allclose(g[k], v, 1e-4, 1e-5));
}

TEST_CASE("SCAFFOLD control deltas update the server control sent in tasks") {
  ServerConfig cfg = base_config("scaffold");
  cfg.rounds = 2;
  cfg.clients_per_round = 1;
  cfg.algorithm = "scaffold";
  Server server(cfg, tiny_weights());
  zmq::context_t ctx;
  FakeClient a(ctx, server.endpoint(), "a");
  Running run(server);
  a.hello(server.model_digest(), 1);
  wire::Task t1 = a.expect<wire::Task>();
  CHECK(t1.train.algorithm == "scaffold");
  CHECK(t1.control.empty());  // zeros before the first update
  wire::ModelUpdate u;
  u.round = 1;
  u.client_id = "a";
  u.num_samples = 1;
  for (const auto& [k, v] : tiny_weights()) {
    u.tensors.push_back({k, dense(at::zeros_like(v))});
    u.control_delta.push_back({k, dense(at::full_like(v, 0.5f))});
  }
  a.send(message(u));
  a.expect<wire::Ack>();
  wire::Task t2 = a.expect<wire::Task>();
  REQUIRE(t2.control.size() == 2);
  at::Tensor c = compression::decode(t2.control[0].tensor);
  CHECK(at::allclose(c, at::full_like(c, 0.5f)));  // one known client: c = mean of Δc
  // A control delta of the wrong shape is rejected.
  u.round = 2;
  u.control_delta[0].tensor = dense(at::ones({2}));
  a.send(message(u));
  CHECK(a.expect_error().code == wire::ErrorCode::kRejected);
  server.stop();
}

TEST_CASE("a database of another configuration is refused") {
  ServerConfig cfg = base_config("identity");
  { Server s(cfg, tiny_weights()); }
  cfg.lr = 0.5;
  CHECK_THROWS_AS(Server(cfg, tiny_weights()), ConfigError);
}

TEST_CASE("CURVE admits allow-listed keys only") {
  const std::string dir = "server_test_curve_keys";
  fs::remove_all(dir);
  net::KeyPair server_keys = net::generate_keypair(), good = net::generate_keypair(), bad = net::generate_keypair();
  net::write_keypair(dir, "server", server_keys);
  net::write_keypair(dir + "/allowed", "good", good);
  ServerConfig cfg = base_config("curve");
  cfg.insecure = false;
  cfg.clients_per_round = 1;
  cfg.server_key = dir + "/server.key_secret";
  cfg.allow = dir + "/allowed";
  Server server(cfg, tiny_weights());
  CHECK(server.public_key() == server_keys.public_key);
  zmq::context_t ctx;
  FakeClient intruder(ctx, server.endpoint(), "intruder", &bad, server_keys.public_key);
  FakeClient a(ctx, server.endpoint(), "a", &good, server_keys.public_key);
  Running run(server);
  wire::Hello h;
  h.client_id = "intruder";
  h.num_samples = 1;
  h.model = "tiny";
  h.model_digest = server.model_digest();
  intruder.send(message(h));
  CHECK_FALSE(intruder.next(300).has_value());  // the handshake never completes
  a.hello(server.model_digest(), 1);
  a.expect<wire::Task>();
  a.update(1, scaled(tiny_weights(), 1.f), 1);
  a.expect<wire::Ack>();
  run.join();
  REQUIRE_FALSE(run.error);
  auto store = ServerStore::open_readonly(cfg.db);
  auto clients = store->clients();
  REQUIRE(clients.size() == 1);
  CHECK(clients[0].public_key == good.public_key);  // bound to its key
}

TEST_CASE("a median round ignores one outlier client, central DP clips and reports epsilon") {
  SUBCASE("median") {
    ServerConfig cfg = base_config("median");
    cfg.clients_per_round = 3;
    cfg.quorum = 3;
    cfg.aggregator = "median";
    Server server(cfg, tiny_weights());
    zmq::context_t ctx;
    FakeClient a(ctx, server.endpoint(), "a"), b(ctx, server.endpoint(), "b"), c(ctx, server.endpoint(), "c");
    Running run(server);
    a.hello(server.model_digest(), 1);
    b.hello(server.model_digest(), 1);
    c.hello(server.model_digest(), 1000);  // a large claimed weight does not help under the median
    a.expect<wire::Task>();
    b.expect<wire::Task>();
    c.expect<wire::Task>();
    a.update(1, scaled(tiny_weights(), 0.1f), 1);
    b.update(1, scaled(tiny_weights(), 0.2f), 1);
    // An outlier inside max_update_norm (norm 4e4 < 1e6; beyond it the update
    // would be refused at admission, tests/aggregation/admission_test.cc).
    c.update(1, scaled(tiny_weights(), 1e4f), 1000);
    a.expect<wire::Ack>();
    b.expect<wire::Ack>();
    c.expect<wire::Ack>();
    run.join();
    REQUIRE_FALSE(run.error);
    const Weights w0 = tiny_weights();
    for (const auto& [k, v] : server.global_weights()) CHECK(at::allclose(v, w0.at(k) + 0.2f, 1e-5, 1e-6));
    auto store = ServerStore::open_readonly(server.config().db);
    CHECK(store->metrics(1).at("aggregate.kept") == 3);
  }
  SUBCASE("central dp") {
    ServerConfig cfg = base_config("dp");
    cfg.dp = "central:clip=1,noise=0";
    Server server(cfg, tiny_weights());
    zmq::context_t ctx;
    FakeClient a(ctx, server.endpoint(), "a"), b(ctx, server.endpoint(), "b");
    Running run(server);
    a.hello(server.model_digest(), 1);
    b.hello(server.model_digest(), 5);
    a.expect<wire::Task>();
    b.expect<wire::Task>();
    Weights big = scaled(tiny_weights(), 10.f);    // norm 40: clipped to 1
    Weights small = scaled(tiny_weights(), 0.1f);  // norm 0.4: kept
    a.update(1, big, 1);
    b.update(1, small, 5);
    a.expect<wire::Ack>();
    b.expect<wire::Ack>();
    run.join();
    REQUIRE_FALSE(run.error);
    const Weights w0 = tiny_weights();
    // (clip(big) + small) / m with m = clients_per_round = 2, sample counts ignored.
    for (const auto& [k, v] : server.global_weights())
      CHECK(at::allclose(v, w0.at(k) + (0.25f + 0.1f) / 2, 1e-5, 1e-6));
    auto store = ServerStore::open_readonly(server.config().db);
    const auto m = store->metrics(1);
    CHECK(m.at("aggregate.clipped") == 1);
    CHECK(m.count("dp.epsilon") == 0);  // noise 0: no guarantee to report
  }
}

TEST_CASE("a buffering aggregator over the memory bound is refused at start") {
  ServerConfig cfg = base_config("bound");
  cfg.aggregator = "median";
  cfg.max_buffer_mb = 1e-6;
  auto start = [&] { Server s(cfg, tiny_weights()); };
  CHECK_THROWS_AS(start(), ConfigError);
  cfg.aggregator = "mean";  // streaming: no bound applies
  CHECK_NOTHROW(start());
}

TEST_CASE("the adaptive DP clip is checkpointed and a restarted server continues from it") {
  ServerConfig cfg = base_config("adaptive");
  cfg.clients_per_round = 1;
  cfg.dp = "central:clip=1,noise=0,adaptive=1,quantile=0.5,clip_lr=0.2";
  std::string saved;
  {
    Server server(cfg, tiny_weights());
    zmq::context_t ctx;
    FakeClient a(ctx, server.endpoint(), "a");
    Running run(server);
    a.hello(server.model_digest(), 1);
    a.expect<wire::Task>();
    a.update(1, scaled(tiny_weights(), 0.01f), 1);  // norm 0.04 <= 1: the clip shrinks
    a.expect<wire::Ack>();
    run.join();
    REQUIRE_FALSE(run.error);
    saved = ServerStore::open_readonly(cfg.db)->latest_checkpoint()->aggregator;
  }
  aggregation::Aggregator check("mean", cfg.dp, 1, 0);
  check.deserialize_state(saved);
  CHECK(check.clip() == doctest::Approx(std::exp(-0.2 * 0.5)));
  // Round 2 after a restart clips at the checkpointed value, not at the configured one.
  cfg.rounds = 2;
  Server server(cfg, tiny_weights());
  REQUIRE(server.completed_rounds() == 1);
  zmq::context_t ctx;
  FakeClient a(ctx, server.endpoint(), "a");
  Running run(server);
  a.hello(server.model_digest(), 1, 1);
  a.expect<wire::Task>();
  a.update(2, scaled(tiny_weights(), 1.f), 1);  // norm 4: clipped
  a.expect<wire::Ack>();
  run.join();
  REQUIRE_FALSE(run.error);
  CHECK(ServerStore::open_readonly(cfg.db)->metrics(2).at("aggregate.clip") == doctest::Approx(std::exp(-0.2 * 0.5)));
}

TEST_CASE("one CURVE key is one client: other ids from the same key are refused, also after a restart") {
  const std::string dir = "server_test_one_key";
  fs::remove_all(dir);
  net::KeyPair server_keys = net::generate_keypair(), good = net::generate_keypair(), other = net::generate_keypair();
  net::write_keypair(dir, "server", server_keys);
  net::write_keypair(dir + "/allowed", "good", good);
  net::write_keypair(dir + "/allowed", "other", other);
  ServerConfig cfg = base_config("one_key");
  cfg.insecure = false;
  cfg.clients_per_round = 2;
  cfg.server_key = dir + "/server.key_secret";
  cfg.allow = dir + "/allowed";
  zmq::context_t ctx;
  {
    Server server(cfg, tiny_weights());
    Running run(server);
    FakeClient a(ctx, server.endpoint(), "a", &good, server_keys.public_key);
    a.hello(server.model_digest(), 1);
    // The same key under other ids, on new connections: refused, the first binding stands.
    for (const char* id : {"a2", "a3"}) {
      FakeClient sybil(ctx, server.endpoint(), id, &good, server_keys.public_key);
      wire::Hello h;
      h.client_id = id;
      h.num_samples = 1000;
      h.model = "tiny";
      h.model_digest = server.model_digest();
      sybil.send(message(h));
      CHECK(sybil.expect_error().message.find("one key is one client") != std::string::npos);
    }
    // The same key and id on a new connection is a reconnection, and another key is another client.
    FakeClient again(ctx, server.endpoint(), "a", &good, server_keys.public_key);
    again.hello(server.model_digest(), 1);
    FakeClient b(ctx, server.endpoint(), "b", &other, server_keys.public_key);
    b.hello(server.model_digest(), 1);
    server.stop();
    run.join();
    REQUIRE_FALSE(run.error);
  }
  Server restarted(cfg, tiny_weights());
  Running run(restarted);
  FakeClient sybil(ctx, restarted.endpoint(), "a9", &good, server_keys.public_key);
  wire::Hello h;
  h.client_id = "a9";
  h.num_samples = 1;
  h.model = "tiny";
  h.model_digest = restarted.model_digest();
  sybil.send(message(h));
  CHECK(sybil.expect_error().message.find("bound to client id 'a'") != std::string::npos);
}

TEST_CASE("a second server on the same database is refused, a server that cannot bind writes no run") {
  ServerConfig cfg = base_config("lock");
  Server first(cfg, tiny_weights());
  std::string what;
  try {
    Server second(cfg, tiny_weights());
  } catch (const ConfigError& e) {
    what = e.what();
  }
  CHECK(what.find("in use by another sparrow-server") != std::string::npos);
  ServerConfig busy = base_config("nobind");
  busy.listen = first.endpoint();  // taken
  CHECK_THROWS_AS(Server(busy, tiny_weights()), ConfigError);
  CHECK_FALSE(fs::exists(busy.db));
}

TEST_CASE("clients' holdout evaluations fill the round's accuracy when the server does not evaluate") {
  ServerConfig cfg = base_config("fedeval");
  cfg.clients_per_round = 3;
  cfg.quorum = 3;
  Server server(cfg, tiny_weights());
  zmq::context_t ctx;
  FakeClient a(ctx, server.endpoint(), "a"), b(ctx, server.endpoint(), "b"), c(ctx, server.endpoint(), "c");
  Running run(server);
  a.hello(server.model_digest(), 1);
  b.hello(server.model_digest(), 3);
  c.hello(server.model_digest(), 4);
  (void)a.expect<wire::Task>();
  (void)b.expect<wire::Task>();
  (void)c.expect<wire::Task>();
  Weights d = scaled(tiny_weights(), 0.1f);
  a.update(1, d, 1, {{"train_loss", 1.0}, {"eval_accuracy", 0.2}, {"eval_loss", 2.0}});
  b.update(1, d, 3, {{"train_loss", 1.0}, {"eval_accuracy", 0.6}, {"eval_loss", 1.0}});
  c.update(1, d, 4, {{"train_loss", 3.0}});  // no holdout: not part of the accuracy
  CHECK(a.expect<wire::Ack>().round == 1);
  CHECK(b.expect<wire::Ack>().round == 1);
  CHECK(c.expect<wire::Ack>().round == 1);
  run.join();
  REQUIRE_FALSE(run.error);
  auto store = ServerStore::open_readonly(server.config().db);
  const auto r = store->rounds().at(0);
  CHECK(r.train_loss == doctest::Approx((1.0 * 1 + 1.0 * 3 + 3.0 * 4) / 8));
  CHECK(r.eval_accuracy == doctest::Approx((0.2 * 1 + 0.6 * 3) / 4));  // weighted by samples
  CHECK(r.eval_loss == doctest::Approx((2.0 * 1 + 1.0 * 3) / 4));
}

TEST_CASE("the server evaluates on the user's data folder, checked against the model first") {
  const std::string dir = "server_test_evaldata";
  fs::remove_all(dir);
  fs::create_directories(dir);
  at::Tensor x = at::rand({8, 784}).contiguous(), y = at::arange(8, at::kFloat).contiguous();
  npy::write(dir + "/x.npy", {8, 784}, x.data_ptr<float>());
  npy::write(dir + "/y.npy", {8}, y.data_ptr<float>());
  ServerConfig cfg = base_config("evaldata");
  cfg.model = "mlp";
  cfg.eval_every = 1;
  cfg.eval_data = dir;
  CHECK_NOTHROW(Server(cfg, Weights{}));
  y.fill_(12);  // labels the 10-class model cannot have
  npy::write(dir + "/y.npy", {8}, y.data_ptr<float>());
  cfg.db = fresh_db("evaldata2");
  CHECK_THROWS_WITH_AS(Server(cfg, Weights{}), doctest::Contains("label"), ConfigError);
  fs::remove_all(dir);
}
