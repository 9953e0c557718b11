// The one configuration model (federation/run_config.h): the same TOML text in
// sparrow-server and sparrow-sim gives the same shared values, the same
// defaults and the same error text, and a simulation's file runs as a
// deployment with only the deployment keys added.
#include "tests/sparrow_test.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/flat_config.h"
#include "federation/run_config.h"
#include "server/config.h"
#include "simulator/config.h"

using namespace sparrow;
using federation::OtherProgramKeys;
using federation::RunConfig;

namespace {

// The message of the ConfigError `f` throws ("" if it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// The shared keys of `c` as "key = value" lines (federation::bind's order).
std::string shared_lines(const RunConfig& c, bool with_clients = true) {
  core::FlatConfig f("");
  federation::bind(f, const_cast<RunConfig&>(c));  // read only
  std::string out;
  for (const std::string& key : f.keys())
    if (with_clients || key != "clients") out += key + " = " + f.toml_value(key) + "\n";
  return out;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// What a deployment adds to a simulation's file: endpoints and keys.
const std::string kDeploymentKeys =
    "listen = \"tcp://127.0.0.1:7070\"\nkey = \"keys/server.key_secret\"\nallow = \"keys/allow.txt\"\n";

}  // namespace

TEST_CASE("run config: the server and the simulator have one default per shared key") {
  const server::ServerConfig s = server::parse_server_config("");
  const simulator::SimConfig m = simulator::parse_config_string("");
  // Every shared key but the population has the same default in both.
  CHECK(shared_lines(s, false) == shared_lines(m, false));
  CHECK(shared_lines(s, false) == shared_lines(RunConfig{}, false));
  // The documented values (docs/configuration.md).
  CHECK(s.seed == 1);
  CHECK(s.model_seed == 0);
  CHECK(s.effective_model_seed() == 1);
  CHECK(s.lr == 0.05);
  CHECK(s.clients_per_round == 10);
  CHECK(s.rounds == 10);
  CHECK(s.eval_every == 0);
  CHECK(s.model == "mlp");
  // The population: the clients that connect in a deployment; 100 simulated.
  CHECK(s.clients == 0);
  CHECK(m.clients == 100);
  CHECK(m.partition == "iid");  // as sparrow-client's partition
  CHECK(s.no_effect.empty());
  CHECK(m.no_effect.empty());
}

TEST_CASE("run config: the same text gives the same shared values in the server and the simulator") {
  const std::string text =
      "seed = 7\nmodel = \"cnn\"\nmodel_seed = 3\nalgorithm = \"fedprox\"\nmu = 0.01\nlocal_epochs = 2\n"
      "batch_size = 16\nlr = 0.1\nmomentum = 0.9\nweight_decay = 0.0001\ncompression = \"topk:ratio=0.1\"\n"
      "downlink = \"topk:ratio=0.5\"\nserver_optimizer = \"fedavgm:lr=1,momentum=0.9\"\n"
      "aggregator = \"trimmed_mean:beta=0.1\"\ndp = \"none\"\nmax_buffer_mb = 512\nrounds = 3\nclients = 20\n"
      "clients_per_round = 5\neval_every = 2\ndata_dir = \"/tmp/fmnist\"\n"
      // simulation keys
      "dataset = \"fashion-mnist\"\npartition = \"dirichlet:alpha=0.3\"\nout = \"runs/x\"\ndeadline_s = 3\n"
      "workers = 2\n"
      // deployment keys
      "quorum = 4\nround_deadline_s = 30\ndb = \"x.db\"\n"
      "[profiles]\navailability = 0.9\n";
  const server::ServerConfig s = server::parse_server_config(kDeploymentKeys + text, {"lr=0.2"});
  const simulator::SimConfig m = simulator::parse_config_string(kDeploymentKeys + text, {"lr=0.2"});
  CHECK(shared_lines(s) == shared_lines(m));
  CHECK(s.lr == 0.2);
  CHECK(s.clients == 20);
  CHECK(m.clients == 20);
  CHECK(s.effective_model_seed() == 3);
  CHECK(m.effective_model_seed() == 3);
  CHECK(s.quorum == 4);   // the server's own
  CHECK(s.workers == 2);  // each program's own meaning
  CHECK(m.workers == 2);
  CHECK(m.deadline_s == 3.0);  // the simulator's own
  // The other program's keys are listed, in bind order, never silently dropped.
  CHECK(s.no_effect == std::vector<std::string>{"dataset", "partition", "out", "deadline_s", "profiles.availability"});
  CHECK(m.no_effect == std::vector<std::string>{"listen", "key", "allow", "quorum", "round_deadline_s", "db"});
  // The note names the key and the program.
  const std::string note = OtherProgramKeys::note("deadline_s", OtherProgramKeys::Program::kServer);
  CHECK(note.find("config key 'deadline_s' has no effect in sparrow-server") == 0);
  CHECK(note.find("round_deadline_s") != std::string::npos);
  CHECK(OtherProgramKeys::note("quorum", OtherProgramKeys::Program::kSimulator)
            .find("config key 'quorum' has no effect in sparrow-sim") == 0);
  // A typo is still an error in both.
  CHECK(error_of([] { server::parse_server_config("lerning_rate = 0.1\n"); }).find("unknown") != std::string::npos);
  CHECK(error_of([] { simulator::parse_config_string("lerning_rate = 0.1\n"); }).find("unknown") != std::string::npos);
  // A wrong type in the other program's key is an error too (the file could
  // not run where the key means something).
  CHECK(error_of([] { server::parse_server_config("partition = 3\n"); }).find("'partition'") != std::string::npos);
  CHECK(error_of([] { simulator::parse_config_string("quorum = \"x\"\n"); }).find("'quorum'") != std::string::npos);
}

TEST_CASE("run config: an invalid shared value gives the same error text in the server and the simulator") {
  for (const char* line : {"lr = 0.0",
                           "lr = nan",
                           "momentum = 1.0",
                           "mu = -1",
                           "local_epochs = 0",
                           "batch_size = 0",
                           "weight_decay = 2",
                           "rounds = 0",
                           "model = \"\"",
                           "algorithm = \"fedsgd\"",
                           "compression = \"topk:ratio\"",
                           "compression = \"nonsense\"",
                           "downlink = \"acp:rank=2\"",
                           "downlink = \"tcs:ratio=0.01\"",
                           "server_optimizer = \"sgd\"",
                           "aggregator = \"krum:f=4\"",
                           "aggregator = \"krum:x=1\"",
                           "dp = \"central:clip=1\"",
                           "dp = \"central:clip=1,noise=1\"\naggregator = \"median\"",
                           "secagg = \"secagg+:degree=16,threshold=12\"",
                           "clients = 10\nclients_per_round = 20",
                           "clients_per_round = 0",
                           "clients = -1",
                           "eval_every = -1",
                           "max_buffer_mb = 0"}) {
    const std::string text = std::string(line) + "\n";
    CAPTURE(text);
    const std::string in_server = error_of([&] { server::parse_server_config(text); });
    const std::string in_sim = error_of([&] { simulator::parse_config_string(text); });
    CHECK(in_server.find("<string>:") == 0);  // where the value came from, then the key
    CHECK(in_server.find("config key '") != std::string::npos);
    CHECK(in_server == in_sim);
  }
  // Built in code: the same text without a location.
  RunConfig c;
  c.lr = 0;
  CHECK(error_of([&] { federation::validate(c); }) == "config key 'lr' must be in (0, 10]");
  server::ServerConfig s;
  s.insecure = true;
  s.lr = 0;
  CHECK(error_of([&] { server::validate(s); }) == "config key 'lr' must be in (0, 10]");
}

TEST_CASE("run config: every example simulation loads in sparrow-server with only the deployment keys added") {
  int n = 0;
  for (const char* folder : {"/examples", "/examples/results"}) {
    for (const auto& entry : std::filesystem::directory_iterator(std::string(SPARROW_SOURCE_DIR) + folder)) {
      if (entry.path().extension() != ".toml") continue;
      const std::string path = entry.path().string();
      CAPTURE(path);
      const std::string text = read_text(path);
      const simulator::SimConfig m = simulator::load_config(path);
      server::ServerConfig s;
      REQUIRE_NOTHROW(s = server::parse_server_config(kDeploymentKeys + text, {}, path));
      CHECK_NOTHROW(server::validate(s));  // with key and allow: not insecure
      CHECK(shared_lines(s) == shared_lines(m));
      CHECK(contains(s.no_effect, "out"));  // every example names its run folder
      CHECK_FALSE(contains(s.no_effect, "lr"));
      ++n;
    }
  }
  CHECK(n >= 6);
  // And the service's example runs in the simulator (its population: 100).
  const std::string service = std::string(SPARROW_SOURCE_DIR) + "/examples/service/server.toml";
  const server::ServerConfig s = server::load_server_config(service);
  const simulator::SimConfig m = simulator::load_config(service);
  CHECK(shared_lines(s, false) == shared_lines(m, false));
  CHECK(contains(m.no_effect, "quorum"));
  CHECK(contains(m.no_effect, "allow"));
}

TEST_CASE("run config: each program accepts every key the other writes") {
  // Every simulation key (to_toml writes them all) loads in the server, and is
  // reported there: a key added to the simulator but not to
  // OtherProgramKeys fails here.
  const simulator::SimConfig m = simulator::parse_config_string("");
  const server::ServerConfig s = server::parse_server_config(simulator::to_toml(m));
  CHECK(shared_lines(s) == shared_lines(m));
  std::vector<std::string> sim_only = OtherProgramKeys::keys(OtherProgramKeys::Program::kServer);
  sim_only.erase(std::remove(sim_only.begin(), sim_only.end(), "alpha"), sim_only.end());  // never written
  CHECK(s.no_effect == sim_only);
  // Every deployment key loads in the simulator (with a population set).
  server::ServerConfig d;
  d.clients = 50;
  d.upstream = "tcp://127.0.0.1:7070";
  const simulator::SimConfig back = simulator::parse_config_string(server::to_toml(d));
  CHECK(shared_lines(back) == shared_lines(d));
  for (const std::string& key : OtherProgramKeys::keys(OtherProgramKeys::Program::kSimulator)) {
    CAPTURE(key);
    if (key != "server_key") CHECK(contains(back.no_effect, key));  // the old name of `key`, never written
  }
  // A deployment without a population cannot be simulated: said, not guessed.
  CHECK(error_of([] {
          simulator::parse_config_string("clients = 0\n");
        }).find("config key 'clients' must be in [1, 10000000] (a simulation needs a population)") !=
        std::string::npos);
}

TEST_CASE("run config: SCAFFOLD's population and the model seed, as the server and the simulator use them") {
  RunConfig c;
  CHECK(c.scaffold_population(0) == 1.0);
  CHECK(c.scaffold_population(3) == 3.0);  // the service: the clients seen
  c.clients = 100;
  CHECK(c.scaffold_population(3) == 100.0);  // the declared population, as the simulator divides
  CHECK(c.scaffold_population(150) == 150.0);
  c.seed = 9;
  CHECK(c.effective_model_seed() == 9);
  c.model_seed = 4;
  CHECK(c.effective_model_seed() == 4);
}
