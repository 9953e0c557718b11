#include "tests/sparrow_test.h"

#include <cstdio>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "core/error.h"
#include "simulator/config.h"

using sparrow::ConfigError;
using namespace sparrow::simulator;

namespace {

// A config file with a name unique to this test and process, removed on scope exit.
struct TempConfig {
  std::string path;
  TempConfig(const std::string& name, const std::string& text)
      : path("config_test_" + name + "_" + std::to_string(getpid()) + ".toml") {
    std::ofstream(path) << text;
  }
  ~TempConfig() { std::remove(path.c_str()); }
};

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

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Every key with an effect: fashion-mnist, the one dataset that reads data_dir
// and partition (a key without an effect is refused).
const char* kFull = R"(seed = 7
dataset = "fashion-mnist"
data_dir = "/tmp/data"
partition = "shards:per_client=3"
clients = 50
clients_per_round = 5
rounds = 20
model = "cnn"
algorithm = "fedprox"
mu = 0.01
local_epochs = 2
batch_size = 64
lr = 0.1
momentum = 0.9
weight_decay = 1e-4
compression = "dgc:ratio=0.001,momentum=0.9"
server_optimizer = "fedadam:lr=0.01"
workers = 4
eval_every = 5
out = "runs/full"
deadline_s = 30.5

[profiles]
compute_speed = 0.5
uplink_mbps = 2
downlink_mbps = 20.5
availability = 0.8
)";

}  // namespace

TEST_CASE("config defaults") {
  const SimConfig c = parse_config_string("");
  CHECK(c == SimConfig{});
  CHECK(c.seed == 1);  // the shared defaults (docs/configuration.md), as sparrow-server's
  CHECK(c.model_seed == 0);
  CHECK(c.effective_model_seed() == 1);
  CHECK(c.eval_every == 0);
  CHECK(c.dataset == "fashion-mnist");
  CHECK(c.data_dir == "/usr/share/datasets/fashion-mnist");
  CHECK(c.partition == "iid");
  CHECK(c.clients == 100);
  CHECK(c.clients_per_round == 10);
  CHECK(c.rounds == 10);
  CHECK(c.algorithm == "fedavg");
  CHECK(c.lr == doctest::Approx(0.05));
  CHECK(c.compression == "none");
  CHECK(c.profiles.availability == 1.0);
  SUBCASE("load_config names the run folder after the file") {
    TempConfig f("defaults", "");
    const SimConfig d = load_config(f.path);
    CHECK(d.out == "runs/config_test_defaults_" + std::to_string(getpid()));
  }
}

TEST_CASE("config reads every key from a file") {
  TempConfig f("full", kFull);
  const SimConfig c = load_config(f.path, {});
  CHECK(c.seed == 7);
  CHECK(c.dataset == "fashion-mnist");
  CHECK(c.data_dir == "/tmp/data");
  CHECK(c.partition == "shards:per_client=3");
  CHECK(c.clients == 50);
  CHECK(c.clients_per_round == 5);
  CHECK(c.rounds == 20);
  CHECK(c.model == "cnn");
  CHECK(c.algorithm == "fedprox");
  CHECK(c.mu == 0.01);
  CHECK(c.local_epochs == 2);
  CHECK(c.batch_size == 64);
  CHECK(c.lr == 0.1);
  CHECK(c.momentum == 0.9);
  CHECK(c.weight_decay == 1e-4);
  CHECK(c.compression == "dgc:ratio=0.001,momentum=0.9");
  CHECK(c.server_optimizer == "fedadam:lr=0.01");
  CHECK(c.workers == 4);
  CHECK(c.eval_every == 5);
  CHECK(c.out == "runs/full");
  CHECK(c.deadline_s == 30.5);
  CHECK(c.profiles.compute_speed == 0.5);
  CHECK(c.profiles.uplink_mbps == 2.0);  // an integer is a fine float
  CHECK(c.profiles.downlink_mbps == 20.5);
  CHECK(c.profiles.availability == 0.8);
}

TEST_CASE("config --set overrides are typed by key") {
  TempConfig f("set", kFull);
  const SimConfig c = load_config(f.path, {"clients=8", "lr=1e-3", "model=resnet", "profiles.availability=0.5",
                                           "compression=topk:ratio=0.01", "seed=42", "clients_per_round=8"});
  CHECK(c.clients == 8);
  CHECK(c.clients_per_round == 8);
  CHECK(c.lr == 1e-3);
  CHECK(c.model == "resnet");
  CHECK(c.profiles.availability == 0.5);
  CHECK(c.compression == "topk:ratio=0.01");  // text after the first '=' verbatim
  CHECK(c.seed == 42);
  CHECK(c.rounds == 20);  // untouched keys keep the file's value
  SUBCASE("later overrides win") { CHECK(parse_config_string("", {"rounds=3", "rounds=4"}).rounds == 4); }
  SUBCASE("integer key rejects non-integers") {
    const std::string e = error_of([] { parse_config_string("", {"rounds=2.5"}); });
    CHECK(contains(e, "--set"));
    CHECK(contains(e, "'rounds'"));
    CHECK(contains(e, "integer"));
    CHECK(contains(error_of([] { parse_config_string("", {"lr=fast"}); }), "'lr'"));
    CHECK(contains(error_of([] { parse_config_string("", {"seed=-1"}); }), "'seed'"));
    CHECK(contains(error_of([] { parse_config_string("", {"rounds"}); }), "key=value"));
  }
}

TEST_CASE("config alpha is folded into the partition spec") {
  CHECK(parse_config_string("partition = \"dirichlet\"\nalpha = 0.1").partition == "dirichlet:alpha=0.1");
  CHECK(parse_config_string("partition = \"quantity:alpha=2\"", {"alpha=0.3"}).partition == "quantity:alpha=0.3");
  CHECK(parse_config_string("alpha = 1\npartition = \"dirichlet\"").partition == "dirichlet:alpha=1");
  const std::string e = error_of([] { parse_config_string("alpha = 0.1\npartition = \"iid\""); });
  CHECK(contains(e, "'alpha'"));
  CHECK(contains(e, "<string>:1"));
  CHECK(contains(error_of([] { parse_config_string("partition = \"dirichlet:alpha=1\"\nalpha = 0"); }), "'alpha'"));
  // The default partition is iid: alpha alone says so.
  CHECK(contains(error_of([] { parse_config_string("alpha = 0.1"); }), "partition is 'iid'"));
}

TEST_CASE("config unknown keys are errors") {
  SUBCASE("in the file, with the line") {
    TempConfig f("unknown", "rounds = 3\n\nlearning_rate = 0.1\n");
    const std::string e = error_of([&] { load_config(f.path); });
    CHECK(contains(e, f.path + ":3"));
    CHECK(contains(e, "'learning_rate'"));
    CHECK(contains(e, "unknown"));
  }
  SUBCASE("in the profiles table") {
    const std::string e = error_of([] { parse_config_string("[profiles]\nbattery = 3\n"); });
    CHECK(contains(e, "'profiles.battery'"));
    CHECK(contains(e, "<string>:2"));
  }
  SUBCASE("an unknown table") {
    CHECK(contains(error_of([] { parse_config_string("[extra]\nx = 1\n"); }), "'extra'"));
  }
  SUBCASE("in --set") {
    const std::string e = error_of([] { parse_config_string("", {"learning_rate=0.1"}); });
    CHECK(contains(e, "--set"));
    CHECK(contains(e, "'learning_rate'"));
  }
}

TEST_CASE("config wrong types are errors") {
  const std::string e = error_of([] { parse_config_string("seed = 1\nclients = \"ten\"\n"); });
  CHECK(contains(e, "<string>:2"));
  CHECK(contains(e, "'clients'"));
  CHECK(contains(e, "integer"));
  CHECK(contains(error_of([] { parse_config_string("lr = \"0.1\""); }), "'lr'"));
  CHECK(contains(error_of([] { parse_config_string("rounds = 2.0"); }), "'rounds'"));
  CHECK(contains(error_of([] { parse_config_string("model = 3"); }), "'model'"));
  CHECK(contains(error_of([] { parse_config_string("profiles = 3"); }), "'profiles'"));
}

TEST_CASE("config out of range values are errors") {
  struct Case {
    const char* toml;
    const char* key;
  };
  for (const Case& c : {Case{"clients_per_round = 101", "'clients_per_round'"}, Case{"rounds = 0", "'rounds'"},
                        Case{"lr = 0.0", "'lr'"}, Case{"lr = -1", "'lr'"}, Case{"momentum = 1.0", "'momentum'"},
                        Case{"clients = 0", "'clients'"}, Case{"algorithm = \"fedsgd\"", "'algorithm'"},
                        Case{"partition = \"pareto\"", "'partition'"}, Case{"dataset = \"cifar\"", "'dataset'"},
                        Case{"compression = \"topk:ratio\"", "'compression'"}, Case{"deadline_s = -1", "'deadline_s'"},
                        Case{"lr = nan", "'lr'"}, Case{"clients = 10000000000", "'clients'"},
                        Case{"[profiles]\navailability = 0.0", "'profiles.availability'"},
                        Case{"[profiles]\nuplink_mbps = 0", "'profiles.uplink_mbps'"}}) {
    CAPTURE(c.toml);
    CHECK(contains(error_of([&] { parse_config_string(c.toml); }), c.key));
  }
  // Cross-key checks run after the overrides, and name where the value came from.
  const std::string e = error_of([] { parse_config_string("clients_per_round = 20\n", {"clients=10"}); });
  CHECK(contains(e, "<string>:1"));
  CHECK(contains(e, "'clients_per_round'"));
  CHECK_NOTHROW(parse_config_string("clients_per_round = 200", {"clients=300"}));
}

TEST_CASE("config syntax error has line and column") {
  TempConfig f("syntax", "rounds = 3\nlr = = 0.1\n");
  const std::string e = error_of([&] { load_config(f.path); });
  CHECK(contains(e, f.path + ":2:"));
  CHECK(contains(e, "syntax"));
  CHECK(contains(error_of([] { load_config("config_test_no_such_file.toml"); }), "cannot read"));
}

TEST_CASE("config round trips through to_toml") {
  SUBCASE("defaults") { CHECK(parse_config_string(to_toml(SimConfig{})) == SimConfig{}); }
  SUBCASE("every key set") {
    TempConfig f("roundtrip", kFull);
    const SimConfig c = load_config(f.path, {"lr=0.1234567890123", "out=runs/with \"quotes\"\\and\ttab"});
    const std::string text = to_toml(c);
    CHECK(parse_config_string(text) == c);
    SimConfig other = c;
    other.profiles.availability = 0.7;
    CHECK(parse_config_string(text) != other);  // equality really compares the profiles
    TempConfig g("roundtrip_saved", text);
    CHECK(load_config(g.path) == c);
  }
}

TEST_CASE("config checkpoint_every defaults to 10 and must be at least 1") {
  CHECK(parse_config_string("").checkpoint_every == 10);
  CHECK(parse_config_string("checkpoint_every = 3").checkpoint_every == 3);
  CHECK(contains(error_of([] { parse_config_string("", {"checkpoint_every=0"}); }), "checkpoint_every"));
  SimConfig c = parse_config_string("", {"checkpoint_every=4"});
  CHECK(parse_config_string(to_toml(c)) == c);
}

TEST_CASE("config: deployment keys are accepted and listed, the run unchanged") {
  const SimConfig c =
      parse_config_string("listen = \"tcp://*:7070\"\nkey = \"s.key_secret\"\nquorum = 2\nround_deadline_s = 5\n");
  CHECK(c == SimConfig{});
  CHECK(c.no_effect == std::vector<std::string>{"listen", "key", "quorum", "round_deadline_s"});
  CHECK(contains(to_toml(c), "quorum") == false);  // the saved config holds what the simulation uses
  SUBCASE("the model seed follows seed unless set") {
    CHECK(parse_config_string("seed = 5").effective_model_seed() == 5);
    CHECK(parse_config_string("seed = 5\nmodel_seed = 2").effective_model_seed() == 2);
    const SimConfig d = parse_config_string("model_seed = 2");
    CHECK(parse_config_string(to_toml(d)) == d);
  }
  SUBCASE("eval_every = 0: only the last round is evaluated") {
    CHECK(parse_config_string("eval_every = 0").eval_every == 0);
    CHECK(contains(error_of([] { parse_config_string("eval_every = -1"); }), "'eval_every'"));
  }
}
