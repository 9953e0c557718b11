#include "tests/sparrow_test.h"

#include <sys/stat.h>

#include <cmath>

#include "core/datasets.h"
#include "core/error.h"

using sparrow::ConfigError;
using sparrow::core::Dataset;
using sparrow::core::make_synthetic;

namespace {

// Variance across clients of each client's mean feature value.
double spread_of_client_means(const sparrow::core::FederatedData& d) {
  std::vector<double> m;
  for (const auto& c : d.train) m.push_back(c.x.mean().item<double>());
  double mean = 0, var = 0;
  for (double v : m) mean += v / m.size();
  for (double v : m) var += (v - mean) * (v - mean) / m.size();
  return var;
}

}  // namespace

TEST_CASE("datasets: synthetic shapes and splits") {
  const auto d = make_synthetic(0.5, 0.5, 12, 7);
  REQUIRE(d.train.size() == 12);
  REQUIRE(d.test.size() == 12);
  bool sizes_differ = false;
  for (int k = 0; k < 12; ++k) {
    const Dataset& tr = d.train[k];
    const Dataset& te = d.test[k];
    CHECK(tr.x.dtype() == at::kFloat);
    CHECK(tr.y.dtype() == at::kLong);
    CHECK(tr.x.size(1) == 60);
    CHECK(tr.x.size(0) == tr.y.size(0));
    CHECK(te.x.size(0) == te.y.size(0));
    const int64_t n = tr.size() + te.size();
    CHECK(n >= 50);
    CHECK(n <= 1000);
    CHECK(tr.size() == std::llround(0.8 * n));
    CHECK(tr.y.min().item<int64_t>() >= 0);
    CHECK(tr.y.max().item<int64_t>() < 10);
    CHECK(std::isfinite(tr.x.sum().item<double>()));
    sizes_differ = sizes_differ || n != d.train[0].size() + d.test[0].size();
  }
  CHECK(sizes_differ);  // lognormal counts, not a constant
}

TEST_CASE("datasets: synthetic is deterministic per seed and per client") {
  const auto a = make_synthetic(1, 1, 5, 42);
  const auto b = make_synthetic(1, 1, 8, 42);  // more clients: the first five are unchanged
  const auto c = make_synthetic(1, 1, 5, 43);
  for (int k = 0; k < 5; ++k) {
    CHECK(at::equal(a.train[k].x, b.train[k].x));
    CHECK(at::equal(a.train[k].y, b.train[k].y));
    CHECK(at::equal(a.test[k].x, b.test[k].x));
  }
  CHECK_FALSE((a.train[0].x.sizes() == c.train[0].x.sizes() && at::equal(a.train[0].x, c.train[0].x)));
}

TEST_CASE("datasets: synthetic heterogeneity grows with beta") {
  // Client feature means v_k ~ N(B_k, 1) with B_k ~ N(0, beta^2): across clients the
  // mean feature varies like beta^2 + 1/60, about 1/60 for beta = 0.
  const double homogeneous = spread_of_client_means(make_synthetic(0, 0, 40, 1));
  const double heterogeneous = spread_of_client_means(make_synthetic(1, 1, 40, 1));
  CHECK(homogeneous < 0.1);
  CHECK(heterogeneous > 0.3);
  CHECK(heterogeneous > 5 * homogeneous);
}

TEST_CASE("datasets: synthetic labels follow the client model") {
  // Labels are argmax of a linear model: a class should not dominate everywhere,
  // and more than one class should appear over all clients.
  const auto d = make_synthetic(0, 0, 10, 3);
  at::Tensor all = at::cat({d.train[0].y, d.train[1].y, d.train[2].y, d.train[3].y});
  CHECK(std::get<0>(at::_unique(all)).size(0) >= 3);
}

TEST_CASE("datasets: synthetic rejects bad arguments") {
  CHECK_THROWS_AS(make_synthetic(1, 1, 0, 1), ConfigError);
  CHECK_THROWS_AS(make_synthetic(-1, 1, 3, 1), ConfigError);
  CHECK_THROWS_AS(make_synthetic(1, NAN, 3, 1), ConfigError);
  sparrow::core::SyntheticOptions o;
  o.train_fraction = 1.0;
  CHECK_THROWS_AS(make_synthetic(1, 1, 3, 1, o), ConfigError);
  o = {};
  o.max_samples = 10;
  CHECK_THROWS_AS(make_synthetic(1, 1, 3, 1, o), ConfigError);
}

TEST_CASE("datasets: select rows") {
  Dataset d{at::arange(12, at::kFloat).reshape({6, 2}), at::arange(6, at::kLong)};
  Dataset s = sparrow::core::select(d, {4, 1});
  CHECK(s.size() == 2);
  CHECK(s.y[0].item<int64_t>() == 4);
  CHECK(s.x[1][1].item<float>() == 3.0f);
  CHECK_THROWS_AS(sparrow::core::select(d, {6}), ConfigError);
  CHECK_THROWS_AS(sparrow::core::select(d, {-1}), ConfigError);
}

TEST_CASE("datasets: Fashion-MNIST test split") {
  struct stat st;
  if (::stat(sparrow::core::kFashionMnistDir, &st) != 0) {
    MESSAGE("dataset-fashion-mnist not installed; skipped");
    return;
  }
  Dataset d = sparrow::core::load_fashion_mnist(sparrow::core::kFashionMnistDir, "test");
  CHECK(d.x.sizes() == at::IntArrayRef({10000, 1, 28, 28}));
  CHECK(d.x.dtype() == at::kFloat);
  CHECK(d.y.dtype() == at::kLong);
  CHECK(d.size() == 10000);
  CHECK(at::bincount(d.y).min().item<int64_t>() == 1000);  // balanced test set
  CHECK_THROWS_AS(sparrow::core::load_fashion_mnist("/nonexistent-fmnist", "test"), ConfigError);
  CHECK_THROWS_AS(sparrow::core::load_fashion_mnist(sparrow::core::kFashionMnistDir, "valid"), ConfigError);
}
