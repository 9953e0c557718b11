// federation/ordered_fold.h: a round's updates summed in canonical client
// order whatever order (and thread) they arrive from, early bad updates
// refused at once, the memory bound, and clients that will not send.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "aggregation/robust.h"
#include "core/error.h"
#include "compression/compressor.h"
#include "federation/ordered_fold.h"
#include "wire/wire.h"

using namespace sparrow;
using namespace sparrow::federation;

namespace {

using compression::dense_encoded;

const aggregation::TensorShapes kShapes = {{"w", {64}}, {"b", {3}}};

// Client i's update: values of very different magnitudes, so that float sums
// in another order differ in the last bits.
Arrival arrival(int i, bool bad = false) {
  at::Tensor w = at::randn({64}, at::TensorOptions().dtype(at::kFloat)) * std::pow(10.0, (i % 5) - 2);
  at::Tensor b = at::full({3}, 0.1f * static_cast<float>(i + 1));
  if (bad) w[5] = std::numeric_limits<float>::quiet_NaN();
  Arrival a;
  a.update = {{"w", dense_encoded(w)}, {"b", dense_encoded(b)}};
  a.weight = 10.0 + i;
  a.metrics["train_loss"] = 1.0 / (i + 1);
  return a;
}

std::vector<std::string> ids(int n) {
  std::vector<std::string> v;
  for (int i = 0; i < n; ++i) v.push_back(std::to_string(i));
  return v;
}

// The weighted mean's bytes.
std::string mean_bytes(aggregation::Aggregator& agg, const aggregation::Accumulator& acc) {
  std::string s;
  for (const auto& [n, t] : agg.finish(acc, 1)) s.append(static_cast<const char*>(t.data_ptr()), t.numel() * 4);
  return s;
}

}  // namespace

TEST_CASE("ordered fold: any arrival order and any threads give the bits of a fold in id order") {
  constexpr int kN = 12;
  at::manual_seed(3);
  std::vector<Arrival> ups;
  for (int i = 0; i < kN; ++i) ups.push_back(arrival(i));
  aggregation::Aggregator agg("mean", "none", kN, 1);
  // The reference: one accumulator, ids ascending. And the same in reverse,
  // which differs: the test can tell orders apart.
  auto plain = [&](std::vector<int> order) {
    aggregation::Accumulator a = agg.make_accumulator(kShapes);
    a.reset(0);
    for (int i : order) a.add(ups[static_cast<size_t>(i)].update, ups[static_cast<size_t>(i)].weight);
    return mean_bytes(agg, a);
  };
  std::vector<int> asc(kN);
  for (int i = 0; i < kN; ++i) asc[static_cast<size_t>(i)] = i;
  const std::string want = plain(asc);
  std::vector<int> desc(asc.rbegin(), asc.rend());
  CHECK(plain(desc) != want);

  OrderedFold fold(agg, kShapes, 3, int64_t{1} << 30);
  SUBCASE("reversed, one thread") {
    fold.open(ids(kN), {}, 0);
    for (int i : desc) fold.add(0, std::to_string(i), ups[static_cast<size_t>(i)]);
    CHECK(fold.held_peak() > 0);  // all but the last were early
  }
  SUBCASE("three threads, interleaved") {
    fold.open(ids(kN), {}, 0);
    std::vector<std::thread> th;
    for (size_t s = 0; s < 3; ++s)
      th.emplace_back([&, s] {
        for (int i = kN - 1 - static_cast<int>(s); i >= 0; i -= 3)
          fold.add(s, std::to_string(i), ups[static_cast<size_t>(i)]);
      });
    for (auto& t : th) t.join();
  }
  fold.close();
  CHECK_FALSE(fold.relaxed());
  CHECK(fold.sum().count() == kN);
  CHECK(mean_bytes(agg, fold.sum()) == want);
  double w = 0, loss = 0;
  for (int i = 0; i < kN; ++i) {
    w += 10.0 + i;
    loss += (10.0 + i) / (i + 1);
  }
  CHECK(fold.metric_weight().at("train_loss") == doctest::Approx(w));
  CHECK(fold.metric_sum().at("train_loss") == doctest::Approx(loss));
}

TEST_CASE("ordered fold: an early bad update is refused when it comes, and a good one may follow") {
  at::manual_seed(4);
  aggregation::Aggregator agg("mean", "none", 3, 1);
  OrderedFold fold(agg, kShapes, 1, int64_t{1} << 30);
  fold.open(ids(3), {}, 0);
  CHECK_THROWS_AS(fold.add(0, "2", arrival(2, /*bad=*/true)), FormatError);  // early and bad: refused now
  CHECK(fold.held_peak() == 0);
  fold.add(0, "2", arrival(2));
  CHECK_THROWS_AS(fold.add(0, "2", arrival(2)), Error);  // once a round
  CHECK_THROWS_AS(fold.add(0, "7", arrival(7)), Error);  // not in the round
  fold.add(0, "0", arrival(0));
  CHECK(fold.sum().count() == 1);  // 2 waits for 1
  fold.skip("1");                  // 1 will not send: 2 is folded now
  CHECK(fold.sum().count() == 2);
  fold.close();
  CHECK(fold.sum().total_weight() == doctest::Approx(10.0 + 12.0));
}

TEST_CASE("ordered fold: past the budget the round goes on in arrival order, every update summed") {
  at::manual_seed(5);
  aggregation::Aggregator agg("mean", "none", 4, 1);
  int64_t one = 0;  // a held update's bytes: one fits, two do not
  for (const auto& [n, e] : arrival(0).update) one += static_cast<int64_t>(wire::encoded_size(e, n));
  OrderedFold fold(agg, kShapes, 1, one * 3 / 2);
  fold.open(ids(4), {}, 0);
  fold.add(0, "3", arrival(3));
  CHECK_FALSE(fold.relaxed());
  fold.add(0, "2", arrival(2));
  CHECK(fold.relaxed());
  CHECK(fold.sum().count() == 2);  // flushed
  fold.add(0, "1", arrival(1));    // folded at once
  CHECK(fold.sum().count() == 3);
  fold.close();
  CHECK(fold.sum().count() == 3);
  // A new round starts ordered again.
  fold.open(ids(2), {}, 0);
  CHECK_FALSE(fold.relaxed());
  CHECK(fold.sum().count() == 0);
}

TEST_CASE("ordered fold: a budget of 0 sums in arrival order") {
  at::manual_seed(6);
  aggregation::Aggregator agg("mean", "none", 2, 1);
  OrderedFold fold(agg, kShapes, 1, 0);
  fold.open(ids(2), {}, 0);
  fold.add(0, "1", arrival(1));
  CHECK(fold.sum().count() == 1);
  CHECK(fold.held_peak() == 0);
}
