// No setting silently ignored, with the real binaries: every program refuses a
// documented key in a mode where it has no effect (exit 2, the key named, the
// reason given), and three sparrow-client processes on one folder with
// clients = 3 train on shards that add up to the folder.
#include "tests/integration/fixtures.h"

#include <signal.h>

#include <regex>
#include <thread>
#include <vector>

#include "core/npy.h"

using namespace sparrow::testing::integ;  // NOLINT(google-build-using-namespace)

namespace {

const std::string kEdge = kBin + "/sparrow-edge";
const std::string kSim = kBin + "/sparrow-sim";

// n samples for "mlp" (labels i % 10); with `ids`, a client_id.npy of i % ids.
void write_folder(const std::string& dir, int64_t n, int64_t ids = 0) {
  fs::create_directories(dir);
  std::vector<float> x(static_cast<size_t>(n) * 784, 0.25f), y(static_cast<size_t>(n)), c(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    y[static_cast<size_t>(i)] = static_cast<float>(i % 10);
    c[static_cast<size_t>(i)] = static_cast<float>(ids > 0 ? i % ids : 0);
  }
  sparrow::npy::write(dir + "/x.npy", {n, 784}, x.data());
  sparrow::npy::write(dir + "/y.npy", {n}, y.data());
  if (ids > 0) sparrow::npy::write(dir + "/client_id.npy", {n}, c.data());  // whole floats are ids too
}

}  // namespace

TEST_CASE("config: every program refuses a key where it has no effect (exit 2, the key and the reason named)") {
  const std::string dir = fresh_dir("no_effect");
  const std::string own = dir + "/own", natural = dir + "/natural", tested = dir + "/tested";
  write_folder(own, 20);
  write_folder(natural, 20, 4);
  write_folder(tested, 20);
  write_folder(tested + "/test", 5);
  struct Row {
    std::string program;            // server, sim, client, cloud, device
    std::string extra;              // TOML added to the program's base file
    std::vector<std::string> sets;  // --set key=value, in order
    std::string key;                // the key the refusal names
    std::string why = "has no effect";
  };
  const std::string folder_own = "data = \"folder:" + own + "\"\n";
  const std::string folder_natural = "data = \"folder:" + natural + "\"\n";
  const std::vector<Row> rows = {
      // sparrow-client: the data keys against the data source, the keys against insecure.
      {"client", folder_own, {"data_dir=/tmp"}, "data_dir"},
      {"client", "data = \"synthetic\"\n", {"partition=iid"}, "partition"},
      {"client", "", {"partition=dirichlet:alpha=1"}, "partition"},  // clients = 1: one shard
      {"client", "", {"partition_seed=3"}, "partition_seed"},
      {"client", folder_natural, {"clients=4"}, "clients"},
      {"client", folder_natural, {"partition_seed=3"}, "partition_seed"},
      {"client", "clients = 2\n", {"partition=natural"}, "partition", "needs a data folder with its own client ids"},
      {"client", "insecure = true\n", {}, "server_key"},
      // sparrow-sim: the simulation's own keys against the dataset and the attack model.
      {"sim", "dataset = \"synthetic\"\n", {"data_dir=/tmp"}, "data_dir"},
      {"sim", "dataset = \"synthetic\"\n", {"partition=dirichlet:alpha=1"}, "partition"},
      {"sim", "", {"test_fraction=0.3"}, "test_fraction"},
      {"sim", "", {"dataset=folder:" + tested, "test_fraction=0.3"}, "test_fraction"},
      {"sim", "", {"attack=scale"}, "attack"},
      {"sim", "", {"partition=natural"}, "partition", "needs a folder dataset with its own client ids"},
      {"sim", "", {"dataset=mydata"}, "dataset", "folder:PATH"},
      // sparrow-server: the deployment's own keys against its mode.
      {"server", "", {"http_token=/tmp/token"}, "http_token"},
      {"server", "", {"eval_every=0", "eval_data=" + own}, "eval_data"},
      {"server", "", {"eval_every=0", "eval_batch=10"}, "eval_batch"},
      {"server", "", {"upstream_key=/tmp/g.key_secret"}, "upstream_key"},
      {"server", "", {"upstream_id=gw"}, "upstream_id"},
      // sparrow-edge serve.
      {"cloud", "", {"state=", "checkpoint_every=5"}, "checkpoint_every"},
      {"cloud", "", {"state=", "fsync=true"}, "fsync"},
      {"cloud", "insecure = true\n", {}, "key"},
      // sparrow-edge (the device).
      {"device", "", {"freeze=true", "lr=0.1"}, "lr"},
      {"device", "", {"progress=", "save_every=5"}, "save_every"},
      {"device", folder_own, {"eval_samples=10"}, "eval_samples", "has nothing to evaluate"},
      {"device", "data = \"synthetic\"\n", {"data_dir=/tmp"}, "data_dir"},
      {"device", folder_natural, {"clients=2"}, "clients"},
      {"device", "insecure = true\n", {}, "cloud_key"},
  };
  const std::string keys = "key = \"" + dir + "/server.key_secret\"\nallow = \"" + dir + "/allow.txt\"\n";
  std::vector<std::unique_ptr<Process>> procs;
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const std::string d = dir + "/row" + std::to_string(i);
    fs::create_directories(d);
    std::vector<std::string> argv;
    if (r.program == "server") {
      write_file(d + "/run.toml", "listen = \"tcp://127.0.0.1:*\"\n" + keys + "db = \"" + d +
                                      "/server.db\"\nmodel = \"mlp\"\neval_every = 1\n" + r.extra);
      argv = {kServerBin, "--config", d + "/run.toml"};
    } else if (r.program == "sim") {
      write_file(d + "/run.toml", "model = \"mlp\"\nclients = 10\nout = \"" + d + "/out\"\n" +
                                      (r.extra.empty() ? "dataset = \"fashion-mnist\"\n" : r.extra));
      argv = {kSim, "--config", d + "/run.toml"};
    } else if (r.program == "client") {
      write_file(d + "/run.toml", "server = \"tcp://127.0.0.1:9\"\nserver_key = \"" + dir + "/server.key\"\nkey = \"" +
                                      dir + "/client1.key_secret\"\nclient_id = \"c1\"\nstate_db = \"" + d +
                                      "/client.db\"\n" + r.extra);
      argv = {kClientBin, "--config", d + "/run.toml"};
    } else if (r.program == "cloud") {
      write_file(d + "/run.toml",
                 "listen = \"tcp://127.0.0.1:0\"\n" + keys + "state = \"" + d + "/cloud.db\"\n" + r.extra);
      argv = {kEdge, "serve", "--config", d + "/run.toml"};
    } else {
      write_file(d + "/run.toml", "cloud = \"tcp://127.0.0.1:9\"\ncloud_key = \"" + dir + "/server.key\"\nkey = \"" +
                                      dir + "/client1.key_secret\"\nprogress = \"" + d + "/progress.bin\"\n" + r.extra);
      argv = {kEdge, "--config", d + "/run.toml"};
    }
    for (const std::string& s : r.sets) argv.insert(argv.end(), {"--set", s});
    procs.push_back(std::make_unique<Process>(argv, dir + "/row" + std::to_string(i) + ".log"));
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::string sets;
    for (const std::string& s : r.sets) sets += " --set " + s;
    INFO(r.program << " [" << r.extra << "]" << sets);
    const auto rc = procs[i]->wait(60s);
    CHECK_MESSAGE(rc == std::optional<int>(2), log_tail(*procs[i]));
    const std::string log = procs[i]->log();
    CHECK_MESSAGE(log.find("'" + r.key + "'") != std::string::npos, log_tail(*procs[i]));
    CHECK_MESSAGE(log.find(r.why) != std::string::npos, log_tail(*procs[i]));
  }
  fs::remove_all(dir);
}

TEST_CASE("sparrow-client: three clients on one folder with clients = 3 load shards that add up to the folder") {
  const std::string dir = fresh_dir("folder_shards");
  write_folder(dir + "/data", 90);
  std::vector<std::unique_ptr<Process>> clients;
  for (int i = 0; i < 3; ++i) {
    write_file(dir + "/c" + std::to_string(i) + ".toml",
               "server = \"tcp://127.0.0.1:9\"\ninsecure = true\nclient_id = \"c" + std::to_string(i) +
                   "\"\nstate_db = \"" + dir + "/c" + std::to_string(i) + ".db\"\ndata = \"folder:" + dir +
                   "/data\"\npartition = \"dirichlet:alpha=0.5\"\nclients = 3\nindex = " + std::to_string(i) + "\n");
    clients.push_back(std::make_unique<Process>(
        std::vector<std::string>{kClientBin, "--config", dir + "/c" + std::to_string(i) + ".toml"},
        dir + "/c" + std::to_string(i) + ".log"));
  }
  int64_t total = 0;
  for (auto& c : clients) {
    // The data is loaded before any connection (the server here never answers).
    const std::regex loaded("event=data samples=(\\d+)|data: (\\d+) samples");
    std::smatch m;
    std::string log;
    for (int tries = 0; tries < 600 && !std::regex_search(log, m, loaded); ++tries) {
      std::this_thread::sleep_for(100ms);
      log = c->log();
    }
    REQUIRE_MESSAGE(!m.empty(), log_tail(*c));
    const int64_t n = std::stoll(m[1].matched ? m[1].str() : m[2].str());
    CHECK(n > 0);
    CHECK(n < 90);  // a shard, not the whole folder
    total += n;
    c->signal(SIGTERM);
    CHECK(c->wait(30s).has_value());
  }
  CHECK(total == 90);
  fs::remove_all(dir);
}
