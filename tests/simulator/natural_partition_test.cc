// The simulator on a folder that carries its own clients (client_id.npy, the
// LEAF/FEMNIST layout), and the simulation keys refused where they have no
// effect.
#include "tests/sparrow_test.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/npy.h"
#include "simulator/config.h"
#include "simulator/simulator.h"

namespace fs = std::filesystem;
using namespace sparrow;
using sparrow::simulator::parse_config_string;
using sparrow::simulator::SimConfig;
using sparrow::simulator::Simulator;

namespace {

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("sparrow_natural_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

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

void write_folder(const std::string& dir, int64_t n) {
  fs::create_directories(dir);
  std::vector<float> x(static_cast<size_t>(n) * 784);
  std::vector<int64_t> y(static_cast<size_t>(n));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7) / 7.0f;
  for (int64_t i = 0; i < n; ++i) y[static_cast<size_t>(i)] = i % 10;
  npy::write(dir + "/x.npy", {n, 784}, x.data());
  write_int64_npy(dir + "/y.npy", y);
}

std::string folder_config(const std::string& data, const std::string& out, const std::string& extra) {
  return "dataset = \"folder:" + data + "\"\nmodel = \"mlp\"\nclients_per_round = 2\nrounds = 1\nout = \"" + out +
         "\"\n" + extra;
}

}  // namespace

TEST_CASE("simulator: a folder with client_id.npy is split by its own clients (partition natural)") {
  const std::string dir = temp_dir("sim");
  const std::string data = dir + "/data", out = dir + "/run";
  write_folder(data, 12);
  write_folder(data + "/test", 5);
  const std::vector<int64_t> ids = {17, 4, 250, 4, 17, 17, 250, 4, 4, 17, 250, 17};
  write_int64_npy(data + "/client_id.npy", ids);
  const std::vector<std::vector<int64_t>> want = {{1, 3, 7, 8}, {0, 4, 5, 9, 11}, {2, 6, 10}};

  SimConfig c = parse_config_string(folder_config(data, out, "clients = 3\n"));
  CHECK(c.partition == "natural");  // automatic: the folder has its clients and partition was not set
  CHECK(parse_config_string(simulator::to_toml(c)) == c);  // config.toml loads again (--resume, export)
  {
    Simulator sim(c);
    CHECK(sim.partition() == want);  // client i is the i-th distinct id, as sparrow-client's index i
  }
  // Fewer clients: the first ones in id order.
  c = parse_config_string(folder_config(data, out, "clients = 2\n"));
  {
    Simulator sim(c, false);
    CHECK(sim.partition() == std::vector<std::vector<int64_t>>{want[0], want[1]});
    CHECK(sim.training_mode().find("the first 2 of 3 client ids") != std::string::npos);
  }
  // More clients than the folder has: named, with the number to set.
  c = parse_config_string(folder_config(data, out, "clients = 4\n"));
  CHECK_THROWS_WITH_AS(Simulator(c, false), doctest::Contains("set clients = 3"), ConfigError);
  // An explicit partition splits the samples as asked.
  c = parse_config_string(folder_config(data, out, "clients = 3\npartition = \"iid\"\n"));
  CHECK(c.partition == "iid");
  {
    Simulator sim(c, false);
    CHECK(sim.partition() != want);
    size_t n = 0;
    for (const auto& p : sim.partition()) n += p.size();
    CHECK(n == 12);
  }
  // Without a test split the held-out test share keeps the ids in step: the
  // 12 - 2 training samples are still split over the 3 clients.
  fs::remove_all(data + "/test");
  c = parse_config_string(folder_config(data, out, "clients = 3\ntest_fraction = 0.2\n"));
  {
    Simulator sim(c, false);
    size_t n = 0;
    for (const auto& p : sim.partition()) n += p.size();
    CHECK(n == 10);
    CHECK(sim.partition().size() == 3);
  }
  // "natural" needs the file.
  fs::remove(data + "/client_id.npy");
  CHECK_THROWS_WITH_AS(parse_config_string(folder_config(data, out, "partition = \"natural\"\n")),
                       doctest::Contains("client_id.npy"), ConfigError);
  fs::remove_all(dir);
}

TEST_CASE("sim config: a simulation key without an effect is refused, naming the key") {
  const std::string dir = temp_dir("keys");
  write_folder(dir + "/own", 10);
  write_folder(dir + "/own/test", 4);
  struct Row {
    std::string toml, key;
  };
  const std::vector<Row> rows = {
      {"dataset = \"synthetic\"\ndata_dir = \"/tmp\"\n", "data_dir"},
      {"dataset = \"synthetic\"\npartition = \"dirichlet:alpha=1\"\n", "partition"},
      {"test_fraction = 0.3\n", "test_fraction"},                                        // fashion-mnist
      {"dataset = \"folder:" + dir + "/own\"\ntest_fraction = 0.3\n", "test_fraction"},  // has test/
      {"attack = \"scale\"\n", "attack"},                                                // adversaries = 0
      {"partition = \"natural\"\n", "partition"},                                        // no client ids
  };
  for (const Row& r : rows) {
    CAPTURE(r.toml);
    CHECK_THROWS_WITH_AS(parse_config_string(r.toml), doctest::Contains(("'" + r.key + "'").c_str()), ConfigError);
  }
  // An unknown dataset lists the choices, the user's own folder included.
  CHECK_THROWS_WITH_AS(parse_config_string("", {"dataset=mydata"}), doctest::Contains("folder:PATH"), ConfigError);
  // Where they have an effect, and at their defaults, the keys are taken.
  CHECK_NOTHROW(parse_config_string("dataset = \"folder:" + dir + "/none\"\ntest_fraction = 0.3\n"));
  CHECK_NOTHROW(parse_config_string("attack = \"scale\"\nadversaries = 0.1\n"));
  CHECK_NOTHROW(parse_config_string("dataset = \"synthetic\"\npartition = \"iid\"\ntest_fraction = 0.2\n"));
  fs::remove_all(dir);
}
