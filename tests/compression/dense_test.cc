#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "compression/compressor.h"
#include "core/error.h"

using namespace sparrow::compression;

TEST_CASE("dense codecs round trip shapes") {
  at::manual_seed(0);
  for (const char* spec : {"none", "fp16", "bf16"}) {
    auto c = make_compressor(spec);
    for (auto shape : {std::vector<int64_t>{7}, {3, 5}, {2, 3, 4}, {0}}) {
      at::Tensor x = at::randn(shape);
      State s;
      Encoded e = c->encode(x, s, {});
      CHECK(e.shape == shape);
      at::Tensor y = c->decode(e);
      CHECK(y.sizes() == x.sizes());
      CHECK_UNARY(y.scalar_type() == at::kFloat);
      const double tol = std::string(spec) == "none" ? 0.0 : (std::string(spec) == "fp16" ? 1e-3 : 8e-3);
      if (x.numel()) CHECK(((y - x).abs() - tol * x.abs()).max().item<float>() <= 1e-6f);
      CHECK(s.step == 1);
    }
  }
}

TEST_CASE("dense: wire sizes") {
  at::Tensor x = at::randn({1000});
  State s;
  CHECK(make_compressor("none")->encode(x, s, {}).values.size() == 4000);
  CHECK(make_compressor("fp16")->encode(x, s, {}).values.size() == 2000);
  CHECK(make_compressor("bf16")->encode(x, s, {}).values.size() == 2000);
}

TEST_CASE("registry: unknown methods and keys are errors") {
  CHECK_THROWS_AS(make_compressor("nonexistent"), sparrow::ConfigError);
  CHECK_THROWS_AS(make_compressor("none:ratio=0.1"), sparrow::ConfigError);
  CHECK_THROWS_AS(make_compressor("fp16:x=1"), sparrow::ConfigError);
}

TEST_CASE("dense: input checks") {
  auto c = make_compressor("none");
  State s;
  CHECK_THROWS_AS(c->encode(at::Tensor(), s, {}), sparrow::Error);
  CHECK_THROWS_AS(c->encode(at::ones({3}, at::kDouble), s, {}), sparrow::Error);
  // Non-contiguous input is accepted (made contiguous).
  at::Tensor x = at::randn({4, 6}).t();
  CHECK(at::equal(c->decode(c->encode(x, s, {})), x));
}

TEST_CASE("decode rejects NaN and wrong sizes") {
  auto c = make_compressor("none");
  State s;
  Encoded e = c->encode(at::ones({4}), s, {});
  Encoded bad = e;
  float nan = std::nanf("");
  std::memcpy(bad.values.data() + 4, &nan, 4);
  CHECK_THROWS_AS(decode(bad), sparrow::FormatError);
  bad = e;
  bad.values.pop_back();
  CHECK_THROWS_AS(decode(bad), sparrow::FormatError);
  bad = e;
  bad.shape = {5};
  CHECK_THROWS_AS(decode(bad), sparrow::FormatError);
  at::Tensor out = at::zeros({3});
  CHECK_THROWS_AS(decode_add(e, out, 1.0f), sparrow::FormatError);
}

TEST_CASE("all_finite: the vectorised scan and ATen's fallback agree") {
  at::Tensor t = at::randn({1000, 37});
  CHECK(all_finite(t));
  CHECK(all_finite(at::empty({0})));
  for (const float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    for (const int64_t i : {int64_t{0}, int64_t{15}, int64_t{16}, int64_t{36999}}) {
      at::Tensor u = t.clone();
      u.view({-1})[i] = bad;
      CHECK_FALSE(all_finite(u));                  // contiguous float32: the scan
      CHECK_FALSE(all_finite(u.t()));              // not contiguous: ATen
      CHECK_FALSE(all_finite(u.to(at::kDouble)));  // not float32: ATen
    }
  }
  CHECK(all_finite(t.t()));
  CHECK(all_finite(t.to(at::kDouble)));
}

TEST_CASE("validate names the first non-finite value of a large tensor") {
  // The finiteness scan works in blocks of 1,024 values: bad values at block
  // edges, past the first block, in the last partial block, and two in one
  // block (the first is named).
  for (const char* spec : {"none", "fp16", "bf16"}) {
    CAPTURE(spec);
    auto c = make_compressor(spec);
    State s;
    const Encoded e = c->encode(at::ones({5000}), s, {});
    CHECK_NOTHROW(validate(e));
    const size_t width = e.values.size() / 5000;
    for (const int64_t at : {0, 1023, 1024, 2047, 3333, 4999}) {
      CAPTURE(at);
      Encoded bad = e;
      std::fill_n(bad.values.begin() + static_cast<std::ptrdiff_t>(width * at), width, uint8_t{0xff});  // a NaN
      if (at == 3333) std::fill_n(bad.values.begin() + static_cast<std::ptrdiff_t>(width * 3400), width, uint8_t{0xff});
      const std::string want = "value " + std::to_string(at) + " is not finite";
      CHECK_THROWS_WITH_AS(validate(bad), doctest::Contains(want.c_str()), sparrow::FormatError);
    }
  }
}

TEST_CASE("decode_fill: a deferred scan runs while the values are written") {
  auto c = make_compressor("none");
  State s;
  at::manual_seed(3);
  const at::Tensor x = at::randn({5000});
  const Encoded e = c->encode(x, s, {});
  // Deferred validation checks sizes, not finiteness.
  Encoded bad = e;
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(bad.values.data() + 4 * 3000, &inf, 4);
  CHECK_NOTHROW(validate(bad, ValueCheck::kDeferDenseF32));
  CHECK_THROWS_AS(validate(bad), NonFiniteError);
  Encoded short_values = e;
  short_values.values.pop_back();
  CHECK_THROWS_AS(validate(short_values, ValueCheck::kDeferDenseF32), sparrow::FormatError);
  // The fill equals weight * values; a non-finite value (past the first chunks)
  // throws with the output all zero again.
  at::Tensor out = at::zeros({5000});
  decode_fill(e, out, 0.5f);
  CHECK(at::equal(out, x * 0.5f));
  at::Tensor zero = at::zeros({5000});
  CHECK_THROWS_WITH_AS(decode_fill(bad, zero, 2.0f), doctest::Contains("value 3000 is not finite"), NonFiniteError);
  CHECK(at::equal(zero, at::zeros({5000})));
  // The scan's verdict is kept: the next validate does not rescan (a value
  // changed behind the memo's back shows it), and decode_fill of values known
  // finite writes without a scan, whatever out held.
  Encoded good = e;
  at::Tensor twice = at::full({5000}, 7.0f);
  decode_fill(good, twice, 1.0f);
  CHECK(at::equal(twice, x));
  float* raw = reinterpret_cast<float*>(const_cast<uint8_t*>(std::as_const(good.values).data()));
  raw[10] = inf;  // after the scan: the memo says finite
  CHECK_NOTHROW(validate(good));
  // Other formats: decode_add.
  auto fp16 = make_compressor("fp16");
  const Encoded h = fp16->encode(x, s, {});
  at::Tensor hout = at::zeros({5000});
  decode_fill(h, hout, 1.0f);
  CHECK(at::equal(hout, decode(h)));
  at::Tensor wrong = at::zeros({4999});
  Encoded fresh = c->encode(x, s, {});
  CHECK_THROWS_AS(decode_fill(fresh, wrong, 1.0f), sparrow::FormatError);
}

TEST_CASE("decode_fill_pair: two dense updates written in one pass, the second scanned") {
  auto c = make_compressor("none");
  State s;
  at::manual_seed(4);
  const at::Tensor a = at::randn({5000}), b = at::randn({5000});
  const Encoded ea = c->encode(a, s, {});
  const Encoded eb = c->encode(b, s, {});
  validate(ea);                             // the held one is known finite
  at::Tensor out = at::full({5000}, 7.0f);  // prior contents are not read
  decode_fill_pair(ea, 2.0f, eb, 0.5f, out);
  CHECK(at::allclose(out, a * 2.0f + b * 0.5f, 1e-6, 1e-6));
  // A non-finite value in the second, past the first chunks: out all zero again.
  Encoded bad = c->encode(b, s, {});
  const float nan = std::nanf("");
  std::memcpy(bad.values.data() + 4 * 4100, &nan, 4);
  at::Tensor zero = at::zeros({5000});
  CHECK_THROWS_WITH_AS(decode_fill_pair(ea, 2.0f, bad, 0.5f, zero), doctest::Contains("value 4100 is not finite"),
                       NonFiniteError);
  CHECK(at::equal(zero, at::zeros({5000})));
  // Not dense fp32, or sizes that differ: FormatError, out untouched.
  const Encoded h = make_compressor("fp16")->encode(b, s, {});
  CHECK_THROWS_AS(decode_fill_pair(ea, 1.0f, h, 1.0f, zero), sparrow::FormatError);
  const Encoded shorter = c->encode(at::randn({4999}), s, {});
  CHECK_THROWS_AS(decode_fill_pair(ea, 1.0f, shorter, 1.0f, zero), sparrow::FormatError);
  CHECK(at::equal(zero, at::zeros({5000})));
}
