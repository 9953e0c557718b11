// federation/sampler.h: the selection rules both drivers call. The uniform
// rule over string ids picks what the simulator picks over its indices, the
// canonical id order puts "2" before "10", least_recent gives every client its
// turn, and a user's rule registers by name.
#include "tests/sparrow_test.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "federation/sampler.h"

using namespace sparrow;
using namespace sparrow::federation;

TEST_CASE("sampler: uniform positions are a seeded sample without replacement, ascending") {
  const auto a = uniform_positions(7, 3, 100, 10);
  CHECK(a == uniform_positions(7, 3, 100, 10));
  CHECK(a != uniform_positions(7, 4, 100, 10));
  CHECK(a != uniform_positions(8, 3, 100, 10));
  CHECK(a.size() == 10);
  CHECK(std::is_sorted(a.begin(), a.end()));
  CHECK(std::set<size_t>(a.begin(), a.end()).size() == 10);
  CHECK(a.back() < 100);
  CHECK(uniform_positions(7, 3, 4, 10) == std::vector<size_t>{0, 1, 2, 3});
  CHECK(uniform_positions(7, 3, 0, 10).empty());
  // The simulator's draw, written out: a partial Fisher-Yates over 0..n-1
  // from the stream of (seed, "samp", round - 1) (its runs reproduce).
  std::vector<size_t> pos(100);
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = i;
  rng::Stream s(rng::derive(rng::derive(7, 0x73616d70), 2));
  for (size_t i = 0; i < 10; ++i) std::swap(pos[i], pos[i + s.below(100 - i)]);
  pos.resize(10);
  std::sort(pos.begin(), pos.end());
  CHECK(a == pos);
}

TEST_CASE("sampler: ids in canonical order, numbers by value before names") {
  CHECK(id_less("2", "10"));
  CHECK_FALSE(id_less("10", "2"));
  CHECK(id_less("10", "a"));
  CHECK(id_less("a", "b"));
  CHECK(id_less("7", "007") != id_less("007", "7"));  // equal values still ordered, strictly
  CHECK_FALSE(id_less("7", "7"));
  std::vector<std::string> ids = {"b", "10", "2", "a", "0"};
  std::sort(ids.begin(), ids.end(), id_less);
  CHECK(ids == std::vector<std::string>{"0", "2", "10", "a", "b"});
}

TEST_CASE("sampler: uniform over string ids picks what the simulator picks over its indices, whatever the order") {
  std::vector<Candidate> c;
  for (int i = 11; i >= 0; --i) c.push_back({std::to_string(i), 0});
  const auto chosen = sampler("uniform")(5, 2, c, 4);
  std::vector<std::string> expect;
  for (size_t p : uniform_positions(5, 2, 12, 4)) expect.push_back(std::to_string(p));
  CHECK(chosen == expect);
  std::reverse(c.begin(), c.end());
  CHECK(sampler("uniform")(5, 2, c, 4) == expect);
}

TEST_CASE("sampler: least_recent gives every live client its turn") {
  std::vector<Candidate> c = {{"a", 3}, {"b", 0}, {"c", 1}, {"d", 0}, {"e", 2}};
  const auto chosen = sampler("least_recent")(9, 4, c, 3);
  REQUIRE(chosen.size() == 3);
  CHECK(std::set<std::string>(chosen.begin(), chosen.begin() + 2) == std::set<std::string>{"b", "d"});
  CHECK(chosen[2] == "c");
  // Over 5 rounds of 2 of 5 clients, nobody waits more than 3 rounds.
  std::map<std::string, int64_t> last;
  for (const auto& x : c) last[x.id] = 0;
  for (uint64_t r = 1; r <= 5; ++r) {
    std::vector<Candidate> now;
    for (const auto& [id, l] : last) now.push_back({id, l});
    for (const auto& id : sampler("least_recent")(9, r, now, 2)) last[id] = static_cast<int64_t>(r);
  }
  for (const auto& kv : last) CHECK_MESSAGE(kv.second >= 3, kv.first);
}

TEST_CASE("sampler: rules by name, a user's own rule, unknown names listed") {
  CHECK(known_sampler("uniform"));
  CHECK(known_sampler("least_recent"));
  CHECK_FALSE(known_sampler("auto"));  // resolved by each program
  CHECK_THROWS_WITH_AS(sampler("roulette"), doctest::Contains("least_recent, uniform"), ConfigError);
  register_sampler(
      "first_k",
      [](uint64_t, uint64_t, std::vector<Candidate> c, size_t k) {
        std::sort(c.begin(), c.end(), [](const Candidate& a, const Candidate& b) { return id_less(a.id, b.id); });
        std::vector<std::string> out;
        for (size_t i = 0; i < c.size() && i < k; ++i) out.push_back(c[i].id);
        return out;
      },
      "the first k ids (a test's rule)");
  CHECK(sampler("first_k")(1, 1, {{"10", 0}, {"2", 0}, {"3", 0}}, 2) == std::vector<std::string>{"2", "3"});
  CHECK_THROWS_AS(register_sampler("uniform", sampler("uniform"), "again"), Error);
}
