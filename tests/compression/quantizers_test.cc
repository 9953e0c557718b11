#include "tests/sparrow_test.h"
// Tests for the quantizing codecs: qsgd, terngrad, sign.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "compression/compressor.h"
#include "core/error.h"
#include "core/rng.h"

using namespace sparrow::compression;
using sparrow::ConfigError;
using sparrow::FormatError;

namespace {

Context ctx_with(uint64_t seed, const std::string& name = "w") {
  Context c;
  c.seed = seed;
  c.name = name;
  return c;
}

// A deterministic "gradient-like" tensor from our own RNG (independent of torch's).
at::Tensor randn_det(std::vector<int64_t> shape, uint64_t key) {
  at::Tensor t = at::empty(shape, at::kFloat);
  float* p = t.data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = sparrow::rng::normal(key, static_cast<uint64_t>(i));
  return t;
}

double max_abs(const at::Tensor& t) { return t.numel() ? t.abs().max().item<double>() : 0.0; }

// Per-bucket L2 norms of a flat tensor.
std::vector<double> bucket_norms(const at::Tensor& x, int64_t bucket) {
  const at::Tensor f = x.reshape({-1});
  std::vector<double> norms;
  for (int64_t lo = 0; lo < f.numel(); lo += bucket)
    norms.push_back(f.slice(0, lo, std::min(f.numel(), lo + bucket)).to(at::kDouble).norm().item<double>());
  return norms;
}

// Decoding a mutated payload must either succeed or throw FormatError; nothing else.
void decode_or_format_error(const Encoded& e) {
  try {
    at::Tensor y = decode(e);
    CHECK(y.sizes().vec() == e.shape);
    CHECK(at::isfinite(y).all().item<bool>());
  } catch (const FormatError&) {
  }
}

const std::vector<std::vector<int64_t>> kShapes = {{1},      {7},          {1000}, {1025}, {3, 5},
                                                   {17, 31}, {2, 3, 5, 7}, {0},    {4, 0}};

}  // namespace

// ---- all three: shapes, determinism, config --------------------------------------

TEST_CASE("quantizers: shapes round trip, step counter, determinism") {
  for (const char* spec : {"qsgd:levels=4", "qsgd:levels=16,bucket=64", "qsgd:levels=1,bucket=3", "terngrad",
                           "terngrad:clip=2.5", "sign", "sign:ef=0"}) {
    CAPTURE(spec);
    auto c = make_compressor(spec);
    for (const auto& shape : kShapes) {
      CAPTURE(shape.size());
      at::Tensor x = randn_det(shape, 11);
      State s1, s2;
      Encoded e1 = c->encode(x, s1, ctx_with(3));
      Encoded e2 = c->encode(x, s2, ctx_with(3));
      CHECK(e1.shape == shape);
      CHECK(s1.step == 1);
      // Same seed, name and step: identical bytes.
      CHECK(e1.values == e2.values);
      CHECK(e1.scales == e2.scales);
      at::Tensor y = decode(e1);
      CHECK(y.sizes() == x.sizes());
      CHECK((y.scalar_type() == at::kFloat));
      // decode_add with a weight adds weight · decode.
      at::Tensor acc = at::ones(shape);
      decode_add(e1, acc, 0.5f);
      CHECK(at::allclose(acc, 1 + 0.5 * y, 1e-5, 1e-6));
      if (x.numel() == 0) continue;
      // Every decoded value is bounded by what the format allows.
      if (std::string(spec).rfind("sign", 0) == 0) {
        CHECK(at::allclose(y.abs(), at::full_like(y, e1.scales[0])));
      } else if (std::string(spec).rfind("terngrad", 0) == 0) {
        const float s = e1.scales[0];
        CHECK(s <= max_abs(x) + 1e-6);
        CHECK((((y == 0) | (y == s) | (y == -s)).all().item<bool>()));
        CHECK((((y * x) >= 0).all().item<bool>()));  // signs kept
      } else {
        CHECK((((y * x) >= 0).all().item<bool>()));
      }
    }
  }
}

TEST_CASE("quantizers: bytes do not depend on the thread count, and depend on seed and step") {
  const at::Tensor x = randn_det({300000}, 5);  // several parallel blocks
  const int threads = at::get_num_threads();
  for (const char* spec : {"qsgd:levels=8", "qsgd:levels=3,bucket=100", "terngrad:clip=2.5", "sign"}) {
    CAPTURE(spec);
    auto c = make_compressor(spec);
    at::set_num_threads(1);
    State s1;
    const Encoded one = c->encode(x, s1, ctx_with(9));
    at::set_num_threads(std::max(threads, 4));
    State s2;
    const Encoded many = c->encode(x, s2, ctx_with(9));
    at::set_num_threads(threads);
    CHECK(one.values == many.values);
    CHECK(one.scales == many.scales);
    CHECK(at::equal(decode(one), decode(many)));
    if (std::string(spec) != "sign") {
      State s3;
      CHECK(c->encode(x, s3, ctx_with(10)).values != one.values);  // other seed
      CHECK(c->encode(x, s1, ctx_with(9)).values != one.values);   // next step
    }
  }
}

TEST_CASE("quantizers: config errors") {
  for (const char* bad :
       {"qsgd", "qsgd:levels=0", "qsgd:levels=-3", "qsgd:levels=2.5", "qsgd:levels=16777217", "qsgd:levels=4,bucket=0",
        "qsgd:levels=4,bucket=-1", "qsgd:levels=4,bucket=4294967296", "qsgd:levels=4,foo=1", "qsgd:bucket=512",
        "terngrad:clip=-1", "terngrad:clip=nan", "terngrad:levels=2", "sign:ef=2", "sign:ratio=0.1"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(make_compressor(bad), ConfigError);
  }
  CHECK_NOTHROW(make_compressor("qsgd:levels=16777216,bucket=4294967295"));
  CHECK_NOTHROW(make_compressor("terngrad:clip=0"));
  CHECK_NOTHROW(make_compressor("sign:ef=0"));
}

TEST_CASE("quantizers: non-finite input is an error, not a payload") {
  at::Tensor x = randn_det({100}, 1);
  x[7] = std::nanf("");
  for (const char* spec : {"qsgd:levels=4", "terngrad", "sign"}) {
    CAPTURE(spec);
    State s;
    CHECK_THROWS_AS(make_compressor(spec)->encode(x, s, {}), sparrow::Error);
  }
  // sign with ef leaves the residual untouched when it refuses.
  auto c = make_compressor("sign");
  State s;
  c->encode(randn_det({100}, 2), s, {});
  const at::Tensor before = s.tensors.at("residual").clone();
  CHECK_THROWS_AS(c->encode(x, s, {}), sparrow::Error);
  CHECK(at::equal(before, s.tensors.at("residual")));
  CHECK(s.step == 1);
}

// ---- qsgd -------------------------------------------------------------------------

TEST_CASE("qsgd: unbiased") {
  // Per element the decoded value is norm/S · (l or l+1), variance <= (norm/S)²/4,
  // so the mean of K independent encodes has std <= norm/(2S√K). We allow 6 of those.
  const int64_t n = 1000, bucket = 512, S = 4;
  const int K = 3000;
  const at::Tensor x = randn_det({n}, 77);
  auto c = make_compressor("qsgd:levels=4,bucket=512");
  at::Tensor sum = at::zeros({n});
  State s;
  for (int k = 0; k < K; ++k) decode_add(c->encode(x, s, ctx_with(1)), sum, 1.0f);  // step advances the stream
  const at::Tensor mean = sum / K;
  const std::vector<double> norms = bucket_norms(x, bucket);
  for (size_t b = 0; b < norms.size(); ++b) {
    const int64_t lo = static_cast<int64_t>(b) * bucket, hi = std::min(n, lo + bucket);
    const double tol = 6.0 * norms[b] / (2.0 * S * std::sqrt(static_cast<double>(K)));
    CHECK(max_abs(mean.slice(0, lo, hi) - x.slice(0, lo, hi)) <= tol);
  }
  // And the mean squared error shrinks like 1/K (the bound, not the 6σ slack).
  double bound = 0.0;
  for (double nb : norms) bound += bucket * (nb / S) * (nb / S) / 4.0;
  CHECK((mean - x).pow(2).sum().item<double>() <= 2.0 * bound / K);
}

TEST_CASE("qsgd: error is at most one level, many levels reproduce x") {
  const at::Tensor x = randn_det({5, 300}, 3);
  for (int64_t S : {1, 2, 16, 255, 1 << 20, 1 << 24}) {
    CAPTURE(S);
    const int64_t bucket = 128;
    auto c = make_compressor("qsgd:levels=" + std::to_string(S) + ",bucket=128");
    State s;
    const Encoded e = c->encode(x, s, ctx_with(2));
    CHECK(e.params == std::vector<uint32_t>({static_cast<uint32_t>(S), 128u}));
    const at::Tensor err = (decode(e) - x).reshape({-1});
    const std::vector<double> norms = bucket_norms(x, bucket);
    for (size_t b = 0; b < norms.size(); ++b) {
      const int64_t lo = static_cast<int64_t>(b) * bucket, hi = std::min<int64_t>(err.numel(), lo + bucket);
      CHECK(max_abs(err.slice(0, lo, hi)) <= norms[b] / S * (1 + 1e-5) + 1e-6 * norms[b]);
    }
    if (S == (1 << 24)) CHECK(max_abs(err) <= 1e-5 * max_abs(x));
  }
  // A lone nonzero in a bucket sits exactly on the top level: decoded exactly.
  at::Tensor one = at::zeros({1000});
  one[3] = -2.5f;
  one[700] = 0.75f;
  State s;
  CHECK(at::equal(decode(make_compressor("qsgd:levels=3")->encode(one, s, {})), one));
}

TEST_CASE("qsgd: zero buckets give zeros, no NaN") {
  at::Tensor x = at::zeros({1500});
  x.slice(0, 1024, 1088).fill_(1.0f);  // 64 ones: norm 8, every element exactly on level 2 of 16
  State s;
  const Encoded e = make_compressor("qsgd:levels=16")->encode(x, s, {});
  CHECK(e.scales[0] == 0.0f);
  CHECK(e.scales[1] == 0.0f);
  const at::Tensor y = decode(e);
  CHECK(at::isfinite(y).all().item<bool>());
  CHECK(max_abs(y.slice(0, 0, 1024)) == 0.0);
  CHECK(at::equal(y, x));
}

TEST_CASE("qsgd: wire size") {
  const at::Tensor x = randn_det({1 << 20}, 21);
  State s;
  const Encoded e = make_compressor("qsgd:levels=16,bucket=512")->encode(x, s, ctx_with(4));
  const double dense = 4.0 * x.numel();
  const double ratio = dense / static_cast<double>(e.payload_bytes());
  MESSAGE("qsgd levels=16 bucket=512 on randn(2^20): " << ratio << "x below fp32, " << 8.0 * e.values.size() / x.numel()
                                                       << " bits/element");
  CHECK(ratio >= 6.0);
  // Fewer levels, smaller; one level costs at most 2 bits per element + norms.
  const Encoded e1 = make_compressor("qsgd:levels=1,bucket=512")->encode(x, s, ctx_with(4));
  CHECK(e1.values.size() < e.values.size());
  CHECK(e1.values.size() <= static_cast<size_t>(x.numel()) * 4 / 8 + 1);
}

TEST_CASE("qsgd: bit layout is the documented LSB-first gamma code") {
  // bucket=1: every element is its own bucket with level S = 4 (x = 5 = 0b101, N = 2):
  // 00 1 then low bits 01 LSB first = "1","0", then sign. Stream: 0,0,1,1,0,s.
  State s;
  const Encoded e = make_compressor("qsgd:levels=4,bucket=1")->encode(at::tensor({-3.0f, 0.0f, 2.0f}), s, {});
  // element 0: bits 0..5 = 0,0,1,1,0,1 ; element 1 (level 0): bit 6 = 1 ; element 2: bits 7..12 = 0,0,1,1,0,0
  uint64_t want = 0;
  int pos = 0;
  for (int b : {0, 0, 1, 1, 0, 1, 1, 0, 0, 1, 1, 0, 0}) want |= static_cast<uint64_t>(b) << pos++;
  REQUIRE(e.values.size() == 2);
  CHECK(static_cast<uint64_t>(e.values[0] | (e.values[1] << 8)) == want);
  CHECK(at::equal(decode(e), at::tensor({-3.0f, 0.0f, 2.0f})));
}

TEST_CASE("qsgd: malformed payloads throw FormatError") {
  const at::Tensor x = randn_det({777}, 8);
  State s;
  const Encoded e = make_compressor("qsgd:levels=6,bucket=100")->encode(x, s, ctx_with(1));
  REQUIRE(e.values.size() > 8);
  SUBCASE("every truncation") {
    for (size_t len = 0; len < e.values.size(); ++len) {
      Encoded bad = e;
      bad.values.resize(len);
      CAPTURE(len);
      CHECK_THROWS_AS(decode(bad), FormatError);
    }
  }
  SUBCASE("trailing bytes") {
    Encoded bad = e;
    bad.values.push_back(0);
    CHECK_THROWS_AS(decode(bad), FormatError);
    bad.values.back() = 0xff;
    CHECK_THROWS_AS(decode(bad), FormatError);
  }
  SUBCASE("all zero bits: gamma prefix too long") {
    Encoded bad = e;
    std::fill(bad.values.begin(), bad.values.end(), 0);
    CHECK_THROWS_AS(decode(bad), FormatError);
  }
  SUBCASE("level above S") {
    Encoded bad = e;
    bad.params[0] = 1;  // the stream holds levels up to 6
    CHECK_THROWS_AS(decode(bad), FormatError);
  }
  SUBCASE("structural") {
    Encoded bad = e;
    bad.params = {6};
    CHECK_THROWS_AS(decode(bad), FormatError);
    bad = e;
    bad.params[1] = 0;
    CHECK_THROWS_AS(decode(bad), FormatError);
    bad = e;
    bad.scales.pop_back();
    CHECK_THROWS_AS(decode(bad), FormatError);
    bad = e;
    bad.scales[0] = -1.0f;
    CHECK_THROWS_AS(decode(bad), FormatError);
    bad = e;
    bad.scales[0] = std::numeric_limits<float>::infinity();
    CHECK_THROWS_AS(decode(bad), FormatError);
  }
  SUBCASE("random byte flips never crash") {
    sparrow::rng::Stream r(99);
    for (int t = 0; t < 2000; ++t) {
      Encoded bad = e;
      const int flips = 1 + static_cast<int>(r.below(3));
      for (int f = 0; f < flips; ++f) bad.values[r.below(bad.values.size())] ^= static_cast<uint8_t>(1 + r.below(255));
      decode_or_format_error(bad);
    }
    for (int t = 0; t < 500; ++t) {  // and random garbage of random length
      Encoded bad = e;
      bad.values.resize(r.below(e.values.size() * 2) + 1);
      for (auto& b : bad.values) b = static_cast<uint8_t>(r.next());
      decode_or_format_error(bad);
    }
    for (int t = 0; t < 500; ++t) {  // garbage with random shapes and params, mostly zero bits (long prefixes)
      Encoded bad;
      bad.format = Format::kQuantized;
      bad.shape = {static_cast<int64_t>(r.below(200))};
      bad.params = {static_cast<uint32_t>(1 + r.below(1u << 24)), static_cast<uint32_t>(1 + r.below(300))};
      if (t % 2) bad.params[0] = 1 + static_cast<uint32_t>(r.below(20));
      bad.scales.assign((bad.shape[0] + bad.params[1] - 1) / bad.params[1], 1.0f);
      bad.values.resize(r.below(bad.shape[0] * 2 + 8));
      for (auto& b : bad.values) b = static_cast<uint8_t>(r.next() & r.next() & r.next());
      decode_or_format_error(bad);
    }
  }
}

// ---- terngrad ------------------------------------------------------------------------

TEST_CASE("terngrad: unbiased without clipping") {
  // Var(g̃_i) = s|g_i| − g_i² <= s²/4: the mean of K encodes has std <= s/(2√K); allow 6.
  const int64_t n = 2000;
  const int K = 3000;
  const at::Tensor x = randn_det({n}, 31);
  auto c = make_compressor("terngrad");
  at::Tensor sum = at::zeros({n});
  State s;
  for (int k = 0; k < K; ++k) decode_add(c->encode(x, s, ctx_with(5)), sum, 1.0f);
  const double smax = max_abs(x);
  const at::Tensor mean = sum / K;
  CHECK(max_abs(mean - x) <= 6.0 * smax / (2.0 * std::sqrt(static_cast<double>(K))));
  const double bound = (smax * x.abs() - x * x).sum().item<double>();  // exact total variance
  CHECK((mean - x).pow(2).sum().item<double>() <= 2.0 * bound / K);
}

TEST_CASE("terngrad: clipping bounds the scale at C·sigma") {
  at::Tensor x = randn_det({10000}, 4);
  x[17] = 100.0f;  // an outlier
  const double sigma = x.to(at::kDouble).std(/*unbiased=*/false).item<double>();
  State s;
  const Encoded off = make_compressor("terngrad")->encode(x, s, {});
  const Encoded on = make_compressor("terngrad:clip=2.5")->encode(x, s, {});
  CHECK(off.scales[0] == 100.0f);
  CHECK(on.scales[0] == doctest::Approx(2.5 * sigma).epsilon(1e-5));
  // Clipped elements are always sent (b = 1).
  CHECK(decode(on)[17].item<float>() == on.scales[0]);
  // Constant tensor: sigma = 0, everything clips to zero (documented).
  CHECK(make_compressor("terngrad:clip=2.5")->encode(at::full({10}, 3.0f), s, {}).scales[0] == 0.0f);
}

TEST_CASE("terngrad: zero tensor and wire size") {
  State s;
  const Encoded z = make_compressor("terngrad")->encode(at::zeros({33}), s, {});
  CHECK(z.scales[0] == 0.0f);
  CHECK(at::equal(decode(z), at::zeros({33})));
  const Encoded e = make_compressor("terngrad")->encode(randn_det({1001}, 2), s, {});
  CHECK(e.values.size() == (2 * 1001 + 7) / 8);
}

TEST_CASE("terngrad: malformed payloads throw FormatError") {
  const at::Tensor x = randn_det({103}, 6);
  State s;
  const Encoded e = make_compressor("terngrad")->encode(x, s, ctx_with(2));
  for (size_t len = 0; len < e.values.size(); ++len) {
    Encoded bad = e;
    bad.values.resize(len);
    CHECK_THROWS_AS(decode(bad), FormatError);
  }
  Encoded bad = e;
  bad.values.push_back(0);
  CHECK_THROWS_AS(decode(bad), FormatError);
  for (size_t byte : {size_t{0}, size_t{9}, e.values.size() - 1}) {
    for (int slot = 0; slot < (byte == e.values.size() - 1 ? 3 : 4); ++slot) {
      bad = e;
      bad.values[byte] |= static_cast<uint8_t>(3u << (2 * slot));  // code 3
      CAPTURE(byte);
      CHECK_THROWS_AS(decode(bad), FormatError);
    }
  }
  bad = e;
  bad.values.back() |= 0x40;  // 103 = 4·25 + 3: the top 2 bits of the last byte are padding
  CHECK_THROWS_AS(decode(bad), FormatError);
  bad = e;
  bad.scales = {};
  CHECK_THROWS_AS(decode(bad), FormatError);
  bad = e;
  bad.scales = {-1.0f};
  CHECK_THROWS_AS(decode(bad), FormatError);
  sparrow::rng::Stream r(7);
  for (int t = 0; t < 2000; ++t) {
    bad = e;
    bad.values[r.below(bad.values.size())] ^= static_cast<uint8_t>(1 + r.below(255));
    decode_or_format_error(bad);
  }
}

// ---- sign ----------------------------------------------------------------------------

TEST_CASE("sign: scale is the mean magnitude, zero maps to +") {
  const at::Tensor x = at::tensor({1.0f, -2.0f, 0.0f, 3.0f, -0.0f});
  State s;
  const Encoded e = make_compressor("sign:ef=0")->encode(x, s, {});
  CHECK(e.scales[0] == doctest::Approx(6.0 / 5.0));
  CHECK(e.values == std::vector<uint8_t>{0x02});
  const float m = e.scales[0];
  CHECK(at::equal(decode(e), at::tensor({m, -m, m, m, m})));
  CHECK(s.tensors.empty());  // ef=0 keeps no state
}

TEST_CASE("sign: error feedback makes the running mean converge to the input") {
  const at::Tensor x = randn_det({4, 250}, 12);
  auto c = make_compressor("sign");
  State s;
  at::Tensor sum = at::zeros({4, 250});
  double err_early = 0.0;
  const int N = 400;
  for (int t = 1; t <= N; ++t) {
    decode_add(c->encode(x, s, {}), sum, 1.0f);
    // Exact bookkeeping: Σ decode + residual = t·x (up to fp32 rounding).
    if (t % 50 == 0) CHECK(max_abs(sum + s.tensors.at("residual") - t * x) <= 1e-4 * t * max_abs(x));
    if (t == 20) err_early = ((sum / t - x).norm() / x.norm()).item<double>();
  }
  const double err = ((sum / N - x).norm() / x.norm()).item<double>();
  MESSAGE("sign ef: relative error of the mean after 20 steps " << err_early << ", after " << N << " " << err);
  CHECK(err < 0.05);
  // The residual of a scaled-sign compressor grows like √t on a constant input
  // (the contraction factor ||p||_1²/(d||p||²) can be small), so the error of the
  // mean falls like 1/√t: 20 → 400 steps is a factor √20 ≈ 4.5.
  CHECK(err < err_early / 3);
  // Without memory the mean stays a biased sign vector.
  auto c0 = make_compressor("sign:ef=0");
  State s0;
  at::Tensor sum0 = at::zeros({4, 250});
  for (int t = 0; t < 50; ++t) decode_add(c0->encode(x, s0, {}), sum0, 1.0f);
  CHECK(((sum0 / 50 - x).norm() / x.norm()).item<double>() > 0.3);
}

TEST_CASE("sign: state survives serialize/deserialize mid-stream") {
  auto c = make_compressor("sign");
  State a;
  std::vector<at::Tensor> xs;
  for (int t = 0; t < 10; ++t) xs.push_back(randn_det({37, 3}, 100 + t));
  for (int t = 0; t < 5; ++t) c->encode(xs[t], a, {});
  State b = State::deserialize(a.serialize());
  CHECK(b.step == 5);
  for (int t = 5; t < 10; ++t) {
    const Encoded ea = c->encode(xs[t], a, {});
    const Encoded eb = c->encode(xs[t], b, {});
    CHECK(ea.values == eb.values);
    CHECK(ea.scales == eb.scales);
  }
  CHECK(at::equal(a.tensors.at("residual"), b.tensors.at("residual")));
  // A changed shape resets the residual instead of failing.
  CHECK_NOTHROW(c->encode(randn_det({5}, 1), a, {}));
  CHECK(a.tensors.at("residual").numel() == 5);
}

TEST_CASE("sign: wire size and malformed payloads") {
  const at::Tensor x = randn_det({1 << 20}, 13);
  State s;
  const Encoded e = make_compressor("sign")->encode(x, s, {});
  const double ratio = 4.0 * x.numel() / static_cast<double>(e.payload_bytes());
  CHECK(ratio >= 30.0);
  CHECK(e.values.size() == static_cast<size_t>(x.numel() / 8));

  const Encoded small = make_compressor("sign:ef=0")->encode(randn_det({13}, 1), s, {});
  for (size_t len = 0; len < small.values.size(); ++len) {
    Encoded bad = small;
    bad.values.resize(len);
    CHECK_THROWS_AS(decode(bad), FormatError);
  }
  Encoded bad = small;
  bad.values.push_back(0);
  CHECK_THROWS_AS(decode(bad), FormatError);
  bad = small;
  bad.values.back() |= 0x80;  // padding bit (13 = 8 + 5)
  CHECK_THROWS_AS(decode(bad), FormatError);
  bad = small;
  bad.scales = {std::nanf("")};
  CHECK_THROWS_AS(decode(bad), FormatError);
  bad = small;
  bad.scales = {1.0f, 2.0f};
  CHECK_THROWS_AS(decode(bad), FormatError);
  sparrow::rng::Stream r(3);
  for (int t = 0; t < 500; ++t) {
    bad = small;
    bad.values[r.below(bad.values.size())] ^= static_cast<uint8_t>(1 + r.below(255));
    decode_or_format_error(bad);
  }
}

// ---- speed ----------------------------------------------------------------------------

TEST_SUITE("slow") {
  TEST_CASE("quantizers: encode/decode time on 25M elements") {
    const int64_t n = 25'000'000;
    const at::Tensor x = at::randn({n});
    at::Tensor out = at::zeros({n});
    using clock = std::chrono::steady_clock;
    auto ms = [](clock::time_point a, clock::time_point b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    // Baseline measured in the same run: a copy of the same bytes.
    auto t0 = clock::now();
    at::Tensor copy = x.clone();
    auto t1 = clock::now();
    MESSAGE("memcpy 100 MB: " << ms(t0, t1) << " ms, threads " << at::get_num_threads());
    for (const char* spec : {"qsgd:levels=16", "qsgd:levels=256", "terngrad", "terngrad:clip=2.5", "sign"}) {
      auto c = make_compressor(spec);
      State s;
      c->encode(x, s, {});  // warm up (allocates the residual for sign)
      t0 = clock::now();
      const Encoded e = c->encode(x, s, {});
      t1 = clock::now();
      decode_add(e, out, 1.0f);
      auto t2 = clock::now();
      MESSAGE(std::string(spec) << ": encode " << ms(t0, t1) << " ms, decode_add " << ms(t1, t2) << " ms, "
                                << 4.0 * n / e.payload_bytes() << "x below fp32");
      CHECK(ms(t0, t1) < 5000.0);  // generous: the target is < 1 s; this only catches pathologies
      CHECK(ms(t1, t2) < 5000.0);
    }
  }
}
