// federation/client_pipeline.h: the client's half of a round that sparrow-client
// and the simulator's clients share. Here its local DP and SecAgg+
// quantisation: the same input and key give the same bytes (so a simulated
// client and a device agree), other keys other noise, and the clip holds.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "federation/client_pipeline.h"
#include "secagg/secagg.h"

using namespace sparrow;

namespace {

using Weights = std::map<std::string, at::Tensor>;

// A small update: two tensors, values of both signs, not on any grid.
Weights update() {
  return {{"w", at::linspace(-0.9, 0.7, 12, at::kFloat).reshape({3, 4})}, {"b", at::tensor({0.31f, -0.27f, 0.05f})}};
}

Weights clone(const Weights& w) {
  Weights out;
  for (const auto& [n, t] : w) out[n] = t.clone();
  return out;
}

bool same_bytes(const Weights& a, const Weights& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [n, t] : a) {
    auto it = b.find(n);
    if (it == b.end()) return false;
    const at::Tensor x = t.contiguous(), y = it->second.contiguous();
    if (x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes()) return false;
    if (std::memcmp(x.data_ptr(), y.data_ptr(), static_cast<size_t>(x.nbytes())) != 0) return false;
  }
  return true;
}

double l2(const Weights& w) {
  double sq = 0;
  for (const auto& [n, t] : w) sq += t.to(at::kDouble).square().sum().item<double>();
  return std::sqrt(sq);
}

}  // namespace

TEST_CASE("client pipeline: local DP is a function of the update and the key") {
  const Weights in = update();
  const uint64_t key = federation::sim_local_dp_key(7, 3, 2);

  SUBCASE("same update, same key: the same bytes") {
    Weights a = clone(in), b = clone(in);
    federation::local_dp_update(a, 0.5, 1.0, key);
    federation::local_dp_update(b, 0.5, 1.0, key);
    CHECK(same_bytes(a, b));
    CHECK(!same_bytes(a, in));  // noise was added
  }
  SUBCASE("another client, another round or another seed: other noise") {
    Weights a = clone(in), b = clone(in), c = clone(in), d = clone(in);
    federation::local_dp_update(a, 0.5, 1.0, key);
    federation::local_dp_update(b, 0.5, 1.0, federation::sim_local_dp_key(7, 3, 5));
    federation::local_dp_update(c, 0.5, 1.0, federation::sim_local_dp_key(7, 4, 2));
    federation::local_dp_update(d, 0.5, 1.0, federation::sim_local_dp_key(8, 3, 2));
    CHECK(!same_bytes(a, b));
    CHECK(!same_bytes(a, c));
    CHECK(!same_bytes(a, d));
  }
  SUBCASE("the clip holds: without noise the update is scaled to norm clip, and the norm before is returned") {
    Weights a = clone(in);
    const double before = l2(in);
    REQUIRE(before > 0.5);
    const double norm = federation::local_dp_update(a, 0.5, 0.0, key);
    CHECK(norm == doctest::Approx(before).epsilon(1e-6));
    CHECK(l2(a) == doctest::Approx(0.5).epsilon(1e-5));
    // Only scaled: each tensor points the same way as before.
    for (const auto& [n, t] : in) CHECK(at::allclose(a.at(n), t * (0.5 / before), 1e-5, 1e-7));
    // An update inside the clip is left as it was.
    Weights small = clone(in);
    federation::local_dp_update(small, 100.0, 0.0, key);
    CHECK(same_bytes(small, in));
  }
  SUBCASE("the update becomes CPU float32") {
    Weights a = {{"w", at::ones({4}, at::kDouble)}};
    federation::local_dp_update(a, 10.0, 0.1, key);
    CHECK((a.at("w").scalar_type() == at::kFloat));
    CHECK(a.at("w").device().is_cpu());
  }
}

TEST_CASE("client pipeline: the simulator's keys are the streams every earlier run used") {
  // Results of existing runs depend on these derivations: pinned.
  const uint64_t seed = 11, t = 4;
  const int64_t c = 9;
  const uint64_t ckey = rng::derive(t, static_cast<uint64_t>(c));
  CHECK(federation::sim_local_dp_key(seed, t, c) == rng::derive(rng::derive(seed, 0x6c647020), ckey));
  CHECK(federation::sim_secagg_key(seed, t, c) == rng::derive(rng::derive(seed, 0x73656361), ckey));
  CHECK(federation::sim_local_dp_key(seed, t, c) != federation::sim_secagg_key(seed, t, c));
}

TEST_CASE("client pipeline: SecAgg+ quantisation") {
  const Weights in = update();
  const std::vector<std::string> names = {"w", "b"};  // model order, not the map's
  const double clip = 0.5, weight = 0.25;
  const double scale = secagg::ring_scale(4, clip);
  const uint64_t key = federation::sim_secagg_key(3, 0, 1);

  SUBCASE("tensors in names order, each rounded from derive(key, its offset)") {
    const federation::RingUpdate q = federation::quantise_update(names, in, weight, clip, scale, key);
    REQUIRE(q.x.size() == 15);
    std::vector<uint32_t> want(15);
    size_t clipped = 0;
    const at::Tensor w = in.at("w").contiguous(), b = in.at("b").contiguous();
    clipped += secagg::quantise(w.data_ptr<float>(), 12, weight, clip, scale, rng::derive(key, 0), want.data());
    clipped += secagg::quantise(b.data_ptr<float>(), 3, weight, clip, scale, rng::derive(key, 12), want.data() + 12);
    CHECK(q.x == want);
    CHECK(q.clipped == clipped);
  }
  SUBCASE("same input, same key: the same ring vector; another key: other rounding") {
    const auto a = federation::quantise_update(names, in, weight, clip, scale, key);
    const auto b = federation::quantise_update(names, in, weight, clip, scale, key);
    const auto c = federation::quantise_update(names, in, weight, clip, scale, federation::sim_secagg_key(3, 0, 2));
    CHECK(a.x == b.x);
    CHECK(a.x != c.x);
  }
  SUBCASE("the clip holds: coordinates beyond it are counted and clamped") {
    // linspace(-0.9, 0.7, 12): |v| > 0.5 for the first three and the last two.
    const auto q = federation::quantise_update(names, in, weight, clip, scale, key);
    CHECK(q.clipped == 5);
    std::vector<float> back(q.x.size());
    secagg::dequantise(q.x.data(), q.x.size(), scale, back.data());
    const at::Tensor flat = at::cat({in.at("w").flatten(), in.at("b")});
    for (size_t i = 0; i < back.size(); ++i) {
      const double v =
          std::max(-clip, std::min(clip, static_cast<double>(flat[static_cast<int64_t>(i)].item<float>())));
      CHECK(std::abs(back[i] - weight * v) <= 1.0 / scale + 1e-7);
    }
  }
  SUBCASE("an update that lacks a tensor of the model is an error") {
    CHECK_THROWS_AS(federation::quantise_update({"w", "missing"}, in, weight, clip, scale, key), Error);
  }
}
