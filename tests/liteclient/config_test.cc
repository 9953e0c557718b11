// sparrow-client-lite's config: sparrow-client's keys it honours are read,
// the ones it cannot honour and unknown ones are errors naming the key.
// LibTorch-free: also built and run in a device build (SPARROW_LITE_ONLY), on arm64 under qemu.
#include <doctest/doctest.h>
#include <string>

#include "core/error.h"
#include "liteclient/config.h"

namespace {

using sparrow::ConfigError;
using sparrow::liteclient::Config;
using sparrow::liteclient::parse_config;

const std::string kBase =
    "server = \"tcp://127.0.0.1:7070\"\ninsecure = true\nclient_id = \"c1\"\nmodel = \"mlp\"\n"
    "model_file = \"mlp.lite\"\ndata = \"folder:/tmp/d\"\n";

// The message of the ConfigError that parsing `extra` on top of kBase throws ("" if none).
std::string refusal(const std::string& extra, const std::vector<std::string>& sets = {}) {
  try {
    parse_config(kBase + extra, sets, "client.toml");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("liteclient config: sparrow-client's keys it honours are read") {
  const Config c = parse_config(kBase +
                                    "heartbeat_ms = 250\nstate_file = \"s.lite\"\nbackoff_max_ms = 900\n"
                                    "give_up_s = 5\nclients = 1\nindex = 0\nstate_encoding = \"fp32\"\n"
                                    "device = \"cpu\"\ndp = \"local:clip=2,noise=0.5\"\nholdout = 0\n",
                                {"max_message_mb=64"});
  CHECK(c.server == "tcp://127.0.0.1:7070");
  CHECK(c.insecure);
  CHECK(c.client_id == "c1");
  CHECK(c.model == "mlp");
  CHECK(c.model_file == "mlp.lite");
  CHECK(c.data == "folder:/tmp/d");
  CHECK(c.heartbeat_ms == 250);
  CHECK(c.state_file == "s.lite");
  CHECK(c.backoff_max_ms == 900);
  CHECK(c.give_up_s == 5);
  CHECK(c.max_message_mb == 64);
  CHECK(c.dp == "local:clip=2,noise=0.5");
}

TEST_CASE("liteclient config: keys it cannot honour are refused, naming the key") {
  struct Case {
    std::string extra, key, why;
  };
  const Case cases[] = {
      {"state_db = \"c.db\"\n", "state_db", "state_file"},
      {"clients = 4\nindex = 1\n", "clients", "whole data folder"},
      {"partition = \"dirichlet:alpha=0.5\"\n", "partition", "whole data folder"},
      {"partition_seed = 7\n", "partition_seed", "whole data folder"},
      {"data_dir = \"/x\"\n", "data_dir", "no effect"},
      {"state_encoding = \"bf16\"\n", "state_encoding", "float32"},
      {"device = \"cuda\"\n", "device", "CPU"},
      {"holdout = 0.1\n", "holdout", "not supported"},
      {"dp = \"central:clip=1,noise=1\"\n", "dp", "server's setting"},
      {"dp = \"local:clip=0,noise=1\"\n", "dp", "clip must be > 0"},
      {"heartbeat_ms = 5\n", "heartbeat_ms", "[10, 600000]"},
      {"lr = 0.1\n", "lr", "unknown"},
  };
  for (const Case& c : cases) {
    const std::string msg = refusal(c.extra);
    INFO(c.extra << " -> " << msg);
    CHECK(msg.find("'" + c.key + "'") != std::string::npos);
    CHECK(msg.find(c.why) != std::string::npos);
    CHECK(msg.find("client.toml") != std::string::npos);  // where it was set
  }
}

TEST_CASE("liteclient config: the data source must be a folder, and the model file is required") {
  std::string msg;
  try {
    parse_config("insecure = true\nclient_id = \"c1\"\ndata = \"fashion-mnist\"\nmodel_file = \"m.lite\"\n");
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  CHECK(msg.find("'data'") != std::string::npos);
  CHECK(msg.find("folder:PATH") != std::string::npos);
  msg.clear();
  try {
    parse_config("insecure = true\nclient_id = \"c1\"\ndata = \"folder:/d\"\n");
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  CHECK(msg.find("'model_file'") != std::string::npos);
  // CURVE keys are needed unless insecure, as in sparrow-client.
  msg.clear();
  try {
    parse_config("client_id = \"c1\"\ndata = \"folder:/d\"\nmodel_file = \"m.lite\"\n");
  } catch (const ConfigError& e) {
    msg = e.what();
  }
  CHECK(msg.find("'server_key'") != std::string::npos);
  CHECK(refusal("", {"server=bogus"}).find("'server'") != std::string::npos);
}
