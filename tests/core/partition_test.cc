#include "tests/sparrow_test.h"

#include <cmath>
#include <set>

#include "core/error.h"
#include "core/partition.h"

using sparrow::ConfigError;
using sparrow::core::partition;
using Parts = std::vector<std::vector<int64_t>>;

namespace {

// Labels 0..classes-1, `per_class` of each, interleaved (label of i is i % classes).
at::Tensor labels(int64_t classes, int64_t per_class) { return at::arange(classes * per_class, at::kLong) % classes; }

// Every index in [0, n) exactly once, every client non-empty, lists sorted.
void check_is_partition(const Parts& parts, int64_t n, int clients) {
  REQUIRE(parts.size() == static_cast<size_t>(clients));
  std::vector<int> seen(n, 0);
  for (const auto& p : parts) {
    CHECK_FALSE(p.empty());
    CHECK(std::is_sorted(p.begin(), p.end()));
    for (int64_t i : p) {
      REQUIRE(i >= 0);
      REQUIRE(i < n);
      ++seen[i];
    }
  }
  for (int64_t i = 0; i < n; ++i) REQUIRE(seen[i] == 1);
}

// Mean number of distinct labels per client.
double mean_distinct_labels(const Parts& parts, const at::Tensor& y) {
  const int64_t* yp = y.data_ptr<int64_t>();
  double total = 0;
  for (const auto& p : parts) {
    std::set<int64_t> s;
    for (int64_t i : p) s.insert(yp[i]);
    total += static_cast<double>(s.size());
  }
  return total / static_cast<double>(parts.size());
}

}  // namespace

TEST_CASE("partition: every spec yields a deterministic partition") {
  const at::Tensor y = labels(10, 100);
  for (const char* spec : {"iid", "dirichlet:alpha=0.5", "dirichlet:alpha=100", "shards", "shards:per_client=3",
                           "quantity:alpha=1", "quantity:alpha=0.05"}) {
    CAPTURE(spec);
    const Parts a = partition(y, 20, spec, 11);
    check_is_partition(a, 1000, 20);
    CHECK(a == partition(y, 20, spec, 11));
    CHECK(a != partition(y, 20, spec, 12));
  }
}

TEST_CASE("partition: iid sizes differ by at most one") {
  const Parts p = partition(labels(10, 100), 7, "iid", 1);
  for (const auto& c : p) CHECK((c.size() == 142 || c.size() == 143));
  check_is_partition(partition(labels(3, 3), 9, "iid", 1), 9, 9);  // one sample each
}

TEST_CASE("partition: dirichlet label skew follows alpha") {
  const at::Tensor y = labels(10, 200);
  const double skewed = mean_distinct_labels(partition(y, 20, "dirichlet:alpha=0.1", 5), y);
  const double mild = mean_distinct_labels(partition(y, 20, "dirichlet:alpha=100", 5), y);
  CHECK(skewed < 5.0);
  CHECK(mild > 9.5);
  // FedML's min_size: every client ends with at least that many samples.
  const Parts p = partition(y, 20, "dirichlet:alpha=0.3,min_size=20", 5);
  check_is_partition(p, 2000, 20);
  for (const auto& c : p) CHECK(c.size() >= 20);
}

TEST_CASE("partition: shards give each client per_client labels") {
  // 10 labels x 100 samples, 10 clients x 2 shards of 50: each shard holds one label.
  const at::Tensor y = labels(10, 100);
  const Parts p = partition(y, 10, "shards", 3);
  const int64_t* yp = y.data_ptr<int64_t>();
  for (const auto& c : p) {
    CHECK(c.size() == 100);
    std::set<int64_t> s;
    for (int64_t i : c) s.insert(yp[i]);
    CHECK(s.size() <= 2);
  }
  // Sizes that do not divide evenly still use every index once.
  check_is_partition(partition(labels(7, 13), 6, "shards:per_client=2", 3), 91, 6);
}

TEST_CASE("partition: quantity skew varies sizes with alpha") {
  const at::Tensor y = labels(10, 100);
  auto size_spread = [&](const char* spec) {
    const Parts p = partition(y, 10, spec, 9);
    size_t lo = 1000, hi = 0;
    for (const auto& c : p) lo = std::min(lo, c.size()), hi = std::max(hi, c.size());
    return static_cast<double>(hi) / static_cast<double>(lo);
  };
  CHECK(size_spread("quantity:alpha=0.1") > 10);
  CHECK(size_spread("quantity:alpha=1000") < 1.5);
  // Many clients and a tiny alpha still give everyone a sample.
  check_is_partition(partition(y, 500, "quantity:alpha=0.01", 2), 1000, 500);
}

TEST_CASE("partition: bad specs and arguments are ConfigError") {
  const at::Tensor y = labels(10, 10);
  for (const char* spec :
       {"random", "iid:alpha=1", "dirichlet", "dirichlet:alpha=0", "dirichlet:alpha=-1", "dirichlet:alpha=1,beta=2",
        "dirichlet:alpha=abc", "shards:per_client=0", "shards:per_client=51", "shards:ratio=2", "quantity", ""}) {
    CAPTURE(spec);
    CHECK_THROWS_AS(partition(y, 2, spec, 0), ConfigError);
  }
  CHECK_THROWS_AS(partition(y, 0, "iid", 0), ConfigError);
  CHECK_THROWS_AS(partition(y, 101, "iid", 0), ConfigError);
  CHECK_THROWS_AS(partition(at::ones({4, 2}, at::kLong), 2, "iid", 0), ConfigError);
  CHECK_THROWS_AS(partition(at::ones({4}, at::kFloat), 2, "iid", 0), ConfigError);
  CHECK_THROWS_AS(partition(at::full({4}, -1, at::kLong), 2, "iid", 0), ConfigError);
}

TEST_CASE("partition: impossible dirichlet split is a clear error") {
  // 20 samples of 2 classes over 20 clients with alpha = 0.001: each class lands on
  // (almost) one client, so 18 clients stay empty on every try.
  try {
    partition(labels(2, 10), 20, "dirichlet:alpha=0.001", 0);
    FAIL("expected ConfigError");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("raise alpha") != std::string::npos);
  }
}

TEST_CASE("partition: gamma and dirichlet draws have the right moments") {
  for (double shape : {0.3, 1.0, 4.5}) {
    CAPTURE(shape);
    const int n = 20000;
    uint64_t counter = 0;
    double sum = 0, sq = 0;
    for (int i = 0; i < n; ++i) {
      const double g = sparrow::core::sample_gamma(shape, 77, counter);
      REQUIRE(g >= 0);
      sum += g;
      sq += g * g;
    }
    const double mean = sum / n, var = sq / n - mean * mean;
    CHECK(mean == doctest::Approx(shape).epsilon(0.05));  // Gamma(k, 1): mean k, variance k
    CHECK(var == doctest::Approx(shape).epsilon(0.1));
  }
  const std::vector<double> p = sparrow::core::sample_dirichlet(0.5, 8, 3);
  double total = 0;
  for (double v : p) total += v;
  CHECK(total == doctest::Approx(1.0));
  CHECK(p == sparrow::core::sample_dirichlet(0.5, 8, 3));
  uint64_t c = 0;
  CHECK_THROWS_AS(sparrow::core::sample_gamma(0, 1, c), ConfigError);
}
