// sparrow-server in mode = "async" (docs/async.md): the shared
// federation::AsyncEngine driven over ZeroMQ by hand-written clients, so that
// the arrival order is the test's.
#include "tests/server/server_fixture.h"

#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>
#include <zmq.hpp>

#include "compression/compressor.h"
#include "core/error.h"
#include "core/model_digest.h"
#include "core/models.h"
#include "server/server.h"
#include "server/store.h"
#include "tests/http_client.h"
#include "tests/integration/process.h"
#include "wire/net.h"
#include "wire/wire.h"

using namespace sparrow;
using namespace sparrow::server;
namespace fs = std::filesystem;
using namespace sparrow::server_fixture;

namespace {

ServerConfig base_config(const std::string& name, int clients) {
  ServerConfig c;
  c.listen = "tcp://127.0.0.1:*";
  c.model = "tiny";
  c.insecure = true;
  c.rounds = 2;
  c.clients_per_round = clients;
  c.round_deadline_s = 30;
  c.heartbeat_ms = 10000;  // the fake clients never heartbeat
  c.workers = 2;
  c.db = fresh_db_file("async_server_test_", name);
  return c;
}

ServerConfig async_config(const std::string& name, int clients, int buffer, int concurrency,
                          const std::string& staleness) {
  ServerConfig c = base_config(name, clients);
  c.mode = "async";
  c.buffer = buffer;
  c.max_concurrency = concurrency;
  c.staleness = staleness;
  return c;
}

// The async tests wait longer: a step folds, records and checkpoints first.
struct AsyncClient : FakeClient {
  AsyncClient(zmq::context_t& ctx, const std::string& endpoint, std::string client_id)
      : FakeClient(ctx, endpoint, std::move(client_id)) {
    wait_ms = 10000;
  }
};

// A deterministic update of client `c` in round `r` (not a multiple of
// another: the sums round differently in another order).
Weights delta_of(int c, uint64_t r, const Weights& like) {
  Weights d;
  int k = 0;
  for (const auto& [name, v] : like) {
    at::Tensor t = at::arange(v.numel(), at::kFloat).reshape(v.sizes());
    d[name] = at::sin(t * (0.37f + 0.11f * static_cast<float>(c)) + static_cast<float>(r) * 1.3f + k++) /
              (3.0f + static_cast<float>(c));
  }
  return d;
}

Weights decode_all(const std::vector<wire::NamedTensor>& ts) {
  Weights w;
  for (const auto& t : ts) w[t.name] = compression::decode(t.tensor);
  return w;
}

}  // namespace

TEST_CASE("async server: buffer = clients, max_concurrency = clients, const staleness is synchronous FedAvg") {
  // Two rounds of three clients, the updates sent in client-id order, each
  // after the previous one's Ack: the async fold is then in the order the
  // synchronous fold sums in, and the models are the same bits.
  const std::vector<uint64_t> samples = {3, 1, 2};
  auto drive = [&](ServerConfig cfg, bool async) {
    Server server(cfg, tiny_weights());
    zmq::context_t ctx;
    std::vector<std::unique_ptr<AsyncClient>> cl;
    for (const char* id : {"a", "b", "c"}) cl.push_back(std::make_unique<AsyncClient>(ctx, server.endpoint(), id));
    Running run(server);
    for (size_t i = 0; i < cl.size(); ++i) cl[i]->hello(server.model_digest(), samples[i], std::nullopt);
    for (uint64_t r = 1; r <= 2; ++r) {
      for (size_t i = 0; i < cl.size(); ++i) {
        const wire::Task t = cl[i]->expect<wire::Task>();
        REQUIRE(t.round == r);
        if (async) CHECK(t.clients == 3);  // num_workers of the buffer's contexts, as the simulator's
      }
      for (size_t i = 0; i < cl.size(); ++i) {
        cl[i]->update(r, delta_of(static_cast<int>(i), r, tiny_weights()), samples[i]);
        CHECK(cl[i]->expect<wire::Ack>().round == r);
      }
    }
    run.join();
    REQUIRE_FALSE(run.error);
    CHECK(server.completed_rounds() == 2);
    return serialize_weights(server.global_weights());
  };
  const std::string sync = drive(base_config("eq_sync", 3), false);
  const std::string async = drive(async_config("eq_async", 3, 3, 3, "const"), true);
  CHECK(sync == async);
  // And the updates changed the model (the comparison is not of two W_0).
  CHECK(sync != serialize_weights(tiny_weights()));
}

TEST_CASE("async server: staleness weights, stale and malformed updates, versions in tasks") {
  // buffer 2 of 3 clients (samples 1, 2, 4), all three training at once,
  // poly:a=0.5: step 1 folds a and b from version 0; step 2 folds c's
  // version-0 update (staleness 1, weight 4 / sqrt(2)) and a's version-1 one.
  ServerConfig cfg = async_config("stale", 3, 2, 3, "poly:a=0.5");
  cfg.http = "127.0.0.1:0";  // the dashboard's async figures
  const std::string db = cfg.db;
  Server server(cfg, tiny_weights());
  zmq::context_t ctx;
  AsyncClient a(ctx, server.endpoint(), "a"), b(ctx, server.endpoint(), "b"), c(ctx, server.endpoint(), "c");
  Running run(server);
  a.hello(server.model_digest(), 1, std::nullopt);
  b.hello(server.model_digest(), 2, std::nullopt);
  c.hello(server.model_digest(), 4, std::nullopt);
  const Weights w0 = tiny_weights();
  for (AsyncClient* x : {&a, &b, &c}) {
    const wire::Task t = x->expect<wire::Task>();
    CHECK(t.round == 1);  // version 0
    const Weights m = decode_all(t.weights);
    for (const auto& [k, v] : w0) CHECK(at::equal(m.at(k), v));
  }
  const Weights da = delta_of(0, 1, w0), db_ = delta_of(1, 1, w0), dc = delta_of(2, 1, w0), da2 = delta_of(0, 2, w0);
  a.update(1, da, 1);
  CHECK(a.expect<wire::Ack>().round == 1);
  b.update(1, db_, 2);
  CHECK(b.expect<wire::Ack>().round == 1);
  Weights w1;
  for (const auto& [k, v] : w0) w1[k] = v + (da.at(k) * 1 + db_.at(k) * 2) / 3;
  // Version 1 goes to the free clients a and b (c still trains version 0).
  const wire::Task ta = a.expect<wire::Task>();
  CHECK(ta.round == 2);
  const wire::Task tb = b.expect<wire::Task>();
  CHECK(tb.round == 2);
  for (const auto& [k, v] : decode_all(ta.weights)) CHECK(at::allclose(v, w1.at(k), 1e-6, 1e-6));
  // A repeated update has no task out: refused as stale, counted, nothing folded.
  a.update(1, da, 1);
  const wire::ErrorBody e = a.expect_error();
  CHECK(e.code == wire::ErrorCode::kRejected);
  CHECK(e.message.find("stale") != std::string::npos);
  // A malformed one (NaN) is refused, and frees b's slot.
  Weights bad = delta_of(1, 2, w0);
  bad["fc.bias"][0] = NAN;
  b.update(2, bad, 2);
  CHECK(b.expect_error().code == wire::ErrorCode::kMalformed);
  c.update(1, dc, 4);  // staleness 1
  CHECK(c.expect<wire::Ack>().round == 1);
  a.update(2, da2, 1);  // staleness 0: the step
  CHECK(a.expect<wire::Ack>().round == 2);
  run.join();
  REQUIRE_FALSE(run.error);
  CHECK(server.completed_rounds() == 2);
  const double wc = 4.0 * std::pow(2.0, -0.5);  // (1 + s)^-a, s = 1, a = 0.5, times 4 samples
  const Weights g = server.global_weights();
  for (const auto& [k, v] : w1) {
    const at::Tensor expected = v + (dc.at(k) * wc + da2.at(k) * 1.0) / (wc + 1.0);
    CHECK(at::allclose(g.at(k), expected, 1e-5, 1e-6));
  }
  const Counters n = server.counters();
  CHECK(n.updates_accepted == 4);
  CHECK(n.stale == 1);
  CHECK(n.rejected_by_code[static_cast<size_t>(wire::ErrorCode::kMalformed)] == 1);
  auto store = ServerStore::open_readonly(db);
  const auto m1 = store->metrics(1), m2 = store->metrics(2);
  CHECK(m1.at("async.staleness_max") == 0);
  CHECK(m2.at("async.staleness_max") == 1);
  CHECK(m2.at("async.staleness_mean") == doctest::Approx(0.5));
  CHECK(store->rounds().at(1).updates == 2);
  CHECK(store->async_updates().empty());  // every acknowledged update is in the checkpoint now
  // The dashboard: the model version and the last step's staleness.
  const std::string url = server.dashboard_url();
  const int port = std::stoi(url.substr(url.rfind(':') + 1));
  const std::string progress = testing::http_body(testing::http_get(port, "/api/progress"));
  INFO(progress);
  CHECK(progress.find("\"async\":{\"version\":2,\"staleness_max\":1,\"staleness_mean\":0.5,") != std::string::npos);
  CHECK(progress.find("\"updates_per_min\":") != std::string::npos);
}

TEST_CASE("async server: the keys the engine refuses are refused by name") {
  auto refused = [](const std::string& extra, const std::string& key) {
    INFO(extra);
    try {
      ServerConfig c = parse_server_config("mode = \"async\"\nclients_per_round = 8\n" + extra);
      c.insecure = true;
      validate(c);
      FAIL_CHECK("not refused");
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("'" + key + "'") != std::string::npos);
    }
  };
  refused("secagg = \"secagg+:threshold=3\"\n", "secagg");
  refused("dp = \"central:clip=1,noise=1\"\n", "dp");
  refused("compression = \"acp:rank=2\"\n", "compression");
  refused("quorum = 2\n", "quorum");
  refused("max_round_wait_s = 100\n", "max_round_wait_s");
  refused("upstream = \"tcp://127.0.0.1:7070\"\n", "upstream");
  refused("aggregator = \"krum:f=1\"\nbuffer = 4\n", "buffer");  // krum needs 2f + 3 = 5 per step
  // The async keys are part of the run's identity; sync runs keep their hash.
  CHECK(config_hash(parse_server_config("")) == config_hash(parse_server_config("mode = \"sync\"\n")));
  CHECK(config_hash(parse_server_config("mode = \"async\"\n")) !=
        config_hash(parse_server_config("mode = \"async\"\nbuffer = 2\n")));
  // What the service runs: fine.
  ServerConfig ok = parse_server_config(
      "mode = \"async\"\nclients_per_round = 4\nbuffer = 3\nmax_concurrency = 4\nstaleness = \"hinge:a=10,b=4\"\n"
      "compression = \"topk:ratio=0.1\"\nalgorithm = \"scaffold\"\n");
  ok.insecure = true;
  CHECK_NOTHROW(validate(ok));
}

TEST_CASE("async server: kill -9 mid-buffer and restart loses no acknowledged update") {
  const std::string dir = "async_server_test_kill";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string db = dir + "/server.db";
  {
    std::ofstream out(dir + "/server.toml");
    out << "listen = \"tcp://127.0.0.1:*\"\nmodel = \"mlp\"\ndb = \"" << db
        << "\"\nseed = 1\nmodel_seed = 1\nmode = \"async\"\nrounds = 1\nclients_per_round = 3\nbuffer = "
           "3\nmax_concurrency = 3\n"
           "staleness = \"const\"\nheartbeat_ms = 10000\nround_deadline_s = 60\n";
  }
  const std::string bin = std::string(SPARROW_BIN_DIR) + "/sparrow-server";
  std::map<std::string, at::Tensor> w0;
  for (const auto& p : core::make_model("mlp", 1)->named_parameters(true))
    w0[p.key()] = p.value().detach().to(at::kFloat).clone();
  const uint64_t digest = core::model_digest(w0);
  auto endpoint_of = [](testing::Process& p) {
    REQUIRE(p.wait_for_log("event=listening", std::chrono::seconds(60)));
    std::smatch m;
    const std::string log = p.log();
    REQUIRE(std::regex_search(log, m, std::regex("event=listening endpoint=(\\S+)")));
    return std::string(m[1]);
  };
  auto start = [&](const std::string& log) {
    return std::make_unique<testing::Process>(
        std::vector<std::string>{bin, "--config", dir + "/server.toml", "--insecure"}, dir + "/" + log);
  };
  const Weights da = delta_of(0, 1, w0), db_ = delta_of(1, 1, w0), dc = delta_of(2, 1, w0);
  {
    auto server = start("server1.log");
    const std::string ep = endpoint_of(*server);
    zmq::context_t ctx;
    AsyncClient a(ctx, ep, "a"), b(ctx, ep, "b"), c(ctx, ep, "c");
    for (AsyncClient* x : {&a, &b, &c}) {
      x->model = "mlp";
      x->hello(digest, 10, std::nullopt);
    }
    for (AsyncClient* x : {&a, &b, &c}) CHECK(x->expect<wire::Task>(30000).round == 1);
    a.update(1, da, 10);
    CHECK(a.expect<wire::Ack>(30000).round == 1);
    b.update(1, db_, 10);
    CHECK(b.expect<wire::Ack>(30000).round == 1);
    // Two of the buffer's three are acknowledged: the crash.
    server->signal(SIGKILL);
    REQUIRE(server->wait(std::chrono::seconds(10)) == 128 + SIGKILL);
  }
  auto server = start("server2.log");
  const std::string ep = endpoint_of(*server);
  CHECK(server->wait_for_log("event=async_buffer_restored step=1 updates=2", std::chrono::seconds(10)));
  zmq::context_t ctx;
  AsyncClient a(ctx, ep, "a"), b(ctx, ep, "b"), c(ctx, ep, "c");
  for (AsyncClient* x : {&a, &b, &c}) {
    x->model = "mlp";
    x->hello(digest, 10, std::nullopt);
  }
  // a and b are in the buffer of this version already: only c gets a task.
  CHECK(c.expect<wire::Task>(30000).round == 1);
  CHECK_FALSE(a.next(500).has_value());
  c.update(1, dc, 10);
  CHECK(c.expect<wire::Ack>(30000).round == 1);
  REQUIRE(server->wait(std::chrono::seconds(60)) == 0);
  auto store = ServerStore::open_readonly(db);
  const auto ck = store->latest_checkpoint();
  REQUIRE(ck.has_value());
  CHECK(ck->round == 1);
  const Weights g = deserialize_weights(ck->weights);
  for (const auto& [k, v] : w0) {
    const at::Tensor expected = v + (da.at(k) + db_.at(k) + dc.at(k)) / 3;
    CHECK(at::allclose(g.at(k), expected, 1e-5, 1e-6));
  }
}
