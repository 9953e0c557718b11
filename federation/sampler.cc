#include "federation/sampler.h"

#include <algorithm>
#include <mutex>

#include "core/registry.h"
#include "core/rng.h"

namespace sparrow::federation {
namespace {

constexpr uint64_t kSampleTag = 0x73616d70;  // "samp": the uniform rule's stream (the simulator's)
constexpr uint64_t kSelectTag = 0x73656c65;  // "sele": least_recent's tie-break (the server's)

bool is_number(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::vector<std::string> uniform(uint64_t seed, uint64_t round, std::vector<Candidate> c, size_t k) {
  std::sort(c.begin(), c.end(), [](const Candidate& a, const Candidate& b) { return id_less(a.id, b.id); });
  std::vector<std::string> out;
  for (size_t p : uniform_positions(seed, round, c.size(), k)) out.push_back(std::move(c[p].id));
  return out;
}

std::vector<std::string> least_recent(uint64_t seed, uint64_t round, std::vector<Candidate> c, size_t k) {
  return least_recent_by_key(rng::derive(rng::derive(seed, kSelectTag), round), std::move(c), k);
}

core::Registry<SamplerFn>& registry() {
  static core::Registry<SamplerFn> r("sampler");
  static std::once_flag once;
  std::call_once(once, [] {
    r.add("uniform", uniform, "a seeded uniform sample without replacement (sparrow-sim's rule)");
    r.add("least_recent", least_recent, "the clients selected longest ago first (sparrow-server's rule)");
  });
  return r;
}

}  // namespace

bool id_less(const std::string& a, const std::string& b) {
  const bool na = is_number(a), nb = is_number(b);
  if (na != nb) return na;
  if (na) {
    // By value: leading zeros stripped, the shorter is smaller; equal values by bytes.
    const size_t za = std::min(a.find_first_not_of('0'), a.size() - 1);
    const size_t zb = std::min(b.find_first_not_of('0'), b.size() - 1);
    const size_t la = a.size() - za, lb = b.size() - zb;
    if (la != lb) return la < lb;
    const int cmp = a.compare(za, la, b, zb, lb);
    if (cmp != 0) return cmp < 0;
  }
  return a < b;
}

std::vector<size_t> uniform_positions(uint64_t seed, uint64_t round, size_t n, size_t k) {
  std::vector<size_t> pos(n);
  for (size_t i = 0; i < n; ++i) pos[i] = i;
  rng::Stream s(rng::derive(rng::derive(seed, kSampleTag), round - 1));
  k = std::min(k, n);
  for (size_t i = 0; i < k; ++i) std::swap(pos[i], pos[i + s.below(n - i)]);
  pos.resize(k);
  std::sort(pos.begin(), pos.end());
  return pos;
}

std::vector<std::string> least_recent_by_key(uint64_t key, std::vector<Candidate> c, size_t k) {
  std::vector<std::pair<std::pair<int64_t, uint64_t>, std::string>> order;
  order.reserve(c.size());
  for (auto& x : c) order.push_back({{x.last_selected, rng::at(key, rng::hash_name(x.id))}, std::move(x.id)});
  std::sort(order.begin(), order.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < order.size() && i < k; ++i) out.push_back(std::move(order[i].second));
  return out;
}

void register_sampler(const std::string& name, SamplerFn fn, const std::string& description) {
  registry().add(name, std::move(fn), description);
}
SamplerFn sampler(const std::string& name) { return registry().get(name); }
bool known_sampler(const std::string& name) { return registry().contains(name); }
std::vector<std::string> sampler_names() { return registry().names(); }

}  // namespace sparrow::federation
