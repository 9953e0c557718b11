// ACP-SGD without LibTorch (flat::make_codec("acp:..."), the lite client's)
// against the LibTorch codec: the same Encoded byte for byte and the same state
// over P rounds and Q rounds, against the seeded initial factor and against
// shared factors as an aggregator makes them, with and without error feedback,
// its ageing and each factor type; the same errors; flat::decode_add of
// kLowRankFactor against compression::decode_add. Both codecs run one kernel
// (acp_cpu.cc), so a reference written out over at::Tensor, the steps the
// LibTorch codec took before it ran that kernel, checks that the bytes did
// not change.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "compression/codec_bits.h"
#include "compression/codec_util.h"
#include "compression/compressor.h"
#include "compression/flat_codec.h"
#include "compression/lowrank.h"
#include "core/error.h"
#include "tests/compression/flat_test_util.h"

using namespace sparrow::compression;
namespace fl = sparrow::compression::flat;
namespace cd = sparrow::compression::detail;
using namespace sparrow::compression::flat_test;

namespace {

fl::Tensor flat_of(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  fl::Tensor f;
  f.shape = sizes_of(c);
  f.data.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  return f;
}

struct Contexts {
  Context torch;
  fl::Context flat;
};

// The contexts of one tensor in `round`, with `shared` as its shared factor
// (undefined: none, both derive the seeded one).
Contexts contexts(int64_t round, const at::Tensor& shared) {
  Contexts c;
  c.torch.name = c.flat.name = "fc.weight";
  c.torch.seed = c.flat.seed = 31;
  c.torch.round = c.flat.round = round;
  if (shared.defined()) {
    c.torch.shared_factor = shared;
    c.flat.has_shared_factor = true;
    c.flat.shared_factor = flat_of(shared);
  }
  return c;
}

// ACP's encode as the LibTorch codec wrote it before the kernel (acp.cc up to
// this change): the reference the kernel's bytes and state must equal.
Encoded reference_encode(const at::Tensor& x_in, State& state, const Context& ctx, int64_t rank, bool ef,
                         const cd::StalePolicy& stale, ValueType vt) {
  const at::Tensor x = cd::as_input(x_in, "acp");
  Encoded e;
  e.shape = cd::shape_of(x);
  const int64_t round = ctx.round >= 0 ? ctx.round : static_cast<int64_t>(state.step);
  if (!lowrank_compressible(e.shape, rank)) {
    ++state.step;
    e.format = Format::kDense;
    cd::pack_values(x.data_ptr<float>(), static_cast<uint64_t>(x.numel()), ValueType::kF32, e.values);
    return e;
  }
  const LowRankDims d = lowrank_dims(e.shape, rank);
  const int64_t n = d.rows, m = d.cols, r = d.rank;
  const int which = (round & 1) ? 1 : 0;
  const at::Tensor s =
      ctx.shared_factor.defined() ? ctx.shared_factor.contiguous() : acp_initial_factor(ctx, n, m, r, 1 - which);
  if (ef) cd::age_state(state, ctx, stale, {"residual"});
  const float* xp = x.data_ptr<float>();
  float* res = ef ? cd::residual_data(state, x) : nullptr;
  at::Tensor f = at::empty({which == 0 ? n : m, r});
  if (which == 0)
    cd::skinny_mm(ef ? res : xp, ef ? xp : nullptr, res, n, m, s.data_ptr<float>(), r, f.data_ptr<float>());
  else
    cd::skinny_mm_t(ef ? res : xp, ef ? xp : nullptr, res, n, m, s.data_ptr<float>(), r, f.data_ptr<float>());
  e.format = Format::kLowRankFactor;
  e.value_type = vt;
  e.params = {static_cast<uint32_t>(n), static_cast<uint32_t>(m), static_cast<uint32_t>(r),
              static_cast<uint32_t>(which)};
  cd::pack_factor(f, vt, e);
  if (ef) {
    if (which == 0)
      cd::rank_update(res, n, m, f.data_ptr<float>(), s.data_ptr<float>(), r, -1.0f);
    else
      cd::rank_update(res, n, m, s.data_ptr<float>(), f.data_ptr<float>(), r, -1.0f);
  }
  ++state.step;
  return e;
}

struct RefSpec {
  int64_t rank;
  bool ef;
  cd::StalePolicy stale;
  ValueType vt;
};

// The shared factor an aggregator broadcasts for `round` of a tensor of this
// shape: none (the seeded one) in round 0 and in every third round, else the
// orthonormalised mean of a random factor, as acp_next_shared makes it.
at::Tensor shared_for_round(const std::vector<int64_t>& shape, int64_t rank, int64_t round) {
  if (!lowrank_compressible(shape, rank) || round <= 0 || round % 3 == 0) return {};
  const LowRankDims d = lowrank_dims(shape, rank);
  return acp_next_shared(at::randn(acp_shared_shape(d, round)));
}

// One step on the three sides: the inputs of step s are random, of
// alternating scale, all zero at step 3.
void step_all(Compressor& tc, fl::Codec& fc, const RefSpec& ref, State& ts, fl::State& fs, State& rs,
              const std::vector<int64_t>& shape, size_t s, int64_t round) {
  INFO("step " << s << ", round " << round);
  at::Tensor x = at::randn(shape) * (s % 2 ? 0.01 : 3.0);
  if (s == 3) x.zero_();
  const Contexts c = contexts(round, shared_for_round(shape, ref.rank, round));
  Encoded te, fe, re;
  const std::string terr = error_of([&] { te = tc.encode(x, ts, c.torch); });
  const std::string ferr = error_of([&] { fe = fc.encode(x.data_ptr<float>(), shape, fs, c.flat); });
  const std::string rerr =
      error_of([&] { re = reference_encode(x, rs, c.torch, ref.rank, ref.ef, ref.stale, ref.vt); });
  CHECK(terr.empty());
  CHECK(terr == ferr);
  CHECK(terr == rerr);
  if (!terr.empty()) return;
  check_same(te, fe);
  check_same(te, re);
  CHECK(te.format == (lowrank_compressible(shape, ref.rank) ? Format::kLowRankFactor : Format::kDense));
  if (te.format == Format::kLowRankFactor) {
    const int64_t which = round >= 0 ? (round & 1) : static_cast<int64_t>((ts.step - 1) & 1);
    CHECK(te.params[3] == static_cast<uint32_t>(which));
  }
  check_same(ts, fs);
  check_same(rs, fs);
  // The decoded update, against the same shared factor on both sides.
  const int64_t n = te.numel();
  at::Tensor torch_out = at::zeros({n});
  std::vector<float> flat_out(static_cast<size_t>(n), 0.0f);
  decode_add(te, torch_out, 0.5f, c.torch);
  fl::decode_add(fe, flat_out.data(), n, 0.5f, c.flat);
  CHECK(std::memcmp(torch_out.data_ptr<float>(), flat_out.data(), static_cast<size_t>(n) * sizeof(float)) == 0);
}

void run_all(const std::string& spec, const RefSpec& ref, const std::vector<std::vector<int64_t>>& shapes,
             const std::vector<int64_t>& rounds) {
  INFO("spec " << spec);
  auto tc = make_compressor(spec);
  auto fc = fl::make_codec(spec);
  CHECK(fc->method() == "acp");
  CHECK(tc->method() == "acp");
  at::manual_seed(static_cast<uint64_t>(std::hash<std::string>()(spec) % 1000));
  for (const auto& shape : shapes) {
    INFO("shape of " << shape.size() << " dims, " << cd::numel_of(shape) << " values");
    State ts, rs;
    fl::State fs;
    for (size_t s = 0; s < rounds.size(); ++s) step_all(*tc, *fc, ref, ts, fs, rs, shape, s, rounds[s]);
    // The state bytes of one read by the other: each carries on from the other's.
    State ts2 = State::deserialize(fs.serialize());
    fl::State fs2 = fl::State::deserialize(ts.serialize());
    State rs2 = State::deserialize(ts.serialize());
    for (size_t s = 0; s < 2; ++s) step_all(*tc, *fc, ref, ts2, fs2, rs2, shape, s + 10, 20 + static_cast<int64_t>(s));
  }
}

cd::StalePolicy stale(double decay, int64_t max_age) {
  cd::StalePolicy p;
  p.decay = decay;
  p.max_age = max_age;
  return p;
}

}  // namespace

TEST_CASE("flat acp: same bytes, decodes and states as the LibTorch codec over P and Q rounds") {
  // 2-D, a 4-D conv weight, a tall and a wide matrix, a matrix too small for
  // rank 4 and a 1-D bias (both dense).
  const std::vector<std::vector<int64_t>> shapes = {{40, 50}, {16, 3, 5, 5}, {600, 3}, {3, 700}, {10, 10}, {300}};
  // Consecutive rounds (P, Q, P, ...), gaps of one and of several rounds (two
  // Q rounds in a row: 5 then 7), and a run without rounds (State::step's parity).
  const std::vector<int64_t> with_gaps = {0, 1, 2, 3, 5, 7, 8, 12, 13};
  const std::vector<int64_t> no_rounds = {-1, -1, -1, -1, -1};
  const cd::StalePolicy keep;
  struct Case {
    const char* spec;
    RefSpec ref;
  };
  for (const Case& k : {
           Case{"acp:rank=1", {1, true, keep, ValueType::kF32}},
           Case{"acp:rank=2", {2, true, keep, ValueType::kF32}},
           Case{"acp:rank=4", {4, true, keep, ValueType::kF32}},
           Case{"acp:rank=3,values=fp16", {3, true, keep, ValueType::kF16}},
           Case{"acp:rank=2,values=bf16", {2, true, keep, ValueType::kBF16}},
           Case{"acp:rank=2,values=int8", {2, true, keep, ValueType::kInt8}},
           Case{"acp:rank=2,ef=0", {2, false, keep, ValueType::kF32}},
           Case{"acp:rank=3,ef=0,values=int8", {3, false, keep, ValueType::kInt8}},
           Case{"acp:rank=2,decay=0.5", {2, true, stale(0.5, 0), ValueType::kF32}},
           Case{"acp:rank=2,decay=0.9,max_age=2", {2, true, stale(0.9, 2), ValueType::kF32}},
           Case{"acp:rank=1,max_age=1,values=fp16", {1, true, stale(1.0, 1), ValueType::kF16}},
       }) {
    run_all(k.spec, k.ref, shapes, with_gaps);
    run_all(k.spec, k.ref, {{40, 50}, {7}}, no_rounds);
  }
}

TEST_CASE("flat acp: a changed shape resets the residual on both sides") {
  auto tc = make_compressor("acp:rank=2");
  auto fc = fl::make_codec("acp:rank=2");
  const RefSpec ref{2, true, cd::StalePolicy{}, ValueType::kF32};
  State ts, rs;
  fl::State fs;
  at::manual_seed(5);
  step_all(*tc, *fc, ref, ts, fs, rs, {40, 50}, 0, 0);
  step_all(*tc, *fc, ref, ts, fs, rs, {50, 40}, 1, 1);
  step_all(*tc, *fc, ref, ts, fs, rs, {2000}, 2, 2);  // dense: the state stays
  step_all(*tc, *fc, ref, ts, fs, rs, {50, 40}, 4, 3);
}

TEST_CASE("flat acp: a non-contiguous shared factor is read as its contiguous copy") {
  at::manual_seed(12);
  const at::Tensor x = at::randn({30, 40});
  const at::Tensor shared = acp_next_shared(at::randn({40, 2}));
  const at::Tensor strided = shared.t().contiguous().t();  // same values, column-major
  REQUIRE_FALSE(strided.is_contiguous());
  auto tc = make_compressor("acp:rank=2");
  State a, b;
  Context ca, cb;
  ca.round = cb.round = 0;
  ca.shared_factor = shared;
  cb.shared_factor = strided;
  const Encoded ea = tc->encode(x, a, ca);
  const Encoded eb = tc->encode(x, b, cb);
  check_same(ea, eb);
  at::Tensor da = at::zeros({1200}), db = at::zeros({1200});
  decode_add(ea, da, 1.0f, ca);
  decode_add(ea, db, 1.0f, cb);
  CHECK(at::equal(da, db));
}

TEST_CASE("flat acp: bad specs, inputs and shared factors give the LibTorch codec's errors, the state intact") {
  for (const char* spec : {"acp", "acp:rank=0", "acp:rank=2,values=fp8", "acp:rank=2,decay=0.5,ef=0",
                           "acp:rank=2,decay=2", "acp:rank=2,foo=1"}) {
    INFO(spec);
    const std::string flat = error_of([&] { fl::make_codec(spec); });
    CHECK(flat.rfind("ConfigError: ", 0) == 0);
    CHECK(flat == error_of([&] { make_compressor(spec); }));
  }
  auto tc = make_compressor("acp:rank=2");
  auto fc = fl::make_codec("acp:rank=2");
  at::manual_seed(3);
  // One step first, so the state to keep intact holds a residual.
  State ts;
  fl::State fs;
  at::Tensor x = at::randn({30, 40});
  tc->encode(x, ts, contexts(0, {}).torch);
  fc->encode(x.data_ptr<float>(), {30, 40}, fs, contexts(0, {}).flat);
  check_same(ts, fs);
  const std::string before = fs.serialize();

  struct Bad {
    const char* what;
    at::Tensor shared;
    int64_t round;
  };
  at::Tensor nan_factor = acp_next_shared(at::randn({30, 2}));
  nan_factor[4][1] = std::numeric_limits<float>::infinity();
  for (const Bad& b : {
           Bad{"Q^ in a Q round", acp_next_shared(at::randn({40, 2})), 1},
           Bad{"P^ in a P round", acp_next_shared(at::randn({30, 2})), 2},
           Bad{"wrong rank", acp_next_shared(at::randn({40, 3})), 2},
           Bad{"1-D", at::randn({80}), 2},
           Bad{"not finite", nan_factor, 3},
       }) {
    INFO(b.what);
    const Contexts c = contexts(b.round, b.shared);
    const std::string terr = error_of([&] { tc->encode(x, ts, c.torch); });
    const std::string ferr = error_of([&] { fc->encode(x.data_ptr<float>(), {30, 40}, fs, c.flat); });
    CHECK(terr.rfind("FormatError: acp encode: shared factor ", 0) == 0);
    CHECK(terr == ferr);
    check_same(ts, fs);
    CHECK(fs.serialize() == before);
  }
  // A flat factor whose values do not fill its shape.
  fl::Context short_ctx = contexts(2, acp_next_shared(at::randn({40, 2}))).flat;
  short_ctx.shared_factor.data.pop_back();
  CHECK(error_of([&] {
          fc->encode(x.data_ptr<float>(), {30, 40}, fs, short_ctx);
        }) == "FormatError: acp encode: shared factor has 79 values for its shape");
  CHECK(fs.serialize() == before);
  // A LibTorch factor of another type.
  Context dbl = contexts(2, {}).torch;
  dbl.shared_factor = at::randn({40, 2}, at::TensorOptions().dtype(at::kDouble));
  CHECK(error_of([&] { tc->encode(x, ts, dbl); }) ==
        "FormatError: acp encode: shared factor must be float32 on the CPU");
  // A non-finite input: the same Error on both, nothing changed.
  x.view({-1})[517] = std::numeric_limits<float>::quiet_NaN();
  const std::string terr = error_of([&] { tc->encode(x, ts, contexts(2, {}).torch); });
  CHECK(!terr.empty());
  CHECK(terr == error_of([&] { fc->encode(x.data_ptr<float>(), {30, 40}, fs, contexts(2, {}).flat); }));
  check_same(ts, fs);
  CHECK(fs.serialize() == before);
}

TEST_CASE("flat decode_add: kLowRankFactor as compression::decode_add, with and without the shared factor") {
  at::manual_seed(9);
  const std::vector<int64_t> shape = {16, 3, 5, 5};
  struct Case {
    const char* spec;
    int64_t rank;
  };
  for (const Case& k : {Case{"acp:rank=3", 3}, Case{"acp:rank=2,values=int8", 2}, Case{"acp:rank=2,values=bf16", 2}}) {
    auto tc = make_compressor(k.spec);
    const LowRankDims d = lowrank_dims(shape, k.rank);
    for (int64_t round : {0, 1, 6, 9}) {
      INFO(k.spec << ", round " << round);
      // Round 0 without a shared factor (both derive the seeded one).
      const at::Tensor shared = round == 0 ? at::Tensor() : acp_next_shared(at::randn(acp_shared_shape(d, round)));
      const Contexts c = contexts(round, shared);
      State ts;
      const Encoded e = tc->encode(at::randn(shape), ts, c.torch);
      REQUIRE(e.format == Format::kLowRankFactor);
      for (float w : {1.0f, -0.3f}) {
        at::Tensor start = at::randn({1200});
        at::Tensor torch_out = start.clone();
        std::vector<float> flat_out(start.data_ptr<float>(), start.data_ptr<float>() + 1200);
        decode_add(e, torch_out, w, c.torch);
        fl::decode_add(e, flat_out.data(), 1200, w, c.flat);
        CHECK(std::memcmp(torch_out.data_ptr<float>(), flat_out.data(), 1200 * sizeof(float)) == 0);
        // The aggregator's expansion of this one factor: the same update.
        at::Tensor agg = start.clone().view(shape);
        const at::Tensor used = shared.defined() ? shared : acp_initial_shared(c.torch, d, round);
        acp_update_add(acp_factor(e), used, round, agg, w);
        CHECK(at::allclose(agg.view({-1}), torch_out, 1e-5, 1e-6));
      }
      // The shared factor of the next round (the other factor's shape): the
      // same FormatError, out unchanged.
      const Contexts wrong = contexts(round, acp_next_shared(at::randn(acp_shared_shape(d, round + 1))));
      std::vector<float> out(1200, 1.0f);
      at::Tensor tout = at::ones({1200});
      const std::string ferr = error_of([&] { fl::decode_add(e, out.data(), 1200, 1.0f, wrong.flat); });
      CHECK(ferr.rfind("FormatError: acp decode: shared factor has shape ", 0) == 0);
      CHECK(ferr == error_of([&] { decode_add(e, tout, 1.0f, wrong.torch); }));
      CHECK(out == std::vector<float>(1200, 1.0f));
      // Malformed: the same FormatError, out unchanged.
      Encoded bad = e;
      bad.values.resize(bad.values.size() - 1);
      const std::string berr = error_of([&] { fl::decode_add(bad, out.data(), 1200, 1.0f, c.flat); });
      CHECK(berr.rfind("FormatError: ", 0) == 0);
      CHECK(berr == error_of([&] { decode_add(bad, tout, 1.0f, c.torch); }));
      CHECK(out == std::vector<float>(1200, 1.0f));
    }
  }
}

TEST_CASE(
    "flat shared_factor_of: the server's labelled factor and a dense {k, r} tensor, as sparrow-client reads them") {
  at::manual_seed(4);
  const std::vector<int64_t> shape = {30, 40};
  const LowRankDims d = lowrank_dims(shape, 3);
  for (int64_t round : {1, 2, 7}) {
    INFO("round " << round);
    const at::Tensor s = acp_next_shared(at::randn(acp_shared_shape(d, round)));
    // sparrow-server labels round r's factor as the kind sent in round r + 1.
    const Encoded wire = acp_factor_encoded(s, shape, round + 1);
    const fl::Tensor f = fl::shared_factor_of(wire);
    CHECK(f.shape == sizes_of(s));
    CHECK(f.data == flat_of(acp_factor(wire)).data);
    CHECK(f.data == flat_of(s).data);
    const fl::Tensor g = fl::shared_factor_of(dense_encoded(s));
    CHECK(g.shape == f.shape);
    CHECK(g.data == f.data);
    // It encodes as sparrow-client's context does.
    auto tc = make_compressor("acp:rank=3");
    auto fc = fl::make_codec("acp:rank=3");
    State ts;
    fl::State fs;
    const at::Tensor x = at::randn(shape);
    Context tctx;
    tctx.round = round;
    tctx.shared_factor = acp_factor(wire).contiguous();
    fl::Context fctx;
    fctx.round = round;
    fctx.has_shared_factor = true;
    fctx.shared_factor = f;
    check_same(tc->encode(x, ts, tctx), fc->encode(x.data_ptr<float>(), shape, fs, fctx));
    check_same(ts, fs);
    Encoded bad = wire;
    bad.values.pop_back();
    CHECK(error_of([&] { fl::shared_factor_of(bad); }).rfind("FormatError: ", 0) == 0);
  }
}
