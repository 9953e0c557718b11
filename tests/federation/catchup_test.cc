// federation/catchup.h: downlink catch-up for clients that missed rounds. A
// client that holds B_s and applies the plan, as the clients do (chain:
// decode_add in order; patch: wire::apply_patch; after a wire round trip),
// ends at B_t bit for bit, whatever the policy; auto is the smallest.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "aggregation/aggregator.h"
#include "compression/compressor.h"
#include "federation/catchup.h"
#include "federation/global_model.h"
#include "wire/wire.h"

using namespace sparrow;
using federation::CatchupPlan;
using federation::GlobalConfig;
using federation::GlobalModel;
using federation::Weights;

namespace {

constexpr uint16_t kMinor = wire::kProtocolMinor;  // a client of this build (packed tasks)

const std::vector<std::string> kNames = {"a", "b"};
const aggregation::TensorShapes kShapes = {{"a", {40, 30}}, {"b", {30}}};
constexpr int kRounds = 12;
constexpr uint64_t kMax = 4;  // chain:max / auto:max of the runs below

Weights initial() {
  at::manual_seed(7);
  return {{"a", at::randn({40, 30})}, {"b", at::randn({30})}};
}

Weights clone(const Weights& w) {
  Weights out;
  for (const auto& [n, v] : w) out[n] = v.clone();
  return out;
}

bool same_bits(const Weights& x, const Weights& y) {
  if (x.size() != y.size()) return false;
  for (const auto& [n, v] : x) {
    const at::Tensor& u = y.at(n);
    if (u.numel() != v.numel() || std::memcmp(u.data_ptr<float>(), v.data_ptr<float>(), 4 * v.numel()) != 0)
      return false;
  }
  return true;
}

// A run of kRounds steps with `policy`: B_0 .. B_kRounds, and each round's view.
struct Run {
  std::unique_ptr<GlobalModel> gm;
  std::vector<Weights> b;  // b[t] = B_t
  std::vector<std::shared_ptr<const federation::CatchupView>> views;
  explicit Run(const std::string& policy, const std::string& downlink = "topk:ratio=0.05") {
    GlobalConfig gc;
    gc.downlink = downlink;
    gc.downlink_catchup = policy;
    gm = std::make_unique<GlobalModel>(gc, initial(), kNames);
    b.push_back(clone(gm->broadcast()));
    views.push_back(gm->catchup_view(0));
    aggregation::Aggregator aggr("mean", "none", 1, 1);
    for (int r = 1; r <= kRounds; ++r) {
      aggregation::Accumulator acc = aggr.make_accumulator(kShapes);
      acc.reset(aggr.clip());
      at::manual_seed(100 + r);
      acc.add({{"a", compression::dense_encoded(at::randn({40, 30}) * 0.1)},
               {"b", compression::dense_encoded(at::randn({30}) * 0.1)}},
              1.0);
      REQUIRE(gm->step(aggr, acc, {}, static_cast<uint64_t>(r), 1.0).applied);
      b.push_back(clone(gm->broadcast()));
      views.push_back(gm->catchup_view(static_cast<uint64_t>(r)));
    }
  }
};

// The task a server builds from `p` for round t + 1, through the wire.
wire::Task task_of(const CatchupPlan& p, uint64_t t, const Weights& bt) {
  wire::Task task;
  task.round = t + 1;
  task.base_round = p.base;
  switch (p.kind) {
    case CatchupPlan::Kind::kFull:
      task.model_encoding = wire::ModelEncoding::kFull;
      for (const auto& n : kNames) task.weights.push_back({n, compression::dense_encoded(bt.at(n))});
      break;
    case CatchupPlan::Kind::kDelta:
      task.model_encoding = wire::ModelEncoding::kDelta;
      if (!p.chain.empty()) task.weights = p.chain.front()->tensors;
      break;
    case CatchupPlan::Kind::kChain:
      task.model_encoding = wire::ModelEncoding::kChain;
      for (const auto& st : p.chain) task.chain.push_back(st->tensors);
      break;
    case CatchupPlan::Kind::kPatch:
      task.model_encoding = wire::ModelEncoding::kPatch;
      task.weights = p.patch;
      break;
  }
  wire::Message m;
  m.body = task;
  return std::get<wire::Task>(wire::parse(wire::serialize(m)).body);
}

// What a client holding `held` makes of the task (both clients' rule).
Weights apply_task(const wire::Task& t, const Weights& held) {
  Weights w = clone(held);
  switch (t.model_encoding) {
    case wire::ModelEncoding::kFull:
      w.clear();
      for (const auto& nt : t.weights) w[nt.name] = compression::decode(nt.tensor).contiguous();
      break;
    case wire::ModelEncoding::kDelta:
      for (const auto& nt : t.weights) compression::decode_add(nt.tensor, w.at(nt.name), 1.0f);
      break;
    case wire::ModelEncoding::kChain:
      for (const auto& step : t.chain)
        for (const auto& nt : step) compression::decode_add(nt.tensor, w.at(nt.name), 1.0f);
      break;
    case wire::ModelEncoding::kPatch:
      for (const auto& nt : t.weights)
        wire::apply_patch(nt.tensor, w.at(nt.name).data_ptr<float>(), w.at(nt.name).numel());
      break;
  }
  return w;
}

}  // namespace

TEST_CASE("catch-up: the policy key") {
  CHECK(federation::parse_catchup("full").mode == federation::CatchupMode::kFull);
  CHECK(federation::parse_catchup("patch").mode == federation::CatchupMode::kPatch);
  CHECK(federation::parse_catchup("chain:max=8").max_steps == 8);
  CHECK(federation::parse_catchup("auto").max_steps == 256);
  CHECK(federation::parse_catchup(federation::kDefaultCatchup).mode == federation::CatchupMode::kAuto);
  CHECK_THROWS_AS(federation::parse_catchup("sketch"), ConfigError);
  CHECK_THROWS_AS(federation::parse_catchup("chain:max=1"), ConfigError);
  CHECK_THROWS_AS(federation::parse_catchup("patch:max=3"), ConfigError);
  CHECK_THROWS_AS(federation::parse_catchup("chain:k=3"), ConfigError);
  GlobalConfig gc;
  gc.downlink_catchup = "nope";
  CHECK_THROWS_AS(GlobalModel(gc, initial(), kNames), ConfigError);
}

TEST_CASE("catch-up: a client that missed 1, 3 or K+1 rounds ends at B_t bit for bit under every policy") {
  const std::string k = std::to_string(kMax);
  Run full("full"), chain("chain:max=" + k), patch("patch"), autop("auto:max=" + k);
  // The policy changes the bytes only, never the model.
  for (const Run* r : {&chain, &patch, &autop}) {
    CHECK(same_bits(r->gm->weights(), full.gm->weights()));
    CHECK(same_bits(r->b.back(), full.b.back()));
  }
  for (const uint64_t missed : {uint64_t{0}, uint64_t{1}, uint64_t{3}, kMax + 1}) {
    for (uint64_t t = missed + 1; t <= kRounds; ++t) {
      const uint64_t s = t - 1 - missed;
      CAPTURE(missed);
      CAPTURE(t);
      const uint64_t model = full.views[t]->full_bytes();
      for (const Run* r : {&full, &chain, &patch, &autop}) {
        const CatchupPlan p = r->views[t]->plan(s, wire::kProtocolMinor);
        const wire::Task task = task_of(p, t, r->b[t]);
        CHECK(same_bits(apply_task(task, r->b[s]), r->b[t]));
        CHECK(p.bytes <= model);
        if (missed == 0) CHECK(p.kind == CatchupPlan::Kind::kDelta);
      }
      const CatchupPlan c = chain.views[t]->plan(s, kMinor), q = patch.views[t]->plan(s, kMinor),
                        a = autop.views[t]->plan(s, kMinor), f = full.views[t]->plan(s, kMinor);
      if (missed >= 1) {
        CHECK(f.kind == CatchupPlan::Kind::kFull);
        // A chain spans at most K steps: missing K + 1 rounds is K + 2 steps away.
        if (missed + 1 > kMax) CHECK(c.kind == CatchupPlan::Kind::kFull);
        if (missed == 1 || missed == 3) CHECK(c.kind == CatchupPlan::Kind::kChain);
        CHECK(q.kind == CatchupPlan::Kind::kPatch);
        // auto: the smallest of the three.
        CHECK(a.bytes == std::min({c.bytes, q.bytes, f.bytes}));
        // An old client (protocol < 1.9) gets the dense model.
        CHECK(autop.views[t]->plan(s, static_cast<uint16_t>(wire::kCatchupMinor - 1)).kind == CatchupPlan::Kind::kFull);
      }
    }
  }
  // Nothing held, or a model newer than B_t: the dense model.
  CHECK(autop.views[5]->plan(std::nullopt, kMinor).kind == CatchupPlan::Kind::kFull);
  CHECK(autop.views[5]->plan(6, kMinor).kind == CatchupPlan::Kind::kFull);
  CHECK(autop.views[5]->plan(5, kMinor).bytes == 0);
}

TEST_CASE("catch-up: a snapshot keeps its round's sources while the model moves on") {
  Run r("auto");
  // views[3] was taken at B_3; steps 4.. changed the arrays since.
  const CatchupPlan p = r.views[3]->plan(1, kMinor);
  CHECK(same_bits(apply_task(task_of(p, 3, r.b[3]), r.b[1]), r.b[3]));
  const CatchupPlan q = r.views[3]->plan(0, kMinor);
  REQUIRE(q.kind != CatchupPlan::Kind::kFull);
  CHECK(same_bits(apply_task(task_of(q, 3, r.b[3]), r.b[0]), r.b[3]));
}

TEST_CASE("catch-up: after a restart nothing before it is known (the dense model), then the history grows again") {
  federation::CatchupHistory h(federation::parse_catchup("auto"), kNames, initial());
  // Restored at B_5: the view of round 5 knows nothing before it.
  const auto v5 = h.view(5, initial());
  CHECK(v5->plan(3, kMinor).kind == CatchupPlan::Kind::kFull);
  CHECK(v5->plan(4, kMinor).kind == CatchupPlan::Kind::kFull);  // C_5 is not in this history
  CHECK(v5->plan(5, kMinor).kind == CatchupPlan::Kind::kDelta);
  // Step 6 after the restart: B_5 and later are known again.
  const Weights b5 = initial();
  Weights b6 = clone(b5);
  b6.at("a").view(-1)[3] = 42.0f;
  h.begin_step(6);
  h.record_tensor(0, b5.at("a"), b6.at("a"));
  h.record_tensor(1, b5.at("b"), b6.at("b"));
  h.end_step({});
  const auto v6 = h.view(6, b6);
  CHECK(v6->plan(4, kMinor).kind == CatchupPlan::Kind::kFull);
  const CatchupPlan p = v6->plan(5, kMinor);
  CHECK(p.kind == CatchupPlan::Kind::kDelta);  // C_6 (empty here) applies to B_5
}

TEST_CASE("catch-up: without a downlink codec there is no catch-up view (a dense step changes every position)") {
  GlobalModel gm(GlobalConfig{}, initial(), kNames);
  CHECK(gm.catchup_view(0) == nullptr);
}

TEST_CASE("catch-up: the wire refuses malformed chains and patches, and apply_patch leaves the model as it was") {
  Run r("chain");
  const uint64_t t = 6;
  wire::Task chain = task_of(r.views[t]->plan(2, kMinor), t, r.b[t]);
  REQUIRE(chain.model_encoding == wire::ModelEncoding::kChain);
  auto reparse = [](const wire::Task& task) {
    wire::Message m;
    m.body = task;
    return wire::parse(wire::serialize(m));
  };
  SUBCASE("a chain one step short") {
    wire::Task bad = chain;
    bad.chain.pop_back();
    CHECK_THROWS_AS(reparse(bad), wire::ProtocolError);
  }
  SUBCASE("a chain with weights") {
    wire::Task bad = chain;
    bad.weights = chain.chain.front();
    CHECK_THROWS_AS(reparse(bad), wire::ProtocolError);
  }
  SUBCASE("a Delta with a chain") {
    wire::Task bad = chain;
    bad.model_encoding = wire::ModelEncoding::kDelta;
    CHECK_THROWS_AS(reparse(bad), wire::ProtocolError);
  }
  SUBCASE("a patch of sign values") {
    wire::Task bad = chain;
    bad.model_encoding = wire::ModelEncoding::kPatch;
    compression::State st;
    compression::Context ctx;
    ctx.name = "a";
    bad.weights.clear();
    bad.weights.push_back({"a", compression::make_compressor("stc:ratio=0.1")->encode(at::randn({40, 30}), st, ctx)});
    bad.chain.clear();
    CHECK_THROWS_AS(reparse(bad), wire::ProtocolError);
  }
  CHECK_NOTHROW(reparse(chain));
  // apply_patch: another tensor's size, or not a patch at all: an error, the model untouched.
  Weights w = clone(r.b[2]);
  compression::Encoded e = Run("patch").views[t]->plan(2, kMinor).patch.at(0).tensor;
  CHECK_THROWS_AS(wire::apply_patch(e, w.at("b").data_ptr<float>(), w.at("b").numel()), FormatError);
  compression::Encoded dense = compression::dense_encoded(w.at("a"));
  CHECK_THROWS_AS(wire::apply_patch(dense, w.at("a").data_ptr<float>(), w.at("a").numel()), FormatError);
  CHECK(same_bits(w, r.b[2]));
}

TEST_CASE("sparse model step: a move that rounds in fp32 is still broadcast exactly (B stays W)") {
  // 0.5 - 2^-25 has an odd last bit: + mu crosses into [0.5, 1), where the
  // sum rounds, so W - B is mu plus a rounding there and stc's one magnitude
  // cannot carry it; the tensor's C then goes as exact fp32 values.
  const float below_half = std::nextafter(0.5f, 0.0f);
  GlobalConfig gc;
  gc.downlink = "stc:ratio=1";
  gc.server_optimizer = "fedtopk:ratio=1,momentum=0,values=sign,scope=model";
  const Weights w0 = {{"a", at::tensor({below_half, 0.1f, -0.2f, 0.3f})}};
  GlobalModel gm(gc, clone(w0), {"a"});
  aggregation::Aggregator aggr("mean", "none", 1, 1);
  for (int r = 1; r <= 3; ++r) {
    aggregation::Accumulator acc = aggr.make_accumulator({{"a", {4}}});
    acc.reset(aggr.clip());
    acc.add({{"a", compression::dense_encoded(at::full({4}, 0.01f))}}, 1.0);
    const Weights b_before = clone(gm.broadcast());
    const federation::StepResult st = gm.step(aggr, acc, {}, static_cast<uint64_t>(r), 1.0);
    REQUIRE(st.applied);
    CAPTURE(r);
    CHECK(same_bits(gm.broadcast(), gm.weights()));
    // What a client adds to the B it holds is the server's B, bit for bit.
    Weights client = clone(b_before);
    for (const auto& [n, e] : st.downlink) compression::decode_add(e, client.at(n), 1.0f);
    CHECK(same_bits(client, gm.weights()));
  }
  CHECK(gm.weights().at("a")[0].item<float>() > 0.5f);
  CHECK(gm.exact_fallbacks() >= 1);  // round 1's crossing of 0.5 at least
}
