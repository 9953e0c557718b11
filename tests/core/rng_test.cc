#include "tests/sparrow_test.h"

#include <cmath>

#include "core/rng.h"

namespace rng = sparrow::rng;

TEST_CASE("rng: counter based and deterministic") {
  CHECK(rng::at(1, 5) == rng::at(1, 5));
  CHECK(rng::at(1, 5) != rng::at(2, 5));
  CHECK(rng::at(1, 5) != rng::at(1, 6));
  CHECK(rng::derive(7, 1) != rng::derive(7, 2));
  CHECK(rng::hash_name("layer.weight") != rng::hash_name("layer.bias"));
}

TEST_CASE("rng: uniform and normal moments") {
  const int n = 200000;
  double su = 0, su2 = 0, sn = 0, sn2 = 0;
  for (int i = 0; i < n; ++i) {
    const double u = rng::uniform01(42, static_cast<uint64_t>(i));
    CHECK_UNARY(u >= 0.0);
    CHECK_UNARY(u < 1.0);
    su += u;
    su2 += u * u;
    const double z = rng::normal(43, static_cast<uint64_t>(i));
    sn += z;
    sn2 += z * z;
  }
  CHECK(su / n == doctest::Approx(0.5).epsilon(0.01));
  CHECK(su2 / n - (su / n) * (su / n) == doctest::Approx(1.0 / 12).epsilon(0.02));
  CHECK(std::abs(sn / n) < 0.01);
  CHECK(sn2 / n == doctest::Approx(1.0).epsilon(0.02));
  rng::Stream s(9);
  for (int i = 0; i < 1000; ++i) CHECK(s.below(10) < 10u);
}
