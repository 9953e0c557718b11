#pragma once
// The split device's config keys, written once for sparrow-edge
// (edge::DeviceConfig, edge/device_config.cc) and sparrow-edge-lite
// (liteedge::DeviceConfig, liteedge/config.cc): both structs have these
// fields, so the key table and the ranges of docs/split.md's key table cannot
// drift apart. Each device adds its own checks (data keys, what the lite
// runtime cannot do) and words its errors.

#include <string>
#include <vector>

#include "core/flat_config.h"

namespace sparrow::edge::device {

// Binds every key of the device config file to its field of `c`.
template <class C>
void bind_device_keys(core::FlatConfig& f, C& c) {
  f.bind("cloud", &c.cloud);
  f.bind("cloud_key", &c.cloud_key);
  f.bind("key", &c.key);
  f.bind("insecure", &c.insecure);
  f.bind("device_id", &c.device_id);
  f.bind("model", &c.model);
  f.bind("cut", &c.cut);
  f.bind("weights", &c.weights);
  f.bind("seed", &c.seed);
  f.bind("codec", &c.codec);
  f.bind("freeze", &c.freeze);
  f.bind("lr", &c.lr);
  f.bind("momentum", &c.momentum);
  f.bind("batch_size", &c.batch_size);
  f.bind("steps", &c.steps);
  f.bind("data", &c.data);
  f.bind("data_dir", &c.data_dir);
  f.bind("partition", &c.partition);
  f.bind("clients", &c.clients);
  f.bind("index", &c.index);
  f.bind("partition_seed", &c.partition_seed);
  f.bind("eval_samples", &c.eval_samples);
  f.bind("progress", &c.progress);
  f.bind("save_every", &c.save_every);
  f.bind("reply_timeout_ms", &c.reply_timeout_ms);
  f.bind("backoff_initial_ms", &c.backoff_initial_ms);
  f.bind("backoff_max_ms", &c.backoff_max_ms);
  f.bind("max_reconnects", &c.max_reconnects);
  f.bind("max_message_mb", &c.max_message_mb);
  f.bind("threads", &c.threads);
  f.bind("fedavg_every", &c.fedavg_every);
}

// One range of the key table: `ok` false means `key` "must be <what>".
struct KeyRange {
  const char* key;
  bool ok;
  std::string what;
};

// The ranges of docs/split.md's key table, checked before anything is loaded
// (NaN fails every comparison).
template <class C>
std::vector<KeyRange> device_key_ranges(const C& c) {
  return {
      {"lr", c.lr > 0 && c.lr <= 10, "in (0, 10]"},
      {"momentum", c.momentum >= 0 && c.momentum < 1, "in [0, 1)"},
      {"batch_size", c.batch_size >= 1 && c.batch_size <= 65536, "in [1, 65536]"},
      {"steps", c.steps >= 1 && c.steps <= 1000000000, "in [1, 1000000000]"},
      {"eval_samples", c.eval_samples <= 10000000, "in [0, 10000000]"},
      {"save_every", c.save_every >= 1 && c.save_every <= 1000000000, "in [1, 1000000000]"},
      {"reply_timeout_ms", c.reply_timeout_ms >= 10 && c.reply_timeout_ms <= 3600000, "in [10, 3600000]"},
      {"backoff_initial_ms", c.backoff_initial_ms >= 1 && c.backoff_initial_ms <= 600000, "in [1, 600000]"},
      {"backoff_max_ms", c.backoff_max_ms >= c.backoff_initial_ms && c.backoff_max_ms <= 3600000,
       "in [backoff_initial_ms, 3600000]"},
      {"max_reconnects", c.max_reconnects <= 1000000000, "in [0, 1000000000]"},
      {"max_message_mb", c.max_message_mb >= 1 && c.max_message_mb <= 2047, "in [1, 2047]"},
      {"threads", c.threads >= 0 && c.threads <= 1024, "in [0, 1024] (0 = one per core)"},
      {"clients", c.clients >= 1 && c.clients <= 1000000, "in [1, 1000000]"},
      {"fedavg_every", c.fedavg_every <= 1000000000, "in [0, 1000000000] (0 = off)"},
  };
}

// No key without an effect (docs/split.md): the keys that freeze, progress = ""
// and insecure make meaningless. ConfigError naming the key.
template <class C>
void check_keys_without_effect(const core::FlatConfig& f, const C& c) {
  for (const char* k : {"lr", "momentum"})
    f.check(k, !c.freeze || !f.has(k), "has no effect with freeze = true (the bottom does not train)");
  f.check("save_every", !c.progress.empty() || !f.has("save_every"),
          "has no effect with progress = \"\" (no progress file is written)");
  if (c.insecure && f.where("insecure") != "--set")  // --insecure on a secure file is the documented try-out
    for (const char* k : {"cloud_key", "key"})
      f.check(k, !f.has(k), "has no effect with insecure = true (plain TCP, no CURVE keys)");
}

}  // namespace sparrow::edge::device
