#include "liteclient/config.h"

#include "core/error.h"
#include "core/flat_config.h"
#include "liteclient/local_dp.h"
#include "wire/client_keys.h"

namespace sparrow::liteclient {
namespace {

void bind_all(core::FlatConfig& f, Config& c) {
  net::bind_client_head_keys(f, c);
  f.bind("model", &c.model);
  f.bind("model_file", &c.model_file);
  f.bind("data", &c.data);
  f.bind("data_dir", &c.data_dir);
  f.bind("partition", &c.partition);
  f.bind("clients", &c.clients);
  f.bind("index", &c.index);
  f.bind("partition_seed", &c.partition_seed);
  f.bind("state_file", &c.state_file);
  f.bind("state_db", &c.state_db);
  f.bind("state_encoding", &c.state_encoding);
  net::bind_client_tail_keys(f, c);
}

void check(const core::FlatConfig& f, const Config& c) {
  net::check_client_server_keys(f, c);
  f.check("model", !c.model.empty(), "must not be empty (the model the server runs, e.g. \"mlp\")");
  f.check("model_file", !c.model_file.empty(),
          "must name the lite model file (written by sparrow-lite-export for the server's model)");
  f.check("data", c.data.rfind("folder:", 0) == 0 && c.data.size() > 7,
          "must be \"folder:PATH\" (x.npy + y.npy): sparrow-client-lite reads no built-in data set");
  const std::string whole =
      "is not supported by sparrow-client-lite: it trains on the whole data folder "
      "(give each client a folder of its own)";
  f.check("data_dir", !f.has("data_dir"), "has no effect with data = \"folder:PATH\"");
  f.check("partition", c.partition == "iid", whole);
  f.check("clients", c.clients == 1, whole);
  f.check("index", c.index == 0, whole);
  f.check("partition_seed", c.partition_seed == 0, whole);
  f.check("state_db", !f.has("state_db"),
          "is sparrow-client's SQLite database; sparrow-client-lite keeps its state in `state_file`");
  f.check("state_file", !c.state_file.empty(), "must not be empty");
  f.check("state_encoding", c.state_encoding == "fp32",
          "must be \"fp32\": sparrow-client-lite keeps its state in float32 only");
  f.check("device", c.device == "cpu", "must be \"cpu\": the lite runtime trains on the CPU only");
  f.check("holdout", c.holdout == 0, "is not supported by sparrow-client-lite (federated evaluation): must be 0");
  try {
    parse_local_dp(c.dp);
  } catch (const ConfigError& e) {
    f.fail("dp", e.what());
  }
  net::check_client_ranges(f, c);
  net::check_client_key_files(f, c);
}

}  // namespace

Config parse_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                    const std::string& source) {
  Config c;
  core::FlatConfig f(source);
  bind_all(f, c);
  f.read(toml_text, overrides);
  check(f, c);
  return c;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_config(core::read_config_file(path), overrides, path);
}

}  // namespace sparrow::liteclient
