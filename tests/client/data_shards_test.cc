// Shards of the user's own data (client/data_folder.h): sparrow-client's
// `clients` and `index` split a folder as the simulator splits it, and a folder
// that carries client_id.npy is split by its own clients (partition "natural").
#include "tests/sparrow_test.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "client/data_folder.h"
#include "client/session.h"
#include "core/data_folder.h"
#include "core/error.h"
#include "core/npy.h"
#include "federation/client_pipeline.h"

namespace fs = std::filesystem;
using namespace sparrow;

namespace {

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("sparrow_data_shards_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// int64 [n] as a .npy file (numpy's np.save of an int64 array).
void write_int64_npy(const std::string& path, const std::vector<int64_t>& v) {
  std::string header = "{'descr': '<i8', 'fortran_order': False, 'shape': (" + std::to_string(v.size()) + ",), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  std::ofstream(path, std::ios::binary) << out << header
                                        << std::string(reinterpret_cast<const char*>(v.data()), v.size() * 8);
}

// n samples for "mlp" whose first pixel is the sample's number, labels i % 10.
void write_folder(const std::string& dir, int64_t n) {
  std::vector<float> x(static_cast<size_t>(n) * 784, 0.0f);
  std::vector<int64_t> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    x[static_cast<size_t>(i) * 784] = static_cast<float>(i);
    y[static_cast<size_t>(i)] = i % 10;
  }
  npy::write(dir + "/x.npy", {n, 784}, x.data());
  write_int64_npy(dir + "/y.npy", y);
}

// The sample numbers a shard holds (the first pixel of each sample).
std::vector<int64_t> sample_numbers(const core::Dataset& d) {
  const at::Tensor first = d.x.reshape({d.size(), -1}).select(1, 0).to(at::kLong).contiguous();
  return std::vector<int64_t>(first.data_ptr<int64_t>(), first.data_ptr<int64_t>() + first.numel());
}

const std::string kBase = "server = \"tcp://127.0.0.1:1\"\nclient_id = \"c1\"\ninsecure = true\n";

}  // namespace

TEST_CASE("client data: three clients on one folder with clients = 3 hold disjoint shards whose union is the folder") {
  const std::string dir = temp_dir("three");
  write_folder(dir, 100);
  for (const std::string partition : {"iid", "dirichlet:alpha=0.5", "shards"}) {
    CAPTURE(partition);
    std::set<int64_t> seen;
    size_t total = 0;
    std::vector<std::vector<int64_t>> shards;
    for (int index = 0; index < 3; ++index) {
      // As sparrow-client reads it: the config file, then the folder.
      const client::SessionConfig c =
          client::parse_session_config(kBase + "data = \"folder:" + dir + "\"\nclients = 3\npartition = \"" +
                                       partition + "\"\npartition_seed = 11\nindex = " + std::to_string(index) + "\n");
      const core::Dataset d = client::load_client_data(c.data, "mlp");
      const std::vector<int64_t> mine = sample_numbers(d);
      CHECK(!mine.empty());
      CHECK(mine.size() < 100);
      total += mine.size();
      seen.insert(mine.begin(), mine.end());
      shards.push_back(mine);
    }
    CHECK(total == 100);        // no sample in two shards ...
    CHECK(seen.size() == 100);  // ... and every sample in one
    CHECK(*seen.begin() == 0);
    CHECK(*seen.rbegin() == 99);
    // The simulator's clients 0, 1, 2 on this folder (with its own test
    // split) under a seed whose partition_seed the clients use.
    const at::Tensor labels = at::arange(100, at::kLong).fmod(10);
    const auto parts = core::partition_folder(labels, std::nullopt, 3, partition, 11);
    for (size_t i = 0; i < 3; ++i) {
      std::vector<int64_t> mine = shards[i];
      std::sort(mine.begin(), mine.end());
      CHECK(mine == parts[i]);
    }
  }
  // One shard (the default) is the whole folder, in its order.
  client::DataConfig whole;
  whole.data = "folder:" + dir;
  std::vector<int64_t> all(100);
  for (int64_t i = 0; i < 100; ++i) all[static_cast<size_t>(i)] = i;
  CHECK(sample_numbers(client::load_client_data(whole, "mlp")) == all);
  // More shards than samples is said before anything trains.
  whole.clients = 101;
  whole.index = 3;
  CHECK_THROWS_WITH_AS(client::load_client_data(whole, "mlp"), doctest::Contains("clients"), ConfigError);
  fs::remove_all(dir);
}

TEST_CASE("client data: a folder with client_id.npy is split by its own clients, index picks the index-th id") {
  const std::string dir = temp_dir("natural");
  write_folder(dir, 12);
  // Ids out of order, not 0-based, not contiguous: 3 clients, ascending 4 < 17 < 250.
  const std::vector<int64_t> ids = {17, 4, 250, 4, 17, 17, 250, 4, 4, 17, 250, 17};
  write_int64_npy(dir + "/client_id.npy", ids);
  const std::vector<std::vector<int64_t>> want = {{1, 3, 7, 8}, {0, 4, 5, 9, 11}, {2, 6, 10}};
  CHECK(core::natural_partition(at::tensor(ids, at::kLong)) == want);
  for (int index = 0; index < 3; ++index) {
    CAPTURE(index);
    const client::SessionConfig c =
        client::parse_session_config(kBase + "data = \"folder:" + dir + "\"\nindex = " + std::to_string(index) + "\n");
    CHECK(c.data.partition == "natural");  // automatic: partition was not set
    CHECK(sample_numbers(client::load_client_data(c.data, "mlp")) == want[static_cast<size_t>(index)]);
  }
  // "natural" written out is the same; index past the last id is named.
  client::SessionConfig c =
      client::parse_session_config(kBase + "data = \"folder:" + dir + "\"\npartition = \"natural\"\nindex = 3\n");
  CHECK_THROWS_WITH_AS(client::load_client_data(c.data, "mlp"), doctest::Contains("index: must be in [0, 3)"),
                       ConfigError);
  // An explicit partition re-splits the folder and ignores the ids, as asked.
  c = client::parse_session_config(kBase + "data = \"folder:" + dir + "\"\npartition = \"iid\"\nclients = 2\n");
  CHECK(c.data.partition == "iid");
  CHECK(client::load_client_data(c.data, "mlp").size() == 6);
  // What has no effect with the natural partition is refused, naming the key.
  CHECK_THROWS_WITH_AS(client::parse_session_config(kBase + "data = \"folder:" + dir + "\"\nclients = 3\n"),
                       doctest::Contains("'clients' has no effect with the natural partition"), ConfigError);
  CHECK_THROWS_WITH_AS(client::parse_session_config(kBase + "data = \"folder:" + dir + "\"\npartition_seed = 3\n"),
                       doctest::Contains("'partition_seed' has no effect"), ConfigError);
  // A wrong number of ids is a bad file.
  write_int64_npy(dir + "/client_id.npy", {1, 2, 3});
  CHECK_THROWS_WITH_AS(client::load_client_data(c.data, "mlp"), doctest::Contains("3 client ids for 12 samples"),
                       FormatError);
  // "natural" without the file is named.
  fs::remove(dir + "/client_id.npy");
  CHECK_THROWS_WITH_AS(client::parse_session_config(kBase + "data = \"folder:" + dir + "\"\npartition = \"natural\"\n"),
                       doctest::Contains("client_id.npy"), ConfigError);
  fs::remove_all(dir);
}

TEST_CASE("client config: a data key without an effect for its source is refused, naming the key") {
  const std::string dir = temp_dir("keys");
  write_folder(dir, 10);
  const std::string folder = "data = \"folder:" + dir + "\"\n";
  struct Row {
    std::string toml, key;
  };
  const std::vector<Row> rows = {
      {folder + "data_dir = \"/tmp\"\n", "data_dir"},
      {"data = \"synthetic\"\ndata_dir = \"/tmp\"\n", "data_dir"},
      {"data = \"synthetic\"\npartition = \"iid\"\nclients = 2\n", "partition"},
      {"partition = \"dirichlet:alpha=1\"\n", "partition"},  // clients = 1: one shard
      {folder + "partition_seed = 4\n", "partition_seed"},
      {"partition = \"natural\"\nclients = 2\n", "partition"},  // fashion-mnist has no client ids
      {"data = \"mydata\"\n", "data"},
      {"server_key = \"s.key\"\n", "server_key"},  // insecure = true in the file
  };
  for (const Row& r : rows) {
    CAPTURE(r.toml);
    CHECK_THROWS_WITH_AS(client::parse_session_config(kBase + r.toml), doctest::Contains(("'" + r.key + "'").c_str()),
                         ConfigError);
  }
  // The unknown source lists every choice, the user's own folder included.
  CHECK_THROWS_WITH_AS(client::parse_session_config(kBase + "data = \"mydata\"\n"), doctest::Contains("folder:PATH"),
                       ConfigError);
  // --insecure on a file with keys is the documented try-out: accepted.
  CHECK_NOTHROW(
      client::parse_session_config("server = \"tcp://127.0.0.1:1\"\nclient_id = \"c1\"\nserver_key = "
                                   "\"s.key\"\nkey = \"c.key_secret\"\n",
                                   {"insecure=true"}));
  // With an effect, the same keys are taken.
  CHECK_NOTHROW(client::parse_session_config(kBase + folder + "clients = 2\npartition_seed = 4\n"));
  CHECK_NOTHROW(client::parse_session_config(kBase + "data = \"synthetic\"\nclients = 2\npartition_seed = 4\n"));
  CHECK_NOTHROW(client::parse_session_config(kBase + "data_dir = \"/tmp\"\nclients = 3\npartition = \"iid\"\n"));
  fs::remove_all(dir);
}
