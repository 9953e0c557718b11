// The torch-free activation codecs (edge/codec/act_codec_flat.h) on their own:
// what a LibTorch-free split device relies on, runnable where LibTorch is not
// (the arm64 device build). The comparisons with the LibTorch codecs are in
// act_codec_flat_test.cc.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "edge/codec/act_codec_flat.h"

using sparrow::ConfigError;
using sparrow::FormatError;
using namespace sparrow::edge;

namespace {

std::vector<float> normals(size_t n, uint64_t key, float scale = 1.0f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = scale * sparrow::rng::normal(key, i);
  return v;
}

// rows x cols of rank `r` (U V^T with Gaussian U, V).
std::vector<float> low_rank(int64_t rows, int64_t cols, int64_t r, uint64_t key) {
  const std::vector<float> u = normals(static_cast<size_t>(rows * r), key);
  const std::vector<float> v = normals(static_cast<size_t>(cols * r), key + 1);
  std::vector<float> a(static_cast<size_t>(rows * cols), 0.0f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      for (int64_t k = 0; k < r; ++k) a[i * cols + j] += u[i * r + k] * v[j * r + k];
  return a;
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

float max_abs(const std::vector<float>& a) {
  float m = 0;
  for (float v : a) m = std::max(m, std::fabs(v));
  return m;
}

// Largest |Q^T Q - I| entry of an [M, R] matrix.
double orthonormality_error(const flat::Matrix& q) {
  double worst = 0;
  for (int64_t a = 0; a < q.cols; ++a)
    for (int64_t b = 0; b < q.cols; ++b) {
      double dot = 0;
      for (int64_t i = 0; i < q.rows; ++i) dot += static_cast<double>(q.data[i * q.cols + a]) * q.data[i * q.cols + b];
      worst = std::max(worst, std::fabs(dot - (a == b ? 1.0 : 0.0)));
    }
  return worst;
}

ActPacket roundtrip(const ActPacket& p) {
  const std::vector<uint8_t> bytes = p.serialize();
  CHECK(bytes.size() == p.wire_bytes());
  return ActPacket::deserialize(bytes.data(), bytes.size());
}

}  // namespace

TEST_CASE("flat act codec: bad specs are config errors") {
  for (const char* spec : {"lowrank:rank=0", "lowrank:beta=1", "lowrank:refresh=0", "lowrank:iters=0,warm=0",
                           "lowrank:bits=16", "lowrank:gbits=8", "lowrank:bits=8,qbits=2", "q8:block=-1",
                           "topk:ratio=0", "topk:ratio=1.5", "zip", "none:rank=2"}) {
    CAPTURE(spec);
    CHECK_THROWS_AS(flat::ActCodec{spec}, ConfigError);
  }
  CHECK(flat::ActCodec("lowrank:rank=2").lowrank());
  CHECK_FALSE(flat::ActCodec("q4:block=8").lowrank());
}

TEST_CASE("flat act codec: dense is exact and keeps the shape") {
  const std::vector<float> x = normals(2 * 3 * 4, 7);
  flat::CodecState st;
  const ActPacket p = flat::ActCodec("none").encode(x.data(), {2, 3, 4}, st);
  CHECK(p.format == ActFormat::kDense);
  CHECK(p.shape == std::vector<int64_t>{2, 3, 4});
  CHECK(st.steps == 1);
  CHECK(flat::decode(roundtrip(p)) == x);
  CHECK(flat::decode_gradient(p, st, {2, 3, 4}) == x);
  CHECK_THROWS_AS(flat::decode_gradient(p, st, {2, 12}), FormatError);
  CHECK_THROWS_AS(flat::ActCodec("none").encode(x.data(), std::vector<int64_t>{}, st), sparrow::Error);
  CHECK_THROWS_AS(flat::ActCodec("none").encode(x.data(), {2, 0}, st), sparrow::Error);
}

TEST_CASE("flat act codec: q8 and q4 stay within half a step of each block") {
  const int64_t rows = 3, cols = 10;
  std::vector<float> x = normals(static_cast<size_t>(rows * cols), 11);
  x[5] = 40.0f;  // one outlier widens only its block
  const struct {
    const char* spec;
    int64_t block;  // what the packet says: 0 and blocks past the row are one block per row
  } cases[] = {{"q8", cols}, {"q4", cols}, {"q8:block=4", 4}, {"q4:block=3", 3}, {"q4:block=100", cols}};
  for (const auto& c : cases) {
    CAPTURE(c.spec);
    flat::CodecState st;
    const ActPacket p = roundtrip(flat::ActCodec(c.spec).encode(x.data(), rows, cols, st));
    REQUIRE(p.format == ActFormat::kQuant);
    REQUIRE(static_cast<int64_t>(p.params[1]) == c.block);
    const int64_t block = c.block, nb = (cols + block - 1) / block;
    const std::vector<float> y = flat::decode(p);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const float step = p.scales[2 * (i * nb + j / block) + 1];
        CHECK(std::fabs(y[i * cols + j] - x[i * cols + j]) <= step / 2 * 1.0001f + 1e-6f);
      }
    CHECK(p.data.size() == (p.params[0] == 8 ? x.size() : (x.size() + 1) / 2));
  }
  // A constant row: step 0, decoded exactly.
  const std::vector<float> c(8, 2.5f);
  flat::CodecState st;
  CHECK(flat::decode(flat::ActCodec("q4").encode(c.data(), 1, 8, st)) == c);
}

TEST_CASE("flat act codec: topk keeps the largest magnitudes, ties by index") {
  std::vector<float> x = {0.5f, -3.0f, 1.0f, 3.0f, -0.25f, 2.0f, 0.0f, -2.0f};
  flat::CodecState st;
  const ActPacket p = roundtrip(flat::ActCodec("topk:ratio=0.5").encode(x.data(), 2, 4, st));
  REQUIRE(p.params[0] == 4);
  // |3| twice, then |2| at 5 and 7.
  CHECK(flat::decode(p) == std::vector<float>{0, -3.0f, 0, 3.0f, 0, 2.0f, 0, -2.0f});
  const ActPacket tie = flat::ActCodec("topk:ratio=0.375").encode(x.data(), 2, 4, st);  // k = 3
  CHECK(flat::decode(tie) == std::vector<float>{0, -3.0f, 0, 3.0f, 0, 2.0f, 0, 0});
  CHECK(flat::decode(flat::ActCodec("topk:ratio=1").encode(x.data(), 2, 4, st)) == x);
}

TEST_CASE("flat act codec: lowrank recovers a low-rank activation, cloud and device agree") {
  const int64_t rows = 12, cols = 40;
  const std::vector<float> a = low_rank(rows, cols, 3, 21);
  flat::ActCodec codec("lowrank:rank=3,iters=2");
  flat::CodecState dev, cloud;
  const ActPacket p = roundtrip(codec.encode(a.data(), rows, cols, dev));
  REQUIRE(p.format == ActFormat::kLowRank);
  CHECK(dev.basis.is(cols, 3));
  CHECK(dev.basis_id == 1);
  CHECK(orthonormality_error(dev.basis) < 1e-5);
  const std::vector<float> a_hat = flat::decode_activation(p, cloud);
  CHECK(max_abs_diff(a_hat, a) <= 1e-4f * max_abs(a));
  CHECK(flat::decode(p) == a_hat);
  CHECK(cloud.basis.data == dev.basis.data);  // the cloud keeps the sent basis
  CHECK(cloud.basis_id == 1);

  // The way back: G Q (kProjected), rebuilt by the device as G Q Q^T.
  const std::vector<float> g = normals(static_cast<size_t>(rows * cols), 99);
  const ActPacket gp = roundtrip(flat::encode_gradient(g.data(), p, flat::ActCodec("none"), cloud));
  REQUIRE(gp.format == ActFormat::kProjected);
  const std::vector<float> back = flat::decode_gradient(gp, dev, {rows, cols});
  std::vector<double> ref(static_cast<size_t>(rows * cols), 0.0);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t k = 0; k < 3; ++k) {
      double y = 0;
      for (int64_t j = 0; j < cols; ++j) y += static_cast<double>(g[i * cols + j]) * dev.basis.data[j * 3 + k];
      for (int64_t j = 0; j < cols; ++j) ref[i * cols + j] += y * dev.basis.data[j * 3 + k];
    }
  for (size_t i = 0; i < ref.size(); ++i) CHECK(back[i] == doctest::Approx(ref[i]).epsilon(1e-4).scale(1.0));
  // A projected gradient of another rank does not fit the device's basis.
  ActPacket wrong = gp;
  wrong.params[1] = 2;
  wrong.data.resize(4 * rows * 2);
  CHECK_THROWS_AS(flat::decode_gradient(wrong, dev, {rows, cols}), FormatError);
}

TEST_CASE("flat act codec: refresh schedule, cached packets, infer, forced refresh") {
  const int64_t rows = 8, cols = 24;
  flat::ActCodec codec("lowrank:rank=4,beta=0.5,refresh=4,ramp=0");
  flat::CodecState dev, cloud;
  std::vector<ActFormat> formats;
  for (uint64_t step = 0; step < 9; ++step) {
    const std::vector<float> a = normals(static_cast<size_t>(rows * cols), 100 + step);
    const ActPacket p = roundtrip(codec.encode(a.data(), rows, cols, dev));
    formats.push_back(p.format);
    CHECK(p.params[3] == dev.basis_id);
    CHECK(flat::decode_activation(p, cloud).size() == a.size());
    CHECK(cloud.basis.data == dev.basis.data);
    CHECK(dev.tracker.is(cols, 4));
    CHECK(orthonormality_error(dev.tracker) < 1e-5);
  }
  using F = ActFormat;
  CHECK(formats == std::vector<F>{F::kLowRank, F::kLowRankCached, F::kLowRankCached, F::kLowRankCached, F::kLowRank,
                                  F::kLowRankCached, F::kLowRankCached, F::kLowRankCached, F::kLowRank});
  CHECK(dev.basis_id == 3);

  // infer: the basis as is, nothing but the step count changes.
  const std::vector<float> a = normals(static_cast<size_t>(rows * cols), 500);
  const std::string before = dev.serialize();
  flat::CodecState scratch = dev;
  const ActPacket inf = codec.encode(a.data(), rows, cols, scratch, /*infer=*/true);
  CHECK(inf.format == ActFormat::kLowRankCached);
  scratch.steps = dev.steps;
  CHECK(scratch.serialize() == before);

  // A cloud that lost the basis refuses the cached packet and changes nothing.
  const ActPacket cached = codec.encode(a.data(), rows, cols, dev);
  REQUIRE(cached.format == ActFormat::kLowRankCached);
  flat::CodecState lost;
  CHECK_THROWS_AS(flat::decode_activation(cached, lost), FormatError);
  CHECK(lost.basis.empty());
  CHECK(lost.basis_id == 0);
  // The device's forced refresh sends the basis again.
  dev.refresh_next = true;
  const ActPacket again = codec.encode(a.data(), rows, cols, dev);
  CHECK(again.format == ActFormat::kLowRank);
  CHECK_FALSE(dev.refresh_next);
  CHECK_NOTHROW(flat::decode_activation(again, lost));
}

TEST_CASE("flat act codec: quantised factors, both sides hold the dequantised basis") {
  const int64_t rows = 6, cols = 30;
  for (const char* spec : {"lowrank:rank=4,bits=8", "lowrank:rank=4,bits=4,qbits=4,gbits=8",
                           "lowrank:rank=8,beta=0.9,refresh=3,bits=8,gbits=4"}) {
    CAPTURE(spec);
    flat::ActCodec codec(spec);
    flat::CodecState dev, cloud;
    for (int step = 0; step < 4; ++step) {
      const std::vector<float> a = normals(static_cast<size_t>(rows * cols), 300 + step);
      const ActPacket p = roundtrip(codec.encode(a.data(), rows, cols, dev));
      CHECK((p.format == ActFormat::kLowRankQ || p.format == ActFormat::kLowRankCachedQ));
      flat::decode_activation(p, cloud);
      CHECK(cloud.basis.data == dev.basis.data);
      const std::vector<float> g = normals(static_cast<size_t>(rows * cols), 900 + step);
      const ActPacket gp = roundtrip(flat::encode_gradient(g.data(), p, flat::ActCodec("none"), cloud));
      CHECK(gp.format == (p.params[5] == 32 ? ActFormat::kProjected : ActFormat::kProjectedQ));
      CHECK(flat::decode_gradient(gp, dev, {rows, cols}).size() == g.size());
    }
  }
}

TEST_CASE("flat act codec: codec state bytes round trip and bad bytes are refused") {
  const int64_t rows = 5, cols = 16;
  flat::ActCodec codec("lowrank:rank=6,beta=0.8,refresh=2");
  flat::CodecState st;
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> a = normals(static_cast<size_t>(rows * cols), 40 + step);
    codec.encode(a.data(), rows, cols, st);
  }
  st.refresh_next = true;
  const std::string bytes = st.serialize();
  const flat::CodecState back = flat::CodecState::deserialize(bytes);
  CHECK(back.serialize() == bytes);
  CHECK(back.basis.data == st.basis.data);
  CHECK(back.sketch.data == st.sketch.data);
  CHECK(back.tracker.data == st.tracker.data);
  CHECK(back.basis.is(cols, 6));
  CHECK(back.basis_id == st.basis_id);
  CHECK(back.steps == 3);
  CHECK(back.refresh_next);
  // The same next packet from the restored state.
  const std::vector<float> a = normals(static_cast<size_t>(rows * cols), 77);
  flat::CodecState s1 = st, s2 = back;
  CHECK(codec.encode(a.data(), rows, cols, s1).serialize() == codec.encode(a.data(), rows, cols, s2).serialize());
  // An empty state too.
  CHECK(flat::CodecState::deserialize(flat::CodecState{}.serialize()).basis.empty());

  for (size_t n = 0; n < bytes.size(); n += 7) {
    CAPTURE(n);
    CHECK_THROWS_AS(flat::CodecState::deserialize(bytes.substr(0, n)), FormatError);
  }
  CHECK_THROWS_AS(flat::CodecState::deserialize(bytes + "x"), FormatError);
  std::string magic = bytes;
  magic[0] = 'X';
  CHECK_THROWS_AS(flat::CodecState::deserialize(magic), FormatError);
  std::string version = bytes;
  version[4] = 9;
  CHECK_THROWS_AS(flat::CodecState::deserialize(version), FormatError);
  flat::CodecState no_id = st;
  no_id.basis_id = 0;
  CHECK_THROWS_AS(flat::CodecState::deserialize(no_id.serialize()), FormatError);
  flat::CodecState nan = st;
  nan.sketch.data[3] = NAN;
  CHECK_THROWS_AS(flat::CodecState::deserialize(nan.serialize()), FormatError);
  flat::CodecState shape = st;
  shape.tracker.cols = 5000;  // a header that lies about the size
  CHECK_THROWS_AS(flat::CodecState::deserialize(shape.serialize()), FormatError);
}

TEST_CASE("flat act codec: malformed packets are refused before decoding") {
  const int64_t rows = 4, cols = 12;
  const std::vector<float> a = normals(static_cast<size_t>(rows * cols), 5);
  for (const char* spec : {"none", "q4:block=5", "topk:ratio=0.2", "lowrank:rank=2", "lowrank:rank=2,bits=4"}) {
    CAPTURE(spec);
    flat::CodecState st;
    const std::vector<uint8_t> bytes = flat::ActCodec(spec).encode(a.data(), rows, cols, st).serialize();
    for (size_t n = 0; n < bytes.size(); n += 5) {
      CAPTURE(n);
      CHECK_THROWS_AS(ActPacket::deserialize(bytes.data(), n), FormatError);
    }
    ActPacket p = ActPacket::deserialize(bytes.data(), bytes.size());
    ActPacket extra = p;
    extra.params.push_back(1);
    CHECK_THROWS_AS(flat::decode(extra), FormatError);
    ActPacket shape = p;
    shape.shape = {2};
    CHECK_THROWS_AS(flat::decode(shape), FormatError);
    if (p.format == ActFormat::kDense || p.format == ActFormat::kLowRank) {
      ActPacket inf = p;
      const float bad = INFINITY;
      std::memcpy(inf.data.data(), &bad, 4);
      CHECK_THROWS_AS(flat::decode(inf), FormatError);
    }
  }
  // Projected and cached packets need state.
  flat::ActCodec codec("lowrank:rank=2,refresh=2");
  flat::CodecState dev, cloud;
  const ActPacket first = codec.encode(a.data(), rows, cols, dev);
  const ActPacket cached = codec.encode(a.data(), rows, cols, dev);
  REQUIRE(cached.format == ActFormat::kLowRankCached);
  CHECK_THROWS_AS(flat::decode(cached), FormatError);
  flat::decode_activation(first, cloud);
  const ActPacket gp = flat::encode_gradient(a.data(), cached, flat::ActCodec("none"), cloud);
  CHECK_THROWS_AS(flat::decode(gp), FormatError);
  CHECK_THROWS_AS(flat::decode_gradient(gp, flat::CodecState{}, {rows, cols}), FormatError);
  // A gradient for a basis the cloud does not hold is refused on the cloud.
  CHECK_THROWS_AS(flat::encode_gradient(a.data(), cached, flat::ActCodec("none"), flat::CodecState{}), sparrow::Error);
}
