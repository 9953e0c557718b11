#pragma once
// Staleness discounts of buffered asynchronous aggregation
// (federation/async_engine.h, docs/async.md): an update trained from model
// version v and folded while the server is at version V has staleness
// s = V - v, and is folded with weight w(s) x its sample count. The rules are
// a registry keyed by the names users write (`staleness = "poly:a=0.5"`),
// like aggregators and server optimisers; code outside the library adds its
// own with register_staleness().
//
// Built-ins (Xie et al., "Asynchronous Federated Optimization", 2019; Nguyen
// et al., FedBuff, AISTATS 2022, use poly with a = 0.5):
//   const             w(s) = 1
//   poly:a=0.5        w(s) = (1 + s)^-a              (a >= 0)
//   hinge:a=10,b=4    w(s) = 1 for s <= b, else 1 / (a (s - b) + 1)   (a, b >= 0)
//
// Contract: a rule is a pure function of s, with w(0) = 1 and values in (0, 1]
// (make_staleness checks w(0) and a few values, so a user's rule that breaks
// it is a ConfigError when the run starts, not a silent reweighting).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/spec.h"

namespace sparrow::federation {

using StalenessFn = std::function<double(uint64_t staleness)>;
// Builds a rule from its spec (keys consumed with the Spec getters; the
// caller checks that every key was used).
using StalenessFactory = std::function<StalenessFn(Spec& spec)>;

// Adds a rule; sparrow::Error for a name already registered.
void register_staleness(const std::string& name, StalenessFactory factory, const std::string& description);
// The rule of `spec` ("poly:a=0.5"); ConfigError for an unknown name, a bad
// or unused key, or a rule outside (0, 1] / with w(0) != 1.
StalenessFn make_staleness(const std::string& spec);
// Registered rule names, sorted.
std::vector<std::string> staleness_names();

}  // namespace sparrow::federation
