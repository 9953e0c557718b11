// Time-correlated sparsification (tcs): values on the server's shared mask
// (IndexCoding::kMask, no index bits) plus the client's own top positions, and
// the mask helpers the aggregators use (compression/mask.h).
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <set>

#include "compression/codec_util.h"
#include "compression/compressor.h"
#include "compression/mask.h"
#include "core/error.h"

using namespace sparrow::compression;
using sparrow::ConfigError;
using sparrow::FormatError;
namespace cd = sparrow::compression::detail;

namespace {

at::Tensor randn(int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  return at::randn({n});
}

Context with_mask(const at::Tensor& mask) {
  Context c;
  c.name = "w";
  c.seed = 5;
  c.round = 3;
  c.mask = mask;
  return c;
}

at::Tensor positions(std::vector<int64_t> v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
  return t;
}

std::vector<int64_t> to_vec(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

}  // namespace

TEST_CASE("tcs: without a mask only the client's own top positions go, Rice-coded") {
  auto c = make_compressor("tcs:ratio=0.05,extra=0.01,values=fp32");
  CHECK(c->mask_ratio() == doctest::Approx(0.05));
  const at::Tensor x = randn(1000, 1);
  State st;
  const Encoded e = c->encode(x, st, with_mask({}));
  CHECK(e.format == Format::kSparse);
  CHECK(e.index_coding == IndexCoding::kMask);
  REQUIRE(e.params.size() == 2);
  CHECK(e.params[1] == 0);
  CHECK(e.count == 10);
  // The ten largest |x|, at their exact values; decodable without a mask.
  const at::Tensor d = decode(e, with_mask({}));
  const auto top = std::get<1>(x.abs().topk(10));
  std::set<int64_t> want;
  for (int64_t i = 0; i < 10; ++i) want.insert(top[i].item<int64_t>());
  for (int64_t i = 0; i < 1000; ++i) CHECK(d[i].item<float>() == (want.count(i) ? x[i].item<float>() : 0.0f));
  // Error feedback: the residual holds exactly what was not sent.
  CHECK(at::equal(st.tensors.at("residual") + d, x));
}

TEST_CASE("tcs: values at every mask position, then the own top positions outside it") {
  for (const char* vt : {"fp32", "fp16", "bf16", "int8", "sign"}) {
    CAPTURE(vt);
    auto c = make_compressor(std::string("tcs:ratio=0.05,extra=0.01,values=") + vt);
    const at::Tensor x = randn(1000, 2);
    // A mask on small entries too, so the own top positions are not all on it.
    const at::Tensor mask = positions({0, 3, 17, 250, 251, 640, 999});
    State st;
    const at::Tensor before = at::zeros({1000});
    const Encoded e = c->encode(x, st, with_mask(mask));
    REQUIRE(e.index_coding == IndexCoding::kMask);
    CHECK(e.params[1] == 7);
    CHECK(e.count == 7 + 10);
    CHECK_NOTHROW(validate(e));
    const std::vector<int64_t> idx = cd::decode_masked_indices(e, with_mask(mask));
    for (size_t i = 0; i < 7; ++i) CHECK(idx[i] == to_vec(mask)[i]);
    const std::set<int64_t> on_mask(idx.begin(), idx.begin() + 7);
    for (size_t i = 7; i < idx.size(); ++i) CHECK(on_mask.count(idx[i]) == 0);
    // The own positions are the largest |x| outside the mask.
    at::Tensor outside = x.abs().clone();
    outside.index_put_({mask}, 0.0f);
    const float tenth = std::get<0>(outside.topk(10))[9].item<float>();
    for (size_t i = 7; i < idx.size(); ++i) CHECK(std::fabs(x[idx[i]].item<float>()) >= tenth);
    // Whatever the value type, decoded + residual == compensated input.
    const at::Tensor d = decode(e, with_mask(mask));
    CHECK(at::allclose(st.tensors.at("residual") + d, x + before, 1e-5, 1e-6));
    // Only the sent positions are nonzero.
    CHECK(d.ne(0).sum().item<int64_t>() <= 17);
    if (std::string(vt) == "fp32")
      for (const int64_t i : idx) CHECK(d[i].item<float>() == x[i].item<float>());
    if (std::string(vt) == "sign" || std::string(vt) == "int8") CHECK(e.scales.size() == 2);
  }
}

TEST_CASE("tcs: error feedback carries what was not sent into the next round") {
  auto c = make_compressor("tcs:ratio=0.02,extra=0.005,values=int8");
  const at::Tensor mask = positions({1, 5, 9, 13, 400});
  State st;
  at::Tensor sent = at::zeros({2000});
  at::Tensor total = at::zeros({2000});
  for (int r = 0; r < 6; ++r) {
    const at::Tensor x = randn(2000, 10 + r);
    total += x;
    sent += decode(c->encode(x, st, with_mask(mask)), with_mask(mask));
  }
  CHECK(st.step == 6);
  CHECK(at::allclose(sent + st.tensors.at("residual"), total, 1e-4, 1e-5));
}

TEST_CASE("tcs: a masked update decodes only with the same mask, and a refusal changes nothing") {
  auto c = make_compressor("tcs:ratio=0.05,extra=0.01");
  const at::Tensor mask = positions({2, 4, 8});
  State st;
  const Encoded e = c->encode(randn(100, 3), st, with_mask(mask));
  at::Tensor out = at::ones({100});
  CHECK_THROWS_AS(decode_add(e, out, 1.0f, with_mask(positions({2, 4}))), FormatError);
  CHECK_THROWS_AS(decode_add(e, out, 1.0f, with_mask({})), FormatError);
  CHECK(at::equal(out, at::ones({100})));
  CHECK_NOTHROW(decode_add(e, out, 1.0f, with_mask(mask)));
  // decode_indices (no context) cannot place the mask's values.
  CHECK_THROWS_AS(cd::decode_indices(e), FormatError);
}

TEST_CASE("tcs: malformed masked updates are refused by validate") {
  auto c = make_compressor("tcs:ratio=0.05,extra=0.05,values=int8");
  State st;
  const Encoded good = c->encode(randn(200, 4), st, with_mask(positions({0, 1, 2})));
  REQUIRE_NOTHROW(validate(good));
  Encoded e = good;
  e.params = {good.params[0]};
  CHECK_THROWS_AS(validate(e), FormatError);
  e = good;
  e.params[1] = static_cast<uint32_t>(good.count + 1);  // mask larger than the update
  CHECK_THROWS_AS(validate(e), FormatError);
  e = good;
  e.scales = {good.scales[0]};  // int8 on a mask needs two scales
  CHECK_THROWS_AS(validate(e), FormatError);
  e = good;
  e.scales[1] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_AS(validate(e), FormatError);
  e = good;
  e.indices.pop_back();  // truncated Rice stream of the own positions
  CHECK_THROWS_AS(validate(e), FormatError);
  e = good;
  e.count += 1;  // a value more than the bytes hold
  CHECK_THROWS_AS(validate(e), FormatError);
  e = good;
  e.format = Format::kDense;  // mask coding on a dense tensor
  CHECK_THROWS_AS(validate(e), FormatError);
}

TEST_CASE("tcs: the client refuses a mask outside its tensor, and bad specs are ConfigErrors") {
  auto c = make_compressor("tcs");
  State st;
  CHECK_THROWS_AS(c->encode(randn(10, 5), st, with_mask(positions({3, 10}))), sparrow::Error);
  CHECK_THROWS_AS(c->encode(randn(10, 5), st, with_mask(positions({4, 3}))), sparrow::Error);
  CHECK_THROWS_AS(make_compressor("tcs:extra=0"), ConfigError);
  CHECK_THROWS_AS(make_compressor("tcs:ratio=1.5"), ConfigError);
  CHECK_THROWS_AS(make_compressor("tcs:values=int4"), ConfigError);
  CHECK_THROWS_AS(make_compressor("tcs:ef=0,decay=0.5"), ConfigError);
  CHECK_THROWS_AS(make_compressor("tcs:ratio=0.01,bogus=1"), ConfigError);
  CHECK(make_compressor("stc")->mask_ratio() == 0.0);
}

TEST_CASE("mask: the server's mask is the largest nonzero entries of its step") {
  at::Tensor step = at::zeros({4, 5});
  step[0][1] = 3.0f;
  step[2][2] = -5.0f;
  step[3][4] = 0.5f;
  step[1][0] = -0.25f;
  CHECK(to_vec(step_mask(step, 0.1)) == std::vector<int64_t>{1, 12});  // k = 2
  // More room than nonzeros: only the nonzero entries.
  CHECK(to_vec(step_mask(step, 0.5)) == std::vector<int64_t>{1, 5, 12, 19});
}

TEST_CASE("mask: broadcast form and checkpoint form round-trip exactly") {
  const at::Tensor mask = positions({0, 7, 8, 1000, 49999});
  const Encoded e = mask_encoded(mask, {500, 100});
  CHECK(e.format == Format::kSparse);
  CHECK(to_vec(mask_positions(e)) == to_vec(mask));
  // Positions beyond float32's 2^24 survive the (hi, lo) pairs.
  const int64_t big = (int64_t{1} << 33) + 12345;
  const at::Tensor far = positions({5, (int64_t{1} << 24) + 1, big});
  CHECK(to_vec(mask_from_weights(mask_to_weights(far), big + 1)) == to_vec(far));
  CHECK_THROWS_AS(mask_from_weights(mask_to_weights(far), big), FormatError);  // out of range
  at::Tensor w = mask_to_weights(positions({4, 9}));
  w[1][1] = 3.0f;  // not ascending
  CHECK_THROWS_AS(mask_from_weights(w, 100), FormatError);
  w[1][1] = 9.5f;  // not an integer
  CHECK_THROWS_AS(mask_from_weights(w, 100), FormatError);
  CHECK_THROWS_AS(mask_from_weights(at::zeros({3}), 100), FormatError);
  CHECK(mask_key("fc1.weight") == "mask/fc1.weight");
}

TEST_CASE("tcs: decay ages the residual of a client that skipped rounds") {
  auto keep = make_compressor("tcs:ratio=0.01,extra=0.01,values=fp32");
  auto decay = make_compressor("tcs:ratio=0.01,extra=0.01,values=fp32,decay=0.5");
  State a, b;
  Context c0 = with_mask({}), c3 = with_mask({});
  c0.round = 0;
  c3.round = 3;  // rounds 1 and 2 skipped
  const at::Tensor x = randn(500, 8);
  keep->encode(x, a, c0);
  decay->encode(x, b, c0);
  CHECK(at::equal(a.tensors.at("residual"), b.tensors.at("residual")));
  const at::Tensor r0 = a.tensors.at("residual").clone();
  const at::Tensor zero = at::zeros({500});
  const Encoded ea = keep->encode(zero, a, c3);
  const Encoded eb = decay->encode(zero, b, c3);
  // Compensated = 0.25 x the old residual: the same positions, values a quarter.
  CHECK(at::allclose(decode(eb, c3), 0.25 * decode(ea, c3)));
  CHECK(at::allclose(b.tensors.at("residual"), 0.25 * a.tensors.at("residual")));
  CHECK(at::allclose(a.tensors.at("residual") + decode(ea, c3), r0));
}

TEST_CASE("tcs: a mask position is never sent twice, even when few entries outside it are nonzero") {
  auto c = make_compressor("tcs:ratio=1,extra=1,values=fp32");
  at::Tensor x = at::zeros({50});
  x[3] = 1.0f;
  x[7] = -2.0f;
  x[40] = 0.5f;
  State st;
  const at::Tensor mask = positions({3, 7, 20});
  const Encoded e = c->encode(x, st, with_mask(mask));
  CHECK(e.params[1] == 3);
  CHECK(e.count == 4);  // the mask's 3 (one of them 0) and position 40
  const std::vector<int64_t> idx = cd::decode_masked_indices(e, with_mask(mask));
  CHECK(idx == std::vector<int64_t>{3, 7, 20, 40});
  CHECK(at::equal(decode(e, with_mask(mask)), x));
}

TEST_CASE("tcs: block=B gives the mask's values one scale per B of them") {
  const at::Tensor x = randn(3000, 9);
  const at::Tensor mask = std::get<0>(std::get<1>(x.abs().topk(700)).sort()).contiguous();
  for (const char* vt : {"sign", "int8"}) {
    CAPTURE(vt);
    State plain_state, block_state;
    auto plain = make_compressor(std::string("tcs:ratio=0.2,extra=0.01,values=") + vt);
    auto blocked = make_compressor(std::string("tcs:ratio=0.2,extra=0.01,block=64,values=") + vt);
    const Encoded p = plain->encode(x, plain_state, with_mask(mask));
    const Encoded b = blocked->encode(x, block_state, with_mask(mask));
    REQUIRE(b.params.size() == 3);
    CHECK(b.params[2] == 64);
    CHECK(b.scales.size() == (700 + 63) / 64 + 1);
    CHECK_NOTHROW(validate(b));
    // Same positions; a finer scale sends the mask's values closer to the truth.
    CHECK(cd::decode_masked_indices(b, with_mask(mask)) == cd::decode_masked_indices(p, with_mask(mask)));
    const at::Tensor db = decode(b, with_mask(mask)), dp = decode(p, with_mask(mask));
    const at::Tensor on = x.index({mask});
    const double err_b = (db.index({mask}) - on).norm().item<double>();
    const double err_p = (dp.index({mask}) - on).norm().item<double>();
    CHECK(err_b < err_p);
    CHECK(at::allclose(block_state.tensors.at("residual") + db, x, 1e-5, 1e-6));
    Encoded bad = b;
    bad.scales.pop_back();
    CHECK_THROWS_AS(validate(bad), FormatError);
    bad = b;
    bad.params[2] = 0;
    CHECK_THROWS_AS(validate(bad), FormatError);
  }
  CHECK_THROWS_AS(make_compressor("tcs:block=64,values=fp16"), ConfigError);
  CHECK_THROWS_AS(make_compressor("tcs:block=-1"), ConfigError);
}

TEST_CASE("mask: a sparse step's mask is its largest nonzero entries, whatever their number") {
  at::Tensor step = at::zeros({100000});
  for (int64_t i = 0; i < 50; ++i) step[i * 1999] = static_cast<float>(i + 1) * (i % 2 ? -1.0f : 1.0f);
  // Room for all 50: every nonzero, ascending.
  std::vector<int64_t> all;
  for (int64_t i = 0; i < 50; ++i) all.push_back(i * 1999);
  CHECK(to_vec(step_mask(step, 0.01)) == all);
  // Room for 10 (ratio 1e-4): the ten largest |value|, i = 40..49.
  std::vector<int64_t> top(all.begin() + 40, all.end());
  CHECK(to_vec(step_mask(step, 1e-4)) == top);
}

TEST_CASE("tcs keep=P: values at a seeded share of the mask, a different share per update") {
  const at::Tensor mask =
      positions({1, 4, 9, 16, 25, 36, 49, 64, 81, 100, 121, 144, 169, 196, 225, 256, 289, 324, 361, 400});
  for (const char* vt : {"fp32", "int8", "sign"}) {
    CAPTURE(vt);
    auto c = make_compressor(std::string("tcs:ratio=0.05,extra=0.01,keep=0.25,ef=0,values=") + vt);
    const at::Tensor x = randn(500, 21);
    State st;
    const Encoded e = c->encode(x, st, with_mask(mask));
    REQUIRE(e.index_coding == IndexCoding::kMask);
    REQUIRE(e.params.size() == 4);
    CHECK(e.params[1] == 20);
    CHECK(e.params[2] == 0);
    CHECK(e.params[3] == 5);  // ceil(0.25 · 20)
    CHECK(e.count == 5 + 5);  // plus ceil(0.01 · 500) own positions
    CHECK_NOTHROW(validate(e));
    // The kept entries are the seeded stream over the mask's m entries.
    const std::vector<int64_t> pick = cd::seeded_indices(e.seed, 5, 20);
    const std::vector<int64_t> idx = cd::decode_masked_indices(e, with_mask(mask));
    for (size_t j = 0; j < 5; ++j) CHECK(idx[j] == mask[pick[j]].item<int64_t>());
    // Own positions stay off the whole mask.
    const std::vector<int64_t> mv = to_vec(mask);
    const std::set<int64_t> on_mask(mv.begin(), mv.end());
    for (size_t i = 5; i < idx.size(); ++i) CHECK(on_mask.count(idx[i]) == 0);
    // Without error feedback the kept values are scaled by m/k = 4: no state.
    CHECK(st.tensors.empty());
    const at::Tensor d = decode(e, with_mask(mask));
    if (std::string(vt) == "fp32") {
      for (size_t j = 0; j < 5; ++j) CHECK(d[idx[j]].item<float>() == 4.0f * x[idx[j]].item<float>());
      for (size_t i = 5; i < idx.size(); ++i) CHECK(d[idx[i]].item<float>() == x[idx[i]].item<float>());
    } else {
      // The values sit at the chosen entries: the sign of x there (int8: or a zero code).
      for (size_t j = 0; j < idx.size(); ++j) CHECK(d[idx[j]].item<float>() * x[idx[j]].item<float>() >= 0.0f);
      CHECK(d.ne(0).sum().item<int64_t>() >= 5);
    }
    // The same input draws the same share; another input (another client) another.
    State st2;
    CHECK(c->encode(x, st2, with_mask(mask)).seed == e.seed);
    State st3;
    const Encoded other = c->encode(randn(500, 22), st3, with_mask(mask));
    CHECK(other.seed != e.seed);
    CHECK(cd::seeded_indices(other.seed, 5, 20) != pick);
  }
}

TEST_CASE("tcs keep=P without error feedback: the decode is unbiased on the mask") {
  const at::Tensor mask = positions({0, 2, 4, 6, 8, 10, 12, 14, 16, 18});
  auto c = make_compressor("tcs:ratio=0.5,extra=0.05,keep=0.3,ef=0,values=fp32");
  const at::Tensor x = randn(20, 30);
  at::Tensor sum = at::zeros({20});
  const int draws = 4000;
  for (int s = 0; s < draws; ++s) {
    Context ctx = with_mask(mask);
    ctx.seed = static_cast<uint64_t>(s);  // another run: another share
    State st;
    sum += decode(c->encode(x, st, ctx), ctx);
  }
  const at::Tensor mean = (sum / draws).index({mask});
  const at::Tensor want = x.index({mask});
  // Per entry the estimate's standard deviation is |x|·sqrt((m/k − 1)/draws) ≈ 0.024|x|.
  CHECK(((mean - want).abs() / (want.abs() * std::sqrt((10.0 / 3.0 - 1.0) / draws) + 1e-6)).max().item<float>() < 4.5f);
}

TEST_CASE("tcs keep=P with error feedback: values unscaled, the rest stays in the residual") {
  const at::Tensor mask = positions({3, 7, 11, 19, 23, 31, 47, 59});
  {
    // fp32: each kept mask value is the input itself, not m/k times it.
    auto f = make_compressor("tcs:ratio=0.1,extra=0.02,keep=0.5,values=fp32");
    State sf;
    const at::Tensor x = randn(300, 39);
    const Encoded e = f->encode(x, sf, with_mask(mask));
    REQUIRE(e.params.size() == 4);
    const std::vector<int64_t> idx = cd::decode_masked_indices(e, with_mask(mask));
    const at::Tensor d = decode(e, with_mask(mask));
    for (size_t j = 0; j < 4; ++j) CHECK(d[idx[j]].item<float>() == x[idx[j]].item<float>());
  }
  auto c = make_compressor("tcs:ratio=0.1,extra=0.02,keep=0.5,values=int8");
  State st;
  at::Tensor sent = at::zeros({300});
  at::Tensor total = at::zeros({300});
  for (int r = 0; r < 5; ++r) {
    const at::Tensor x = randn(300, 40 + r);
    total += x;
    const Encoded e = c->encode(x, st, with_mask(mask));
    CHECK(e.params.size() == 4);
    CHECK(e.params[3] == 4);
    const at::Tensor d = decode(e, with_mask(mask));
    CHECK(d.index({mask}).ne(0).sum().item<int64_t>() <= 4);
    sent += d;
  }
  CHECK(at::allclose(sent + st.tensors.at("residual"), total, 1e-4, 1e-5));
}

TEST_CASE("tcs keep=P: fp16 values scaled by m/k saturate instead of becoming inf") {
  const at::Tensor mask = positions({0, 1, 2, 3, 4, 5, 6, 7});
  auto c = make_compressor("tcs:ratio=0.5,extra=0.1,keep=0.25,ef=0,values=fp16");
  const at::Tensor x = at::full({16}, 30000.0f);  // times m/k = 4: beyond fp16's 65504
  State st;
  const Encoded e = c->encode(x, st, with_mask(mask));
  CHECK_NOTHROW(validate(e));
  const at::Tensor d = decode(e, with_mask(mask));
  CHECK(d.isfinite().all().item<bool>());
  CHECK(d.max().item<float>() == 65504.0f);
}

TEST_CASE("tcs keep=P: malformed shares are refused, bad keep is a ConfigError") {
  auto c = make_compressor("tcs:ratio=0.05,extra=0.05,keep=0.5,ef=0,values=sign");
  State st;
  const at::Tensor mask = positions({0, 1, 2, 3, 4, 5});
  const Encoded good = c->encode(randn(200, 50), st, with_mask(mask));
  REQUIRE(good.params.size() == 4);
  REQUIRE_NOTHROW(validate(good));
  REQUIRE_NOTHROW(decode(good, with_mask(mask)));
  Encoded e = good;
  e.params[3] = 7;  // more kept entries than the mask has
  CHECK_THROWS_AS(validate(e), FormatError);
  e = good;
  e.params[1] = 100;  // a mask of 100 (<= numel), so that only kept <= count is violated
  e.params[3] = static_cast<uint32_t>(good.count + 1);  // more kept values than the update holds
  REQUIRE(e.params[3] <= e.params[1]);
  CHECK_THROWS_AS(validate(e), FormatError);
  e = good;
  e.params[1] = 201;  // a mask larger than the tensor
  CHECK_THROWS_AS(validate(e), FormatError);
  e = good;
  e.params.push_back(1);  // five params
  CHECK_THROWS_AS(validate(e), FormatError);
  // Against a mask of another size the update is refused before anything is added.
  at::Tensor out = at::ones({200});
  CHECK_THROWS_AS(decode_add(good, out, 1.0f, with_mask(positions({0, 1, 2, 3, 4}))), FormatError);
  CHECK(at::equal(out, at::ones({200})));
  CHECK_THROWS_AS(make_compressor("tcs:keep=0"), ConfigError);
  CHECK_THROWS_AS(make_compressor("tcs:keep=1.5"), ConfigError);
  // keep=1 is the whole mask, the 1.3 layout.
  State s1;
  CHECK(make_compressor("tcs:ratio=0.05,keep=1")->encode(randn(200, 50), s1, with_mask(mask)).params.size() == 2);
}

TEST_CASE("tcs keep=P, share=mean: the share goes unscaled and asks the aggregator for a per-position mean") {
  const at::Tensor mask = positions({2, 5, 8, 13, 21, 34, 55, 89});
  auto sum = make_compressor("tcs:ratio=0.05,extra=0.02,keep=0.5,ef=0,values=fp32");
  auto mean = make_compressor("tcs:ratio=0.05,extra=0.02,keep=0.5,share=mean,ef=0,values=fp32");
  CHECK_FALSE(sum->share_mean());
  CHECK(mean->share_mean());
  const at::Tensor x = randn(100, 61);
  State s1, s2;
  const Encoded a = sum->encode(x, s1, with_mask(mask));
  const Encoded b = mean->encode(x, s2, with_mask(mask));
  // The same share (same key), the same layout; the values are x itself, not m/k = 2 times it.
  REQUIRE(a.params == b.params);
  REQUIRE(a.seed == b.seed);
  const std::vector<int64_t> idx = cd::decode_masked_indices(b, with_mask(mask));
  const at::Tensor da = decode(a, with_mask(mask)), db = decode(b, with_mask(mask));
  for (size_t j = 0; j < 4; ++j) {
    CHECK(db[idx[j]].item<float>() == x[idx[j]].item<float>());
    CHECK(da[idx[j]].item<float>() == 2.0f * x[idx[j]].item<float>());
  }
  for (size_t i = 4; i < idx.size(); ++i) CHECK(db[idx[i]].item<float>() == x[idx[i]].item<float>());
  CHECK_THROWS_AS(make_compressor("tcs:ratio=0.05,share=mean"), ConfigError);  // keep=1: nothing to average
  CHECK_THROWS_AS(make_compressor("tcs:ratio=0.05,keep=0.5,share=median"), ConfigError);
}

TEST_CASE("tcs mask=all: a seeded share of every position, whatever the last step, with no mask on the wire") {
  auto c = make_compressor("tcs:mask=all,keep=0.2,share=mean,ef=0,values=sign");
  CHECK(c->mask_ratio() == 0.0);  // the server keeps and broadcasts no mask
  CHECK(c->share_mean());
  const int64_t n = 1000;
  const at::Tensor x = randn(n, 71);
  // The same update with no mask in ctx, or with a step mask the codec ignores.
  State s1, s2;
  const Encoded a = c->encode(x, s1, with_mask({}));
  const Encoded b = c->encode(x, s2, with_mask(positions({1, 7, 300})));
  REQUIRE(a.params.size() == 4);
  CHECK(a.params[1] == static_cast<uint32_t>(n));  // the mask is every position
  CHECK(a.params[3] == 200u);                      // ceil(0.2 n) of them
  CHECK(a.count == 200u);                          // and no own positions: none lies outside
  CHECK(a.indices.empty());                        // no position bits of any kind
  CHECK(a.values.size() == 200u / 8);              // one sign bit per kept position
  CHECK(a.params == b.params);
  CHECK(a.seed == b.seed);
  CHECK(a.values == b.values);
  CHECK(a.scales == b.scales);
  // Decoded without any mask: the kept positions are the seeded entries of 0..n-1.
  const std::vector<int64_t> idx = cd::decode_masked_indices(a, with_mask({}));
  CHECK(idx == cd::seeded_indices(a.seed, 200, n));
  const at::Tensor d = decode(a, with_mask({}));
  const std::set<int64_t> kept(idx.begin(), idx.end());
  const float mu = a.scales[0];
  CHECK(mu > 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i].item<float>(), di = d[i].item<float>();
    if (kept.count(i))
      CHECK(di == (xi < 0.0f ? -mu : mu));
    else
      CHECK(di == 0.0f);
  }
  // A round whose mask is a step's refuses it, and a step-mask update still needs its mask.
  CHECK_THROWS_AS(decode(a, with_mask(positions({1, 7, 300}))), FormatError);
  State s3;
  const Encoded step =
      make_compressor("tcs:ratio=0.05,keep=0.5,ef=0")->encode(x, s3, with_mask(positions({1, 7, 300})));
  CHECK_THROWS_AS(decode(step, with_mask({})), FormatError);
  // keep=1 sends every position, still without position bits; error feedback works as with a step mask.
  auto whole = make_compressor("tcs:mask=all,values=fp32");
  State s4;
  const Encoded w = whole->encode(x, s4, with_mask({}));
  CHECK(w.indices.empty());
  CHECK(at::equal(decode(w, with_mask({})), x));
  CHECK_THROWS_AS(make_compressor("tcs:mask=all,ratio=0.5"), ConfigError);
  CHECK_THROWS_AS(make_compressor("tcs:mask=all,extra=0.001"), ConfigError);
  CHECK_THROWS_AS(make_compressor("tcs:mask=some"), ConfigError);
}
