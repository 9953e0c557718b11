#pragma once
// The experiment configuration of sparrow-sim: one TOML file plus `--set key=value`
// overrides, parsed strictly into a SimConfig. Every key has a default, so an empty
// file is a valid experiment.
//
// Contract:
//  - Keys are the SimConfig field names; the device profile keys live in a
//    [profiles] table (`--set profiles.uplink_mbps=5`).
//  - Unknown keys, wrong types and out-of-range values throw sparrow::ConfigError
//    naming the key and where it came from ("exp.toml:12" or "--set"); a TOML
//    syntax error throws ConfigError with "path:line:column".
//  - Overrides are applied after the file, in order, and typed by the key
//    (an integer key needs an integer, a float key any number, a string key
//    takes the text after '=' verbatim).
//  - `alpha` is shorthand, not a field: `alpha = A` sets `alpha=A` in the
//    partition spec (replacing any alpha there), once file and overrides are
//    applied. It is an error unless the partition method takes an alpha
//    (dirichlet, quantity). So the effective config has one source of truth,
//    `partition`, and to_toml never writes `alpha`.
//  - The keys shared with sparrow-server are bound and validated by
//    federation/run_config.h (the same defaults and error text in both); the
//    deployment-only keys (listen, key, allow, quorum, ...) are accepted,
//    listed in `no_effect` and logged by load_config, never used.
//  - Spec-string keys (dataset, partition) are checked for spec syntax and
//    the method; the shared ones (compression, server_optimizer, aggregator,
//    dp, secagg) are built once by federation::validate.
//  - Validation happens after all values are in, so `--set clients=5
//    --set clients_per_round=5` works whatever the file said.

#include <cstdint>
#include <string>
#include <vector>

#include "federation/run_config.h"

namespace sparrow::simulator {

// Heterogeneous devices: each client draws a compute speed factor from
// LogNormal(0, compute_speed) (0 = identical devices), link bandwidths with these
// means, and is reachable in a round with probability `availability`.
struct DeviceProfiles {
  double compute_speed = 0;   // lognormal sigma of the speed factor, >= 0
  double uplink_mbps = 10;    // mean uplink bandwidth, > 0
  double downlink_mbps = 50;  // mean downlink bandwidth, > 0
  double availability = 1;    // probability in (0, 1]
};

// The shared keys (seed, model, training, codecs, rounds, clients,
// eval_every, data_dir) are federation::RunConfig's, with the defaults of
// docs/configuration.md; these are the simulation's own.
struct SimConfig : federation::RunConfig {
  // A simulation needs a population: 100 clients unless `clients` says
  // otherwise (the service's default, 0, means the clients that connect).
  SimConfig() { clients = 100; }

  std::string dataset = "fashion-mnist";  // or "synthetic:alpha=1,beta=1", or "folder:PATH" (the user's data)
  double test_fraction = 0.2;             // folder:PATH without a test split: the share of samples held out to test on
  double validation = 0;  // share of the training samples held out to evaluate on instead of the test set, [0, 0.5)
  // iid | dirichlet:alpha= | shards | quantity:alpha=; iid as sparrow-client's
  // default, so a deployed client given `clients` and `index` holds the shard
  // the simulation gave client `index`.
  std::string partition = "iid";
  double adversaries = 0;            // fraction of the population that attacks, [0, 1)
  std::string attack = "sign_flip";  // sign_flip[:scale=] | scale[:factor=] | gaussian[:std=] | label_flip | alie[:z=]
  int workers = 1;                   // training threads, >= 1 (the server's `workers`: its decode pool)
  int client_batch = 0;              // clients trained in one pass; 0 = automatic, 1 = sequential
  int threads = 0;                   // ATen + BLAS threads per worker; 0 = cores / workers
  std::string device = "cpu";        // "cpu", "cuda" or "cuda:N"
  int checkpoint_every = 10;         // checkpoint (client states + run state) every N rounds, >= 1
  // false: when the last round is done, client_state.db keeps only the run's
  // checkpoint (export works) and its client states are dropped; such a run
  // cannot be continued with --resume (docs/simulator.md, "Disk use").
  bool keep_client_state = true;
  // How client_state.db stores residuals, momentum and controls: "fp32"
  // (exact) or "bf16" (half the bytes; docs/state.md, "Compact state").
  std::string state_encoding = "fp32";
  std::string out = "runs/default";  // load_config: "runs/<file stem>" unless set
  double deadline_s = 0;             // round deadline in seconds, 0 = none
  DeviceProfiles profiles;
};

bool operator==(const DeviceProfiles& a, const DeviceProfiles& b);
bool operator==(const SimConfig& a, const SimConfig& b);
inline bool operator!=(const SimConfig& a, const SimConfig& b) { return !(a == b); }

// Reads `path` (ConfigError if it cannot be read) and applies `overrides`.
SimConfig load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// The same for TOML text (errors name "<string>" as the source).
SimConfig parse_config_string(const std::string& toml_text, const std::vector<std::string>& overrides = {});

// The complete effective config as TOML; parse_config_string(to_toml(c)) == c.
std::string to_toml(const SimConfig& c);
// The keys whose values differ, each as "key (value in a -> value in b)", in
// to_toml's order; empty when a == b.
std::vector<std::string> config_differences(const SimConfig& a, const SimConfig& b);

}  // namespace sparrow::simulator
