#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "aggregation/aggregator.h"
#include "compression/codec_util.h"
#include "compression/compressor.h"
#include "compression/lowrank.h"
#include "core/error.h"

using namespace sparrow::aggregation;
using namespace sparrow::compression;

namespace {

const TensorShapes kModel = {{"conv", {16, 24}}, {"bias", {24}}, {"fc", {12, 10}}};

struct Client {
  std::map<std::string, at::Tensor> x;
  EncodedUpdate update;
  double weight;
};

// Encodes random per-tensor updates with `spec`; ctx.name = tensor name.
std::vector<Client> make_clients(const std::string& spec, int n, uint64_t seed) {
  at::manual_seed(seed);
  auto c = make_compressor(spec);
  std::vector<Client> out;
  for (int i = 0; i < n; ++i) {
    Client cl;
    cl.weight = 1.0 + 7.0 * i / n;
    for (const auto& [name, shape] : kModel) {
      at::Tensor x = at::randn(shape);
      State s;
      Context ctx;
      ctx.name = name;
      cl.x[name] = x;
      cl.update.emplace_back(name, c->encode(x, s, ctx));
    }
    out.push_back(std::move(cl));
  }
  return out;
}

// The contexts of a tcs share=mean round (seed 9, round 2), without a mask.
ContextMap share_contexts() {
  ContextMap ctxs;
  for (const auto& [name, shape] : kModel) {
    Context c;
    c.name = name;
    c.seed = 9;
    c.round = 2;
    c.share_mean = true;
    ctxs[name] = c;
  }
  return ctxs;
}

// Encodes random per-tensor updates with `codec` under `ctxs`; client i weighs 1 + i.
std::vector<Client> make_share_clients(const Compressor& codec, const ContextMap& ctxs, int n, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<Client> out;
  for (int i = 0; i < n; ++i) {
    Client cl;
    cl.weight = 1.0 + i;
    for (const auto& [name, shape] : kModel) {
      State st;
      cl.x[name] = at::randn(shape);
      cl.update.emplace_back(name, codec.encode(cl.x[name], st, ctxs.at(name)));
    }
    out.push_back(std::move(cl));
  }
  return out;
}

// Σ w·decode(e) / Σ w, the direct (dense) weighted average.
std::map<std::string, at::Tensor> direct_mean(const std::vector<Client>& clients) {
  std::map<std::string, at::Tensor> sum;
  double wsum = 0;
  for (const auto& [name, shape] : kModel) sum[name] = at::zeros(shape, at::kDouble);
  for (const auto& cl : clients) {
    for (const auto& [name, e] : cl.update) {
      Context ctx;
      ctx.name = name;
      sum[name] += decode(e, ctx).to(at::kDouble) * cl.weight;
    }
    wsum += cl.weight;
  }
  for (auto& [name, t] : sum) t = (t / wsum).to(at::kFloat);
  return sum;
}

void check_close(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
                 double tol = 1e-5) {
  REQUIRE(a.size() == b.size());
  for (const auto& entry : a) {
    const auto& name = entry.first;  // INFO's lambda cannot capture a structured binding (C++17)
    const auto& t = entry.second;
    REQUIRE(b.count(name));
    INFO("tensor " << name);
    CHECK(t.sizes() == b.at(name).sizes());
    CHECK(at::allclose(t, b.at(name), tol, tol));
  }
}

bool identical(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, t] : a) {
    if (!b.count(name) || !at::equal(t, b.at(name))) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("aggregator: streaming equals direct weighted average") {
  for (const char* spec : {"none", "fp16", "topk:ratio=0.1", "randomk:ratio=0.2", "qsgd:levels=16", "terngrad",
                           "powersgd:rank=2", "powersgd:rank=2,values=int8,sparse=0.05"}) {
    INFO("spec " << spec);
    auto clients = make_clients(spec, 5, 1);
    StreamingAggregator agg(kModel);
    for (const auto& cl : clients) agg.add(cl.update, cl.weight);
    CHECK(agg.count() == 5);
    double wsum = 0;
    for (const auto& cl : clients) wsum += cl.weight;
    CHECK(agg.total_weight() == doctest::Approx(wsum));
    check_close(agg.mean(), direct_mean(clients));
  }
}

TEST_CASE("aggregator: update order within an update does not matter") {
  auto clients = make_clients("topk:ratio=0.3", 3, 2);
  StreamingAggregator a(kModel), b(kModel);
  for (auto& cl : clients) {
    a.add(cl.update, cl.weight);
    EncodedUpdate rev(cl.update.rbegin(), cl.update.rend());
    b.add(rev, cl.weight);
  }
  CHECK(identical(a.mean(), b.mean()));
}

TEST_CASE("aggregator: partial then merge equals flat") {
  auto clients = make_clients("qsgd:levels=8", 7, 3);
  auto more = make_clients("powersgd:rank=2", 3, 4);
  clients.insert(clients.end(), more.begin(), more.end());
  StreamingAggregator flat(kModel);
  for (const auto& cl : clients) flat.add(cl.update, cl.weight);

  // Workers take 4, 0, 5 and 1 clients; the global merges them in a fixed order.
  const std::vector<size_t> split = {4, 0, 5, 1};
  StreamingAggregator global(kModel);
  size_t next = 0;
  for (size_t k : split) {
    StreamingAggregator worker(kModel);
    for (size_t i = 0; i < k; ++i, ++next) worker.add(clients[next].update, clients[next].weight);
    global.merge(worker);
  }
  REQUIRE(next == clients.size());
  CHECK(global.count() == flat.count());
  CHECK(global.total_weight() == doctest::Approx(flat.total_weight()));
  check_close(global.mean(), flat.mean());
  check_close(global.mean(), direct_mean(clients));

  // Two-level hierarchy: partials of partials.
  StreamingAggregator g1(kModel), g2(kModel), root(kModel);
  for (size_t i = 0; i < clients.size(); ++i) (i % 2 ? g1 : g2).add(clients[i].update, clients[i].weight);
  StreamingAggregator mid(kModel);
  mid.merge(g1);
  root.merge(mid);
  root.merge(g2);
  check_close(root.mean(), flat.mean());

  StreamingAggregator other({{"conv", {16, 24}}});
  CHECK_THROWS_AS(global.merge(other), sparrow::Error);
  StreamingAggregator other_shape({{"conv", {24, 16}}, {"bias", {24}}, {"fc", {12, 10}}});
  CHECK_THROWS_AS(global.merge(other_shape), sparrow::Error);
}

TEST_CASE("aggregator: rejected updates change nothing") {
  auto clients = make_clients("none", 2, 5);
  auto quant = make_clients("qsgd:levels=4", 1, 6);
  StreamingAggregator agg(kModel);
  agg.add(clients[0].update, 2.0);
  const auto before = agg.mean();
  const auto check_unchanged = [&] {
    CHECK(agg.count() == 1);
    CHECK(agg.total_weight() == 2.0);
    CHECK(identical(agg.mean(), before));
  };

  const EncodedUpdate good = clients[1].update;  // order: conv, bias, fc
  SUBCASE("bad weights") {
    for (double w : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity(), 1e300}) {
      CHECK_THROWS_AS(agg.add(good, w), sparrow::Error);
    }
  }
  SUBCASE("unknown tensor") {
    EncodedUpdate u = good;
    u.emplace_back("extra", u[1].second);
    CHECK_THROWS_AS(agg.add(u, 1.0), sparrow::FormatError);
  }
  SUBCASE("missing tensor") {
    EncodedUpdate u = good;
    u.pop_back();
    CHECK_THROWS_AS(agg.add(u, 1.0), sparrow::FormatError);
  }
  SUBCASE("duplicate tensor") {
    EncodedUpdate u = good;
    u.back() = u[0];
    CHECK_THROWS_AS(agg.add(u, 1.0), sparrow::FormatError);
  }
  SUBCASE("wrong shape, same numel") {
    EncodedUpdate u = good;
    u.back().second.shape = {10, 12};
    CHECK_THROWS_AS(agg.add(u, 1.0), sparrow::FormatError);
  }
  SUBCASE("malformed last tensor") {
    EncodedUpdate u = good;
    u.back().second.values.pop_back();
    CHECK_THROWS_AS(agg.add(u, 1.0), sparrow::FormatError);
  }
  SUBCASE("NaN value in the last tensor") {
    EncodedUpdate u = good;
    const float nan = std::nanf("");
    std::memcpy(u.back().second.values.data(), &nan, 4);
    CHECK_THROWS_AS(agg.add(u, 1.0), sparrow::FormatError);
  }
  SUBCASE("bit stream that fails while decoding") {
    // Dense tensors first, then a QSGD tensor whose Elias-gamma stream is all
    // zeros: a code that never ends, which only the decoder can see.
    EncodedUpdate u = good;
    Encoded q = quant[0].update.back().second;
    std::fill(q.values.begin(), q.values.end(), 0);
    u.back().second = q;
    CHECK_THROWS_AS(agg.add(u, 1.0), sparrow::FormatError);
  }
  SUBCASE("masked last tensor made for another mask") {
    // Two dense tensors are added before the masked one is reached; a mask of
    // another size must be refused before anything is added.
    auto tcs = sparrow::compression::make_compressor("tcs:ratio=0.1,extra=0.05,values=fp32");
    sparrow::compression::State st;
    sparrow::compression::Context made;
    made.name = "fc";
    at::Tensor mk = at::arange(0, 120, 10, at::TensorOptions().dtype(at::kLong));  // 12 positions
    made.mask = mk;
    EncodedUpdate u = good;
    u.back().second = tcs->encode(at::randn({12, 10}), st, made);
    sparrow::compression::Context other = made;
    other.mask = mk.narrow(0, 0, 11);
    CHECK_THROWS_AS(agg.add(u, 1.0, {{"fc", other}}), sparrow::FormatError);
    CHECK_THROWS_AS(agg.add(u, 1.0), sparrow::FormatError);  // no mask at all
  }
  check_unchanged();
  // And the aggregator still works.
  agg.add(good, 1.0);
  CHECK(agg.count() == 2);
}

TEST_CASE("aggregator: a failure midway through an update is rolled back") {
  auto clients = make_clients("topk:ratio=0.2", 1, 7);
  auto quant = make_clients("qsgd:levels=16", 2, 8);
  StreamingAggregator agg(kModel);
  agg.add(quant[0].update, 1.5);
  const auto before = agg.mean();
  // Mixed update: sparse (decode_add), QSGD (scratch) and dense tensors.
  EncodedUpdate u = clients[0].update;
  u[1] = quant[1].update[1];
  for (int after : {1, 2}) {
    sparrow::aggregation::detail::inject_add_failure_after(after);
    CHECK_THROWS_AS(agg.add(u, 3.0), std::runtime_error);
    CHECK(agg.count() == 1);
    CHECK(agg.total_weight() == 1.5);
    check_close(agg.mean(), before, 1e-6);
  }
  agg.add(u, 3.0);
  CHECK(agg.count() == 2);
  Client mixed{clients[0].x, u, 3.0};
  std::vector<Client> all = {quant[0], mixed};
  all[0].weight = 1.5;
  check_close(agg.mean(), direct_mean(all));
}

TEST_CASE("aggregator: a dense update into an all-zero sum is checked while written, exactly undone") {
  // conv and fc dense fp32 whose finiteness was not scanned yet (as the server
  // parses them), bias sparse: the dense ones take the fused fill.
  auto dense = make_clients("none", 3, 11);
  auto sparse = make_clients("topk:ratio=0.5", 1, 12);
  const auto unscanned = [](EncodedUpdate u) {  // writable bytes drop the scan memo
    for (auto& entry : u) (void)entry.second.values.data();
    return u;
  };
  const auto with_nan_in = [&](EncodedUpdate u, const std::string& name) {
    for (auto& [n, e] : u)
      if (n == name) {
        const float nan = std::nanf("");
        std::memcpy(e.values.data() + e.values.size() - 4, &nan, 4);  // the last value
      }
    return unscanned(u);
  };
  EncodedUpdate mixed = dense[0].update;
  for (auto& [n, e] : mixed)
    if (n == "bias") e = sparse[0].update[1].second;
  StreamingAggregator agg(kModel);
  SUBCASE("a NaN in the second dense tensor leaves every sum exactly zero") {
    CHECK_THROWS_AS(agg.add(with_nan_in(mixed, "fc"), 2.0), NonFiniteError);
    CHECK(agg.count() == 0);
    CHECK(agg.total_weight() == 0.0);
    agg.add(unscanned(dense[1].update), 1.0);  // then a good one: the mean is exactly its values
    for (const auto& [name, e] : dense[1].update) CHECK(at::equal(agg.mean().at(name), decode(e)));
  }
  SUBCASE("into a sum that holds an update: scanned first, the sum bit for bit unchanged") {
    agg.add(unscanned(mixed), 2.0);
    const auto before = agg.mean();
    CHECK_THROWS_AS(agg.add(with_nan_in(dense[1].update, "conv"), 1.0), NonFiniteError);
    CHECK(agg.count() == 1);
    CHECK(identical(agg.mean(), before));
  }
  SUBCASE("fill, add and reset give the same mean as adds into zeroed sums") {
    agg.add(unscanned(mixed), 2.0);
    agg.add(unscanned(dense[1].update), 1.5);
    agg.add(unscanned(dense[2].update), 0.5);
    std::vector<Client> all = {dense[0], dense[1], dense[2]};
    all[0].update = mixed;
    all[0].weight = 2.0;
    all[1].weight = 1.5;
    all[2].weight = 0.5;
    check_close(agg.mean(), direct_mean(all));
    agg.reset();
    CHECK(agg.count() == 0);
    agg.add(unscanned(dense[2].update), 3.0);  // a fill again after reset
    check_close(agg.mean(), direct_mean({dense[2]}));
  }
}

TEST_CASE("aggregator: ACP factors aggregate with the shared factor") {
  const TensorShapes model = {{"w", {16, 24}}, {"b", {24}}};
  const int64_t rank = 2;
  auto acp = make_compressor("acp:rank=2,ef=0");
  const LowRankDims d = lowrank_dims({16, 24}, rank);
  Context base;
  base.seed = 42;
  base.name = "w";
  at::Tensor shared = acp_initial_shared(base, d, 0);
  at::manual_seed(9);
  StreamingAggregator agg(model);
  for (int64_t round = 0; round < 3; ++round) {
    INFO("round " << round);
    agg.reset();
    ContextMap ctxs;
    ctxs["w"] = base;
    ctxs["w"].round = round;
    ctxs["w"].shared_factor = shared;
    at::Tensor expect = at::zeros({16, 24}, at::kDouble), expect_f = at::zeros(acp_sent_shape(d, round), at::kDouble);
    at::Tensor expect_b = at::zeros({24}, at::kDouble);
    double wsum = 0;
    for (int i = 0; i < 4; ++i) {
      const double w = 1.0 + i;
      EncodedUpdate u;
      for (const auto& [name, shape] : model) {
        State s;
        Context ctx = name == "w" ? ctxs["w"] : Context{};
        ctx.name = name;
        u.emplace_back(name, acp->encode(at::randn(shape), s, ctx));
      }
      CHECK(u[0].second.format == Format::kLowRankFactor);
      CHECK(u[1].second.format == Format::kDense);
      expect += decode(u[0].second, ctxs["w"]).to(at::kDouble) * w;
      expect_f += acp_factor(u[0].second).to(at::kDouble) * w;
      expect_b += decode(u[1].second).to(at::kDouble) * w;
      wsum += w;
      agg.add(u, w, ctxs);

      if (i == 0) {
        // Wrong round for the factor kind, and a different shared factor: rejected.
        ContextMap wrong = ctxs;
        wrong["w"].round = round + 1;
        CHECK_THROWS_AS(agg.add(u, 1.0, wrong), sparrow::FormatError);
        wrong = ctxs;
        wrong["w"].shared_factor = shared * 2;
        CHECK_THROWS_AS(agg.add(u, 1.0, wrong), sparrow::FormatError);
        wrong["w"].shared_factor = at::zeros({3, 3});
        CHECK_THROWS_AS(agg.add(u, 1.0, wrong), sparrow::FormatError);
        CHECK(agg.count() == 1);
      }
    }
    const auto mean = agg.mean();
    CHECK(at::allclose(mean.at("w"), (expect / wsum).to(at::kFloat), 1e-5, 1e-5));
    CHECK(at::allclose(mean.at("b"), (expect_b / wsum).to(at::kFloat), 1e-5, 1e-5));
    const at::Tensor fbar = agg.factor_mean("w");
    REQUIRE(fbar.defined());
    CHECK(at::allclose(fbar, (expect_f / wsum).to(at::kFloat), 1e-5, 1e-5));
    CHECK_FALSE(agg.factor_mean("b").defined());
    // The expansion equals acp_update of the mean factor.
    CHECK(at::allclose(mean.at("w"), acp_update(fbar, shared, round, {16, 24}), 1e-5, 1e-5));
    shared = acp_next_shared(fbar);
  }
}

TEST_CASE("aggregator: ACP without an explicit shared factor uses the seeded one") {
  const TensorShapes model = {{"w", {16, 24}}};
  auto acp = make_compressor("acp:rank=3,ef=0");
  Context ctx;
  ctx.name = "w";
  ctx.seed = 7;
  ctx.round = 0;
  at::manual_seed(10);
  StreamingAggregator a(model), b(model);
  ContextMap implicit = {{"w", ctx}};
  ContextMap explicit_ctx = implicit;
  explicit_ctx["w"].shared_factor = acp_initial_shared(ctx, lowrank_dims({16, 24}, 3), 0);
  for (int i = 0; i < 3; ++i) {
    State s;
    EncodedUpdate u = {{"w", acp->encode(at::randn({16, 24}), s, ctx)}};
    a.add(u, 1.0, implicit);
    b.add(u, 1.0, explicit_ctx);
  }
  CHECK(identical(a.mean(), b.mean()));
  // Partials of ACP factors merge; the merged mean equals either.
  StreamingAggregator g(model);
  g.merge(a);
  g.merge(b);
  check_close(g.mean(), a.mean());
  CHECK(g.count() == 6);
}

TEST_CASE("aggregator: construction, empty aggregate and reset") {
  CHECK_THROWS_AS(StreamingAggregator({{"a", {2}}, {"a", {3}}}), sparrow::Error);
  CHECK_THROWS_AS(StreamingAggregator({{"", {2}}}), sparrow::Error);
  StreamingAggregator agg(kModel);
  CHECK_THROWS_AS(agg.mean(), sparrow::Error);
  auto clients = make_clients("none", 1, 11);
  agg.add(clients[0].update, 4.0);
  check_close(agg.mean(), clients[0].x, 0.0);
  agg.reset();
  CHECK(agg.count() == 0);
  CHECK(agg.total_weight() == 0.0);
  CHECK_THROWS_AS(agg.mean(), sparrow::Error);
  StreamingAggregator empty(kModel);
  agg.add(clients[0].update, 1.0);
  agg.merge(empty);
  CHECK(agg.count() == 1);
  check_close(agg.mean(), clients[0].x, 0.0);
}

TEST_CASE("aggregator: a dense update that views a received frame is held, not copied, with the same results") {
  // As the server's workers hold updates: values are views into a frame that a
  // shared owner keeps alive, not yet scanned for finiteness.
  auto dense = make_clients("none", 3, 21);
  auto frame = std::make_shared<std::vector<uint8_t>>();
  std::vector<std::pair<size_t, size_t>> where;  // per client and tensor: offset, size
  for (const auto& cl : dense)
    for (const auto& [n, e] : cl.update) {
      where.emplace_back(frame->size(), e.values.size());
      frame->insert(frame->end(), e.values.begin(), e.values.end());
    }
  const auto views = [&](int client) {
    EncodedUpdate u = dense[static_cast<size_t>(client)].update;
    for (size_t t = 0; t < u.size(); ++t) {
      const auto [off, size] = where[static_cast<size_t>(client) * u.size() + t];
      u[t].second.values = Bytes::view(frame->data() + off, size, frame);
    }
    return u;
  };
  const auto owned = [&](int client) {  // the same values in writable bytes: copied, not held
    EncodedUpdate u = dense[static_cast<size_t>(client)].update;
    for (auto& entry : u) (void)entry.second.values.data();
    return u;
  };
  const long base = frame.use_count();
  StreamingAggregator held(kModel), copied(kModel);

  SUBCASE("one update: held (the frame stays alive), the mean bit for bit the written one's") {
    held.add(views(0), 2.0);
    CHECK(frame.use_count() == base + 3);  // conv, bias and fc each hold the frame
    copied.add(owned(0), 2.0);
    CHECK(identical(held.mean(), copied.mean()));
    held.reset();
    CHECK(frame.use_count() == base);
  }
  SUBCASE("a NaN in a held update's last tensor: rejected, nothing held") {
    EncodedUpdate u = views(0);
    auto bad = std::make_shared<std::vector<uint8_t>>(u.back().second.values.begin(), u.back().second.values.end());
    const float nan = std::nanf("");
    std::memcpy(bad->data() + 8, &nan, 4);
    u.back().second.values = Bytes::view(bad->data(), bad->size(), bad);
    CHECK_THROWS_AS(held.add(u, 2.0), NonFiniteError);
    CHECK(held.count() == 0);
    CHECK(frame.use_count() == base + 2);  // only `u` itself still views it (conv, bias)
    CHECK(bad.use_count() == 2);
    u.clear();
    CHECK(frame.use_count() == base);
    held.add(views(1), 1.0);
    copied.add(owned(1), 1.0);
    CHECK(identical(held.mean(), copied.mean()));
  }
  SUBCASE("a second dense update is written together with the held one: the sums of writing both") {
    held.add(views(0), 2.0);
    held.add(views(1), 1.5);
    CHECK(frame.use_count() == base);  // both written in one pass: nothing held
    copied.add(owned(0), 2.0);
    copied.add(owned(1), 1.5);
    check_close(held.mean(), copied.mean(), 1e-6);  // w1·a + w2·b, rounded once less or more
    held.add(views(2), 0.5);                        // and a third is added as before
    copied.add(owned(2), 0.5);
    check_close(held.mean(), copied.mean(), 1e-6);
  }
  SUBCASE("a NaN in the second update: rejected, the first still held, its mean bit for bit") {
    held.add(views(0), 2.0);
    const auto before = held.mean();
    EncodedUpdate u = owned(1);  // owned, unscanned: written with the held one in one pass
    const float nan = std::nanf("");
    std::memcpy(u.back().second.values.data() + 8, &nan, 4);
    CHECK_THROWS_AS(held.add(u, 1.5), NonFiniteError);
    CHECK(held.count() == 1);
    CHECK(frame.use_count() == base + 3);
    CHECK(identical(held.mean(), before));
  }
  SUBCASE("a failure while the second update is added: the first still held, nothing else changed") {
    held.add(views(0), 2.0);
    const auto before = held.mean();
    for (int after : {0, 1, 2}) {  // each of conv, bias, fc reached (3 tensors: never fire more)
      CAPTURE(after);
      sparrow::aggregation::detail::inject_add_failure_after(after);
      CHECK_THROWS_AS(held.add(views(1), 1.5), std::runtime_error);
      CHECK(held.count() == 1);
      CHECK(frame.use_count() == base + 3);
      CHECK(identical(held.mean(), before));
    }
    StreamingAggregator fresh(kModel);  // and on an empty one: nothing held after the failure
    sparrow::aggregation::detail::inject_add_failure_after(1);
    CHECK_THROWS_AS(fresh.add(views(0), 1.0), std::runtime_error);
    CHECK(fresh.count() == 0);
    CHECK(frame.use_count() == base + 3);  // `held`'s only
  }
  SUBCASE("an update rejected after the held one was written (phase 1): the same sums, accepted later") {
    auto sparse = make_clients("topk:ratio=0.5", 1, 23);
    held.add(views(0), 2.0);
    const auto before = held.mean();
    EncodedUpdate u = views(1);
    for (auto& [n, e] : u)
      if (n == "bias") e = sparse[0].update[1].second;  // bias sparse: the held bias is written first
    EncodedUpdate bad = u;
    bad.back().second.shape = {10, 12};  // fc: wrong shape, same numel
    CHECK_THROWS_AS(held.add(bad, 1.0), sparrow::FormatError);
    CHECK(held.count() == 1);
    CHECK(identical(held.mean(), before));
    held.add(u, 1.0);
    copied.add(owned(0), 2.0);
    EncodedUpdate uc = owned(1);
    for (auto& [n, e] : uc)
      if (n == "bias") e = sparse[0].update[1].second;
    copied.add(uc, 1.0);
    check_close(held.mean(), copied.mean(), 1e-6);
  }
  SUBCASE("a second update of another format writes the held one, then adds") {
    auto sparse = make_clients("topk:ratio=0.5", 1, 22);
    held.add(views(0), 2.0);
    held.add(sparse[0].update, 1.0);
    CHECK(frame.use_count() == base);
    copied.add(owned(0), 2.0);
    copied.add(sparse[0].update, 1.0);
    CHECK(identical(held.mean(), copied.mean()));
  }
  SUBCASE("merge: a held partial is shared by an empty aggregate, added into a filled one") {
    StreamingAggregator part(kModel), part_copied(kModel);
    part.add(views(2), 0.5);
    part_copied.add(owned(2), 0.5);
    StreamingAggregator empty_global(kModel);
    empty_global.merge(part);
    CHECK(frame.use_count() == base + 6);
    CHECK(identical(empty_global.mean(), part_copied.mean()));
    held.add(views(0), 2.0);
    held.merge(part);
    copied.add(owned(0), 2.0);
    copied.merge(part_copied);
    CHECK(identical(held.mean(), copied.mean()));
    std::vector<Client> all = {dense[0], dense[2]};
    all[0].weight = 2.0;
    all[1].weight = 0.5;
    check_close(held.mean(), direct_mean(all));
    part.reset();
    empty_global.reset();
    held.reset();
    CHECK(frame.use_count() == base);
  }
}

TEST_CASE("aggregator: tcs share=mean averages each mask position over the updates whose share carried it") {
  // Every third position of each tensor is on the mask; five clients send a
  // random 30% of it (fp32, unscaled) plus 5% of their own positions.
  ContextMap ctxs = share_contexts();
  for (const auto& [name, shape] : kModel) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    ctxs[name].mask = at::arange(0, n, 3, at::TensorOptions().dtype(at::kLong));
  }
  auto codec = make_compressor("tcs:ratio=0.3,extra=0.05,keep=0.3,share=mean,ef=0,values=fp32");
  const std::vector<Client> clients = make_share_clients(*codec, ctxs, 5, 17);
  // By hand: the per-position mean on carried mask positions, 0 on the mask
  // elsewhere, the plain weighted mean off the mask.
  std::map<std::string, at::Tensor> want;
  int64_t uncarried = 0, several = 0;
  for (const auto& [name, shape] : kModel) {
    const Context& c = ctxs.at(name);
    const int64_t n = c.mask.numel() * 3;
    at::Tensor sum = at::zeros({n}, at::kDouble), carried = at::zeros({n}, at::kDouble);
    double total = 0;
    for (const auto& cl : clients) {
      for (const auto& [nm, e] : cl.update) {
        if (nm != name) continue;
        sum += decode(e, c).reshape({-1}).to(at::kDouble) * cl.weight;
        const std::vector<int64_t> idx = sparrow::compression::detail::decode_masked_indices(e, c);
        for (uint64_t j = 0; j < e.params[3]; ++j) carried[idx[j]] += cl.weight;
      }
      total += cl.weight;
    }
    at::Tensor m = sum / total;
    const at::Tensor on = carried.gt(0);
    m = at::where(on, sum / carried.clamp_min(1e-30), m);
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    want[name] = m.narrow(0, 0, numel).reshape(shape).to(at::kFloat);
    // The test means something: some mask positions carried by several updates, some by none.
    const at::Tensor on_mask = carried.index({c.mask});
    uncarried += on_mask.eq(0).sum().item<int64_t>();
    several += on_mask.gt(6).sum().item<int64_t>();
  }
  CHECK(uncarried > 0);
  CHECK(several > 0);
  StreamingAggregator flat(kModel);
  for (const auto& cl : clients) flat.add(cl.update, cl.weight, ctxs);
  check_close(flat.mean(), want);
  // Without share_mean the same updates give the plain weighted mean.
  ContextMap plain = ctxs;
  for (auto& [name, c] : plain) c.share_mean = false;
  StreamingAggregator summed(kModel);
  for (const auto& cl : clients) summed.add(cl.update, cl.weight, plain);
  CHECK_FALSE(identical(summed.mean(), flat.mean()));
  // Partials merged equal the flat aggregate.
  StreamingAggregator a(kModel), b(kModel), merged(kModel);
  for (size_t i = 0; i < clients.size(); ++i) (i < 2 ? a : b).add(clients[i].update, clients[i].weight, ctxs);
  merged.merge(a);
  merged.merge(b);
  check_close(merged.mean(), flat.mean(), 1e-6);
  // A share taken over another mask of the same size is refused and changes nothing.
  const auto before = flat.mean();
  ContextMap other = ctxs;
  other.at("bias").mask = at::arange(1, 24, 3, at::TensorOptions().dtype(at::kLong));
  State st;
  EncodedUpdate u = clients[0].update;
  for (auto& [name, e] : u)
    if (name == "bias") e = codec->encode(at::randn({24}), st, other.at("bias"));
  CHECK_THROWS_AS(flat.add(u, 2.0, other), sparrow::FormatError);
  CHECK(flat.count() == 5);
  CHECK(identical(flat.mean(), before));
  // A failure half way through an update takes its share weights back out.
  for (int after : {1, 2}) {
    sparrow::aggregation::detail::inject_add_failure_after(after);
    CHECK_THROWS_AS(flat.add(clients[1].update, 4.0, ctxs), std::runtime_error);
    check_close(flat.mean(), before, 1e-6);
  }
  StreamingAggregator empty_share(kModel);
  empty_share.add(clients[0].update, 1.0, ctxs);
  empty_share.reset();
  empty_share.add(clients[1].update, 2.0, plain);  // reset() forgets the share weights
  StreamingAggregator only(kModel);
  only.add(clients[1].update, 2.0, plain);
  CHECK(identical(empty_share.mean(), only.mean()));
}

TEST_CASE("aggregator: tcs mask=all, share=mean averages every position over the updates that carried it") {
  // No mask in the contexts (the server broadcasts none for mask=all): each
  // update's share is a seeded 40% of all positions.
  const ContextMap ctxs = share_contexts();
  auto codec = make_compressor("tcs:mask=all,keep=0.4,share=mean,ef=0,values=fp32");
  CHECK(codec->mask_ratio() == 0.0);
  const std::vector<Client> clients = make_share_clients(*codec, ctxs, 4, 23);
  // By hand: per position, the weighted mean of the values of the updates
  // whose share holds it (the share is seeded_indices of all positions), 0 where none does.
  std::map<std::string, at::Tensor> want;
  int64_t uncarried = 0, several = 0;
  for (const auto& [name, shape] : kModel) {
    const at::Tensor proto = at::zeros(shape, at::kDouble);
    const int64_t n = proto.numel();
    at::Tensor sum = at::zeros({n}, at::kDouble), carried = at::zeros({n}, at::kDouble);
    for (const auto& cl : clients) {
      for (const auto& [nm, e] : cl.update) {
        if (nm != name) continue;
        REQUIRE(e.params.size() == 4);
        CHECK(e.params[1] == static_cast<uint32_t>(n));
        const at::Tensor x = cl.x.at(name).reshape({-1}).to(at::kDouble);
        for (const int64_t j : sparrow::compression::detail::seeded_indices(e.seed, e.params[3], n)) {
          sum[j] += x[j] * cl.weight;
          carried[j] += cl.weight;
        }
      }
    }
    want[name] = at::where(carried.gt(0), sum / carried.clamp_min(1e-30), at::zeros({n}, at::kDouble))
                     .reshape(shape)
                     .to(at::kFloat);
    uncarried += carried.eq(0).sum().item<int64_t>();
    several += carried.gt(4).sum().item<int64_t>();
  }
  CHECK(uncarried > 0);
  CHECK(several > 0);
  StreamingAggregator flat(kModel);
  for (const auto& cl : clients) flat.add(cl.update, cl.weight, ctxs);
  check_close(flat.mean(), want);
  // Partials merged equal the flat aggregate.
  StreamingAggregator a(kModel), b(kModel), merged(kModel);
  for (size_t i = 0; i < clients.size(); ++i) (i < 2 ? a : b).add(clients[i].update, clients[i].weight, ctxs);
  merged.merge(a);
  merged.merge(b);
  check_close(merged.mean(), flat.mean(), 1e-6);
  // A round with a step mask refuses a mask=all update (it was made for every position).
  ContextMap masked = ctxs;
  masked.at("bias").mask = at::arange(0, 24, 3, at::TensorOptions().dtype(at::kLong));
  StreamingAggregator refused(kModel);
  CHECK_THROWS_AS(refused.add(clients[0].update, 1.0, masked), sparrow::FormatError);
  CHECK(refused.count() == 0);
}
