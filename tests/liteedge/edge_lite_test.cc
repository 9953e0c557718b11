// sparrow-edge-lite's device (liteedge/) against sparrow-edge's (edge/device.h):
// the same cloud, seed, data and initial weights must train the same bottom
// and top, for a dense and a lowrank activation codec; a resumed or
// reconnecting lite device ends where an uninterrupted one does; the config
// refuses, by key, what the lite runtime cannot do.
#include "tests/sparrow_test.h"

#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "core/datasets.h"
#include "core/error.h"
#include "core/models.h"
#include "core/rng.h"
#include "edge/cloud.h"
#include "edge/device.h"
#include "edge/split.h"
#include "lite/export/exporter.h"
#include "lite/model.h"
#include "lite/model_file.h"
#include "liteedge/bottom.h"
#include "liteedge/config.h"
#include "liteedge/data.h"
#include "liteedge/device.h"

namespace fs = std::filesystem;
namespace edge = sparrow::edge;
namespace le = sparrow::liteedge;
namespace cflat = sparrow::compression::flat;

namespace {

constexpr uint64_t kSeed = 7;
constexpr int64_t kSamples = 256, kTest = 40, kBatch = 16;

std::string temp_path(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("sparrow_edge_lite_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

// The same samples for both devices: 784 floats each, labels in [0, 10).
struct Data {
  std::vector<float> x, tx;
  std::vector<int64_t> y, ty;
};

Data make_data() {
  Data d;
  const uint64_t key = sparrow::rng::derive(kSeed, 99);
  for (int64_t i = 0; i < kSamples * 784; ++i) d.x.push_back(sparrow::rng::normal(key, static_cast<uint64_t>(i)));
  for (int64_t i = 0; i < kTest * 784; ++i) d.tx.push_back(sparrow::rng::normal(key + 1, static_cast<uint64_t>(i)));
  for (int64_t i = 0; i < kSamples; ++i) d.y.push_back(static_cast<int64_t>(sparrow::rng::at(key + 2, i) % 10));
  for (int64_t i = 0; i < kTest; ++i) d.ty.push_back(static_cast<int64_t>(sparrow::rng::at(key + 3, i) % 10));
  return d;
}

edge::DeviceData torch_data(const Data& d) {
  edge::DeviceData out;
  out.train.x = torch::from_blob(const_cast<float*>(d.x.data()), {kSamples, 784}).clone();
  out.train.y = torch::tensor(d.y, torch::kLong);
  out.test.x = torch::from_blob(const_cast<float*>(d.tx.data()), {kTest, 784}).clone();
  out.test.y = torch::tensor(d.ty, torch::kLong);
  return out;
}

le::DeviceData lite_data(const Data& d) {
  le::DeviceData out;
  out.train.x = d.x;
  out.train.y = d.y;
  out.test.x = d.tx;
  out.test.y = d.ty;
  return out;
}

edge::CloudConfig cloud_config(const std::string& model, const std::string& cut) {
  edge::CloudConfig c;
  c.listen = "tcp://127.0.0.1:*";
  c.insecure = true;
  c.state = "";
  c.model = model;
  c.cut = cut;
  c.seed = kSeed;
  c.lr = 0.05;
  c.momentum = 0.9;
  c.threads = 1;
  return c;
}

// The whole model's initial weights for kSeed, as a weights file (sparrow-edge's `weights`).
std::string initial_weights(const std::string& model) {
  const std::string path = temp_path("weights_" + model);
  auto m = sparrow::core::make_model(model, kSeed);
  std::map<std::string, at::Tensor> w;
  for (const auto& p : m->named_parameters()) w[p.key()] = p.value();
  edge::save_weights(w, path);
  return path;
}

template <class Config>
void common(Config& c, const std::string& endpoint, const std::string& id, const std::string& model,
            const std::string& cut, const std::string& codec) {
  c.cloud = endpoint;
  c.insecure = true;
  c.device_id = id;
  c.model = model;
  c.cut = cut;
  c.seed = kSeed;
  c.codec = codec;
  c.lr = 0.05;
  c.momentum = 0.9;
  c.batch_size = kBatch;
  c.steps = 6;
  c.progress = temp_path("progress_" + id);
  fs::remove(c.progress);
  fs::remove(c.progress + ".log");
  c.save_every = 2;
  c.reply_timeout_ms = 5000;
  c.backoff_initial_ms = 5;
  c.backoff_max_ms = 20;
  c.max_reconnects = 5;
}

struct RunningCloud {
  edge::CloudServer server;
  std::thread thread;
  explicit RunningCloud(edge::CloudConfig cfg) : server(std::move(cfg)) {
    thread = std::thread([this] { server.run(); });
  }
  void join() {
    server.stop();
    if (thread.joinable()) thread.join();
  }
  ~RunningCloud() { join(); }
};

using Weights = std::map<std::string, std::vector<float>>;

Weights from_torch(const std::map<std::string, at::Tensor>& w) {
  Weights out;
  for (const auto& [k, v] : w) {
    const at::Tensor c = v.contiguous();
    out[k].assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return out;
}

Weights from_flat(const std::map<std::string, cflat::Tensor>& w) {
  Weights out;
  for (const auto& [k, v] : w) out[k] = v.data;
  return out;
}

// max |a - b| / max |a| over all tensors (the names must match); inf when they do not.
double relative_gap(const Weights& a, const Weights& b) {
  if (a.size() != b.size()) return INFINITY;
  double diff = 0, scale = 0;
  for (const auto& [k, v] : a) {
    auto it = b.find(k);
    if (it == b.end() || it->second.size() != v.size()) return INFINITY;
    for (size_t i = 0; i < v.size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::fabs(v[i] - it->second[i])));
      scale = std::max(scale, static_cast<double>(std::fabs(v[i])));
    }
  }
  return diff / std::max(scale, 1e-12);
}

struct Run {
  Weights bottom, top;
  double accuracy = -1;
  uint64_t steps = 0;
};

Run torch_run(const std::string& model, const std::string& cut, const std::string& codec, const Data& d,
              bool freeze = false) {
  RunningCloud cloud(cloud_config(model, cut));
  edge::DeviceConfig c;
  common(c, cloud.server.endpoint(), "torch", model, cut, codec);
  c.freeze = freeze;
  edge::EdgeDevice dev(c, torch_data(d));
  const auto s = dev.run();
  Run r;
  r.bottom = from_torch(dev.bottom_weights());
  cloud.join();
  r.top = from_torch(cloud.server.top_weights());
  r.accuracy = s.accuracy;
  r.steps = s.steps;
  return r;
}

le::DeviceConfig lite_config(const std::string& endpoint, const std::string& id, const std::string& model,
                             const std::string& cut, const std::string& codec, const std::string& weights) {
  le::DeviceConfig c;
  common(c, endpoint, id, model, cut, codec);
  c.weights = weights;
  return c;
}

Run lite_run(const le::DeviceConfig& base, const Data& d, const std::string& model, const std::string& cut,
             const std::function<void(le::EdgeDevice&)>& before = {}) {
  RunningCloud cloud(cloud_config(model, cut));
  le::DeviceConfig c = base;
  c.cloud = cloud.server.endpoint();
  le::EdgeDevice dev(c, lite_data(d));
  if (before) before(dev);
  const auto s = dev.run();
  Run r;
  r.bottom = from_flat(dev.bottom_weights());
  cloud.join();
  r.top = from_torch(cloud.server.top_weights());
  r.accuracy = s.accuracy;
  r.steps = s.steps;
  return r;
}

Weights initial_bottom(const std::string& model, const std::string& cut) {
  auto m = sparrow::core::make_model(model, kSeed);
  const edge::Split s = edge::split_model(m, cut);
  return from_torch(edge::copy_weights(s.bottom.parameter_names(), s.bottom.parameters()));
}

}  // namespace

TEST_CASE("edge lite: a lite device trains the same bottom and top as the LibTorch device") {
  const Data d = make_data();
  struct Case {
    std::string model, cut, codec;
  };
  for (const Case& k :
       std::vector<Case>{{"mlp", "fc1", "none"}, {"mlp", "fc2", "lowrank:rank=4"}, {"cnn", "conv2", "none"}}) {
    const std::string &model = k.model, &cut = k.cut, &codec = k.codec;
    const std::string name = model + " cut at " + cut + ", codec " + codec;
    CAPTURE(name);
    const std::string weights = initial_weights(model);
    const Run ref = torch_run(model, cut, codec, d);
    const Run lite = lite_run(lite_config("", "lite", model, cut, codec, weights), d, model, cut);
    CHECK(lite.steps == ref.steps);
    CHECK(ref.steps == 6);
    const double bottom_gap = relative_gap(ref.bottom, lite.bottom), top_gap = relative_gap(ref.top, lite.top);
    CAPTURE(bottom_gap);
    CAPTURE(top_gap);
    CHECK(bottom_gap <= 1e-4);
    CHECK(top_gap <= 1e-4);
    // Training moved the bottom by far more than the two devices differ.
    CHECK(relative_gap(initial_bottom(model, cut), ref.bottom) > 100 * std::max(bottom_gap, 1e-7));
    CHECK(lite.accuracy >= 0);
    CHECK(std::fabs(lite.accuracy - ref.accuracy) <= 1.0 / kTest + 1e-9);
    fs::remove(weights);
  }
}

TEST_CASE("edge lite: a lite device takes a lite model file as its weights, and resumes and resends without a trace") {
  const Data d = make_data();
  const std::string weights = initial_weights("mlp");
  const Run plain = lite_run(lite_config("", "plain", "mlp", "fc1", "lowrank:rank=4", weights), d, "mlp", "fc1");

  SUBCASE("a lite model file of the model's initial weights") {
    const std::string file = temp_path("model_lite");
    auto m = sparrow::core::make_model("mlp", kSeed);
    std::map<std::string, at::Tensor> w;
    for (const auto& p : m->named_parameters()) w[p.key()] = p.value();
    const sparrow::lite::Exported e = sparrow::lite::export_builtin("mlp", w);
    sparrow::lite::save_model_file(file, e.spec, e.values);
    const Run r = lite_run(lite_config("", "file", "mlp", "fc1", "lowrank:rank=4", file), d, "mlp", "fc1");
    CHECK(relative_gap(plain.bottom, r.bottom) == 0);
    fs::remove(file);
  }
  SUBCASE("a dropped link: the step is resent and applied once") {
    le::DeviceConfig c = lite_config("", "drop", "mlp", "fc1", "lowrank:rank=4", weights);
    bool dropped = false;
    const Run r = lite_run(c, d, "mlp", "fc1", [&](le::EdgeDevice& dev) {
      dev.set_drop_hook([&](uint64_t step) { return step == 3 && !std::exchange(dropped, true); });
    });
    CHECK(dropped);
    CHECK(relative_gap(plain.bottom, r.bottom) == 0);
    CHECK(relative_gap(plain.top, r.top) == 0);
  }
  SUBCASE("stopped after 3 steps, restarted from the progress file against the same cloud") {
    RunningCloud cloud(cloud_config("mlp", "fc1"));
    le::DeviceConfig c = lite_config(cloud.server.endpoint(), "resume", "mlp", "fc1", "lowrank:rank=4", weights);
    {
      le::DeviceConfig first = c;
      first.steps = 3;
      first.eval_samples = 0;
      le::EdgeDevice dev(first, lite_data(d));
      CHECK(dev.run().steps == 3);
    }
    CHECK(fs::exists(c.progress));
    le::EdgeDevice dev(c, lite_data(d));
    CHECK(dev.completed_steps() == 3);
    const auto s = dev.run();
    CHECK(s.steps == 6);
    CHECK(s.skipped == 0);
    CHECK(relative_gap(plain.bottom, from_flat(dev.bottom_weights())) == 0);
    cloud.join();
    CHECK(relative_gap(plain.top, from_torch(cloud.server.top_weights())) == 0);
  }
  fs::remove(weights);
}

TEST_CASE("edge lite: a frozen lite bottom stays as loaded while the top trains as with LibTorch") {
  const Data d = make_data();
  const std::string weights = initial_weights("mlp");
  const Run ref = torch_run("mlp", "fc1", "q8", d, /*freeze=*/true);
  le::DeviceConfig c = lite_config("", "frozen", "mlp", "fc1", "q8", weights);
  c.freeze = true;
  const Run lite = lite_run(c, d, "mlp", "fc1");
  CHECK(relative_gap(initial_bottom("mlp", "fc1"), lite.bottom) == 0);
  const double top_gap = relative_gap(ref.top, lite.top);
  CHECK(top_gap <= 1e-4);
  fs::remove(weights);
}

TEST_CASE("edge lite: SplitFed averages a lite device's bottom with a LibTorch device's") {
  const Data d = make_data();
  const std::string weights = initial_weights("mlp");
  edge::CloudConfig cc = cloud_config("mlp", "fc1");
  cc.fedavg_devices = 2;
  RunningCloud cloud(cc);
  edge::DeviceConfig tc;
  common(tc, cloud.server.endpoint(), "fed_torch", "mlp", "fc1", "none");
  tc.fedavg_every = 3;
  le::DeviceConfig lc = lite_config(cloud.server.endpoint(), "fed_lite", "mlp", "fc1", "none", weights);
  lc.fedavg_every = 3;
  edge::EdgeDevice torch_dev(tc, torch_data(d));
  le::EdgeDevice lite_dev(lc, lite_data(d));
  edge::EdgeDevice::Summary ts;
  std::thread t([&] { ts = torch_dev.run(); });
  const le::EdgeDevice::Summary ls = lite_dev.run();
  t.join();
  CHECK(ts.fed_rounds == 2);
  CHECK(ls.fed_rounds == 2);
  // Both hold the last round's average, which the two decoders read alike.
  CHECK(relative_gap(from_torch(torch_dev.bottom_weights()), from_flat(lite_dev.bottom_weights())) == 0);
  CHECK(relative_gap(initial_bottom("mlp", "fc1"), from_flat(lite_dev.bottom_weights())) > 1e-3);
  fs::remove(weights);
}

TEST_CASE("edge lite: the lite device's config refuses, by key, what the lite runtime cannot do") {
  const std::string base = "insecure = true\nweights = \"w.bin\"\ndata = \"folder:/nonexistent\"\n";
  auto refused_key = [&](const std::string& extra) -> std::string {
    try {
      le::parse_device_config(base + extra);
    } catch (const sparrow::ConfigError& e) {
      return e.what();
    }
    return "";
  };
  CHECK_NOTHROW(le::parse_device_config(base));
  CHECK(refused_key("model = \"resnet\"\n").find("config key 'model'") != std::string::npos);
  CHECK(refused_key("cut = \"fc3\"\n").find("config key 'cut'") != std::string::npos);
  CHECK(refused_key("codec = \"lowrank:rnk=2\"\n").find("config key 'codec'") != std::string::npos);
  CHECK(refused_key("threads = 4\n").find("config key 'threads'") != std::string::npos);
  CHECK(refused_key("clients = 2\nindex = 1\n").find("config key 'clients'") != std::string::npos);
  CHECK(refused_key("lr = 0.1\nfreeze = true\n").find("config key 'lr'") != std::string::npos);
  CHECK(refused_key("colud = \"tcp://127.0.0.1:1\"\n").find("'colud'") != std::string::npos);
  std::string no_weights;
  try {
    le::parse_device_config("insecure = true\ndata = \"folder:/nonexistent\"\n");
  } catch (const sparrow::ConfigError& e) {
    no_weights = e.what();
  }
  CHECK(no_weights.find("config key 'weights'") != std::string::npos);
  CHECK(no_weights.find("sparrow-lite-export") != std::string::npos);
  std::string synthetic;
  try {
    le::parse_device_config("insecure = true\nweights = \"w\"\ndata = \"synthetic\"\n");
  } catch (const sparrow::ConfigError& e) {
    synthetic = e.what();
  }
  CHECK(synthetic.find("config key 'data'") != std::string::npos);
  // What sparrow-edge's config takes, the lite device takes too (cut forms included).
  const auto c =
      le::parse_device_config(base + "model = \"cnn\"\ncut = \"after:conv2\"\ncodec = \"q8\"\nthreads = 1\n");
  CHECK(c.model == "cnn");
  CHECK(sparrow::lite::builtin_cut("cnn", "after:conv2") == 2);
  CHECK(sparrow::lite::builtin_cut("cnn", "first:3") == 3);
  CHECK(sparrow::lite::builtin_cut("mlp", "2") == 2);
}

TEST_CASE("edge lite: a lite bottom's parameters and digest are the LibTorch bottom's") {
  for (const auto& k : std::vector<std::pair<std::string, std::string>>{
           {"mlp", "fc1"}, {"mlp", "fc2"}, {"cnn", "conv1"}, {"cnn", "conv2"}, {"cnn", "fc1"}}) {
    const std::string model = k.first, cut = k.second;
    CAPTURE(model);
    CAPTURE(cut);
    const edge::Split s = edge::split_model(sparrow::core::make_model(model, kSeed), cut);
    const sparrow::lite::Model bottom(sparrow::lite::builtin_bottom_spec(model, cut), sparrow::lite::ModelOutput::kAny);
    CHECK(bottom.param_names() == s.bottom.parameter_names());
    const at::Tensor out = s.bottom.forward(torch::zeros({2, 1, 28, 28}));
    CHECK(std::vector<int64_t>(out.sizes().begin() + 1, out.sizes().end()) == bottom.output_shape());
    le::DeviceConfig c;
    c.model = model;
    c.cut = cut;
    c.weights = initial_weights(model);
    const sparrow::liteedge::Bottom b(c);
    CHECK(b.digest() == edge::bottom_digest(s.bottom.parameter_names(), s.bottom.parameters()));
    fs::remove(c.weights);
  }
}

TEST_CASE("edge lite: the lite device reads Fashion-MNIST as sparrow-edge does") {
  const std::string dir = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(dir + "/t10k-images-idx3-ubyte.gz")) return;  // no data set on this machine
  const le::Samples lite = le::load_mnist_idx(dir, "t10k");
  const sparrow::core::Dataset ref = sparrow::core::load_fashion_mnist(dir, "test");
  REQUIRE(lite.size() == ref.size());
  const at::Tensor x = ref.x.reshape({ref.size(), 784}).contiguous();
  CHECK(std::equal(lite.x.begin(), lite.x.end(), x.data_ptr<float>()));
  const at::Tensor y = ref.y.to(torch::kLong).contiguous();
  CHECK(std::equal(lite.y.begin(), lite.y.end(), y.data_ptr<int64_t>()));
  le::DeviceConfig c;
  c.eval_samples = 100;
  const le::DeviceData d = le::load_device_data(c, 784);
  CHECK(d.train.size() == 60000);
  CHECK(d.test.size() == 100);
  CHECK(std::equal(d.test.y.begin(), d.test.y.end(), y.data_ptr<int64_t>()));
}
