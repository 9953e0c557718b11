#pragma once
// The strict flat-TOML config reader every Sparrow program uses (server, client,
// edge, simulator): a FlatConfig binds config keys to the fields of a caller's
// struct, reads a TOML document into them, then applies `--set key=value`
// overrides on top.
//
// Contract:
//  - Every key must be bound: an unknown key is a ConfigError naming it, the
//    nearest known key within 2 edits ("did you mean 'lr'?") and listing the
//    known keys (in bind order).
//  - A bound key "table.x" is read from `x` in a [table] section (and set by
//    `--set table.x=...`); a bare `table = ...` then needs to be a table.
//  - TOML values are type-checked (an integer key needs a TOML integer, a double
//    key any number, a bool key true/false, a string key a string); integers
//    are range-checked against the bounds given to bind().
//  - Overrides are "key=value" (spaces around the key are ignored); the value is
//    parsed by the key's type: integers in base 10, numbers as strtod, bools as
//    true/false, strings verbatim (everything after '=').
//  - Errors read "<where>: config key 'k' <what>", where <where> is
//    "file:line" for the file, "--set" for an override and "<source> (default)"
//    for a key never set; a TOML syntax error is "<source>:line:column: TOML
//    syntax error: ...". A failed read may leave some fields already set.
//  - The binder stores pointers: the bound fields must outlive it.

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <variant>
#include <vector>

namespace sparrow::core {

class FlatConfig {
 public:
  // `source` names the document in messages (a path or "<string>").
  explicit FlatConfig(std::string source);

  // Binds `key` to a field. Integer keys accept values in [lo, hi]; a key bound
  // twice is a programming error (sparrow::Error).
  void bind(const std::string& key, int* v, int64_t lo = std::numeric_limits<int>::min(),
            int64_t hi = std::numeric_limits<int>::max());
  void bind(const std::string& key, uint32_t* v, int64_t lo = 0, int64_t hi = std::numeric_limits<uint32_t>::max());
  void bind(const std::string& key, int64_t* v, int64_t lo = std::numeric_limits<int64_t>::min(),
            int64_t hi = std::numeric_limits<int64_t>::max());
  // TOML integers are signed 64-bit, so a uint64 key tops out at INT64_MAX.
  void bind(const std::string& key, uint64_t* v, int64_t lo = 0, int64_t hi = std::numeric_limits<int64_t>::max());
  void bind(const std::string& key, double* v);  // any number, nan and inf included: callers check
  void bind(const std::string& key, bool* v);
  void bind(const std::string& key, std::string* v);

  // Reads a TOML document into the bound fields (see the contract above).
  void read_toml(const std::string& text);
  // Applies one "key=value" override / several in order.
  void apply_override(const std::string& kv);
  void apply_overrides(const std::vector<std::string>& overrides);
  // read_toml(toml_text), then apply_overrides(overrides): the usual load.
  void read(const std::string& toml_text, const std::vector<std::string>& overrides);

  // Whether the file or an override set `key`.
  bool has(const std::string& key) const { return where_.count(key) != 0; }
  // Where `key` got its value: "file:line", "--set", or "<source> (default)"
  // ("" for a binder with an empty source).
  std::string where(const std::string& key) const;
  // ConfigError "<where(key)>: config key 'key' <msg>".
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const;
  void check(const std::string& key, bool ok, const std::string& msg) const {
    if (!ok) fail(key, msg);
  }
  // fail(key, "must be finite") for the first bound double that is nan or inf.
  void check_finite() const;

  // For writers: the bound keys in bind order, and a key's current value as a
  // TOML value (integers in decimal, toml_number, true/false, toml_quote).
  std::vector<std::string> keys() const;
  std::string toml_value(const std::string& key) const;

 private:
  using Slot = std::variant<int*, uint32_t*, int64_t*, uint64_t*, double*, bool*, std::string*>;
  struct Binding {
    std::string key;
    Slot slot;
    int64_t lo = 0, hi = 0;  // integer slots only
  };
  void add(const std::string& key, Slot slot, int64_t lo, int64_t hi);
  const Binding& find(const std::string& key) const;  // unknown: fail() listing the known keys
  bool is_table(const std::string& name) const;       // some key is "name.x"
  template <class Node>
  void set_from_node(const std::string& key, const Node& node);
  void set_integer(const Binding& b, int64_t v) const;

  std::string source_;
  std::vector<Binding> bindings_;
  std::map<std::string, std::string> where_;  // key -> "file:line" or "--set"
};

// The edit distance of two keys (insertions, deletions, substitutions and
// swaps of neighbours each count one).
size_t edit_distance(const std::string& a, const std::string& b);
// The known key nearest to `key` within 2 edits (the first in `known` order
// on a tie), or "" when none is: what "did you mean 'lr'?" names. A match
// needs fewer edits than the longer key has characters (two edits turn any
// 2-letter key into any other).
std::string closest_key(const std::string& key, const std::vector<std::string>& known);

// A TOML basic string: quotes, backslashes and control characters escaped.
std::string toml_quote(const std::string& s);
// A TOML float that reads back to exactly `v`: the shortest round-tripping
// decimal, whole numbers below 1e15 without an exponent, always with a '.' or
// exponent ("10.0", "0.1", "1e+20", "inf", "nan").
std::string toml_number(double v);
// The whole file; ConfigError "cannot read config file '<path>'" when unreadable.
std::string read_config_file(const std::string& path);

}  // namespace sparrow::core
