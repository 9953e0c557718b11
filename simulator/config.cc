#include "simulator/config.h"

#include <toml++/toml.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>
#include <variant>

#include "core/error.h"
#include "core/spec.h"

namespace sparrow::simulator {
namespace {

// One table of keys drives reading, overriding and writing, so a new field is
// one line here (plus its validation).
using FieldPtr = std::variant<int*, uint64_t*, double*, std::string*>;
struct Field {
  const char* key;  // "profiles.x" lives in the [profiles] table
  FieldPtr ptr;
};

std::vector<Field> fields(SimConfig& c) {
  return {{"seed", &c.seed},
          {"dataset", &c.dataset},
          {"data_dir", &c.data_dir},
          {"partition", &c.partition},
          {"clients", &c.clients},
          {"clients_per_round", &c.clients_per_round},
          {"rounds", &c.rounds},
          {"model", &c.model},
          {"algorithm", &c.algorithm},
          {"mu", &c.mu},
          {"local_epochs", &c.local_epochs},
          {"batch_size", &c.batch_size},
          {"lr", &c.lr},
          {"momentum", &c.momentum},
          {"weight_decay", &c.weight_decay},
          {"compression", &c.compression},
          {"server_optimizer", &c.server_optimizer},
          {"workers", &c.workers},
          {"eval_every", &c.eval_every},
          {"checkpoint_every", &c.checkpoint_every},
          {"out", &c.out},
          {"deadline_s", &c.deadline_s},
          {"profiles.compute_speed", &c.profiles.compute_speed},
          {"profiles.uplink_mbps", &c.profiles.uplink_mbps},
          {"profiles.downlink_mbps", &c.profiles.downlink_mbps},
          {"profiles.availability", &c.profiles.availability}};
}

constexpr const char* kProfiles = "profiles";
constexpr const char* kAlpha = "alpha";  // shorthand folded into `partition`

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

// Shortest decimal that reads back to the same double; whole numbers without an
// exponent ("10", not "1e+01").
std::string format_double(double v) {
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
    return buf;
  }
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// check(key, condition, stream-expression): ConfigError naming the key and its origin.
#define check(key, ok, ...) check_impl(key, ok, [&](std::ostream& os_) { os_ << __VA_ARGS__; })

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
    for (auto&& [k, node] : root) {
      const std::string key(k.str());
      if (key == kProfiles) {
        where_[key] = source_ + ":" + std::to_string(node.source().begin.line);
        check(key, node.is_table(), "must be a table ([profiles])");
        for (auto&& [sub, subnode] : *node.as_table()) set_from_node(key + "." + std::string(sub.str()), subnode);
      } else {
        set_from_node(key, node);
      }
    }
  }

  void apply_override(const std::string& kv) {
    const auto eq = kv.find('=');
    SPARROW_CHECK_T(ConfigError, eq != std::string::npos && eq > 0, "--set '" << kv << "': expected key=value");
    const std::string key = trim(kv.substr(0, eq)), text = kv.substr(eq + 1);
    where_[key] = "--set";
    if (key == kAlpha) {
      alpha_ = parse_double(key, text);
      return;
    }
    std::visit(
        Overloaded{[&](int* v) { *v = static_cast<int>(to_int(key, parse_int(key, text), INT32_MIN, INT32_MAX)); },
                   [&](uint64_t* v) { *v = static_cast<uint64_t>(to_int(key, parse_int(key, text), 0, INT64_MAX)); },
                   [&](double* v) { *v = parse_double(key, text); }, [&](std::string* v) { *v = text; }},
        find(key));
  }

  SimConfig finish(const std::string& default_out) {
    SimConfig& c = config_;
    if (!where_.count("out") && !default_out.empty()) c.out = default_out;
    for (const Field& f : fields(c))
      if (auto* d = std::get_if<double*>(&f.ptr)) check(f.key, std::isfinite(**d), "must be finite");

    spec_method("dataset", c.dataset, {"fashion-mnist", "synthetic"});
    const std::string pmethod = spec_method("partition", c.partition, {"iid", "dirichlet", "shards", "quantity"});
    if (alpha_) fold_alpha(pmethod);
    check("clients", c.clients >= 1, "must be >= 1");
    check("clients_per_round", c.clients_per_round >= 1 && c.clients_per_round <= c.clients,
          "must be in [1, clients = " << c.clients << "]");
    check("rounds", c.rounds >= 1, "must be >= 1");
    check("model", !c.model.empty(), "must not be empty");
    check("algorithm", c.algorithm == "fedavg" || c.algorithm == "fedprox" || c.algorithm == "scaffold",
          "must be fedavg, fedprox or scaffold");
    check("mu", c.mu >= 0, "must be >= 0");
    check("local_epochs", c.local_epochs >= 1, "must be >= 1");
    check("batch_size", c.batch_size >= 1, "must be >= 1");
    check("lr", c.lr > 0, "must be > 0");
    check("momentum", c.momentum >= 0 && c.momentum < 1, "must be in [0, 1)");
    check("weight_decay", c.weight_decay >= 0, "must be >= 0");
    spec_method("compression", c.compression, {});
    spec_method("server_optimizer", c.server_optimizer, {});
    check("workers", c.workers >= 1, "must be >= 1");
    check("eval_every", c.eval_every >= 1, "must be >= 1");
    check("checkpoint_every", c.checkpoint_every >= 1, "must be >= 1 (1 = every round)");
    check("out", !c.out.empty(), "must not be empty");
    check("deadline_s", c.deadline_s >= 0, "must be >= 0 (0 = no deadline)");
    check("profiles.compute_speed", c.profiles.compute_speed >= 0, "must be >= 0 (a lognormal sigma)");
    check("profiles.uplink_mbps", c.profiles.uplink_mbps > 0, "must be > 0");
    check("profiles.downlink_mbps", c.profiles.downlink_mbps > 0, "must be > 0");
    check("profiles.availability", c.profiles.availability > 0 && c.profiles.availability <= 1, "must be in (0, 1]");
    return c;
  }

 private:
  std::string where(const std::string& key) const {
    auto it = where_.find(key);
    return it == where_.end() ? source_ + " (default)" : it->second;
  }

  [[noreturn]] void fail(const std::string& key, const std::string& msg) const {
    throw ConfigError(where(key) + ": config key '" + key + "' " + msg);
  }

  template <class Msg>
  void check_impl(const std::string& key, bool ok, Msg&& msg) const {
    if (ok) return;
    std::ostringstream os;
    msg(os);
    fail(key, os.str());
  }
  FieldPtr find(const std::string& key) {
    for (const Field& f : fields(config_))
      if (key == f.key) return f.ptr;
    std::string known;
    for (const Field& f : fields(config_)) known += std::string(known.empty() ? "" : ", ") + f.key;
    fail(key, "is unknown (known keys: " + known + ", alpha)");
  }

  void set_from_node(const std::string& key, const toml::node& n) {
    where_[key] = source_ + ":" + std::to_string(n.source().begin.line);
    std::ostringstream type;
    type << n.type();
    const std::string got = " (got " + type.str() + ")";
    if (key == kAlpha) {
      check(key, n.is_number(), "must be a number" << got);
      alpha_ = number(n);
      return;
    }
    std::visit(Overloaded{[&](int* v) {
                            check(key, n.is_integer(), "must be an integer" << got);
                            *v = static_cast<int>(to_int(key, n.as_integer()->get(), INT32_MIN, INT32_MAX));
                          },
                          [&](uint64_t* v) {
                            check(key, n.is_integer(), "must be an integer" << got);
                            *v = static_cast<uint64_t>(to_int(key, n.as_integer()->get(), 0, INT64_MAX));
                          },
                          [&](double* v) {
                            check(key, n.is_number(), "must be a number" << got);
                            *v = number(n);
                          },
                          [&](std::string* v) {
                            check(key, n.is_string(), "must be a string" << got);
                            *v = n.as_string()->get();
                          }},
               find(key));
  }

  static double number(const toml::node& n) {
    return n.is_integer() ? static_cast<double>(n.as_integer()->get()) : n.as_floating_point()->get();
  }

  int64_t to_int(const std::string& key, int64_t v, int64_t lo, int64_t hi) const {
    check(key, v >= lo && v <= hi, "is out of range (got " << v << ")");
    return v;
  }

  int64_t parse_int(const std::string& key, const std::string& text) const {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    check(key, !text.empty() && *end == '\0' && errno == 0, "must be an integer (got '" << text << "')");
    return v;
  }

  double parse_double(const std::string& key, const std::string& text) const {
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    check(key, !text.empty() && *end == '\0', "must be a number (got '" << text << "')");
    return v;
  }

  // Parses a spec-string value (syntax errors name the key) and checks its
  // method against `methods` when that list is not empty.
  std::string spec_method(const std::string& key, const std::string& value,
                          std::initializer_list<const char*> methods) const {
    std::string method;
    try {
      method = Spec::parse(value).method();
    } catch (const ConfigError& e) {
      fail(key, "is not a valid spec: " + std::string(e.what()));
    }
    bool ok = methods.size() == 0;
    std::string names;
    for (const char* m : methods) {
      ok = ok || method == m;
      names += std::string(names.empty() ? "" : ", ") + m;
    }
    check(key, ok, "has unknown method '" << method << "' (expected one of " << names << ")");
    return method;
  }

  // `alpha = A` rewrites the partition spec's alpha (see config.h).
  void fold_alpha(const std::string& method) {
    check(kAlpha, method == "dirichlet" || method == "quantity",
          "needs a dirichlet or quantity partition (partition is '" << config_.partition << "')");
    check(kAlpha, *alpha_ > 0 && std::isfinite(*alpha_), "must be > 0");
    std::string spec = method + ":alpha=" + format_double(*alpha_);
    const auto colon = config_.partition.find(':');
    if (colon != std::string::npos) {
      std::stringstream rest(config_.partition.substr(colon + 1));
      for (std::string item; std::getline(rest, item, ',');)
        if (trim(item.substr(0, item.find('='))) != kAlpha) spec += "," + trim(item);
    }
    config_.partition = spec;
  }

  std::string source_;
  SimConfig config_;
  std::map<std::string, std::string> where_;  // key -> "file:line" or "--set"
  std::optional<double> alpha_;
};
#undef check

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

SimConfig parse(const std::string& source, const std::string& text, const std::vector<std::string>& overrides,
                const std::string& default_out) {
  Loader loader(source);
  loader.read_toml(text);
  for (const auto& kv : overrides) loader.apply_override(kv);
  return loader.finish(default_out);
}

}  // namespace

bool operator==(const DeviceProfiles& a, const DeviceProfiles& b) {
  return std::tie(a.compute_speed, a.uplink_mbps, a.downlink_mbps, a.availability) ==
         std::tie(b.compute_speed, b.uplink_mbps, b.downlink_mbps, b.availability);
}

bool operator==(const SimConfig& a, const SimConfig& b) {
  auto fa = fields(const_cast<SimConfig&>(a)), fb = fields(const_cast<SimConfig&>(b));
  for (size_t i = 0; i < fa.size(); ++i) {
    const bool same = std::visit(
        [&](auto* pa) { return *pa == *std::get<std::remove_reference_t<decltype(pa)>>(fb[i].ptr); }, fa[i].ptr);
    if (!same) return false;
  }
  return true;
}

SimConfig parse_config_string(const std::string& toml_text, const std::vector<std::string>& overrides) {
  return parse("<string>", toml_text, overrides, "");
}

SimConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK_T(ConfigError, in, "cannot read config file '" << path << "'");
  std::ostringstream text;
  text << in.rdbuf();
  return parse(path, text.str(), overrides, "runs/" + std::filesystem::path(path).stem().string());
}

std::string to_toml(const SimConfig& c) {
  SPARROW_CHECK_T(ConfigError, c.seed <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                  "seed " << c.seed << " does not fit a TOML integer");
  std::string top = "# sparrow-sim effective configuration\n", profiles = "\n[profiles]\n";
  for (const Field& f : fields(const_cast<SimConfig&>(c))) {
    const std::string key = f.key;
    const std::string value =
        std::visit(Overloaded{[](int* v) { return std::to_string(*v); }, [](uint64_t* v) { return std::to_string(*v); },
                              [](double* v) {
                                std::string s = format_double(*v);
                                // TOML needs a '.' or exponent to read a float back as a float.
                                if (s.find_first_of(".eE") == std::string::npos) s += ".0";
                                return s;
                              },
                              [](std::string* v) { return toml_string(*v); }},
                   f.ptr);
    const auto dot = key.find('.');
    if (dot == std::string::npos)
      top += key + " = " + value + "\n";
    else
      profiles += key.substr(dot + 1) + " = " + value + "\n";
  }
  return top + profiles;
}

}  // namespace sparrow::simulator
