#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
#include <memory>
#include <set>

#include "compression/codec_util.h"
#include "compression/compressor.h"
#include "compression/state.h"

using namespace sparrow::compression;
using namespace sparrow::compression::detail;
using sparrow::FormatError;

TEST_CASE("index coding: delta varint and bitmap round trip, smaller one chosen") {
  const int64_t n = 10000;
  for (uint64_t k : {0ull, 1ull, 10ull, 500ull, 3000ull, 9000ull, 10000ull}) {
    std::vector<int64_t> idx = seeded_indices(123 + k, k, n);
    REQUIRE(idx.size() == k);
    for (size_t i = 1; i < idx.size(); ++i) REQUIRE(idx[i - 1] < idx[i]);
    Encoded e;
    e.format = Format::kSparse;
    e.shape = {n};
    encode_indices(idx.data(), k, n, e);
    const size_t bitmap = (n + 7) / 8;
    CHECK(e.indices.size() == std::min(bitmap, delta_varint_bytes(idx.data(), k)));
    CHECK(e.index_coding ==
          (bitmap < delta_varint_bytes(idx.data(), k) ? IndexCoding::kBitmap : IndexCoding::kDeltaVarint));
    CHECK(decode_indices(e) == idx);
  }
}

TEST_CASE("index coding: malformed streams are rejected") {
  Encoded e;
  e.format = Format::kSparse;
  e.shape = {100};
  std::vector<int64_t> idx = {3, 50, 99};
  encode_indices(idx.data(), 3, 100, e);
  REQUIRE(e.index_coding == IndexCoding::kDeltaVarint);
  SUBCASE("count too large") {
    e.count = 4;
    CHECK_THROWS_AS(decode_indices(e), FormatError);
  }
  SUBCASE("out of range") {
    e.indices.back() = 60;
    CHECK_THROWS_AS(decode_indices(e), FormatError);
  }
  SUBCASE("unterminated varint") {
    e.indices.back() |= 0x80;
    CHECK_THROWS_AS(decode_indices(e), FormatError);
  }
  SUBCASE("trailing bytes") {
    e.indices.push_back(0);
    CHECK_THROWS_AS(decode_indices(e), FormatError);
  }
  SUBCASE("bitmap with a bit past numel") {
    Encoded b;
    b.shape = {10};
    b.index_coding = IndexCoding::kBitmap;
    b.indices = {0x01, 0x08};  // bits 0 and 11
    b.count = 2;
    CHECK_THROWS_AS(decode_indices(b), FormatError);
    b.indices = {0x03, 0x00};
    b.count = 1;
    CHECK_THROWS_AS(decode_indices(b), FormatError);
  }
}

TEST_CASE("values: fp16/bf16/sign packing") {
  std::vector<float> v = {0.0f, 1.0f, -2.5f, 65504.0f, 1e-3f, -0.0f, 3.14159f};
  for (ValueType vt : {ValueType::kF32, ValueType::kF16, ValueType::kBF16}) {
    Bytes bytes;
    pack_values(v.data(), v.size(), vt, bytes);
    CHECK(bytes.size() == value_bytes(vt, v.size()));
    std::vector<float> out(v.size());
    unpack_values(bytes.data(), v.size(), vt, 0, out.data());
    const float tol = vt == ValueType::kF32 ? 0.0f : (vt == ValueType::kF16 ? 1e-3f : 8e-3f);
    for (size_t i = 0; i < v.size(); ++i) CHECK(std::abs(out[i] - v[i]) <= tol * std::abs(v[i]) + 1e-6f);
  }
  Bytes bits;
  pack_values(v.data(), v.size(), ValueType::kSign, bits);
  CHECK(bits.size() == 1);
  std::vector<float> out(v.size());
  unpack_values(bits.data(), v.size(), ValueType::kSign, 0.5f, out.data());
  CHECK(out[2] == -0.5f);
  CHECK(out[1] == 0.5f);
  CHECK(out[5] == 0.5f);  // -0 is not < 0: sign maps zero to +
}

TEST_CASE("state: serialise round trip and malformed bytes") {
  State s;
  s.step = 17;
  at::Tensor like = at::ones({3, 4});
  s.slot("u", like).fill_(2.0f);
  s.slot("v", at::ones({5})).fill_(-1.0f);
  const std::string bytes = s.serialize();
  State r = State::deserialize(bytes);
  CHECK(r.step == 17);
  REQUIRE(r.tensors.size() == 2);
  CHECK(at::equal(r.tensors.at("u"), s.tensors.at("u")));
  CHECK(at::equal(r.tensors.at("v"), s.tensors.at("v")));
  for (size_t len = 0; len < bytes.size(); len += 7)
    CHECK_THROWS_AS(State::deserialize(bytes.substr(0, len)), FormatError);
  CHECK_THROWS_AS(State::deserialize(bytes + "z"), FormatError);
  // A slot whose shape no longer matches is reset.
  CHECK(r.slot("u", at::ones({2})).sum().item<float>() == 0.0f);
}

TEST_CASE("decode_add: a malformed update leaves the running sum untouched") {
  at::Tensor x = at::randn({4000});
  at::Tensor sum = at::ones({4000});
  for (const char* spec : {"qsgd:levels=16", "terngrad", "sign", "topk:ratio=0.01", "none"}) {
    CAPTURE(spec);
    State s;
    Encoded e = make_compressor(spec)->encode(x, s, {});
    at::Tensor before = sum.clone();
    decode_add(e, sum, 0.5f);  // a good one goes in
    CHECK_FALSE(at::equal(before, sum));
    Encoded bad = e;
    if (!bad.values.empty()) bad.values.back() ^= 0xff;  // garbage at the end of the payload
    if (!bad.values.empty()) bad.values.pop_back();      // and truncated
    before = sum.clone();
    CHECK_THROWS_AS(decode_add(bad, sum, 1.0f), FormatError);
    CHECK(at::equal(before, sum));
  }
}

TEST_CASE("Bytes: a view reads in place, keeps its owner alive and is copied on write") {
  auto frame = std::make_shared<std::vector<uint8_t>>(std::vector<uint8_t>{1, 2, 3, 4, 5, 6, 7, 8});
  std::weak_ptr<std::vector<uint8_t>> alive = frame;
  Bytes v = Bytes::view(frame->data() + 2, 4, frame);
  const uint8_t* where = frame->data() + 2;
  frame.reset();
  REQUIRE_FALSE(alive.expired());  // the view holds the frame
  CHECK(v.is_view());
  CHECK(static_cast<const Bytes&>(v).data() == where);  // no copy to read
  CHECK(v == Bytes{3, 4, 5, 6});
  Bytes copy = v;  // a copy is another view of the same bytes
  CHECK(copy.is_view());
  v.set_checked(42);
  CHECK(v.checked(42));
  v[0] = 9;  // a write: own storage, memo cleared, the frame untouched
  CHECK_FALSE(v.is_view());
  CHECK_FALSE(v.checked(42));
  CHECK(v == Bytes{9, 4, 5, 6});
  CHECK(copy == Bytes{3, 4, 5, 6});
  copy.clear();
  CHECK(alive.expired());  // the last view gone: the frame is freed
  Bytes big;
  big.resize_uninitialized(size_t{8} << 20);  // a large block (huge-page backed where allowed)
  big.assign(size_t{8} << 20, 7);
  CHECK(big.size() == (size_t{8} << 20));
  CHECK(big[12345] == 7);
  big.resize(16);
  big.resize(20);
  CHECK(big[19] == 0);  // as std::vector: new bytes are zero
}

TEST_CASE("validate scans an update's values once until they change") {
  std::vector<float> x(1000, 1.0f);
  Encoded e;
  e.format = Format::kDense;
  e.shape = {1000};
  pack_values(x.data(), x.size(), ValueType::kF32, e.values);
  validate(e);
  CHECK(e.values.checked((uint64_t{1000} << 3) | 1));  // the memo: fp32, 1000 values
  validate(e);                                         // no second scan
  // Any write through Bytes clears the memo, so a NaN written afterwards is caught.
  reinterpret_cast<float*>(e.values.data())[10] = std::nanf("");
  CHECK_THROWS_AS(validate(e), sparrow::FormatError);
}
