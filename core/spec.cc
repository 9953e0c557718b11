#include "core/spec.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "core/error.h"

namespace sparrow {
namespace {

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

}  // namespace

Spec Spec::parse(const std::string& text) {
  Spec spec;
  spec.text_ = text;
  const size_t colon = text.find(':');
  spec.method_ = trim(text.substr(0, colon));
  SPARROW_CHECK_T(ConfigError, !spec.method_.empty(), "spec '" << text << "': empty method name");
  if (colon == std::string::npos) return spec;
  const std::string rest = text.substr(colon + 1);
  size_t pos = 0;
  while (pos <= rest.size()) {
    size_t comma = rest.find(',', pos);
    if (comma == std::string::npos) comma = rest.size();
    const std::string item = trim(rest.substr(pos, comma - pos));
    pos = comma + 1;
    if (item.empty()) {
      SPARROW_CHECK_T(ConfigError, comma == rest.size() && rest.empty(), "spec '" << text << "': empty key=value item");
      continue;
    }
    const size_t eq = item.find('=');
    SPARROW_CHECK_T(ConfigError, eq != std::string::npos,
                    "spec '" << text << "': item '" << item << "' is not key=value");
    const std::string key = trim(item.substr(0, eq));
    const std::string value = trim(item.substr(eq + 1));
    SPARROW_CHECK_T(ConfigError, !key.empty() && !value.empty(),
                    "spec '" << text << "': item '" << item << "' has an empty key or value");
    SPARROW_CHECK_T(ConfigError, spec.values_.emplace(key, value).second,
                    "spec '" << text << "': key '" << key << "' given twice");
  }
  return spec;
}

double Spec::get_double(const std::string& key, double def) {
  asked_.insert(key);
  auto it = values_.find(key);
  if (it == values_.end()) return def;
  consumed_.insert(key);
  const char* s = it->second.c_str();
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(s, &end);
  SPARROW_CHECK_T(ConfigError, end != s && *end == '\0' && errno == 0 && std::isfinite(v),
                  "spec '" << text_ << "': " << key << "='" << it->second << "' is not a finite number");
  return v;
}

double Spec::require_double(const std::string& key) {
  SPARROW_CHECK_T(ConfigError, has(key), "spec '" << text_ << "': method '" << method_ << "' needs " << key << "=...");
  return get_double(key, 0.0);
}

int64_t Spec::get_int(const std::string& key, int64_t def) {
  asked_.insert(key);
  auto it = values_.find(key);
  if (it == values_.end()) return def;
  consumed_.insert(key);
  const char* s = it->second.c_str();
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s, &end, 10);
  SPARROW_CHECK_T(ConfigError, end != s && *end == '\0' && errno == 0,
                  "spec '" << text_ << "': " << key << "='" << it->second << "' is not an integer");
  return static_cast<int64_t>(v);
}

bool Spec::get_bool(const std::string& key, bool def) {
  asked_.insert(key);
  auto it = values_.find(key);
  if (it == values_.end()) return def;
  consumed_.insert(key);
  const std::string& v = it->second;
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  throw ConfigError("spec '" + text_ + "': " + key + "='" + v + "' is not a boolean (0/1)");
}

std::string Spec::get_string(const std::string& key, const std::string& def) {
  asked_.insert(key);
  auto it = values_.find(key);
  if (it == values_.end()) return def;
  consumed_.insert(key);
  return it->second;
}

void Spec::check_all_consumed() const {
  std::string unknown;
  for (const auto& kv : values_) {
    if (consumed_.count(kv.first)) continue;
    if (!unknown.empty()) unknown += ", ";
    unknown += kv.first;
  }
  if (unknown.empty()) return;
  std::string known;
  for (const auto& k : asked_) known += (known.empty() ? "" : ", ") + k;
  throw ConfigError("spec '" + text_ + "': unknown key(s) for method '" + method_ + "': " + unknown + " (" +
                    (known.empty() ? std::string("it takes no keys") : "its keys: " + known) + ")");
}

}  // namespace sparrow
