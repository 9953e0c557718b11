// Entropy-coded sparse formats (Rice-coded index gaps, int8 values), Sparse
// Ternary Compression (stc), and the stale-residual policy of the error-feedback
// codecs (decay, max_age).
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <set>

#include "compression/codec_util.h"
#include "compression/compressor.h"
#include "core/error.h"
#include "core/rng.h"
#include "tests/compression/sparse_util.h"

using namespace sparrow::compression;
using sparrow::ConfigError;
using sparrow::FormatError;
namespace cd = sparrow::compression::detail;
using sparrow::compression::test::values_of;

namespace {

// k distinct sorted indices in [0, n), from a seed.
std::vector<int64_t> random_indices(uint64_t seed, uint64_t k, int64_t n) { return cd::seeded_indices(seed, k, n); }

// What the codecs send with index=rice: the smallest of Rice, varints and a bitmap.
Encoded rice_of(const std::vector<int64_t>& idx, int64_t numel) {
  Encoded e;
  e.format = Format::kSparse;
  e.shape = {numel};
  e.value_type = ValueType::kF32;
  cd::encode_indices(idx.data(), idx.size(), numel, e, cd::IndexMode::kRice);
  std::vector<float> vals(idx.size(), 1.0f);
  cd::pack_values(vals.data(), vals.size(), ValueType::kF32, e.values);
  return e;
}

// A Rice stream whatever its size, with the best parameter or a given one.
Encoded forced_rice(const std::vector<int64_t>& idx, int64_t numel, int b = -1) {
  Encoded e;
  e.format = Format::kSparse;
  e.shape = {numel};
  e.value_type = ValueType::kF32;
  const uint32_t param = b >= 0 ? static_cast<uint32_t>(b) : cd::best_rice(idx.data(), idx.size()).b;
  cd::encode_indices_rice(idx.data(), idx.size(), param, e);
  std::vector<float> vals(idx.size(), 1.0f);
  cd::pack_values(vals.data(), vals.size(), ValueType::kF32, e.values);
  return e;
}

Context round_ctx(int64_t round) {
  Context c;
  c.name = "w";
  c.seed = 3;
  c.round = round;
  return c;
}

}  // namespace

TEST_CASE("rice: index streams round trip at every density, and beat varints when sparse") {
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{300}, int64_t{199210}, int64_t{2000000}}) {
    for (const double density : {0.0, 0.0005, 0.001, 0.01, 0.1, 0.5, 1.0}) {
      const auto k = static_cast<uint64_t>(std::round(density * static_cast<double>(n)));
      CAPTURE(n);
      CAPTURE(k);
      const std::vector<int64_t> idx = random_indices(static_cast<uint64_t>(n) * 31 + k, k, n);
      const Encoded e = rice_of(idx, n);
      CHECK_NOTHROW(validate(e));
      CHECK(cd::decode_indices(e) == idx);
      CHECK(e.indices.size() <= static_cast<size_t>((n + 7) / 8));  // never above a bitmap
      if (e.index_coding == IndexCoding::kRice && k >= 16)
        CHECK(e.indices.size() <= cd::delta_varint_bytes(idx.data(), k));
    }
  }
  // Density 0.001 of the MLP's first layer: about log2(1/0.001) + 1.5 = 11.5 bits an index against 16 for varints.
  const std::vector<int64_t> idx = random_indices(9, 157, 156800);
  const Encoded e = rice_of(idx, 156800);
  REQUIRE(e.index_coding == IndexCoding::kRice);
  const double bits = 8.0 * static_cast<double>(e.indices.size()) / 157.0;
  CHECK(bits < 12.5);
  CHECK(8.0 * static_cast<double>(cd::delta_varint_bytes(idx.data(), 157)) / 157.0 > 14.0);
}

TEST_CASE("rice: first and last positions, runs and long gaps") {
  const int64_t n = 1 << 20;
  for (const std::vector<int64_t>& idx :
       {std::vector<int64_t>{0}, std::vector<int64_t>{n - 1}, std::vector<int64_t>{0, n - 1},
        std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 1000000}, std::vector<int64_t>{17, 18, 19, 500000, 500001}}) {
    for (const int b : {-1, 0, 3, 19, 40}) {
      CAPTURE(b);
      const Encoded e = forced_rice(idx, n, b);
      REQUIRE_NOTHROW(validate(e));
      CHECK(cd::decode_indices(e) == idx);
    }
    // index=rice picks whichever is smallest: these few clustered positions cost less as varints.
    const Encoded chosen = rice_of(idx, n);
    CHECK(cd::decode_indices(chosen) == idx);
    CHECK(chosen.indices.size() + chosen.params.size() * 4 <= cd::delta_varint_bytes(idx.data(), idx.size()));
  }
  CHECK(rice_of({0}, n).index_coding == IndexCoding::kDeltaVarint);
  const Encoded e = forced_rice({0, 1, 2}, 100);  // all gaps 0: b = 0, three 0 bits
  CHECK(e.params == std::vector<uint32_t>{0});
  CHECK(e.indices == std::vector<uint8_t>{0x00});
  CHECK(cd::decode_indices(e) == std::vector<int64_t>{0, 1, 2});
}

TEST_CASE("rice: malformed streams are refused by validate") {
  const std::vector<int64_t> idx = random_indices(4, 40, 100000);
  const Encoded good = forced_rice(idx, 100000);
  REQUIRE(good.index_coding == IndexCoding::kRice);
  REQUIRE_NOTHROW(validate(good));
  {
    Encoded e = good;  // truncated
    e.indices.pop_back();
    CHECK_THROWS_AS(validate(e), FormatError);
  }
  {
    Encoded e = good;  // a trailing byte
    e.indices.push_back(0);
    CHECK_THROWS_AS(validate(e), FormatError);
  }
  {
    Encoded e = good;  // no Rice parameter, or one too large
    e.params.clear();
    CHECK_THROWS_AS(validate(e), FormatError);
    e.params = {41};
    CHECK_THROWS_AS(validate(e), FormatError);
    e.params = {1, 2};
    CHECK_THROWS_AS(validate(e), FormatError);
  }
  {
    Encoded e = good;  // more indices than the stream holds
    e.count = good.count + 1;
    std::vector<float> vals(e.count, 1.0f);
    e.values.clear();
    cd::pack_values(vals.data(), vals.size(), ValueType::kF32, e.values);
    CHECK_THROWS_AS(validate(e), FormatError);
  }
  {
    Encoded e = good;  // nonzero padding bits (only where the last byte has any)
    const size_t used_bits = [&] {
      // Re-encode to count the bits: the decoder's position after the last index.
      size_t bits = 0;
      int64_t prev = -1;
      for (int64_t i : idx) {
        bits += static_cast<size_t>((i - prev - 1) >> good.params[0]) + 1 + good.params[0];
        prev = i;
      }
      return bits;
    }();
    REQUIRE(used_bits % 8 != 0);  // this seed's stream ends inside its last byte
    e.indices.back() |= 0x80;
    CHECK_THROWS_AS(validate(e), FormatError);
  }
  {
    Encoded e = good;  // an index past numel
    e.shape = {idx.back()};
    CHECK_THROWS_AS(validate(e), FormatError);
  }
  {
    Encoded e = good;  // a stream of ones: one endless quotient
    std::fill(e.indices.begin(), e.indices.end(), 0xff);
    CHECK_THROWS_AS(validate(e), FormatError);
  }
  {
    Encoded e = good;  // params on a varint-coded tensor
    Encoded v;
    v.format = Format::kSparse;
    v.shape = {100};
    cd::encode_indices(std::vector<int64_t>{1, 2}.data(), 2, 100, v);
    std::vector<float> vals(2, 1.0f);
    cd::pack_values(vals.data(), 2, ValueType::kF32, v.values);
    REQUIRE_NOTHROW(validate(v));
    v.params = {3};
    CHECK_THROWS_AS(validate(v), FormatError);
  }
}

TEST_CASE("int8 values: within half a step of the input, scale checked") {
  at::manual_seed(8);
  auto topk = make_compressor("topk:ratio=0.05,values=int8,index=rice");
  const at::Tensor x = at::randn({200, 50});
  State s;
  const Encoded e = topk->encode(x, s, {});
  REQUIRE(e.value_type == ValueType::kInt8);
  REQUIRE(e.scales.size() == 1);
  CHECK(e.values.size() == e.count);  // one byte a value
  State s32;
  const Encoded e32 = make_compressor("topk:ratio=0.05")->encode(x, s32, {});
  REQUIRE(e32.count == e.count);
  const at::Tensor fp = decode(e32);
  const at::Tensor d = decode(e);
  CHECK((d - fp).abs().max().item<float>() <= e.scales[0] * 0.5f + 1e-7f);
  CHECK(((d != 0) == (fp != 0)).all().item<bool>());
  Encoded bad = e;
  bad.scales = {-1.0f};
  CHECK_THROWS_AS(validate(bad), FormatError);
  bad.scales = {3e37f};  // 127 · 3e37 is not a float: a peer cannot make a validated value infinite
  CHECK_THROWS_AS(validate(bad), FormatError);
  bad.scales.clear();
  CHECK_THROWS_AS(validate(bad), FormatError);
  bad = e;
  bad.values = e.values;
  bad.values.data()[0] = 0x80;  // -128 is not a code
  CHECK_THROWS_AS(validate(bad), FormatError);
  // Values near the smallest floats: 1/scale would overflow, the quantiser divides instead.
  const std::vector<int64_t> at{1, 2, 3};
  const std::vector<float> tiny{1e-38f, 0.0f, -5e-39f};
  const Encoded t = cd::make_sparse({10}, at.data(), tiny.data(), 3, ValueType::kInt8);
  const std::vector<float> back = values_of(t);
  CHECK(back[0] == doctest::Approx(1e-38f).epsilon(0.01));
  CHECK(back[1] == 0.0f);
  CHECK(back[2] == doctest::Approx(-5e-39f).epsilon(0.01));
  Encoded dense;
  dense.format = Format::kDense;
  dense.shape = {4};
  dense.value_type = ValueType::kInt8;
  dense.values = std::vector<uint8_t>(4, 1);
  dense.scales = {1.0f};
  CHECK_THROWS_AS(validate(dense), FormatError);
}

TEST_CASE("stc: ternary values with the mean magnitude, exact residual bookkeeping") {
  at::manual_seed(11);
  auto stc = make_compressor("stc:ratio=0.01");
  CHECK(stc->method() == "stc");
  const at::Tensor x = at::randn({1000, 200});
  State s;
  const Encoded e = stc->encode(x, s, {});
  CHECK(e.value_type == ValueType::kSign);
  CHECK(e.index_coding == IndexCoding::kRice);
  CHECK(e.count == 2000);
  // mu = mean |top-k|
  const at::Tensor top = std::get<0>(at::topk(x.reshape(-1).abs(), 2000));
  CHECK(e.scales[0] == doctest::Approx(top.mean().item<float>()).epsilon(1e-5));
  const at::Tensor d = decode(e);
  CHECK(at::allclose(d.abs().sum(), at::scalar_tensor(2000 * e.scales[0]), 1e-4, 1e-3));
  // Residual = input - decoded, exactly (the first step has a zero residual).
  CHECK(at::allclose(s.tensors.at("residual"), x - d, 0, 1e-6));
  // About 12 bits per kept value on the wire (index + sign + one scale).
  const double bits = 8.0 * static_cast<double>(e.payload_bytes()) / static_cast<double>(e.count);
  CHECK(bits < 13.0);
  // Error feedback: the mean of the decoded updates converges to the input (at
  // ratio 0.1 every coordinate is sent about every 10 steps, so the residual stays
  // near 5x the input and the mean's error falls as 1/T).
  auto dense_enough = make_compressor("stc:ratio=0.1");
  const at::Tensor y = x.slice(0, 0, 50);
  State sy;
  at::Tensor sum = at::zeros_like(y);
  for (int t = 0; t < 400; ++t) sum += decode(dense_enough->encode(y, sy, {}));
  const double rel = ((sum / 400) - y).norm().item<double>() / y.norm().item<double>();
  INFO("relative error of the mean after 400 steps: " << rel);
  CHECK(rel < 0.05);
}

TEST_CASE("stc: other value types, ef=0, configuration errors") {
  at::manual_seed(12);
  const at::Tensor x = at::randn({300, 30});
  for (const char* spec :
       {"stc:ratio=0.02,values=int8", "stc:ratio=0.02,values=fp16,index=auto", "stc:ratio=0.02,ef=0"}) {
    CAPTURE(spec);
    State s;
    const Encoded e = make_compressor(spec)->encode(x, s, {});
    REQUIRE_NOTHROW(validate(e));
    const at::Tensor d = decode(e);
    const at::Tensor nz = d.masked_select(d != 0).abs();
    CHECK(nz.numel() == 180);
    CHECK((nz - nz.mean()).abs().max().item<float>() <= nz.mean().item<float>() * 0.01f);  // one magnitude
  }
  State s;
  make_compressor("stc:ratio=0.02,ef=0")->encode(x, s, {});
  CHECK(s.tensors.empty());
  // Fewer nonzeros than k: the zeros are not sent (they would arrive as +mu).
  at::Tensor few = at::zeros({1000});
  few[3] = 2.0f;
  few[700] = -1.0f;
  State sf;
  const Encoded ef = make_compressor("stc:ratio=0.01")->encode(few, sf, {});
  CHECK(ef.count == 2);
  CHECK(at::equal(decode(ef), at::where(few != 0, few.sign() * 1.5f, few)));
  CHECK_THROWS_AS(make_compressor("stc:ratio=0"), ConfigError);
  CHECK_THROWS_AS(make_compressor("stc:values=int4"), ConfigError);
  CHECK_THROWS_AS(make_compressor("stc:index=golomb"), ConfigError);
  CHECK_THROWS_AS(make_compressor("stc:decay=1.5"), ConfigError);
  CHECK_THROWS_AS(make_compressor("stc:max_age=-1"), ConfigError);
  CHECK_THROWS_AS(make_compressor("stc:ef=0,decay=0.5"), ConfigError);
  CHECK_THROWS_AS(make_compressor("topk:decay=0.5"), ConfigError);  // topk's ef defaults to 0
}

TEST_CASE("stale residuals: kept, decayed per skipped round, reset past max_age") {
  at::manual_seed(13);
  const at::Tensor x = at::randn({100, 10});
  const at::Tensor zero = at::zeros({100, 10});
  struct Case {
    const char* spec;
    int64_t second_round;
    double factor;  // what the residual of round 0 is multiplied by before round `second_round`
  };
  for (const Case c :
       {Case{"stc:ratio=0.01", 5, 1.0}, Case{"stc:ratio=0.01,decay=0.5", 1, 1.0},
        Case{"stc:ratio=0.01,decay=0.5", 3, 0.25}, Case{"stc:ratio=0.01,decay=0.5,max_age=2", 3, 0.25},
        Case{"stc:ratio=0.01,decay=0.5,max_age=2", 4, 0.0}, Case{"topk:ratio=0.01,ef=1,max_age=1", 3, 0.0},
        Case{"topk:ratio=0.01,ef=1,max_age=1", 2, 1.0}}) {
    CAPTURE(c.spec);
    CAPTURE(c.second_round);
    auto comp = make_compressor(c.spec);
    State s;
    comp->encode(x, s, round_ctx(0));
    CHECK(s.last_round == 0);
    const at::Tensor r0 = s.tensors.at("residual").clone();
    // Round `second_round` with a zero input: the residual it starts from is r0 · factor.
    State expect;
    expect.tensors["residual"] = r0 * c.factor;
    const Encoded got = comp->encode(zero, s, round_ctx(c.second_round));
    CHECK(s.last_round == c.second_round);
    // Reference: the same codec without a policy, fed the aged residual by hand.
    auto ref = make_compressor(std::string(c.spec).find("topk") == 0 ? "topk:ratio=0.01,ef=1" : "stc:ratio=0.01");
    const Encoded want = ref->encode(zero, expect, {});
    CHECK(at::equal(decode(got), decode(want)));
    CHECK(at::equal(s.tensors.at("residual"), expect.tensors.at("residual")));
  }
}

TEST_CASE("stale momentum in dgc: u and v age together") {
  at::manual_seed(14);
  const at::Tensor x = at::randn({100, 10});
  auto dgc = make_compressor("dgc:ratio=0.01,momentum=0.9,decay=0.5,max_age=3,sample=1");
  auto plain = make_compressor("dgc:ratio=0.01,momentum=0.9,sample=1");
  State s;
  dgc->encode(x, s, round_ctx(0));
  const at::Tensor u0 = s.tensors.at("u").clone(), v0 = s.tensors.at("v").clone();
  // The codec at round 3 (2 rounds skipped) equals the plain codec fed u, v aged by 0.25,
  // and at round 8 (4 skipped, more than max_age) the plain codec fed zeros.
  for (const std::pair<int64_t, double>& rf :
       {std::pair<int64_t, double>{3, 0.25}, std::pair<int64_t, double>{8, 0.0}}) {
    const int64_t round = rf.first;  // not a structured binding: CAPTURE's lambda captures it (C++17)
    const double factor = rf.second;
    CAPTURE(round);
    State a = s, ref;
    a.tensors["u"] = u0.clone();
    a.tensors["v"] = v0.clone();
    ref.step = s.step;
    ref.tensors["u"] = u0 * factor;
    ref.tensors["v"] = v0 * factor;
    const Encoded got = dgc->encode(x, a, round_ctx(round));
    Context c = round_ctx(round);
    const Encoded want = plain->encode(x, ref, c);
    CHECK(at::equal(decode(got), decode(want)));
    CHECK(at::equal(a.tensors.at("u"), ref.tensors.at("u")));
    CHECK(at::equal(a.tensors.at("v"), ref.tensors.at("v")));
  }
  State t = s;
  t.tensors["u"] = u0.clone();
  t.tensors["v"] = v0.clone();
  cd::StalePolicy p;
  p.decay = 0.5;
  p.max_age = 3;
  CHECK(cd::age_state(t, round_ctx(3), p, {"u", "v"}) == 2);
  CHECK(at::allclose(t.tensors.at("u"), u0 * 0.25));
  CHECK(at::allclose(t.tensors.at("v"), v0 * 0.25));
  CHECK(cd::age_state(t, round_ctx(8), p, {"u", "v"}) == 4);
  CHECK(at::equal(t.tensors.at("u"), at::zeros_like(u0)));
  // Unknown rounds (a caller without Context::round) leave the state alone.
  State w;
  w.tensors["u"] = u0.clone();
  CHECK(cd::age_state(w, {}, p, {"u"}) == 0);
  CHECK(at::equal(w.tensors.at("u"), u0));
  CHECK(w.last_round == -1);
}

TEST_CASE("compressor state: last_round survives serialisation and version 1 bytes are still read") {
  State s;
  s.step = 4;
  s.last_round = 17;
  s.tensors["residual"] = at::arange(6, at::kFloat).reshape({2, 3});
  const State back = State::deserialize(s.serialize());
  CHECK(back.step == 4);
  CHECK(back.last_round == 17);
  CHECK(at::equal(back.tensors.at("residual"), s.tensors.at("residual")));
  // Version 1: magic, version, step, count (no last_round).
  std::string v1("SPST", 4);
  const uint32_t version = 1, count = 0;
  const uint64_t step = 9;
  v1.append(reinterpret_cast<const char*>(&version), 4);
  v1.append(reinterpret_cast<const char*>(&step), 8);
  v1.append(reinterpret_cast<const char*>(&count), 4);
  const State old = State::deserialize(v1);
  CHECK(old.step == 9);
  CHECK(old.last_round == -1);
  std::string bad = s.serialize();
  const int64_t minus5 = -5;
  std::memcpy(&bad[16], &minus5, 8);
  CHECK_THROWS_AS(State::deserialize(bad), FormatError);
}
