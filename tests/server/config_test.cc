#include "tests/sparrow_test.h"

#include <string>
#include <vector>

#include "core/error.h"
#include "server/config.h"

using namespace sparrow;
using namespace sparrow::server;

namespace {
std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("server config parses known keys and applies overrides") {
  const ServerConfig c = parse_server_config(
      "listen = \"tcp://127.0.0.1:*\"\nmodel = \"cnn\"\nrounds = 7\nclients_per_round = 3\nquorum = 2\n"
      "lr = 0.1\ncompression = \"topk:ratio=0.1\"\ndownlink = \"none\"\nround_deadline_s = 5\n",
      {"rounds=9", "server_optimizer=fedavgm:lr=1,momentum=0.9"});
  CHECK(c.listen == "tcp://127.0.0.1:*");
  CHECK(c.model == "cnn");
  CHECK(c.rounds == 9);
  CHECK(c.clients_per_round == 3);
  CHECK(c.quorum == 2);
  CHECK(c.lr == doctest::Approx(0.1));
  CHECK(c.server_optimizer == "fedavgm:lr=1,momentum=0.9");
  CHECK(c.effective_min_clients() == 3);
  ServerConfig v = c;
  v.insecure = true;
  CHECK_NOTHROW(validate(v));
}

TEST_CASE("server config rejects unknown keys naming them") {
  const std::string w = what_of([] { parse_server_config("rounds = 3\nroundz = 4\n"); });
  CHECK(w.find("roundz") != std::string::npos);
  CHECK(w.find("unknown") != std::string::npos);
  CHECK(what_of([] { parse_server_config("", {"nope=1"}); }).find("nope") != std::string::npos);
  CHECK(what_of([] { parse_server_config("[table]\nx = 1\n"); }).find("table") != std::string::npos);
}

TEST_CASE("server config rejects wrong types and bad values") {
  CHECK(what_of([] { parse_server_config("rounds = \"ten\"\n"); }).find("rounds") != std::string::npos);
  CHECK(what_of([] { parse_server_config("lr = \"x\"\n"); }).find("lr") != std::string::npos);
  CHECK(what_of([] { parse_server_config("rounds = ", {}); }).find("TOML") != std::string::npos);
  // Shared keys are checked when the text is read, deployment keys by validate().
  auto bad = [](const std::string& toml) {
    return what_of([&] {
      ServerConfig c = parse_server_config(toml);
      c.insecure = true;
      validate(c);
    });
  };
  CHECK(bad("rounds = 0\n").find("rounds") != std::string::npos);
  CHECK(bad("clients_per_round = 2\nquorum = 3\n").find("quorum") != std::string::npos);
  // A pool larger than a round: fine, but the quorum is bounded by the round.
  CHECK(bad("clients_per_round = 2\nmin_clients = 3\nquorum = 2\n").empty());
  CHECK(bad("clients_per_round = 2\nmin_clients = 3\nquorum = 3\n").find("quorum") != std::string::npos);
  CHECK(bad("sampler = \"roulette\"\n").find("sampler") != std::string::npos);
  CHECK(bad("compression = \"dgc:nonsense=1\"\n").find("compression") != std::string::npos);
  CHECK(bad("downlink = \"acp:rank=2\"\n").find("downlink") != std::string::npos);
  CHECK(bad("downlink = \"tcs:ratio=0.01\"\n").find("downlink") != std::string::npos);
  CHECK(bad("server_optimizer = \"sgd\"\n").find("server_optimizer") != std::string::npos);
  CHECK(bad("algorithm = \"fedsgd\"\n").find("algorithm") != std::string::npos);
  CHECK(bad("momentum = 1.5\n").find("momentum") != std::string::npos);
  CHECK(bad("round_deadline_s = 0\n").find("round_deadline_s") != std::string::npos);
  CHECK(bad("workers = 0\n").find("workers") != std::string::npos);
  CHECK(bad("listen = \"tcp://127.0.0.1:99999\"\n").find("listen") != std::string::npos);  // not a silent wrap-around
  CHECK(bad("listen = \"localhost:7070\"\n").find("listen") != std::string::npos);
  CHECK(bad("").empty());
}

TEST_CASE("server config needs keys unless insecure") {
  ServerConfig c = parse_server_config("");
  CHECK(what_of([&] { validate(c); }).find("config key 'key'") != std::string::npos);
  c.server_key = "k.key_secret";
  CHECK(what_of([&] { validate(c); }).find("allow") != std::string::npos);
}

TEST_CASE("server config: `key` is the server's own key file, `server_key` its old name") {
  CHECK(parse_server_config("key = \"a.key_secret\"\n").server_key == "a.key_secret");
  CHECK(parse_server_config("server_key = \"b.key_secret\"\n").server_key == "b.key_secret");
  CHECK(parse_server_config("key = \"a\"\nserver_key = \"a\"\n").server_key == "a");
  CHECK_THROWS_AS(parse_server_config("key = \"a\"\nserver_key = \"b\"\n"), ConfigError);
  // The effective config names it `key` only.
  ServerConfig c = parse_server_config("server_key = \"b.key_secret\"\n");
  const std::string t = to_toml(c);
  CHECK(t.find("key = \"b.key_secret\"") != std::string::npos);
  CHECK(t.find("\nserver_key") == std::string::npos);  // (a gateway's upstream_server_key is another key)
}

TEST_CASE("server config identity ignores operational keys") {
  ServerConfig a = parse_server_config("");
  ServerConfig b = parse_server_config("rounds = 100\nround_deadline_s = 3\nworkers = 5\nlisten = \"tcp://*:1\"\n");
  CHECK(config_hash(a) == config_hash(b));
  ServerConfig c = parse_server_config("lr = 0.5\n");
  CHECK(config_hash(a) != config_hash(c));
  // to_toml round-trips.
  ServerConfig d = parse_server_config(to_toml(c));
  CHECK(config_hash(d) == config_hash(c));
  CHECK(to_toml(d) == to_toml(c));
}

TEST_CASE("server config checks aggregator and dp, and they are part of the identity when set") {
  // Shared keys are checked when the text is read, deployment keys by validate().
  auto bad = [](const std::string& toml) {
    return what_of([&] {
      ServerConfig c = parse_server_config(toml);
      c.insecure = true;
      validate(c);
    });
  };
  CHECK(bad("aggregator = \"krum:f=1\"\nclients_per_round = 5\nquorum = 4\n").find("quorum") != std::string::npos);
  CHECK(bad("aggregator = \"krum:f=1\"\nclients_per_round = 5\nquorum = 5\n").empty());
  CHECK(bad("aggregator = \"krum:x=1\"\n").find("aggregator") != std::string::npos);
  CHECK(bad("dp = \"central:clip=1\"\n").find("dp") != std::string::npos);
  CHECK(bad("dp = \"local:clip=1,noise=1\"\n").find("client") != std::string::npos);
  CHECK(bad("dp = \"central:clip=1,noise=1\"\naggregator = \"median\"\n").find("mean") != std::string::npos);
  CHECK(bad("dp = \"central:clip=1,noise=1\"\n").empty());
  CHECK(bad("max_buffer_mb = 0\n").find("max_buffer_mb") != std::string::npos);
  // Defaults leave the identity of earlier databases unchanged; a set value changes it.
  const ServerConfig a = parse_server_config("");
  CHECK(identity_text(a).find("aggregator") == std::string::npos);
  CHECK(identity_text(a).find("dp") == std::string::npos);
  CHECK(config_hash(a) != config_hash(parse_server_config("aggregator = \"median\"\n")));
  CHECK(config_hash(a) != config_hash(parse_server_config("dp = \"central:clip=1,noise=1\"\n")));
}

TEST_CASE("examples/service/server.toml is a valid server config") {
  ServerConfig c = load_server_config(std::string(SPARROW_SOURCE_DIR) + "/examples/service/server.toml");
  CHECK(c.server_key == "keys/server.key_secret");
  CHECK(c.allow == "keys/allow.txt");
  CHECK_NOTHROW(validate(c));
}

TEST_CASE("server config: a gateway refuses what only the root can apply, and needs upstream keys") {
  auto bad = [](const std::string& toml, bool insecure = true) {
    ServerConfig c = parse_server_config("upstream = \"tcp://127.0.0.1:7070\"\n" + toml);
    c.insecure = insecure;
    return what_of([&] { validate(c); });
  };
  CHECK(bad("").empty());
  CHECK(parse_server_config("upstream = \"tcp://127.0.0.1:7070\"\n").gateway());
  CHECK_FALSE(parse_server_config("").gateway());
  for (const char* key : {"server_optimizer = \"fedavgm:lr=1,momentum=0.9\"", "aggregator = \"median\"",
                          "dp = \"central:clip=1,noise=1\"", "downlink = \"topk:ratio=0.1\"",
                          "algorithm = \"scaffold\"", "secagg = \"secagg+:degree=4\""}) {
    const std::string k(key);
    INFO(k);
    CHECK(bad(k + "\n").find("config key '" + k.substr(0, k.find(' ')) + "'") != std::string::npos);
  }
  CHECK(bad("compression = \"tcs:ratio=0.01\"\n").empty());  // the root's masks are relayed
  CHECK(bad("upstream_id = \"\"\n").find("upstream_id") != std::string::npos);
  CHECK(bad("upstream_id = \"gw eu\"\n").find("upstream_id") != std::string::npos);  // outside the id set
  CHECK(what_of([] {
          ServerConfig c = parse_server_config("upstream = \"root:7070\"\n");
          c.insecure = true;
          validate(c);
        }).find("upstream") != std::string::npos);
  // Without --insecure: the root's public key and this gateway's key pair.
  CHECK(bad("key = \"s.key_secret\"\nallow = \"a.txt\"\n", false).find("upstream_server_key") != std::string::npos);
  CHECK(bad("key = \"s.key_secret\"\nallow = \"a.txt\"\nupstream_server_key = \"r.key\"\nupstream_key = "
            "\"g.key_secret\"\n",
            false)
            .empty());
}

TEST_CASE("server config: an earlier run's identity is unchanged where its keys were set") {
  // A database created before the one configuration model stored this text
  // for a config that set nothing: it resumes under a config that sets the
  // values whose defaults changed (lr, clients_per_round; docs/configuration.md).
  const ServerConfig old = parse_server_config("lr = 0.01\nclients_per_round = 2\n");
  CHECK(identity_text(old) ==
        "model = \"mlp\"\nmodel_seed = 1\nseed = 1\nalgorithm = \"fedavg\"\nmu = 0.0\nlocal_epochs = 1\n"
        "batch_size = 32\nlr = 0.01\nmomentum = 0.0\nweight_decay = 0.0\ncompression = \"none\"\n"
        "downlink = \"none\"\nserver_optimizer = \"fedavg\"\nclients_per_round = 2\n");
  // The new defaults are another identity: such a database refuses them.
  CHECK(config_hash(parse_server_config("")) != config_hash(old));
  // model_seed follows seed unless set; the identity holds the seed used.
  CHECK(config_hash(parse_server_config("seed = 4\n")) ==
        config_hash(parse_server_config("seed = 4\nmodel_seed = 4\n")));
  CHECK(config_hash(parse_server_config("seed = 4\n")) !=
        config_hash(parse_server_config("seed = 4\nmodel_seed = 1\n")));
  // The population is part of the identity when set (SCAFFOLD divides by it).
  CHECK(identity_text(parse_server_config("")).find("clients =") == std::string::npos);
  CHECK(config_hash(parse_server_config("")) != config_hash(parse_server_config("clients = 50\n")));
}

TEST_CASE("server config: a simulation's keys are accepted and listed, not used") {
  const ServerConfig c = parse_server_config(
      "partition = \"dirichlet:alpha=0.1\"\nclients = 40\ncheckpoint_every = 5\ndevice = \"cuda\"\n"
      "[profiles]\nuplink_mbps = 2\n");
  CHECK(c.clients == 40);  // the population means something here
  CHECK(c.no_effect == std::vector<std::string>{"partition", "device", "checkpoint_every", "profiles.uplink_mbps"});
  ServerConfig v = c;
  v.insecure = true;
  CHECK_NOTHROW(validate(v));
  // Not written back: the effective config holds what the service uses.
  CHECK(to_toml(c).find("partition") == std::string::npos);
  CHECK(to_toml(c).find("clients = 40") != std::string::npos);
  CHECK(what_of([] { parse_server_config("clients = 4\nclients_per_round = 5\n"); }).find("clients_per_round") !=
        std::string::npos);
  // Local DP is each client's setting: a simulation may set it, a server refuses it.
  CHECK(what_of([] {
          ServerConfig d = parse_server_config("dp = \"local:clip=1,noise=1\"\n");
          d.insecure = true;
          validate(d);
        }).find("sparrow-client") != std::string::npos);
}
