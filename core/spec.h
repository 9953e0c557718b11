#pragma once
// Spec strings: "method:key=value,key=value". Used for compressors (and later
// anything else configured by a short string). Parsing is strict: a key may
// appear once, every key must be consumed by the component that reads it, and
// values must parse completely. Errors are sparrow::ConfigError.

#include <cstdint>
#include <map>
#include <set>
#include <string>

namespace sparrow {

class Spec {
 public:
  // Throws ConfigError on syntax errors (empty method, "key" without '=',
  // duplicate keys, empty values).
  static Spec parse(const std::string& text);

  const std::string& method() const { return method_; }
  const std::string& text() const { return text_; }
  bool has(const std::string& key) const {
    asked_.insert(key);
    return values_.count(key) != 0;
  }

  // Typed getters mark the key consumed; a missing key returns the default,
  // a malformed value throws ConfigError naming the key.
  double get_double(const std::string& key, double def);
  int64_t get_int(const std::string& key, int64_t def);
  bool get_bool(const std::string& key, bool def);
  std::string get_string(const std::string& key, const std::string& def);
  double require_double(const std::string& key);

  // Throws ConfigError listing every key no getter asked for.
  void check_all_consumed() const;

 private:
  std::string text_;
  std::string method_;
  std::map<std::string, std::string> values_;
  std::set<std::string> consumed_;
  mutable std::set<std::string> asked_;  // every key a getter or has() asked for: the method's keys
};

}  // namespace sparrow
