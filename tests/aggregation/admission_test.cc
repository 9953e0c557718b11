// Admission by norm (StreamingAggregator::set_max_update_norm and the
// Accumulator on every path): an update whose decoded norm is beyond the bound,
// or whose low-rank product overflows float32, is refused and changes nothing.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cstring>
#include <limits>

#include "aggregation/aggregator.h"
#include "aggregation/robust.h"
#include "compression/compressor.h"
#include "compression/update_norm.h"
#include "core/error.h"

using namespace sparrow::aggregation;
using namespace sparrow::compression;

namespace {

const TensorShapes kShapes = {{"w", {6, 5}}, {"b", {5}}};

Encoded dense(const at::Tensor& t) {
  Encoded e;
  e.format = Format::kDense;
  e.shape = t.sizes().vec();
  e.value_type = ValueType::kF32;
  const at::Tensor c = t.contiguous();
  e.values.resize(static_cast<size_t>(c.numel()) * 4);
  std::memcpy(e.values.data(), c.data_ptr<float>(), e.values.size());
  return e;
}

Encoded lowrank(const at::Tensor& p, const at::Tensor& q) {
  Encoded e;
  e.format = Format::kLowRank;
  e.shape = {p.size(0), q.size(0)};
  e.value_type = ValueType::kF32;
  e.params = {static_cast<uint32_t>(p.size(0)), static_cast<uint32_t>(q.size(0)), static_cast<uint32_t>(p.size(1))};
  const at::Tensor both = at::cat({p.contiguous().reshape(-1), q.contiguous().reshape(-1)});
  e.values.resize(static_cast<size_t>(both.numel()) * 4);
  std::memcpy(e.values.data(), both.data_ptr<float>(), e.values.size());
  return e;
}

EncodedUpdate update_of(Encoded w, const at::Tensor& b) { return {{"w", std::move(w)}, {"b", dense(b)}}; }

}  // namespace

TEST_CASE("lowrank_norm equals the norm of the product without forming it, and sees an fp32 overflow") {
  at::manual_seed(3);
  const at::Tensor p = at::randn({7, 3}), q = at::randn({9, 3});
  CHECK(lowrank_norm(p, q) == doctest::Approx(p.mm(q.t()).norm().item<double>()).epsilon(1e-5));
  const at::Tensor big = at::full({4, 1}, 1e20f);
  CHECK(lowrank_norm(big, big) == doctest::Approx(4e40).epsilon(1e-6));  // > FLT_MAX, finite in double
  CHECK(decoded_norm(lowrank(p, q)) == doctest::Approx(p.mm(q.t()).norm().item<double>()).epsilon(1e-5));
  const at::Tensor d = at::randn({6, 5});
  CHECK(decoded_norm(dense(d)) == doctest::Approx(d.norm().item<double>()).epsilon(1e-5));
}

TEST_CASE("aggregator: finite low-rank factors whose product overflows are refused and change nothing") {
  StreamingAggregator agg(kShapes);
  const at::Tensor b = at::ones({5});
  agg.add(update_of(dense(at::ones({6, 5})), b), 2.0);
  const auto before = agg.mean();
  const at::Tensor p = at::full({6, 1}, 1e20f), q = at::full({5, 1}, 1e20f);
  CHECK_THROWS_AS(agg.add(update_of(lowrank(p, q), b), 1.0), sparrow::FormatError);
  CHECK(agg.count() == 1);
  CHECK(agg.total_weight() == 2.0);
  const auto after = agg.mean();
  for (const auto& [k, v] : before) CHECK(at::equal(v, after.at(k)));
}

TEST_CASE("aggregator: max_update_norm refuses a larger update on the streaming and the robust paths") {
  const at::Tensor b = at::zeros({5});
  const at::Tensor small = at::full({6, 5}, 0.1f);  // norm 0.548
  const at::Tensor large = at::full({6, 5}, 1.0f);  // norm 5.48
  SUBCASE("streaming mean") {
    StreamingAggregator agg(kShapes);
    agg.set_max_update_norm(1.0);
    agg.add(update_of(dense(small), b), 1.0);
    CHECK_THROWS_AS(agg.add(update_of(dense(large), b), 1.0), sparrow::FormatError);
    // A low-rank update is measured from its factors: rank 1, 6x5 of 2 * 2 (norm 21.9).
    CHECK_THROWS_AS(agg.add(update_of(lowrank(at::full({6, 1}, 2.f), at::full({5, 1}, 2.f)), b), 1.0),
                    sparrow::FormatError);
    CHECK(agg.count() == 1);
    CHECK(at::allclose(agg.mean().at("w"), small));
  }
  SUBCASE("every aggregator") {
    for (const char* spec : {"mean", "median", "trimmed_mean:beta=0.2", "normclip:c=10"}) {
      INFO(spec);
      Aggregator a(spec, "none", 3, 1);
      Accumulator acc = a.make_accumulator(kShapes);
      acc.set_max_update_norm(1.0);
      acc.reset(a.clip());
      acc.add(update_of(dense(small), b), 1.0);
      CHECK_THROWS_AS(acc.add(update_of(dense(large), b), 1.0), sparrow::FormatError);
      CHECK(acc.count() == 1);
    }
  }
}
