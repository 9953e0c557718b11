#include "tests/sparrow_test.h"

#include <chrono>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include "client/data_folder.h"
#include "client/session.h"
#include "client/trainer.h"
#include "compression/compressor.h"
#include "compression/lowrank.h"
#include "core/error.h"
#include "core/model_digest.h"
#include "core/models.h"
#include "core/npy.h"
#include "tests/client/scripted_server.h"
#include "tests/client/session_fixture.h"
#include "wire/net.h"

namespace fs = std::filesystem;
using namespace sparrow;
using client::ClientSession;
using client::Weights;
using namespace sparrow::testing::client_fixture;   // NOLINT(google-build-using-namespace)
using namespace sparrow::testing::scripted_server;  // NOLINT(google-build-using-namespace)

namespace {

std::string temp_dir(const std::string& name) { return fresh_dir("sparrow_session_test", name); }

wire::Task full_task(uint64_t round, const Weights& w, uint64_t seed, const std::string& compression = "none") {
  wire::Task t;
  t.round = round;
  t.model_encoding = wire::ModelEncoding::kFull;
  t.weights = dense(w);
  t.train = train_settings();
  t.compression = compression;
  t.seed = seed;
  return t;
}

wire::Task delta_task(uint64_t round, uint64_t base, const Weights& d, uint64_t seed,
                      const std::string& compression = "none") {
  wire::Task t;
  t.round = round;
  t.model_encoding = wire::ModelEncoding::kDelta;
  t.base_round = base;
  t.weights = dense(d);
  t.train = train_settings();
  t.compression = compression;
  t.seed = seed;
  return t;
}

client::SessionConfig config(const FakeServer& s, const std::string& dir, const std::string& id = "alice") {
  return session_config(s.endpoint, dir, id, 200, 100);
}

void finish(FakeServer& s, Running& r) {
  s.send(wire::Bye{"run finished"});
  r.join();
  REQUIRE_FALSE(r.error);
  REQUIRE(r.result.has_value());
  CHECK(*r.result);
}

}  // namespace

TEST_CASE("session: Hello carries the digest and a Full task yields LocalTrainer's delta") {
  const std::string dir = temp_dir("full");
  FakeServer server;
  ClientSession session(config(server, dir), make_data());
  Running run(session);

  const wire::Hello h = server.expect<wire::Hello>();
  CHECK(h.client_id == "alice");
  CHECK(h.num_samples == 16);
  CHECK(h.model == "mlp");
  CHECK(h.model_digest == core::model_digest(*core::make_model("mlp", 0)));
  REQUIRE(h.last_round.has_value());
  CHECK(*h.last_round == 0);
  server.welcome();

  const Weights w = model_weights(3);
  server.send(full_task(1, w, 11));
  const wire::ModelUpdate u = server.expect<wire::ModelUpdate>();
  CHECK(u.round == 1);
  CHECK(u.client_id == "alice");
  CHECK(u.num_samples == 16);
  CHECK(u.tensors.size() == w.size());
  CHECK(u.control_delta.empty());
  bool has_loss = false;
  for (const auto& [k, v] : u.metrics) has_loss = has_loss || k == "train_loss";
  CHECK(has_loss);
  CHECK(all_close(decode(u.tensors), expected_delta(w, 11)));
  // The same weights with another seed train differently: the check above can fail.
  CHECK_FALSE(all_close(decode(u.tensors), expected_delta(w, 12)));
  server.send(wire::Ack{1});
  finish(server, run);
  const auto c = session.counters();
  CHECK(c.tasks_done == 1);
  CHECK(c.updates_acked == 1);
  CHECK(c.updates_rejected == 0);
  CHECK(session.last_round() == 0);
}

TEST_CASE("session: Delta tasks apply against the seed-built and the held model") {
  const std::string dir = temp_dir("delta");
  FakeServer server;
  ClientSession session(config(server, dir), make_data());
  Running run(session);
  server.expect<wire::Hello>();
  server.welcome();

  // Round 1: empty Delta against round 0 = the model built from Welcome.model_seed.
  wire::Task t1 = delta_task(1, 0, {}, 21);
  server.send(t1);
  wire::ModelUpdate u = server.expect<wire::ModelUpdate>();
  CHECK(u.round == 1);
  CHECK(all_close(decode(u.tensors), expected_delta(model_weights(kModelSeed), 21)));
  server.send(wire::Ack{1});

  // Round 2: Delta with tensors against round 0 (downlink compression): B_1 = B_0 + C_1.
  Weights c1 = model_weights(kModelSeed);
  for (auto& [k, v] : c1) v = at::full_like(v, 0.01f);
  server.send(delta_task(2, 0, c1, 22));
  u = server.expect<wire::ModelUpdate>();
  CHECK(u.round == 2);
  Weights b1 = model_weights(kModelSeed);
  for (auto& [k, v] : b1) v = v + c1.at(k);
  CHECK(all_close(decode(u.tensors), expected_delta(b1, 22)));
  CHECK(session.last_round() == 1);

  // Round 4, Delta against round 3: not held. The client says what it holds (Hello
  // with last_round 1); the same Delta again is an Error.
  server.send(delta_task(4, 3, {}, 23));
  const wire::Hello h = server.expect<wire::Hello>();
  REQUIRE(h.last_round.has_value());
  CHECK(*h.last_round == 1);
  server.welcome();
  server.send(delta_task(4, 3, {}, 23));
  const wire::ErrorBody e = server.expect<wire::ErrorBody>();
  CHECK(e.code == wire::ErrorCode::kRejected);
  REQUIRE(e.round.has_value());
  CHECK(*e.round == 4);
  // An empty Delta against the held round 1 in round 2 works.
  server.send(delta_task(2, 1, {}, 24));
  u = server.expect<wire::ModelUpdate>();
  CHECK(all_close(decode(u.tensors), expected_delta(b1, 24)));
  finish(server, run);
  CHECK(session.counters().tasks_done == 3);
  CHECK(session.counters().tasks_refused == 2);
}

TEST_CASE("session: error feedback and the held model survive a restart") {
  const std::string dir = temp_dir("restart");
  const std::string spec = "topk:ratio=0.01,ef=true";
  const Weights w = model_weights(5);
  Weights first;
  {
    FakeServer server;
    ClientSession session(config(server, dir), make_data());
    Running run(session);
    server.expect<wire::Hello>();
    server.welcome();
    server.send(full_task(3, w, 31, spec));
    first = decode(server.expect<wire::ModelUpdate>().tensors);
    server.send(wire::Ack{3});
    finish(server, run);
    CHECK(session.last_round() == 2);
  }
  FakeServer server;
  ClientSession session(config(server, dir), make_data());
  CHECK(session.last_round() == 2);
  Running run(session);
  const wire::Hello h = server.expect<wire::Hello>();
  REQUIRE(h.last_round.has_value());
  CHECK(*h.last_round == 2);
  server.welcome();
  // Round 3 again, as an empty Delta against the held B_2 (= w, from the state database).
  server.send(delta_task(3, 2, {}, 31, spec));
  const wire::ModelUpdate u = server.expect<wire::ModelUpdate>();
  server.send(wire::Ack{3});
  finish(server, run);
  // What the same compressor gives on its second call with the carried residual.
  const Weights delta = expected_delta(w, 31);
  auto comp = compression::make_compressor(spec);
  Weights second_expected, first_expected;
  for (const auto& [name, d] : delta) {
    compression::State s;
    compression::Context ctx;
    ctx.name = name;
    ctx.seed = 31;
    ctx.round = 3;
    first_expected[name] = compression::decode(comp->encode(d.contiguous(), s, ctx));
    second_expected[name] = compression::decode(comp->encode(d.contiguous(), s, ctx));
  }
  CHECK(all_close(first, first_expected));
  CHECK(all_close(decode(u.tensors), second_expected));
  CHECK_FALSE(all_close(decode(u.tensors), first_expected));  // the residual was used
}

TEST_CASE("session: an unknown client error triggers a new Hello") {
  const std::string dir = temp_dir("unknown");
  FakeServer server;
  ClientSession session(config(server, dir), make_data());
  Running run(session);
  server.expect<wire::Hello>();
  server.welcome(50);
  // Wait for a heartbeat and answer it as a restarted server would.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  bool got = false;
  while (!got && std::chrono::steady_clock::now() < until) {
    auto m = server.recv(100);
    got = m && std::holds_alternative<wire::Heartbeat>(m->body);
  }
  REQUIRE(got);
  server.send(net::error_message(wire::ErrorCode::kRejected, "unknown client: send Hello").body);
  const wire::Hello h = server.expect<wire::Hello>();
  CHECK(h.client_id == "alice");
  server.welcome(50);
  finish(server, run);
  CHECK(session.counters().hellos == 2);
  CHECK(session.counters().reconnects == 0);
}

TEST_CASE("session: server silence triggers a reconnect with a new Hello") {
  const std::string dir = temp_dir("silence");
  FakeServer server;
  ClientSession session(config(server, dir), make_data());
  Running run(session);
  server.expect<wire::Hello>();
  const std::string first_peer = server.peer;
  server.welcome(50);
  // Never answer heartbeats: after 3 * 50 ms the client reconnects (new socket).
  const wire::Hello h = server.expect<wire::Hello>(5000, /*answer=*/false);
  CHECK(h.client_id == "alice");
  CHECK(server.peer != first_peer);
  CHECK(server.heartbeats >= 1);
  CHECK(session.counters().reconnects >= 1);
  session.stop();
  run.join();
  REQUIRE_FALSE(run.error);
  REQUIRE(run.result.has_value());
  CHECK_FALSE(*run.result);
}

TEST_CASE("session: a bad Task is answered with an Error and changes nothing") {
  const std::string dir = temp_dir("badtask");
  FakeServer server;
  ClientSession session(config(server, dir), make_data());
  Running run(session);
  server.expect<wire::Hello>();
  server.welcome();
  const Weights w = model_weights(3);

  auto refused = [&](const wire::Task& t, const std::string& needle) {
    server.send(t);
    const wire::ErrorBody e = server.expect<wire::ErrorBody>();
    CHECK(e.code == wire::ErrorCode::kRejected);
    REQUIRE(e.round.has_value());
    CHECK(*e.round == t.round);
    CHECK_MESSAGE(e.message.find(needle) != std::string::npos, e.message);
  };
  wire::Task missing = full_task(1, w, 1);
  missing.weights.pop_back();
  refused(missing, "parameters");
  wire::Task renamed = full_task(1, w, 1);
  renamed.weights[0].name = "nope.weight";
  refused(renamed, "nope.weight");
  Weights wrong = w;
  wrong.begin()->second = at::zeros({3, 3});
  refused(full_task(1, wrong, 1), "shape");
  refused(full_task(1, w, 1, "nosuchcodec"), "nosuchcodec");
  wire::Task control = full_task(1, w, 1);
  control.control = dense(w);
  refused(control, "control");
  CHECK(session.counters().tasks_refused == 5);
  CHECK(session.counters().tasks_done == 0);

  // Still alive, and a good task works.
  server.send(full_task(1, w, 2));
  const wire::ModelUpdate u = server.expect<wire::ModelUpdate>();
  CHECK(all_close(decode(u.tensors), expected_delta(w, 2)));
  finish(server, run);
}

TEST_CASE("session: ACP uses the shared factor from the Task") {
  const std::string dir = temp_dir("acp");
  FakeServer server;
  ClientSession session(config(server, dir), make_data());
  Running run(session);
  server.expect<wire::Hello>();
  server.welcome();
  const Weights w = model_weights(3);
  wire::Task t = full_task(2, w, 41, "acp:rank=2");
  // A shared factor for fc1.weight that is not the seeded one.
  const std::vector<int64_t> shape = w.at("fc1.weight").sizes().vec();
  const auto dims = compression::lowrank_dims(shape, 2);
  compression::Context other;
  other.name = "fc1.weight";
  other.seed = 12345;
  const at::Tensor shared = compression::acp_initial_shared(other, dims, 2).contiguous();
  compression::State scratch;
  t.shared.push_back({"fc1.weight", compression::make_compressor("none")->encode(shared, scratch, {})});
  server.send(t);
  const wire::ModelUpdate u = server.expect<wire::ModelUpdate>();
  finish(server, run);
  const Weights delta = expected_delta(w, 41);
  auto acp = compression::make_compressor("acp:rank=2");
  for (const auto& nt : u.tensors) {
    if (nt.name != "fc1.weight") continue;
    CHECK(nt.tensor.format == compression::Format::kLowRankFactor);
    compression::Context ctx;
    ctx.name = nt.name;
    ctx.seed = 41;
    ctx.round = 2;
    ctx.shared_factor = shared;
    compression::State s;
    const at::Tensor want = compression::acp_factor(acp->encode(delta.at(nt.name).contiguous(), s, ctx));
    CHECK(at::allclose(compression::acp_factor(nt.tensor), want, 1e-4, 1e-6));
    ctx.shared_factor = at::Tensor();  // the seeded factor gives another answer
    compression::State s2;
    const at::Tensor seeded = compression::acp_factor(acp->encode(delta.at(nt.name).contiguous(), s2, ctx));
    CHECK_FALSE(at::allclose(compression::acp_factor(nt.tensor), seeded, 1e-4, 1e-6));
  }
}

TEST_CASE("session: CURVE handshake with key files") {
  const std::string dir = temp_dir("curve");
  const net::KeyPair server_keys = net::generate_keypair(), client_keys = net::generate_keypair();
  net::write_keypair(dir + "/keys", "server", server_keys);
  net::write_keypair(dir + "/keys", "alice", client_keys);
  FakeServer server(&server_keys, {client_keys.public_key});
  client::SessionConfig cfg = config(server, dir);
  cfg.insecure = false;
  cfg.server_key = dir + "/keys/server.key";
  cfg.key = dir + "/keys/alice.key_secret";
  ClientSession session(cfg, make_data());
  Running run(session);
  server.expect<wire::Hello>();
  CHECK(server.peer_key == client_keys.public_key);
  server.welcome();
  finish(server, run);

  cfg.key = dir + "/keys/missing.key_secret";
  CHECK_THROWS_AS(ClientSession(cfg, make_data()), ConfigError);
}

TEST_CASE("session: failed handshakes give up with the likely cause (refused key, wrong server_key, plain TCP)") {
  const std::string dir = temp_dir("giveup");
  const net::KeyPair server_keys = net::generate_keypair(), client_keys = net::generate_keypair(),
                     other = net::generate_keypair();
  net::write_keypair(dir + "/keys", "server", server_keys);
  net::write_keypair(dir + "/keys", "other", other);
  net::write_keypair(dir + "/keys", "alice", client_keys);
  auto gives_up = [&](FakeServer& server, client::SessionConfig cfg) {
    cfg.give_up_s = 1.5;
    cfg.heartbeat_ms = 300;
    ClientSession session(cfg, make_data());
    const auto t0 = std::chrono::steady_clock::now();
    std::string what;
    try {
      session.run();
    } catch (const Error& e) {
      what = e.what();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(s < 15);
    CHECK_FALSE(server.recv(10).has_value());  // no Hello ever got through
    return what;
  };
  client::SessionConfig curve;
  {
    FakeServer server(&server_keys, {other.public_key});  // alice is not on the list
    curve = config(server, dir);
    curve.insecure = false;
    curve.server_key = dir + "/keys/server.key";
    curve.key = dir + "/keys/alice.key_secret";
    CHECK(gives_up(server, curve).find("allow-list") != std::string::npos);
  }
  {
    FakeServer server(&server_keys, {client_keys.public_key});
    client::SessionConfig c = curve;
    c.server = server.endpoint;
    c.server_key = dir + "/keys/other.key";  // not the server's key
    CHECK(gives_up(server, c).find("server_key") != std::string::npos);
  }
  {
    FakeServer server(&server_keys, {client_keys.public_key});
    client::SessionConfig c = config(server, dir);  // insecure
    // The mechanism mismatch (or, on a loaded machine, only the closed
    // connection that follows it) names CurveZMQ and the keys to set.
    const std::string why = gives_up(server, c);
    CHECK(why.find("requires CurveZMQ") != std::string::npos);
    CHECK(why.find("`server_key` and `key`") != std::string::npos);
  }
}

TEST_CASE("session: the server refusing the Hello ends run with an error") {
  const std::string dir = temp_dir("refused");
  FakeServer server;
  ClientSession session(config(server, dir), make_data());
  Running run(session);
  server.expect<wire::Hello>();
  server.send(net::error_message(wire::ErrorCode::kRejected, "model digest mismatch").body);
  run.join();
  REQUIRE(run.error);
  CHECK_THROWS_WITH_AS(std::rethrow_exception(run.error), doctest::Contains("digest mismatch"), Error);
}

TEST_CASE("session: state database of another client or model is refused") {
  const std::string dir = temp_dir("statedb");
  FakeServer server;
  { ClientSession a(config(server, dir, "alice"), make_data()); }
  CHECK_THROWS_AS(ClientSession(config(server, dir, "bob"), make_data()), ConfigError);
  client::SessionConfig cfg = config(server, dir, "alice");
  cfg.model = "resnet";
  CHECK_THROWS_AS(ClientSession(cfg, make_data()), ConfigError);
}

// ---- data ----------------------------------------------------------------------------

namespace {

// A .npy file of int64 labels, or of another dtype/shape for the bad cases.
void write_npy_raw(const std::string& path, const std::string& descr, const std::string& shape,
                   const std::string& data) {
  std::string header = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  std::ofstream(path, std::ios::binary) << out << header << data;
}

std::string int64_bytes(const std::vector<int64_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 8);
}

}  // namespace

TEST_CASE("data folder: x.npy and y.npy load and bad files are refused") {
  const std::string dir = temp_dir("npy");
  std::vector<float> x(4 * 784);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 13) / 13.0f;
  npy::write(dir + "/x.npy", {4, 784}, x.data());
  write_npy_raw(dir + "/y.npy", "<i8", "(4,)", int64_bytes({0, 3, 9, 1}));

  client::DataConfig dc;
  dc.data = "folder:" + dir;
  core::Dataset d = client::load_client_data(dc, "mlp");
  CHECK(d.x.sizes().vec() == std::vector<int64_t>{4, 1, 28, 28});
  CHECK((d.y.scalar_type() == at::kLong));
  CHECK(d.y.size(0) == 4);
  CHECK(d.y[2].item<int64_t>() == 9);
  CHECK(d.x.flatten()[14].item<float>() == doctest::Approx(1.0f / 13.0f));

  // float64 samples (numpy's default dtype) are converted.
  {
    std::string body;
    for (float v : x) {
      const double dv = v;
      body.append(reinterpret_cast<const char*>(&dv), 8);
    }
    write_npy_raw(dir + "/x.npy", "<f8", "(4, 784)", body);
    const core::Dataset d64 = client::load_client_data(dc, "mlp");
    CHECK(at::equal(d64.x, d.x));
    npy::write(dir + "/x.npy", {4, 784}, x.data());
  }

  // uint8 labels work too.
  write_npy_raw(dir + "/y.npy", "|u1", "(4,)", std::string("\x01\x02\x03\x04", 4));
  CHECK(client::load_client_data(dc, "mlp").y[3].item<int64_t>() == 4);

  SUBCASE("label out of range") {
    write_npy_raw(dir + "/y.npy", "<i8", "(4,)", int64_bytes({0, 3, 12, 1}));
    CHECK_THROWS_WITH_AS(client::load_client_data(dc, "mlp"), doctest::Contains("label"), ConfigError);
  }
  SUBCASE("samples of the wrong shape") {
    npy::write(dir + "/x.npy", {4, 10}, x.data());
    CHECK_THROWS_WITH_AS(client::load_client_data(dc, "mlp"), doctest::Contains("do not fit"), ConfigError);
  }
  SUBCASE("x and y of different lengths") {
    write_npy_raw(dir + "/y.npy", "<i8", "(3,)", int64_bytes({0, 3, 1}));
    CHECK_THROWS_AS(client::load_client_data(dc, "mlp"), FormatError);
  }
  SUBCASE("unsupported label dtype") {
    write_npy_raw(dir + "/y.npy", "<c8", "(4,)", std::string(32, '\0'));
    CHECK_THROWS_WITH_AS(client::load_client_data(dc, "mlp"), doctest::Contains("dtype"), FormatError);
  }
  SUBCASE("truncated labels") {
    write_npy_raw(dir + "/y.npy", "<i8", "(4,)", int64_bytes({0, 3, 1}));
    CHECK_THROWS_AS(client::load_client_data(dc, "mlp"), FormatError);
  }
  SUBCASE("fractional float labels") {
    const float f[4] = {0.0f, 1.5f, 2.0f, 3.0f};
    write_npy_raw(dir + "/y.npy", "<f4", "(4,)", std::string(reinterpret_cast<const char*>(f), 16));
    CHECK_THROWS_WITH_AS(client::load_client_data(dc, "mlp"), doctest::Contains("whole"), FormatError);
  }
  SUBCASE("not an npy file") {
    std::ofstream(dir + "/x.npy") << "hello";
    CHECK_THROWS_AS(client::load_client_data(dc, "mlp"), FormatError);
  }
  SUBCASE("missing y.npy") {
    fs::remove(dir + "/y.npy");
    CHECK_THROWS_WITH_AS(client::load_client_data(dc, "mlp"), doctest::Contains("y.npy"), ConfigError);
  }
  SUBCASE("empty or missing folder") {
    const std::string empty = temp_dir("npy_empty");
    dc.data = "folder:" + empty;
    CHECK_THROWS_WITH_AS(client::load_client_data(dc, "mlp"), doctest::Contains("neither"), ConfigError);
    dc.data = "folder:" + empty + "/nope";
    CHECK_THROWS_AS(client::load_client_data(dc, "mlp"), ConfigError);
  }
  SUBCASE("unknown data source") {
    dc.data = "imagenet";
    CHECK_THROWS_WITH_AS(client::load_client_data(dc, "mlp"), doctest::Contains("imagenet"), ConfigError);
  }
}

TEST_CASE("client config: strict keys and overrides") {
  const std::string base = "server = \"tcp://127.0.0.1:1\"\nclient_id = \"c1\"\ninsecure = true\n";
  client::SessionConfig c = client::parse_session_config(base + "heartbeat_ms = 500\nindex = 2\nclients = 4\n",
                                                         {"model=cnn", "data=folder:/tmp/x"});
  CHECK(c.heartbeat_ms == 500);
  CHECK(c.data.index == 2);
  CHECK(c.data.clients == 4);
  CHECK(c.model == "cnn");
  CHECK(c.data.data == "folder:/tmp/x");
  CHECK_THROWS_WITH_AS(client::parse_session_config(base + "bogus = 1\n"), doctest::Contains("'bogus'"), ConfigError);
  CHECK_THROWS_WITH_AS(client::parse_session_config(base, {"nope=1"}), doctest::Contains("'nope'"), ConfigError);
  CHECK_THROWS_WITH_AS(client::parse_session_config(base + "heartbeat_ms = \"x\"\n"), doctest::Contains("heartbeat_ms"),
                       ConfigError);
  CHECK_THROWS_WITH_AS(client::parse_session_config(base + "index = 3\n"), doctest::Contains("index"), ConfigError);
  CHECK_THROWS_WITH_AS(client::parse_session_config("client_id = \"c1\"\n"), doctest::Contains("server_key"),
                       ConfigError);
  CHECK_THROWS_AS(client::parse_session_config(base + "server = \n"), ConfigError);
  // An endpoint typo is named, not libzmq's bare "Invalid argument".
  CHECK_THROWS_WITH_AS(client::parse_session_config(base, {"server=notanendpoint"}),
                       doctest::Contains("not a usable ZeroMQ endpoint"), ConfigError);
  CHECK_THROWS_WITH_AS(client::parse_session_config(base, {"server=tcp://127.0.0.1:99999"}),
                       doctest::Contains("above 65535"), ConfigError);
  // Local DP is the client's; central DP is the server's.
  CHECK(client::parse_session_config(base, {"dp=local:clip=1,noise=1"}).dp == "local:clip=1,noise=1");
  CHECK_THROWS_WITH_AS(client::parse_session_config(base, {"dp=central:clip=1,noise=1"}), doctest::Contains("server"),
                       ConfigError);
}

TEST_CASE("examples/service/client.toml is a valid client config") {
  const client::SessionConfig c = client::load_session_config(
      std::string(SPARROW_SOURCE_DIR) + "/examples/service/client.toml", {"key=keys/client2.key_secret", "index=1"});
  CHECK(c.server_key == "keys/server.key");
  CHECK(c.key == "keys/client2.key_secret");
  CHECK(c.data.index == 1);
}

TEST_CASE("session: a holdout is never trained on and reports the received model's accuracy on it") {
  const std::string dir = temp_dir("holdout");
  FakeServer server;
  client::SessionConfig cfg = config(server, dir);
  cfg.holdout = 0.25;
  ClientSession session(cfg, make_data(16));
  Running run(session);
  CHECK(server.expect<wire::Hello>().num_samples == 12);  // 4 of 16 held out
  server.welcome();
  const Weights w = model_weights(3);
  server.send(full_task(1, w, 11));
  const wire::ModelUpdate u = server.expect<wire::ModelUpdate>();
  CHECK(u.num_samples == 12);
  std::map<std::string, double> m(u.metrics.begin(), u.metrics.end());
  REQUIRE(m.count("eval_accuracy"));
  REQUIRE(m.count("eval_loss"));
  CHECK(m["eval_accuracy"] >= 0);
  CHECK(m["eval_accuracy"] <= 1);
  CHECK(std::isfinite(m["eval_loss"]));
  server.send(wire::Ack{1});
  finish(server, run);
  CHECK_THROWS_AS(client::parse_session_config("client_id = \"c\"\ninsecure = true\nholdout = 0.7\n"), ConfigError);
}
