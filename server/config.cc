#include "server/config.h"

#include <toml++/toml.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <variant>

#include "aggregation/server_optimizer.h"
#include "compression/compressor.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/spec.h"

namespace sparrow::server {
namespace {

using FieldPtr = std::variant<int*, uint64_t*, double*, std::string*>;
struct Field {
  const char* key;
  FieldPtr ptr;
  bool identity;  // part of the run identity (identity_text)
};

// One table drives reading, overriding, writing and the run identity.
std::vector<Field> fields(ServerConfig& c) {
  return {{"listen", &c.listen, false},
          {"server_key", &c.server_key, false},
          {"allow", &c.allow, false},
          {"max_message_mb", &c.max_message_mb, false},
          {"heartbeat_ms", &c.heartbeat_ms, false},
          {"model", &c.model, true},
          {"model_seed", &c.model_seed, true},
          {"seed", &c.seed, true},
          {"algorithm", &c.algorithm, true},
          {"mu", &c.mu, true},
          {"local_epochs", &c.local_epochs, true},
          {"batch_size", &c.batch_size, true},
          {"lr", &c.lr, true},
          {"momentum", &c.momentum, true},
          {"weight_decay", &c.weight_decay, true},
          {"compression", &c.compression, true},
          {"downlink", &c.downlink, true},
          {"server_optimizer", &c.server_optimizer, true},
          {"rounds", &c.rounds, false},
          {"clients_per_round", &c.clients_per_round, true},
          {"min_clients", &c.min_clients, false},
          {"quorum", &c.quorum, false},
          {"round_deadline_s", &c.round_deadline_s, false},
          {"max_round_wait_s", &c.max_round_wait_s, false},
          {"workers", &c.workers, false},
          {"db", &c.db, false},
          {"keep_checkpoints", &c.keep_checkpoints, false},
          {"eval_every", &c.eval_every, false},
          {"data_dir", &c.data_dir, false},
          {"eval_batch", &c.eval_batch, false}};
}

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

std::string format_double(double v) {
  char buf[64];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

std::string toml_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += static_cast<char>(ch);
    } else if (ch < 0x20 || ch == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", ch);
      out += buf;
    } else {
      out += static_cast<char>(ch);
    }
  }
  return out + "\"";
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

class Loader {
 public:
  explicit Loader(std::string source) : source_(std::move(source)) {}

  void read_toml(const std::string& text) {
    toml::table root;
    try {
      root = toml::parse(text, source_);
    } catch (const toml::parse_error& e) {
      const auto& at = e.source().begin;
      throw ConfigError(source_ + ":" + std::to_string(at.line) + ":" + std::to_string(at.column) +
                        ": TOML syntax error: " + std::string(e.description()));
    }
    for (auto&& [k, node] : root) set_from_node(std::string(k.str()), node);
  }

  void apply_override(const std::string& kv) {
    const auto eq = kv.find('=');
    SPARROW_CHECK_T(ConfigError, eq != std::string::npos && eq > 0, "--set '" << kv << "': expected key=value");
    const std::string key = trim(kv.substr(0, eq)), text = kv.substr(eq + 1);
    const std::string where = "--set";
    std::visit(Overloaded{[&](int* v) {
                            *v = static_cast<int>(range(where, key, parse_int(where, key, text), INT32_MIN, INT32_MAX));
                          },
                          [&](uint64_t* v) {
                            *v = static_cast<uint64_t>(range(where, key, parse_int(where, key, text), 0, INT64_MAX));
                          },
                          [&](double* v) { *v = parse_double(where, key, text); }, [&](std::string* v) { *v = text; }},
               find(where, key));
  }

  ServerConfig config_;

 private:
  [[noreturn]] static void fail(const std::string& where, const std::string& key, const std::string& msg) {
    throw ConfigError(where + ": config key '" + key + "' " + msg);
  }

  FieldPtr find(const std::string& where, const std::string& key) {
    for (const Field& f : fields(config_))
      if (key == f.key) return f.ptr;
    std::string known;
    for (const Field& f : fields(config_)) known += std::string(known.empty() ? "" : ", ") + f.key;
    fail(where, key, "is unknown (known keys: " + known + ")");
  }

  void set_from_node(const std::string& key, const toml::node& n) {
    const std::string where = source_ + ":" + std::to_string(n.source().begin.line);
    std::ostringstream type;
    type << n.type();
    const std::string got = " (got " + type.str() + ")";
    std::visit(Overloaded{[&](int* v) {
                            if (!n.is_integer()) fail(where, key, "must be an integer" + got);
                            *v = static_cast<int>(range(where, key, n.as_integer()->get(), INT32_MIN, INT32_MAX));
                          },
                          [&](uint64_t* v) {
                            if (!n.is_integer()) fail(where, key, "must be an integer" + got);
                            *v = static_cast<uint64_t>(range(where, key, n.as_integer()->get(), 0, INT64_MAX));
                          },
                          [&](double* v) {
                            if (!n.is_number()) fail(where, key, "must be a number" + got);
                            *v = n.is_integer() ? static_cast<double>(n.as_integer()->get())
                                                : n.as_floating_point()->get();
                          },
                          [&](std::string* v) {
                            if (!n.is_string()) fail(where, key, "must be a string" + got);
                            *v = n.as_string()->get();
                          }},
               find(where, key));
  }

  static int64_t range(const std::string& where, const std::string& key, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi) fail(where, key, "is out of range (got " + std::to_string(v) + ")");
    return v;
  }
  static int64_t parse_int(const std::string& where, const std::string& key, const std::string& text) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno != 0) fail(where, key, "must be an integer (got '" + text + "')");
    return v;
  }
  static double parse_double(const std::string& where, const std::string& key, const std::string& text) {
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0') fail(where, key, "must be a number (got '" + text + "')");
    return v;
  }

  std::string source_;
};

[[noreturn]] void bad(const std::string& key, const std::string& msg) {
  throw ConfigError("config key '" + key + "' " + msg);
}

}  // namespace

void validate(const ServerConfig& c) {
  for (const Field& f : fields(const_cast<ServerConfig&>(c)))
    if (auto* d = std::get_if<double*>(&f.ptr))
      if (!std::isfinite(**d)) bad(f.key, "must be finite");
  if (c.listen.empty()) bad("listen", "must not be empty");
  if (!(c.max_message_mb > 0 && c.max_message_mb <= 2047)) bad("max_message_mb", "must be in (0, 2047]");
  if (c.heartbeat_ms < 10) bad("heartbeat_ms", "must be >= 10");
  if (c.model.empty()) bad("model", "must not be empty");
  if (c.algorithm != "fedavg" && c.algorithm != "fedprox" && c.algorithm != "scaffold")
    bad("algorithm", "must be fedavg, fedprox or scaffold (got '" + c.algorithm + "')");
  if (c.mu < 0) bad("mu", "must be >= 0");
  if (c.local_epochs < 1) bad("local_epochs", "must be >= 1");
  if (c.batch_size < 1) bad("batch_size", "must be >= 1");
  if (!(c.lr > 0)) bad("lr", "must be > 0");
  if (c.momentum < 0 || c.momentum >= 1) bad("momentum", "must be in [0, 1)");
  if (c.weight_decay < 0) bad("weight_decay", "must be >= 0");
  compression::register_builtins();
  try {
    compression::make_compressor(c.compression);
  } catch (const ConfigError& e) {
    bad("compression", std::string("is not a valid compressor spec: ") + e.what());
  }
  if (c.downlink != "none") {
    std::string method;
    try {
      method = Spec::parse(c.downlink).method();
      compression::make_compressor(c.downlink);
    } catch (const ConfigError& e) {
      bad("downlink", std::string("is not a valid compressor spec: ") + e.what());
    }
    if (method == "acp") bad("downlink", "cannot be acp (it needs a shared factor); use powersgd, topk, dgc, ...");
  }
  try {
    aggregation::ServerOptimizer opt(c.server_optimizer);
  } catch (const ConfigError& e) {
    bad("server_optimizer", e.what());
  }
  if (c.rounds < 1) bad("rounds", "must be >= 1");
  if (c.clients_per_round < 1) bad("clients_per_round", "must be >= 1");
  if (c.min_clients < 0 || c.min_clients > c.clients_per_round)
    bad("min_clients", "must be in [0, clients_per_round] (0 = clients_per_round)");
  if (c.quorum < 1 || c.quorum > c.effective_min_clients())
    bad("quorum", "must be in [1, min_clients = " + std::to_string(c.effective_min_clients()) + "]");
  if (!(c.round_deadline_s > 0)) bad("round_deadline_s", "must be > 0");
  if (c.max_round_wait_s < 0) bad("max_round_wait_s", "must be >= 0 (0 = 4 x round_deadline_s)");
  if (c.max_round_wait_s > 0 && c.max_round_wait_s < c.round_deadline_s)
    bad("max_round_wait_s", "must be >= round_deadline_s");
  if (c.workers < 1 || c.workers > 256) bad("workers", "must be in [1, 256]");
  if (c.db.empty()) bad("db", "must not be empty");
  if (c.keep_checkpoints < 1) bad("keep_checkpoints", "must be >= 1");
  if (c.eval_every < 0) bad("eval_every", "must be >= 0 (0 = off)");
  if (c.eval_batch < 1) bad("eval_batch", "must be >= 1");
  if (!c.insecure && c.server_key.empty())
    bad("server_key", "is required (the server's .key_secret file; `sparrow-server keygen`) unless --insecure");
  if (!c.insecure && c.allow.empty())
    bad("allow", "is required (allow-list file or directory of client .key files) unless --insecure");
}

ServerConfig parse_server_config(const std::string& toml_text, const std::vector<std::string>& overrides,
                                 const std::string& source) {
  Loader l(source);
  l.read_toml(toml_text);
  for (const auto& kv : overrides) l.apply_override(kv);
  return l.config_;
}

ServerConfig load_server_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK_T(ConfigError, in, "cannot read config file '" << path << "'");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_server_config(text.str(), overrides, path);
}

namespace {
std::string value_text(const FieldPtr& p) {
  return std::visit(
      Overloaded{[](int* v) { return std::to_string(*v); }, [](uint64_t* v) { return std::to_string(*v); },
                 [](double* v) { return format_double(*v); }, [](std::string* v) { return toml_string(*v); }},
      p);
}
}  // namespace

std::string identity_text(const ServerConfig& c) {
  std::string out;
  for (const Field& f : fields(const_cast<ServerConfig&>(c)))
    if (f.identity) out += std::string(f.key) + " = " + value_text(f.ptr) + "\n";
  return out;
}

std::string config_hash(const ServerConfig& c) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng::hash_name(identity_text(c))));
  return buf;
}

std::string to_toml(const ServerConfig& c) {
  std::string out = "# sparrow-server effective configuration\n";
  for (const Field& f : fields(const_cast<ServerConfig&>(c)))
    out += std::string(f.key) + " = " + value_text(f.ptr) + "\n";
  return out;
}

}  // namespace sparrow::server
