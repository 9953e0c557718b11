#pragma once
// Who takes part in a round: one implementation of each selection rule for
// both drivers. The simulator passes its available population (in client-id
// order), the server its live clients that are not held out; the rule picks k
// of them (all when fewer). Rules are looked up by name (the `sampler` key) in
// a registry, so a deployment can run the simulator's rule and select what the
// simulator selects when the same clients are live (the parity test does).
//
// Built-in rules:
//   "uniform"       a seeded uniform sample without replacement (partial
//                   Fisher-Yates over the candidates in canonical id order),
//                   the same for every party that knows the run seed. The
//                   simulator's rule; the stream of round r is keyed by r - 1
//                   (the simulator numbered its selections from 0 and runs
//                   reproduce).
//   "least_recent"  the clients selected longest ago first (never selected
//                   first), ties broken by a seeded hash of the id: every live
//                   client takes its turn. The service's rule.
// The `sampler` key's "auto" is the program's own: uniform in sparrow-sim,
// least_recent in sparrow-server.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace sparrow::federation {

struct Candidate {
  std::string id;
  int64_t last_selected = 0;  // the last round it was selected in; 0 = never
};

// The canonical order of client ids: decimal integers by value, before any
// other id, which go in byte order ("2" < "10" < "a"). The simulator's ids
// ("0", "1", ...) are in their numeric order.
bool id_less(const std::string& a, const std::string& b);

// Positions (ascending) of the k of n candidates the uniform rule picks in
// round r (1-based) under `seed`; k > n picks all n.
std::vector<size_t> uniform_positions(uint64_t seed, uint64_t round, size_t n, size_t k);

// least_recent's order under an explicit tie-break key (the rule uses
// derive(derive(seed, "sele"), r)): the first k.
std::vector<std::string> least_recent_by_key(uint64_t key, std::vector<Candidate> candidates, size_t k);

// A rule: the chosen ids for round r (1-based). `candidates` in any order.
using SamplerFn =
    std::function<std::vector<std::string>(uint64_t seed, uint64_t round, std::vector<Candidate> candidates, size_t k)>;

// Registers a rule under `name` (sparrow::Error when taken). Thread-safe.
void register_sampler(const std::string& name, SamplerFn fn, const std::string& description);
// The rule for `name` ("uniform", "least_recent" or one registered); ConfigError
// naming the known ones otherwise. "auto" is resolved by the caller.
SamplerFn sampler(const std::string& name);
bool known_sampler(const std::string& name);
std::vector<std::string> sampler_names();

}  // namespace sparrow::federation
