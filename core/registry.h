#pragma once
// A string-keyed registry: the names users write in configs ("median",
// "fedadam", "cnn") mapped to what builds the named thing, each with a
// one-line description for help texts and docs. One registry per kind of
// component (aggregators in aggregation/rules.h, server optimisers in
// aggregation/server_optimizer.h, models in core/models.h; the codecs keep
// their own in compression/compressor.h). Each kind fills its registry with an
// explicit register_builtins(); code outside the library adds entries the same
// way, without editing the library.
//
// Contract:
// - A name means one thing: registering a name twice is a programming error
//   (sparrow::Error), never a silent replacement. Names are non-empty and
//   contain none of ": ,=" (they are the method part of a spec string).
// - Looking up an unknown name is the user's error: ConfigError
//   "unknown <what> 'x' (known: a, b, c)", names in sorted order.
// - Thread-safe: entries may be added while others are looked up. get()
//   returns a copy of the value, so a factory runs without the registry's lock
//   held (and may itself look up other registries).

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace sparrow::core {

template <class T>
class Registry {
 public:
  // `what` names an entry in messages: "unknown <what> 'x' (known: ...)".
  explicit Registry(std::string what) : what_(std::move(what)) {}
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Adds `name`. sparrow::Error for a name already registered or not a valid
  // spec method.
  void add(const std::string& name, T value, std::string description) {
    SPARROW_CHECK(!name.empty() && name.find_first_of(": ,=\t\n") == std::string::npos,
                  "registry: '" << name << "' is not a valid " << what_ << " name");
    std::lock_guard<std::mutex> lock(mu_);
    SPARROW_CHECK(entries_.count(name) == 0, "registry: " << what_ << " '" << name << "' is already registered");
    entries_.emplace(name, Entry{std::move(value), std::move(description)});
  }

  // The value of `name`; ConfigError listing the known names when absent.
  T get(const std::string& name) const {
    std::optional<T> v = find(name);
    if (!v) throw unknown(name);
    return std::move(*v);
  }
  std::optional<T> find(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(name);
    if (it == entries_.end()) return std::nullopt;
    return it->second.value;
  }
  bool contains(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.count(name) != 0;
  }
  // The registered names, sorted.
  std::vector<std::string> names() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out;
    for (const auto& kv : entries_) out.push_back(kv.first);
    return out;
  }
  // The one-line description of `name`; ConfigError when absent.
  std::string description(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(name);
    if (it == entries_.end()) throw unknown_locked(name, "");
    return it->second.description;
  }
  // "unknown <what> 'name' (known: a, b[, extra])": the error get() throws;
  // `extra` appends names that are not entries (e.g. "torchscript:FILE").
  ConfigError unknown(const std::string& name, const std::string& extra = "") const {
    std::lock_guard<std::mutex> lock(mu_);
    return unknown_locked(name, extra);
  }

 private:
  struct Entry {
    T value;
    std::string description;
  };
  ConfigError unknown_locked(const std::string& name, const std::string& extra) const {
    std::string known;
    for (const auto& kv : entries_) known += (known.empty() ? "" : ", ") + kv.first;
    if (!extra.empty()) known += (known.empty() ? "" : ", ") + extra;
    return ConfigError("unknown " + what_ + " '" + name + "' (known: " + known + ")");
  }

  std::string what_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> entries_;
};

}  // namespace sparrow::core
