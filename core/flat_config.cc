#include "core/flat_config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace sparrow::core {
namespace {

template <class... F>
struct Overloaded : F... {
  using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

}  // namespace

size_t edit_distance(const std::string& a, const std::string& b) {
  // Levenshtein with adjacent transpositions counted as one edit ("lrr" ->
  // "lr" is 1, "ilmit" -> "limit" is 1).
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t sub = d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, sub});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

std::string closest_key(const std::string& key, const std::vector<std::string>& known) {
  std::string best;
  size_t best_d = 3;  // at most 2 edits
  for (const std::string& k : known) {
    // Not for very short keys, where two edits make anything out of anything.
    const size_t d = edit_distance(key, k);
    if (d < best_d && d < std::max(key.size(), k.size())) {
      best = k;
      best_d = d;
    }
  }
  return best;
}

FlatConfig::FlatConfig(std::string source) : source_(std::move(source)) {}

void FlatConfig::add(const std::string& key, Slot slot, int64_t lo, int64_t hi) {
  for (const Binding& b : bindings_) SPARROW_CHECK(b.key != key, "config key '" << key << "' bound twice");
  bindings_.push_back({key, slot, lo, hi});
}

void FlatConfig::bind(const std::string& key, int* v, int64_t lo, int64_t hi) { add(key, v, lo, hi); }
void FlatConfig::bind(const std::string& key, uint32_t* v, int64_t lo, int64_t hi) { add(key, v, lo, hi); }
void FlatConfig::bind(const std::string& key, int64_t* v, int64_t lo, int64_t hi) { add(key, v, lo, hi); }
void FlatConfig::bind(const std::string& key, uint64_t* v, int64_t lo, int64_t hi) { add(key, v, lo, hi); }
void FlatConfig::bind(const std::string& key, double* v) { add(key, v, 0, 0); }
void FlatConfig::bind(const std::string& key, bool* v) { add(key, v, 0, 0); }
void FlatConfig::bind(const std::string& key, std::string* v) { add(key, v, 0, 0); }

std::string FlatConfig::where(const std::string& key) const {
  auto it = where_.find(key);
  if (it != where_.end()) return it->second;
  return source_.empty() ? "" : source_ + " (default)";
}

void FlatConfig::fail(const std::string& key, const std::string& msg) const {
  const std::string at = where(key);
  throw ConfigError((at.empty() ? "" : at + ": ") + "config key '" + key + "' " + msg);
}

const FlatConfig::Binding& FlatConfig::find(const std::string& key) const {
  for (const Binding& b : bindings_)
    if (b.key == key) return b;
  std::string known;
  std::vector<std::string> keys;
  for (const Binding& b : bindings_) {
    known += (known.empty() ? "" : ", ") + b.key;
    keys.push_back(b.key);
  }
  const std::string close = closest_key(key, keys);
  fail(key, "is unknown" + (close.empty() ? std::string() : ": did you mean '" + close + "'?") +
                " (known keys: " + known + ")");
}

bool FlatConfig::is_table(const std::string& name) const {
  for (const Binding& b : bindings_)
    if (b.key.size() > name.size() && b.key.compare(0, name.size(), name) == 0 && b.key[name.size()] == '.')
      return true;
  return false;
}

void FlatConfig::set_integer(const Binding& b, int64_t v) const {
  check(b.key, v >= b.lo && v <= b.hi, "is out of range (got " + std::to_string(v) + ")");
  std::visit(Overloaded{[&](int* p) { *p = static_cast<int>(v); }, [&](uint32_t* p) { *p = static_cast<uint32_t>(v); },
                        [&](int64_t* p) { *p = v; }, [&](uint64_t* p) { *p = static_cast<uint64_t>(v); }, [](auto*) {}},
             b.slot);
}

template <class Node>
void FlatConfig::set_from_node(const std::string& key, const Node& n) {
  where_[key] = source_ + ":" + std::to_string(n.source().begin.line);
  const Binding& b = find(key);
  std::ostringstream type;
  type << n.type();
  const std::string got = " (got " + type.str() + ")";
  std::visit(Overloaded{[&](double* p) {
                          check(key, n.is_number(), "must be a number" + got);
                          *p = n.is_integer() ? static_cast<double>(n.as_integer()->get())
                                              : n.as_floating_point()->get();
                        },
                        [&](bool* p) {
                          check(key, n.is_boolean(), "must be true or false" + got);
                          *p = n.as_boolean()->get();
                        },
                        [&](std::string* p) {
                          check(key, n.is_string(), "must be a string" + got);
                          *p = n.as_string()->get();
                        },
                        [&](auto*) {
                          check(key, n.is_integer(), "must be an integer" + got);
                          set_integer(b, n.as_integer()->get());
                        }},
             b.slot);
}

void FlatConfig::read_toml(const std::string& text) {
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
    if (!is_table(key)) {
      set_from_node(key, node);
      continue;
    }
    where_[key] = source_ + ":" + std::to_string(node.source().begin.line);
    check(key, node.is_table(), "must be a table ([" + key + "])");
    for (auto&& [sub, subnode] : *node.as_table()) set_from_node(key + "." + std::string(sub.str()), subnode);
  }
}

void FlatConfig::apply_override(const std::string& kv) {
  const auto eq = kv.find('=');
  SPARROW_CHECK_T(ConfigError, eq != std::string::npos && eq > 0, "--set '" << kv << "': expected key=value");
  const std::string key = trim(kv.substr(0, eq)), text = kv.substr(eq + 1);
  where_[key] = "--set";
  const Binding& b = find(key);
  char* end = nullptr;
  errno = 0;
  std::visit(Overloaded{[&](double* p) {
                          const double v = std::strtod(text.c_str(), &end);
                          check(key, !text.empty() && *end == '\0', "must be a number (got '" + text + "')");
                          check(key, !(errno == ERANGE && std::isinf(v)), "is out of range (got '" + text + "')");
                          *p = v;
                        },
                        [&](bool* p) {
                          check(key, text == "true" || text == "false", "must be true or false (got '" + text + "')");
                          *p = text == "true";
                        },
                        [&](std::string* p) { *p = text; },
                        [&](auto*) {
                          const long long v = std::strtoll(text.c_str(), &end, 10);
                          check(key, !text.empty() && *end == '\0' && errno == 0,
                                "must be an integer (got '" + text + "')");
                          set_integer(b, v);
                        }},
             b.slot);
}

void FlatConfig::apply_overrides(const std::vector<std::string>& overrides) {
  for (const std::string& kv : overrides) apply_override(kv);
}

void FlatConfig::read(const std::string& toml_text, const std::vector<std::string>& overrides) {
  read_toml(toml_text);
  apply_overrides(overrides);
}

void FlatConfig::check_finite() const {
  for (const Binding& b : bindings_)
    if (auto* d = std::get_if<double*>(&b.slot)) check(b.key, std::isfinite(**d), "must be finite");
}

std::vector<std::string> FlatConfig::keys() const {
  std::vector<std::string> out;
  for (const Binding& b : bindings_) out.push_back(b.key);
  return out;
}

std::string FlatConfig::toml_value(const std::string& key) const {
  for (const Binding& b : bindings_)
    if (b.key == key)
      return std::visit(
          Overloaded{[](double* p) { return toml_number(*p); },
                     [](bool* p) { return std::string(*p ? "true" : "false"); },
                     [](std::string* p) { return toml_quote(*p); }, [](auto* p) { return std::to_string(*p); }},
          b.slot);
  SPARROW_CHECK(false, "config key '" << key << "' is not bound");
  return {};
}

std::string toml_quote(const std::string& s) {
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

std::string toml_number(double v) {
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
  } else {
    for (int precision = 1; precision <= 17; ++precision) {
      std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
      if (std::strtod(buf, nullptr) == v) break;
    }
  }
  std::string s = buf;
  // TOML needs a '.' or an exponent to read a float back as a float ("inf"/"nan" are floats).
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

std::string read_config_file(const std::string& path) {
  // A folder opens as a stream that reads nothing: the message would be about missing keys.
  std::error_code ec;
  SPARROW_CHECK_T(ConfigError, !std::filesystem::is_directory(path, ec),
                  "config '" << path << "' is a folder, not a config file");
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK_T(ConfigError, in, "cannot read config file '" << path << "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace sparrow::core
