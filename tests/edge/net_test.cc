#include "tests/sparrow_test.h"

#include <sqlite3.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>

#include "core/error.h"
#include "core/models.h"
#include "core/sqlite_db.h"
#include "edge/act_codec.h"
#include "edge/cloud.h"
#include "edge/device.h"
#include "edge/split.h"
#include "wire/net.h"
#include "wire/wire.h"

using namespace sparrow::edge;
namespace net = sparrow::net;
namespace wire = sparrow::wire;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kSeed = 7;
constexpr int64_t kSamples = 256, kBatch = 16;

std::string temp_path(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("sparrow_edge_net_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

DeviceData make_data(uint64_t seed) {
  torch::manual_seed(seed);
  DeviceData d;
  d.train.x = torch::randn({kSamples, 784});
  d.train.y = torch::randint(0, 10, {kSamples}, torch::kLong);
  d.test.x = torch::randn({40, 784});
  d.test.y = torch::randint(0, 10, {40}, torch::kLong);
  return d;
}

CloudConfig cloud_config() {
  CloudConfig c;
  c.listen = "tcp://127.0.0.1:*";
  c.insecure = true;
  c.state = "";  // in memory; the state-file tests name a file
  c.model = "mlp";
  c.cut = "fc1";
  c.seed = kSeed;
  c.lr = 0.05;
  c.momentum = 0.9;
  return c;
}

DeviceConfig device_config(const std::string& endpoint, const std::string& id) {
  DeviceConfig c;
  c.cloud = endpoint;
  c.insecure = true;
  c.device_id = id;
  c.model = "mlp";
  c.cut = "fc1";
  c.seed = kSeed;
  c.lr = 0.05;
  c.momentum = 0.9;
  c.batch_size = kBatch;
  c.steps = 6;
  c.progress = temp_path("progress_" + id);
  fs::remove(c.progress);
  c.save_every = 2;
  c.reply_timeout_ms = 3000;
  c.backoff_initial_ms = 5;
  c.backoff_max_ms = 20;
  c.max_reconnects = 5;
  return c;
}

// A cloud serving on its own thread for the scope's lifetime.
struct RunningCloud {
  CloudServer server;
  std::map<std::string, at::Tensor> initial_top;
  std::thread thread;
  explicit RunningCloud(CloudConfig cfg) : server(std::move(cfg)), initial_top(server.top_weights()) {
    thread = std::thread([this] { server.run(); });
  }
  // Stops serving; top_weights() is safe afterwards.
  void join() {
    server.stop();
    if (thread.joinable()) thread.join();
  }
  ~RunningCloud() { join(); }
};

bool same_weights(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, v] : a) {
    auto it = b.find(k);
    if (it == b.end() || !torch::equal(v, it->second)) return false;
  }
  return true;
}

// A raw DEALER that says Hello as a device of the test's model would.
struct RawDevice {
  zmq::context_t ctx{1};
  zmq::socket_t sock{ctx, zmq::socket_type::dealer};
  std::shared_ptr<sparrow::core::Model> model = sparrow::core::make_model("mlp", kSeed);
  Split split = split_model(model, "fc1");
  EdgeHalf edge{split.bottom, "none", false};

  explicit RawDevice(const std::string& endpoint, const std::string& id) {
    sock.connect(endpoint);
    wire::Hello h;
    h.client_id = id;
    h.model = split_model_label("mlp", "fc1");
    h.model_digest = bottom_digest(split.bottom.parameter_names(), split.bottom.parameters());
    h.last_round = 0;
    send(h);
    auto m = net::receive(sock, 5000);
    REQUIRE(m.has_value());
    REQUIRE(std::holds_alternative<wire::Welcome>(m->body));
  }
  void send(wire::Body b) {
    wire::Message m;
    m.body = std::move(b);
    REQUIRE(net::send(sock, m));
  }
  wire::Message roundtrip(const wire::SplitActivation& a) {
    send(a);
    auto m = net::receive(sock, 5000);
    REQUIRE(m.has_value());
    return *m;
  }
  wire::SplitActivation activation(uint64_t step, const ActPacket& p, std::vector<int64_t> labels) {
    wire::SplitActivation a;
    a.session = "raw";
    a.step = step;
    a.codec = "none";
    a.shape = p.shape;
    a.payload = p.serialize();
    a.labels = std::move(labels);
    return a;
  }
  ActPacket good_packet() {
    torch::manual_seed(3);
    return edge.forward(torch::randn({4, 784}));  // wants the gradient back
  }
};

}  // namespace

TEST_CASE("edge net: uncompressed networked steps equal the in-process loop") {
  RunningCloud cloud(cloud_config());
  const DeviceData data = make_data(1);
  DeviceConfig dc = device_config(cloud.server.endpoint(), "eq");
  EdgeDevice device(dc, data);
  const EdgeDevice::Summary s = device.run();
  CHECK(s.steps == 6);
  CHECK(s.eval_samples == 40);
  CHECK(s.accuracy >= 0);
  CHECK(s.bytes_up > 6 * kBatch * 200 * 4);  // the dense activations went up
  CHECK(s.bytes_down > 6 * kBatch * 200 * 4);
  CHECK(s.json().find("\"steps\":6") != std::string::npos);
  cloud.join();

  // The same steps in one process, with LibTorch's SGD as the reference optimiser.
  auto model = sparrow::core::make_model("mlp", kSeed);
  Split split = split_model(model, "fc1");
  EdgeHalf edge(split.bottom, "none", false);
  CloudHalf top(split.top, "none");
  torch::optim::SGD opt_bottom(split.bottom.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD opt_top(split.top.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (uint64_t step = 1; step <= 6; ++step) {
    const auto idx = torch::tensor(batch_indices(kSamples, kBatch, kSeed, step), torch::kLong);
    opt_bottom.zero_grad();
    opt_top.zero_grad();
    CloudHalf::Result r = top.step(edge.forward(data.train.x.index_select(0, idx)), data.train.y.index_select(0, idx));
    opt_top.step();
    REQUIRE(r.gradient.has_value());
    edge.backward(*r.gradient);
    opt_bottom.step();
  }
  const auto ref_bottom = copy_weights(split.bottom.parameter_names(), split.bottom.parameters());
  const auto ref_top = copy_weights(split.top.parameter_names(), split.top.parameters());
  CHECK(same_weights(device.bottom_weights(), ref_bottom));
  CHECK(same_weights(cloud.server.top_weights(), ref_top));
  CHECK_FALSE(same_weights(cloud.server.top_weights(), cloud.initial_top));  // training changed something
  fs::remove(dc.progress);
}

TEST_CASE("edge net: lowrank codec sends fewer bytes") {
  RunningCloud cloud(cloud_config());
  const DeviceData data = make_data(2);
  DeviceConfig dense = device_config(cloud.server.endpoint(), "dense");
  DeviceConfig low = device_config(cloud.server.endpoint(), "low");
  low.codec = "lowrank:rank=2";
  const auto s_dense = EdgeDevice(dense, data).run();
  const auto s_low = EdgeDevice(low, data).run();
  CHECK(s_low.steps == 6);
  CHECK(s_low.accuracy >= 0);
  CHECK(s_low.bytes_up * 3 < s_dense.bytes_up);
  CHECK(s_low.bytes_down * 3 < s_dense.bytes_down);
  CHECK(cloud.server.counters().steps_applied == 12);
  fs::remove(dense.progress);
  fs::remove(low.progress);
}

TEST_CASE("edge net: two devices at once") {
  RunningCloud cloud(cloud_config());
  DeviceConfig a = device_config(cloud.server.endpoint(), "a"), b = device_config(cloud.server.endpoint(), "b");
  a.steps = b.steps = 8;
  b.codec = "q8";
  EdgeDevice::Summary sa, sb;
  std::string err;
  std::thread ta([&] {
    try {
      sa = EdgeDevice(a, make_data(3)).run();
    } catch (const std::exception& e) {
      err = e.what();
    }
  });
  sb = EdgeDevice(b, make_data(4)).run();
  ta.join();
  CHECK(err.empty());
  CHECK(sa.steps == 8);
  CHECK(sb.steps == 8);
  CHECK(cloud.server.counters().steps_applied == 16);
  CHECK(cloud.server.counters().duplicates == 0);
  fs::remove(a.progress);
  fs::remove(b.progress);
}

TEST_CASE("edge net: bad activations get an Error and change nothing") {
  RunningCloud cloud(cloud_config());
  RawDevice raw(cloud.server.endpoint(), "raw");
  const ActPacket good = raw.good_packet();
  auto expect_error = [&](const wire::SplitActivation& a, const std::string& what) {
    CAPTURE(what);
    const wire::Message m = raw.roundtrip(a);
    REQUIRE(std::holds_alternative<wire::ErrorBody>(m.body));
    CHECK(std::get<wire::ErrorBody>(m.body).code != wire::ErrorCode::kInternal);
  };
  SUBCASE("truncated payload") {
    auto a = raw.activation(1, good, {0, 1, 2, 3});
    a.payload.resize(a.payload.size() - 3);
    expect_error(a, "truncated");
  }
  SUBCASE("NaN") {
    ActPacket p = good;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(p.data.data(), &nan, sizeof nan);
    expect_error(raw.activation(1, p, {0, 1, 2, 3}), "nan");
  }
  SUBCASE("wrong shape") {
    CodecState st;
    const ActPacket p = ActCodec("none").encode(torch::randn({4, 199}), st);
    expect_error(raw.activation(1, p, {0, 1, 2, 3}), "shape");
  }
  SUBCASE("codec that is not a codec") {
    auto a = raw.activation(1, good, {0, 1, 2, 3});
    a.codec = "foo:bar=1";
    expect_error(a, "codec foo");
  }
  SUBCASE("codec that does not match the payload") {
    auto a = raw.activation(1, good, {0, 1, 2, 3});  // a dense payload
    a.codec = "topk:ratio=0.1";
    expect_error(a, "codec mismatch");
  }
  SUBCASE("labels out of range") { expect_error(raw.activation(1, good, {0, 1, 2, 99}), "labels"); }
  SUBCASE("negative label") { expect_error(raw.activation(1, good, {0, -1, 2, 3}), "negative label"); }
  SUBCASE("unknown session") {
    auto a = raw.activation(1, good, {0, 1, 2, 3});
    a.session = "someone-else";
    expect_error(a, "session");
  }
  // The step counter did not move: step 2 is refused, step 1 still expected.
  const wire::Message m = raw.roundtrip(raw.activation(2, good, {0, 1, 2, 3}));
  REQUIRE(std::holds_alternative<wire::ErrorBody>(m.body));
  CHECK(std::get<wire::ErrorBody>(m.body).message == "expected step 1");
  CHECK(cloud.server.counters().steps_applied == 0);
  cloud.join();
  CHECK(same_weights(cloud.server.top_weights(), cloud.initial_top));
}

TEST_CASE("edge net: a repeated step is answered from the cache") {
  RunningCloud cloud(cloud_config());
  RawDevice raw(cloud.server.endpoint(), "raw");
  const ActPacket good = raw.good_packet();
  const wire::Message first = raw.roundtrip(raw.activation(1, good, {0, 1, 2, 3}));
  REQUIRE(std::holds_alternative<wire::SplitGradient>(first.body));
  const auto g1 = std::get<wire::SplitGradient>(first.body);
  CHECK(g1.step == 1);
  CHECK_FALSE(g1.payload.empty());
  // The same step again (even with other labels): the cached reply, not a second update.
  const wire::Message again = raw.roundtrip(raw.activation(1, good, {3, 2, 1, 0}));
  REQUIRE(std::holds_alternative<wire::SplitGradient>(again.body));
  const auto g2 = std::get<wire::SplitGradient>(again.body);
  CHECK(g2.loss == g1.loss);
  CHECK(g2.payload == g1.payload);
  const auto c = cloud.server.counters();
  CHECK(c.steps_applied == 1);
  CHECK(c.duplicates == 1);
  // A gap is refused.
  const wire::Message gap = raw.roundtrip(raw.activation(3, good, {0, 1, 2, 3}));
  REQUIRE(std::holds_alternative<wire::ErrorBody>(gap.body));
  CHECK(std::get<wire::ErrorBody>(gap.body).message == "expected step 2");
  CHECK(cloud.server.counters().steps_applied == 1);
}

TEST_CASE("edge net: a device resumes after a disconnect and after a restart") {
  RunningCloud cloud(cloud_config());
  const DeviceData data = make_data(5);
  DeviceConfig dc = device_config(cloud.server.endpoint(), "flaky");
  dc.steps = 5;
  {
    EdgeDevice device(dc, data);
    uint64_t drops = 0;
    // Twice at step 3, each time after the cloud has handled the activation
    // (so its reply is what gets lost with the socket).
    device.set_drop_hook([&](uint64_t step) {
      if (step != 3 || drops >= 2) return false;
      for (int i = 0; i < 2000; ++i) {
        const auto c = cloud.server.counters();
        if (c.steps_applied >= 3 && c.duplicates >= drops) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      ++drops;
      return true;
    });
    const auto s = device.run();
    CHECK(s.steps == 5);
    CHECK(s.reconnects == 2);
    CHECK(s.resent == 2);
    CHECK(drops == 2);
  }
  auto c = cloud.server.counters();
  CHECK(c.steps_applied == 5);
  CHECK(c.duplicates == 2);  // step 3 was applied once, answered three times
  // A restarted device continues from its progress file.
  dc.steps = 8;
  EdgeDevice again(dc, data);
  CHECK(again.completed_steps() == 5);
  const auto s = again.run();
  CHECK(s.steps == 8);
  CHECK(cloud.server.counters().steps_applied == 8);
  fs::remove(dc.progress);
}

TEST_CASE("edge net: CURVE admits the listed device key only") {
  const std::string dir = temp_path("keys");
  const net::KeyPair cloud_keys = net::generate_keypair(), good = net::generate_keypair(),
                     bad = net::generate_keypair();
  net::write_keypair(dir, "cloud", cloud_keys);
  net::write_keypair(dir, "good", good);
  net::write_keypair(dir, "bad", bad);
  std::ofstream(dir + "/allow.txt") << good.public_key << "\n";
  CloudConfig cc = cloud_config();
  cc.insecure = false;
  cc.key = dir + "/cloud.key_secret";
  cc.allow = dir + "/allow.txt";
  RunningCloud cloud(cc);
  const DeviceData data = make_data(6);
  DeviceConfig dc = device_config(cloud.server.endpoint(), "good");
  dc.insecure = false;
  dc.cloud_key = dir + "/cloud.key";
  dc.key = dir + "/good.key_secret";
  dc.steps = 2;
  CHECK(EdgeDevice(dc, data).run().steps == 2);

  DeviceConfig bc = device_config(cloud.server.endpoint(), "bad");
  bc.insecure = false;
  bc.cloud_key = dir + "/cloud.key";
  bc.key = dir + "/bad.key_secret";
  bc.reply_timeout_ms = 300;
  bc.max_reconnects = 1;
  CHECK_THROWS_AS(EdgeDevice(bc, data).run(), sparrow::Error);
  CHECK(cloud.server.refused() >= 1);
  CHECK(cloud.server.counters().steps_applied == 2);
  fs::remove(dc.progress);
  fs::remove(bc.progress);
  fs::remove_all(dir);
}

TEST_CASE("edge net: configs are strict") {
  const DeviceConfig d = parse_device_config("cloud = \"tcp://h:1\"\ninsecure = true\nsteps = 3\nlr = 1\n");
  CHECK(d.steps == 3);
  CHECK(d.lr == 1.0);
  CHECK_THROWS_AS(parse_device_config("stepz = 3\n"), sparrow::ConfigError);
  CHECK_THROWS_AS(parse_device_config("steps = \"3\"\n"), sparrow::ConfigError);
  CHECK_THROWS_AS(parse_device_config("steps = -1\n"), sparrow::ConfigError);
  CHECK_THROWS_AS(parse_device_config("", {"steps=x"}), sparrow::ConfigError);
  CHECK(parse_device_config("", {"steps=4"}).steps == 4);
  CHECK_THROWS_AS(parse_cloud_config("listen = \"tcp://*:1\"\n"), sparrow::ConfigError);  // no keys, not insecure
  CHECK(parse_cloud_config("insecure = true\nmomentum = 0.5\n").momentum == 0.5);
  // A model mismatch is refused at the Hello.
  CloudConfig cc = cloud_config();
  cc.cut = "fc2";
  RunningCloud cloud(cc);
  DeviceConfig dc = device_config(cloud.server.endpoint(), "mismatch");
  CHECK_THROWS_WITH_AS(EdgeDevice(dc, make_data(7)).run(), doctest::Contains("model mismatch"), sparrow::Error);
  fs::remove(dc.progress);
}

TEST_CASE("edge net: SplitFed averages the bottoms of two devices") {
  CloudConfig cc = cloud_config();
  cc.fedavg_devices = 2;
  RunningCloud cloud(cc);
  DeviceConfig a = device_config(cloud.server.endpoint(), "fa"), b = device_config(cloud.server.endpoint(), "fb");
  a.steps = b.steps = 6;
  a.fedavg_every = b.fedavg_every = 3;
  std::unique_ptr<EdgeDevice> da = std::make_unique<EdgeDevice>(a, make_data(8));
  std::unique_ptr<EdgeDevice> db = std::make_unique<EdgeDevice>(b, make_data(9));
  EdgeDevice::Summary sa, sb;
  std::string err;
  std::thread ta([&] {
    try {
      sa = da->run();
    } catch (const std::exception& e) {
      err = e.what();
    }
  });
  sb = db->run();
  ta.join();
  REQUIRE(err.empty());
  CHECK(sa.fed_rounds == 2);
  CHECK(sb.fed_rounds == 2);
  CHECK(cloud.server.counters().fed_rounds == 2);
  // Step 6 ended with an average: both bottoms are the same weighted mean.
  CHECK(same_weights(da->bottom_weights(), db->bottom_weights()));
  // Without SplitFed they would differ (different data).
  fs::remove(a.progress);
  fs::remove(b.progress);
}

TEST_CASE("edge net: SplitFed updates are refused when the cloud has it off") {
  RunningCloud cloud(cloud_config());
  DeviceConfig a = device_config(cloud.server.endpoint(), "nofed");
  a.steps = 2;
  a.fedavg_every = 1;
  CHECK_THROWS_WITH_AS(EdgeDevice(a, make_data(10)).run(), doctest::Contains("SplitFed is off"), sparrow::Error);
  fs::remove(a.progress);
}

TEST_CASE("edge net: a restarted cloud gets a fresh lowrank basis") {
  auto cloud = std::make_unique<RunningCloud>(cloud_config());
  const std::string endpoint = cloud->server.endpoint();  // the real port: the new cloud binds it again
  DeviceConfig dc = device_config(endpoint, "basis");
  dc.codec = "lowrank:rank=2,refresh=10";  // steps 2..10 send P only, against the basis of step 1
  dc.steps = 5;
  dc.reply_timeout_ms = 500;
  EdgeDevice device(dc, make_data(11));
  bool replaced = false;
  device.set_drop_hook([&](uint64_t step) {
    if (step != 4 || replaced) return false;
    replaced = true;
    // Wait for step 4 to be applied, then replace the cloud: the new one knows no basis.
    for (int i = 0; i < 2000 && cloud->server.counters().steps_applied < 4; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    cloud.reset();
    CloudConfig cc = cloud_config();
    cc.listen = endpoint;
    cloud = std::make_unique<RunningCloud>(cc);
    return true;
  });
  const auto s = device.run();
  CHECK(s.steps == 5);
  const auto c = cloud->server.counters();
  // The new cloud started at the device's step 3 and refused the cached-basis
  // packet of step 4 once (Malformed); the device resent it with a basis.
  CHECK(c.errors_sent == 1);
  CHECK(c.steps_applied == 2);
  fs::remove(dc.progress);
}

TEST_CASE("edge net: a cloud restarted on its state file keeps the top, the momentum and the device's basis") {
  // Reference: one cloud for the whole run.
  const DeviceData data = make_data(12);
  std::map<std::string, at::Tensor> ref_top, ref_bottom;
  {
    RunningCloud cloud(cloud_config());
    DeviceConfig dc = device_config(cloud.server.endpoint(), "keep");
    dc.codec = "lowrank:rank=2,beta=0.9,refresh=10";  // steps 2..10 send P only, against the basis of step 1
    dc.steps = 7;
    EdgeDevice device(dc, data);
    device.run();
    ref_bottom = device.bottom_weights();
    cloud.join();
    ref_top = cloud.server.top_weights();
    fs::remove(dc.progress);
  }
  const std::string state = temp_path("cloud_state.db");
  CloudConfig cc = cloud_config();
  cc.state = state;
  cc.checkpoint_every = 3;  // a snapshot mid-run, and log entries after it
  auto cloud = std::make_unique<RunningCloud>(cc);
  const std::string endpoint = cloud->server.endpoint();
  DeviceConfig dc = device_config(endpoint, "keep");
  dc.codec = "lowrank:rank=2,beta=0.9,refresh=10";
  dc.steps = 7;
  dc.reply_timeout_ms = 500;
  EdgeDevice device(dc, data);
  bool replaced = false;
  device.set_drop_hook([&](uint64_t step) {
    if (step != 5 || replaced) return false;
    replaced = true;
    for (int i = 0; i < 2000 && cloud->server.counters().steps_applied < 5; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    cloud.reset();  // step 5 was applied; its reply is lost with the connection
    CloudConfig again = cc;
    again.listen = endpoint;
    cloud = std::make_unique<RunningCloud>(again);
    return true;
  });
  const auto s = device.run();
  CHECK(s.steps == 7);
  CHECK(s.skipped == 0);
  const auto c = cloud->server.counters();
  CHECK(c.errors_sent == 0);  // the cached-basis packets of steps 6 and 7 decode against the kept basis
  CHECK(c.duplicates == 1);   // step 5 again: answered from the kept reply
  CHECK(c.steps_applied == 2);
  cloud->join();
  CHECK(same_weights(cloud->server.top_weights(), ref_top));
  CHECK(same_weights(device.bottom_weights(), ref_bottom));
  // A second cloud on the file while one runs is refused; so is another model.
  CHECK_THROWS_WITH_AS(CloudServer{cc}, doctest::Contains("in use by another process"), sparrow::ConfigError);
  cloud.reset();
  CloudConfig other = cc;
  other.cut = "fc2";
  CHECK_THROWS_WITH_AS(CloudServer{other}, doctest::Contains("belongs to a cloud of"), sparrow::ConfigError);
  fs::remove(dc.progress);
  fs::remove(state);
  fs::remove(state + "-wal");
}

TEST_CASE("edge net: a damaged or empty cloud state file is refused with a clear message") {
  const std::string state = temp_path("damaged.db");
  CloudConfig cc = cloud_config();
  cc.state = state;
  { CloudServer first(cc); }  // writes the initial snapshot
  REQUIRE(fs::exists(state));
  {
    // Flip one float of the stored top inside the snapshot blob.
    sqlite3* db = nullptr;
    REQUIRE(sqlite3_open(state.c_str(), &db) == SQLITE_OK);
    REQUIRE(sqlite3_exec(db,
                         "UPDATE cloud_snapshot SET top = CAST(substr(top, 1, length(top) - 5) || X'7f' || "
                         "substr(top, length(top) - 3) AS BLOB)",
                         nullptr, nullptr, nullptr) == SQLITE_OK);
    sqlite3_close(db);
  }
  CHECK_THROWS_WITH_AS(CloudServer{cc}, doctest::Contains("checksum does not match"), sparrow::FormatError);
  fs::remove(state);
  fs::remove(state + "-wal");
  std::ofstream(state).close();  // 0 bytes
  CHECK_THROWS_WITH_AS(CloudServer{cc}, doctest::Contains("exists but is empty"), sparrow::ConfigError);
  std::ofstream(state) << "not a database, just some text that is long enough to have a header";
  CHECK_THROWS_AS(CloudServer{cc}, sparrow::FormatError);
  fs::remove(state);
}

TEST_CASE("edge net: the codec state round-trips bit for bit") {
  sparrow::edge::CodecState s;
  s.basis = torch::randn({12, 3});
  s.sketch = torch::randn({12, 3});
  s.basis_id = 0x12345u;
  s.steps = (uint64_t{1} << 40) + 77;
  s.refresh_next = true;
  const auto back = sparrow::edge::deserialize_codec_state(sparrow::edge::serialize_codec_state(s));
  CHECK(torch::equal(back.basis, s.basis));
  CHECK(torch::equal(back.sketch, s.sketch));
  CHECK_FALSE(back.tracker.defined());
  CHECK(back.basis_id == s.basis_id);
  CHECK(back.steps == s.steps);
  CHECK(back.refresh_next);
  CHECK_THROWS_AS(sparrow::edge::deserialize_codec_state("junk"), sparrow::FormatError);
}

TEST_CASE("edge net: a restarted device keeps its BatchNorm statistics") {
  // resnet cut after its stem (conv1 + bn1): the device's bottom has a BatchNorm.
  CloudConfig cc = cloud_config();
  cc.model = "resnet";
  cc.cut = "stem";
  RunningCloud cloud(cc);
  const DeviceData data = make_data(11);
  DeviceConfig dc = device_config(cloud.server.endpoint(), "bn");
  dc.model = "resnet";
  dc.cut = "stem";
  dc.steps = 2;
  std::map<std::string, at::Tensor> trained;
  {
    EdgeDevice device(dc, data);
    CHECK(device.run().steps == 2);
    trained = device.model_buffers();
  }
  REQUIRE(trained.count("bn1.running_mean"));
  CHECK(trained.at("bn1.num_batches_tracked").item<int64_t>() == 2);
  CHECK(trained.at("bn1.running_mean").abs().sum().item<double>() > 0);  // training moved them
  EdgeDevice again(dc, data);
  CHECK(again.completed_steps() == 2);
  const std::map<std::string, at::Tensor> restored = again.model_buffers();
  REQUIRE(restored.size() == trained.size());
  for (const auto& [key, v] : trained) {
    const std::string k = key;  // (a structured binding cannot be captured before C++20: clang)
    INFO(k);
    CHECK(torch::equal(restored.at(k), v));
  }
  fs::remove(dc.progress);
}

TEST_CASE("edge net: device ids outside the character set are refused at Hello and in the config") {
  RunningCloud cloud(cloud_config());
  zmq::context_t ctx{1};
  zmq::socket_t sock{ctx, zmq::socket_type::dealer};
  sock.set(zmq::sockopt::linger, 0);
  sock.connect(cloud.server.endpoint());
  auto model = sparrow::core::make_model("mlp", kSeed);
  Split split = split_model(model, "fc1");
  wire::Hello h;
  h.client_id = "dev\n2020-01-01T00:00:00.000 level=info event=forged\x1b[2J";
  h.model = split_model_label("mlp", "fc1");
  h.model_digest = bottom_digest(split.bottom.parameter_names(), split.bottom.parameters());
  wire::Message out;
  out.body = h;
  REQUIRE(net::send(sock, out));
  auto m = net::receive(sock, 5000);
  REQUIRE(m.has_value());
  REQUIRE(std::holds_alternative<wire::ErrorBody>(m->body));
  CHECK(std::get<wire::ErrorBody>(m->body).code == wire::ErrorCode::kRejected);
  CHECK(std::get<wire::ErrorBody>(m->body).message.find("A-Z a-z 0-9 . _ : @ -") != std::string::npos);
  // A device checks its own id before it connects.
  DeviceConfig dc = device_config(cloud.server.endpoint(), "a b");
  CHECK_THROWS_WITH_AS(EdgeDevice(dc, make_data(7)), doctest::Contains("device_id"), sparrow::ConfigError);
}

TEST_CASE("edge net: the shared device protocol keeps each device kind's step log checksum") {
  // sparrow-edge's logs were written with sqlite::checksum({step text,
  // payload}), sparrow-edge-lite's with CRC-32 of the two joined: a log left by
  // either before the protocol was shared must still replay.
  std::string payload = "gradient bytes";
  payload.push_back('\0');
  payload += std::string(300, '\x7f');
  for (uint64_t step : {uint64_t{1}, uint64_t{42}, uint64_t{1} << 40}) {
    const std::string text = std::to_string(step);
    CHECK(device::step_log_checksum(device::StepLog::kFramed, step, payload) ==
          static_cast<uint32_t>(sparrow::sqlite::checksum({&text, &payload})));
    CHECK(device::step_log_checksum(device::StepLog::kPlain, step, payload) ==
          static_cast<uint32_t>(sparrow::sqlite::crc32_of(text + payload)));
  }
  // The step counts: moving a digit between the step and the payload changes it.
  CHECK(device::step_log_checksum(device::StepLog::kFramed, 12, "3") !=
        device::step_log_checksum(device::StepLog::kFramed, 1, "23"));
}
