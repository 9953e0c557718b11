// SessionConfig (client/session.h): its TOML keys, the checks across them
// (errors name the key and where it was set) and the loader.
#include <cmath>
#include <string>

#include "aggregation/robust.h"
#include "client/data_folder.h"
#include "client/session.h"
#include "core/error.h"
#include "core/flat_config.h"
#include "state/encoding.h"
#include "wire/client_keys.h"

namespace sparrow::client {
namespace {

void bind_all(core::FlatConfig& f, SessionConfig& c) {
  net::bind_client_head_keys(f, c);
  f.bind("model", &c.model);
  f.bind("data", &c.data.data);
  f.bind("data_dir", &c.data.data_dir);
  f.bind("partition", &c.data.partition);
  f.bind("clients", &c.data.clients);
  f.bind("index", &c.data.index);
  f.bind("partition_seed", &c.data.partition_seed);
  f.bind("state_db", &c.state_db);
  f.bind("state_encoding", &c.state_encoding);
  net::bind_client_tail_keys(f, c);
}

// Cross-key checks, after the file and the overrides; errors name where the key was set.
// Resolves partition = "natural" for a folder with its own client ids.
void check_session_config(const core::FlatConfig& f, SessionConfig& c) {
  net::check_client_server_keys(f, c);
  f.check("model", !c.model.empty(), "must not be empty");
  f.check("data", !c.data.data.empty(), "must not be empty");
  check_data_keys(f, c.data);  // clients, index, partition, ...: each must have an effect with this data
  f.check("state_db", !c.state_db.empty(), "must not be empty");
  f.check("state_encoding", state::valid_encoding(c.state_encoding), "must be \"fp32\" or \"bf16\"");
  net::check_client_ranges(f, c);
  f.check("holdout", std::isfinite(c.holdout) && c.holdout >= 0 && c.holdout <= 0.5, "must be in [0, 0.5] (0 = off)");
  try {
    const aggregation::DpSpec d = aggregation::DpSpec::parse(c.dp);
    f.check("dp", d.mode != aggregation::DpSpec::Mode::kCentral,
            "central DP is the server's setting (its `dp` key); a client takes \"none\" or \"local:clip=,noise=\"");
  } catch (const ConfigError& e) {
    f.fail("dp", e.what());
  }
  net::check_client_key_files(f, c);
}

}  // namespace

SessionConfig parse_session_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                                   const std::string& source) {
  SessionConfig c;
  core::FlatConfig f(source);
  bind_all(f, c);
  f.read(toml_text, overrides);
  check_session_config(f, c);
  return c;
}

SessionConfig load_session_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_session_config(core::read_config_file(path), overrides, path);
}

}  // namespace sparrow::client
