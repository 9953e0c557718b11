#pragma once
// sparrow-client-lite's configuration: sparrow-client's TOML file
// (client/session.h, docs/client.md) with the keys the lite client honours,
// plus `model_file`. A key it cannot honour is a ConfigError naming the key
// and why, never silently ignored: another data source than a folder of
// x.npy + y.npy, a partition of it (clients, index, partition,
// partition_seed, data_dir), `state_db` (the lite client keeps its state in
// `state_file`), bf16 state, a device other than the CPU, a holdout.
// An unknown key is an error too (core/flat_config.h).

#include <cstdint>
#include <string>
#include <vector>

namespace sparrow::liteclient {

struct Config {
  std::string server = "tcp://127.0.0.1:7070";
  std::string server_key;  // the server's public key file
  std::string key;         // this client's .key_secret file
  bool insecure = false;   // plain TCP, no CURVE
  std::string client_id;
  std::string model = "mlp";                     // the server's model spec, sent at Hello (must equal the server's)
  std::string model_file;                        // the lite model file (sparrow-lite-export): architecture and shapes
  std::string data;                              // "folder:PATH" (x.npy + y.npy)
  std::string state_file = "client_state.lite";  // state across restarts (state_file.h)
  uint32_t heartbeat_ms = 1000;
  uint64_t max_message_mb = 256;
  uint32_t backoff_initial_ms = 200;
  uint32_t backoff_max_ms = 30000;
  double give_up_s = 60;  // 0 = retry forever (as sparrow-client)
  // sparrow-client's keys, accepted only at values the lite client honours.
  std::string data_dir = "/usr/share/datasets/fashion-mnist", partition = "iid";
  int clients = 1, index = 0;
  uint64_t partition_seed = 0;
  std::string dp = "none";  // local DP: "none" or "local:clip=C,noise=Z[,delta=D]" (local_dp.h)
  std::string state_encoding = "fp32", device = "cpu";
  double holdout = 0;
  std::string state_db;  // refused: the lite client has no SQLite database
};

// ConfigError naming the key and where it was set for a bad or unsupported value.
Config parse_config(const std::string& toml_text, const std::vector<std::string>& overrides = {},
                    const std::string& source = "<string>");
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});

}  // namespace sparrow::liteclient
