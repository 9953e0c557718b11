// federation/async_staleness.h: the staleness rules' registry and built-ins.
#include "federation/async_staleness.h"

#include <cmath>
#include <mutex>

#include "core/error.h"
#include "core/registry.h"

namespace sparrow::federation {
namespace {

core::Registry<StalenessFactory>& registry() {
  static core::Registry<StalenessFactory> r("staleness rule");
  return r;
}

double nonnegative(Spec& s, const char* key, double def) {
  const double v = s.get_double(key, def);
  SPARROW_CHECK_T(ConfigError, std::isfinite(v) && v >= 0,
                  "staleness '" << s.text() << "': " << key << " must be a finite number >= 0");
  return v;
}

void register_builtins() {
  static std::once_flag once;
  std::call_once(once, [] {
    registry().add(
        "const", [](Spec&) -> StalenessFn { return [](uint64_t) { return 1.0; }; },
        "no discount: every update weighs its samples (with buffer = max_concurrency = the clients, FedAvg)");
    registry().add(
        "poly",
        [](Spec& s) -> StalenessFn {
          const double a = nonnegative(s, "a", 0.5);
          return [a](uint64_t st) { return std::pow(1.0 + static_cast<double>(st), -a); };
        },
        "(1 + s)^-a, a = 0.5 by default (FedBuff's)");
    registry().add(
        "hinge",
        [](Spec& s) -> StalenessFn {
          const double a = nonnegative(s, "a", 10);
          const double b = nonnegative(s, "b", 4);
          return [a, b](uint64_t st) {
            const double x = static_cast<double>(st);
            return x <= b ? 1.0 : 1.0 / (a * (x - b) + 1.0);
          };
        },
        "1 up to staleness b, then 1 / (a (s - b) + 1); a = 10, b = 4 by default");
  });
}

}  // namespace

void register_staleness(const std::string& name, StalenessFactory factory, const std::string& description) {
  register_builtins();
  registry().add(name, std::move(factory), description);
}

std::vector<std::string> staleness_names() {
  register_builtins();
  return registry().names();
}

StalenessFn make_staleness(const std::string& spec) {
  register_builtins();
  Spec s = Spec::parse(spec);
  StalenessFn fn = registry().get(s.method())(s);
  s.check_all_consumed();
  // The contract, on the values a run meets first (and a far one).
  for (uint64_t st : {0, 1, 2, 10, 1000}) {
    const double w = fn(st);
    SPARROW_CHECK_T(
        ConfigError, std::isfinite(w) && w > 0 && w <= 1 && (st != 0 || w == 1),
        "staleness '" << spec << "': w(" << st << ") = " << w << "; a rule must give w(0) = 1 and values in (0, 1]");
  }
  return fn;
}

}  // namespace sparrow::federation
