#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "aggregation/robust.h"
#include "aggregation/rules.h"
#include "compression/compressor.h"
#include "core/error.h"
#include "core/spec.h"

using namespace sparrow;
using namespace sparrow::aggregation;

namespace {

const TensorShapes kShapes = {{"a", {2, 3}}, {"b", {4}}};  // 10 coordinates

EncodedUpdate dense_update(const at::Tensor& flat) {
  compression::register_builtins();
  auto none = compression::make_compressor("none");
  EncodedUpdate u;
  compression::State st;
  u.emplace_back("a", none->encode(flat.narrow(0, 0, 6).reshape({2, 3}).contiguous(), st, {}));
  u.emplace_back("b", none->encode(flat.narrow(0, 6, 4).contiguous(), st, {}));
  return u;
}

at::Tensor flatten(const std::map<std::string, at::Tensor>& m) {
  return at::cat({m.at("a").reshape({-1}), m.at("b").reshape({-1})});
}

// A toy rule registered from outside the library: the update at position
// `index` of the round (in the order the accumulator received them), scaled
// by `scale`. Reports kept = 1.
class Pick final : public AggregationRule {
 public:
  Pick(int64_t index, double scale) : index_(index), scale_(scale) {}
  int64_t min_updates() const override { return index_ + 1; }
  at::Tensor combine(const RoundRows& r, AggregateStats& st) const override {
    st.kept = 1;
    return r.rows.at(static_cast<size_t>(index_)) * scale_;
  }

 private:
  int64_t index_;
  double scale_;
};

// A broken rule: three values for a model of ten.
class Short final : public AggregationRule {
 public:
  at::Tensor combine(const RoundRows& r, AggregateStats&) const override { return r.rows[0].narrow(0, 0, 3); }
};

// Registers "first" once per process (SUBCASEs re-run a test case's body).
void register_first() {
  static const bool done = [] {
    register_aggregator(
        "first",
        [](Spec& s) {
          const int64_t index = s.get_int("index", 0);
          SPARROW_CHECK_T(ConfigError, index >= 0, "first: index must be >= 0");
          return std::make_shared<Pick>(index, s.get_double("scale", 1.0));
        },
        "[index=0,scale=1] the round's update at `index`, scaled (a test rule)");
    return true;
  }();
  (void)done;
}

at::Tensor run(const std::string& spec, const at::Tensor& X, AggregateStats* st = nullptr) {
  Aggregator g(spec, "none", X.size(0), 3);
  Accumulator acc = g.make_accumulator(kShapes);
  acc.reset(g.clip());
  for (int64_t i = 0; i < X.size(0); ++i) acc.add(dense_update(X[i]), 1.0 + static_cast<double>(i));
  return flatten(g.finish(acc, 0, st));
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("rules: the built-in aggregators are registered with descriptions") {
  const std::vector<std::string> names = aggregator_names();
  for (const char* n : {"mean", "median", "trimmed_mean", "krum", "multikrum", "bulyan", "normclip"}) {
    CAPTURE(n);
    CHECK(std::find(names.begin(), names.end(), n) != names.end());
    CHECK(known_aggregator(n));
    CHECK_FALSE(aggregator_description(n).empty());
  }
  CHECK(std::is_sorted(names.begin(), names.end()));
  CHECK_FALSE(known_aggregator("average"));
  CHECK_FALSE(known_aggregator("krum:f=1"));  // a name, not a spec
  CHECK(RobustSpec::parse("median").method == "median");
  CHECK(RobustSpec().is_mean());
  CHECK(RobustSpec::parse("mean").is_mean());
  CHECK_FALSE(RobustSpec::parse("normclip:c=1").is_mean());
  CHECK(RobustSpec::parse("normclip:c=2").clip() == 2.0);
  CHECK(RobustSpec::parse("normclip:q=0.5").clip() == 0.0);
}

TEST_CASE("rules: an unknown aggregator names the known ones") {
  const std::string msg = message_of([] { RobustSpec::parse("average"); });
  CHECK(msg.find("aggregator: unknown method 'average'") == 0);
  for (const std::string& n : aggregator_names()) {
    CAPTURE(n);
    CHECK(msg.find(n) != std::string::npos);
  }
  CHECK_THROWS_AS(Aggregator("average", "none", 3, 0), ConfigError);
}

TEST_CASE("rules: an aggregator registered from outside runs through Accumulator and Aggregator") {
  register_first();
  CHECK(known_aggregator("first"));
  at::manual_seed(11);
  const at::Tensor X = at::randn({4, 10});

  SUBCASE("the registered rule decides the aggregate") {
    AggregateStats st;
    CHECK(at::equal(run("first", X, &st), X[0]));
    CHECK(st.kept == 1);
    CHECK(st.updates == 4);
    CHECK(at::allclose(run("first:index=2,scale=0.5", X), X[2] * 0.5));
    // Not the mean: the weights (1..4) would have moved it.
    CHECK_FALSE(at::allclose(run("mean", X), X[0]));
  }
  SUBCASE("shares merge before the rule sees the rows") {
    Aggregator g("first:index=1", "none", 4, 3);
    Accumulator a = g.make_accumulator(kShapes), b = g.make_accumulator(kShapes);
    a.reset(g.clip());
    b.reset(g.clip());
    a.add(dense_update(X[0]), 1.0);
    b.add(dense_update(X[1]), 1.0);
    a.merge(b);
    CHECK(at::equal(flatten(g.finish(a, 0)), X[1]));
    CHECK(a.buffered_bytes() == 2 * 10 * 4);  // a buffering rule keeps every row
  }
  SUBCASE("its keys are strict and its errors carry the key") {
    CHECK(RobustSpec::parse("first:index=3").min_updates() == 4);
    CHECK(RobustSpec::parse("first").buffers());
    CHECK(message_of([] { RobustSpec::parse("first:index=-1"); }) == "aggregator: first: index must be >= 0");
    CHECK_THROWS_AS(RobustSpec::parse("first:idx=1"), ConfigError);
    // Its own combination rules hold: central DP needs the plain mean.
    CHECK_THROWS_AS(
        check_combination(RobustSpec::parse("first"), DpSpec::parse("central:clip=1,noise=1"), "none", "fedavg"),
        ConfigError);
  }
  SUBCASE("the unknown-name message and the names list include it") {
    CHECK(message_of([] { RobustSpec::parse("average"); }).find("first") != std::string::npos);
    const std::vector<std::string> names = aggregator_names();
    CHECK(std::find(names.begin(), names.end(), "first") != names.end());
    CHECK(aggregator_description("first").find("test rule") != std::string::npos);
  }
  SUBCASE("a name is registered once; built-in names are taken") {
    const auto none = [](Spec&) { return std::make_shared<Pick>(0, 1.0); };
    CHECK_THROWS_AS(register_aggregator("first", none, ""), Error);
    CHECK_THROWS_AS(register_aggregator("median", none, ""), Error);
    CHECK(at::equal(run("first", X), X[0]));  // still the first registration
  }
}

TEST_CASE("rules: a rule's aggregate of the wrong size is an error, not a model") {
  static const bool done = [] {
    register_aggregator(
        "too_short", [](Spec&) { return std::make_shared<Short>(); }, "a broken test rule");
    return true;
  }();
  (void)done;
  CHECK_THROWS_AS(run("too_short", at::ones({2, 10})), Error);
}
