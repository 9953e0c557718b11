// A split device's data (edge/device.h): the user's own folder is evaluated on
// its test split, and device and cloud keys without an effect are refused.
#include "tests/sparrow_test.h"

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/npy.h"
#include "edge/cloud.h"
#include "edge/device.h"

using namespace sparrow::edge;
namespace fs = std::filesystem;

namespace {

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("sparrow_device_data_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

void write_folder(const std::string& dir, int64_t n) {
  fs::create_directories(dir);
  std::vector<float> x(static_cast<size_t>(n) * 784, 0.5f), y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) y[static_cast<size_t>(i)] = static_cast<float>(i % 10);
  sparrow::npy::write(dir + "/x.npy", {n, 784}, x.data());
  sparrow::npy::write(dir + "/y.npy", {n}, y.data());
}

const std::string kDevice = "insecure = true\nmodel = \"mlp\"\ncut = \"fc1\"\n";

}  // namespace

TEST_CASE("split device: folder data is evaluated on the folder's test split") {
  const std::string dir = temp_dir("eval");
  write_folder(dir, 12);
  write_folder(dir + "/test", 5);
  const std::string data = "data = \"folder:" + dir + "\"\n";
  DeviceData d = load_device_data(parse_device_config(kDevice + data + "eval_samples = 3\n"));
  CHECK(d.train.size() == 12);
  CHECK(d.test.size() == 3);  // the first eval_samples of test/
  CHECK(d.test.x.sizes().vec() == std::vector<int64_t>{3, 1, 28, 28});
  CHECK(load_device_data(parse_device_config(kDevice + data)).test.size() == 5);  // default 1000: all of it
  CHECK(load_device_data(parse_device_config(kDevice + data + "eval_samples = 0\n")).test.size() == 0);
  // Shards of the folder, as sparrow-client's.
  CHECK(load_device_data(parse_device_config(kDevice + data + "clients = 3\nindex = 2\n")).train.size() == 4);
  // Without a test split: eval_samples set is refused (nothing to evaluate),
  // the default evaluates nothing.
  fs::remove_all(dir + "/test");
  CHECK_THROWS_WITH_AS(parse_device_config(kDevice + data + "eval_samples = 3\n"),
                       doctest::Contains("'eval_samples' has nothing to evaluate"), sparrow::ConfigError);
  CHECK(load_device_data(parse_device_config(kDevice + data)).test.size() == 0);
  fs::remove_all(dir);
}

TEST_CASE("split config: device and cloud keys without an effect are refused, naming the key") {
  struct Row {
    std::string toml, key;
  };
  const std::vector<Row> device = {
      {"freeze = true\nlr = 0.1\n", "lr"},
      {"freeze = true\nmomentum = 0.9\n", "momentum"},
      {"progress = \"\"\nsave_every = 5\n", "save_every"},
      {"data = \"synthetic\"\ndata_dir = \"/tmp\"\n", "data_dir"},
      {"data = \"synthetic\"\npartition = \"iid\"\n", "partition"},
      {"partition = \"dirichlet:alpha=1\"\n", "partition"},  // clients = 1
      {"cloud_key = \"c.key\"\n", "cloud_key"},              // insecure = true in the file
  };
  for (const Row& r : device) {
    CAPTURE(r.toml);
    CHECK_THROWS_WITH_AS(parse_device_config(kDevice + r.toml), doctest::Contains(("'" + r.key + "'").c_str()),
                         sparrow::ConfigError);
  }
  CHECK_NOTHROW(parse_device_config(kDevice + "lr = 0.1\nsave_every = 5\n"));
  const std::string cloud = "listen = \"tcp://127.0.0.1:0\"\ninsecure = true\n";
  const std::vector<Row> clouds = {
      {"state = \"\"\ncheckpoint_every = 5\n", "checkpoint_every"},
      {"state = \"\"\nfsync = true\n", "fsync"},
      {"key = \"s.key_secret\"\n", "key"},  // insecure = true in the file
  };
  for (const Row& r : clouds) {
    CAPTURE(r.toml);
    CHECK_THROWS_WITH_AS(parse_cloud_config(cloud + r.toml), doctest::Contains(("'" + r.key + "'").c_str()),
                         sparrow::ConfigError);
  }
  CHECK_NOTHROW(parse_cloud_config(cloud + "checkpoint_every = 5\nfsync = true\n"));
  // --insecure on a secure file is the documented try-out.
  CHECK_NOTHROW(
      parse_cloud_config("listen = \"tcp://127.0.0.1:0\"\nkey = \"s.key_secret\"\nallow = \"a\"\n", {"insecure=true"}));
}
