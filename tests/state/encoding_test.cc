// state_encoding: bf16 client states (state/encoding.h) against the exact
// fp32 ones: the rounding, which tensors it touches, the record format (old
// rows still load), the store (cache and file agree) and the file size.
#include "tests/sparrow_test.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "core/bytes.h"
#include "core/error.h"
#include "state/client_state.h"
#include "state/encoding.h"
#include "state/store.h"
#include "tests/state/temp_db.h"

using sparrow::state::ClientState;
using sparrow::state::ClientStateStore;
using sparrow::state::Encoding;

namespace {

using sparrow::state::testing::TempDb;

uint16_t bf16_of(float f) {
  uint16_t b = 0;
  size_t bad = 0;
  REQUIRE(sparrow::state::to_bf16(&f, &b, 1, &bad));
  return b;
}

float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// What ATen's own float -> bfloat16 -> float gives (round to nearest even).
at::Tensor aten_round(const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kFloat); }

// A state with every kind of tensor: the narrowable slots (residual, u, v),
// one that is not (PowerSGD's q), float32, float64, int64 and float16 controls.
ClientState mixed_state() {
  at::manual_seed(7);
  ClientState s;
  s.rng = 0xfeedbeefcafe1234ULL;
  s.rounds = 9;
  sparrow::compression::State dgc;
  dgc.step = 12;
  dgc.last_round = 33;
  dgc.tensors["u"] = at::randn({16, 8});
  dgc.tensors["v"] = at::randn({16, 8}) * 1e-3;
  s.compressor["fc.weight"] = dgc;
  sparrow::compression::State psgd;
  psgd.step = 2;
  psgd.tensors["residual"] = at::randn({8});
  psgd.tensors["q"] = at::randn({8, 2});
  s.compressor["fc.bias"] = psgd;
  s.control["fc.weight"] = at::randn({16, 8});
  s.control["wide"] = at::randn({5}, at::TensorOptions().dtype(at::kDouble));
  s.control["count"] = at::arange(4, at::TensorOptions().dtype(at::kLong));
  s.control["half"] = at::randn({3}).to(at::kHalf);
  return s;
}

// The state a bf16 round trip must give: narrowable slots and float32
// controls rounded, everything else as it was.
void check_bf16_of(const ClientState& orig, const ClientState& back) {
  CHECK(back.rng == orig.rng);
  CHECK(back.rounds == orig.rounds);
  REQUIRE(back.compressor.size() == orig.compressor.size());
  for (const auto& [name, cs] : orig.compressor) {
    const auto& b = back.compressor.at(name);
    CHECK(b.step == cs.step);
    CHECK(b.last_round == cs.last_round);
    REQUIRE(b.tensors.size() == cs.tensors.size());
    for (const auto& [slot, t] : cs.tensors) {
      const at::Tensor& got = b.tensors.at(slot);
      CHECK((got.scalar_type() == at::kFloat));
      const bool narrow = sparrow::state::narrowable_slot(slot);
      const std::string where = "compressor " + name + " slot " + slot;  // INFO may not capture bindings
      INFO(where);
      CHECK(at::equal(got, narrow ? aten_round(t) : t));
    }
  }
  REQUIRE(back.control.size() == orig.control.size());
  for (const auto& [name, t] : orig.control) {
    const at::Tensor& got = back.control.at(name);
    const std::string where = "control " + name;
    INFO(where);
    CHECK((got.scalar_type() == t.scalar_type()));
    CHECK(at::equal(got, t.scalar_type() == at::kFloat ? aten_round(t) : t));
  }
}

}  // namespace

TEST_CASE("bf16 rounding: nearest even, as ATen rounds, and refuses what bf16 cannot hold") {
  CHECK(bf16_of(1.0f) == 0x3f80);
  CHECK(bf16_of(-2.0f) == 0xc000);
  // Ties go to the even neighbour: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7.
  CHECK(bf16_of(bits_to_float(0x3f808000u)) == 0x3f80);
  CHECK(bf16_of(bits_to_float(0x3f818000u)) == 0x3f82);
  CHECK(bf16_of(bits_to_float(0x3f808001u)) == 0x3f81);  // past the tie: up
  CHECK(bf16_of(0.0f) == 0x0000);
  CHECK(bf16_of(-0.0f) == 0x8000);
  CHECK(bf16_of(bits_to_float(0x00000001u)) == 0x0000);  // the smallest denormal rounds to zero

  SUBCASE("random values agree with ATen bit for bit") {
    at::manual_seed(3);
    const at::Tensor x = at::cat({at::randn({4096}), at::randn({4096}) * 1e30, at::randn({4096}) * 1e-40});
    std::vector<uint16_t> ours(static_cast<size_t>(x.numel()));
    REQUIRE(sparrow::state::to_bf16(x.data_ptr<float>(), ours.data(), ours.size(), nullptr));
    const at::Tensor theirs = x.to(at::kBFloat16).contiguous();
    CHECK(std::memcmp(ours.data(), theirs.data_ptr(), ours.size() * 2) == 0);
    std::vector<float> wide(ours.size());
    sparrow::state::from_bf16(ours.data(), wide.data(), ours.size());
    CHECK(at::equal(at::from_blob(wide.data(), {x.numel()}, at::kFloat), aten_round(x)));
  }
  SUBCASE("NaN, infinities and values that round past bf16's largest are refused") {
    const float big_ok = bits_to_float(0x7f7f7fffu);   // rounds down to bf16's largest, 0x7f7f
    const float too_big = bits_to_float(0x7f7f8000u);  // the tie rounds up to infinity
    CHECK(bf16_of(big_ok) == 0x7f7f);
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity(), too_big, -too_big, std::numeric_limits<float>::max()}) {
      float v[3] = {1.0f, bad, 2.0f};
      uint16_t out[3];
      size_t first = 99;
      CHECK_FALSE(sparrow::state::to_bf16(v, out, 3, &first));
      CHECK(first == 1);
      CHECK_FALSE(sparrow::state::round_to_bf16(v, 3, &first));
      CHECK(v[0] == 1.0f);  // checked before anything changed
    }
  }
  SUBCASE("the key's values") {
    CHECK(sparrow::state::parse_encoding("fp32") == Encoding::kFp32);
    CHECK(sparrow::state::parse_encoding("bf16") == Encoding::kBf16);
    CHECK_FALSE(sparrow::state::valid_encoding("fp16"));
    CHECK_THROWS_WITH_AS(sparrow::state::parse_encoding("BF16"), doctest::Contains("state_encoding"),
                         sparrow::ConfigError);
  }
}

TEST_CASE("client state in bf16: residuals, momentum and float32 controls narrowed, the rest exact") {
  const ClientState s = mixed_state();
  const std::string fp32 = s.serialize(Encoding::kFp32), bf16 = s.serialize(Encoding::kBf16);
  uint32_t v32 = 0, v16 = 0;
  std::memcpy(&v32, fp32.data() + 4, 4);
  std::memcpy(&v16, bf16.data() + 4, 4);
  CHECK(v32 == 1);  // fp32 writes the format every build reads
  CHECK(v16 == 2);  // bf16 says so
  CHECK(static_cast<uint8_t>(bf16[8]) == 1);
  CHECK(fp32 == s.serialize());  // the default is fp32

  const ClientState back = ClientState::deserialize(bf16);
  check_bf16_of(s, back);
  // Narrowed: u, v, residual (128 + 128 + 8 floats) and the float32 control
  // (128), 2 bytes less each; the headers differ by a few bytes per tensor.
  const size_t saved = fp32.size() - bf16.size();
  CHECK(saved >= 2 * 392 - 32);
  CHECK(saved <= 2 * 392 + 64);

  SUBCASE("round_to gives in memory what a round trip gives, and then the round trip is exact") {
    ClientState r = s.deep_copy();
    r.round_to(Encoding::kBf16);
    check_bf16_of(s, r);
    const ClientState again = ClientState::deserialize(r.serialize(Encoding::kBf16));
    check_bf16_of(r, again);  // rounding a rounded value changes nothing
    ClientState f = s.deep_copy();
    f.round_to(Encoding::kFp32);
    check_bf16_of(s, ClientState::deserialize(f.serialize(Encoding::kBf16)));
    CHECK(at::equal(f.control.at("fc.weight"), s.control.at("fc.weight")));  // fp32: untouched
  }
  SUBCASE("a non-finite residual or control is refused, naming it, and round_to changes nothing") {
    for (int which = 0; which < 3; ++which) {
      ClientState bad = s.deep_copy();
      at::Tensor& t = which == 0   ? bad.compressor.at("fc.weight").tensors.at("v")
                      : which == 1 ? bad.control.at("fc.weight")
                                   : bad.compressor.at("fc.bias").tensors.at("residual");
      t.view(-1)[5] = which == 2 ? std::numeric_limits<float>::max() : std::nanf("");
      const std::string name = which == 0 ? "slot 'v'" : which == 1 ? "control 'fc.weight'" : "slot 'residual'";
      CHECK_THROWS_WITH_AS(bad.serialize(Encoding::kBf16), doctest::Contains(name.c_str()), sparrow::Error);
      const at::Tensor u_before = bad.compressor.at("fc.weight").tensors.at("u").clone();
      CHECK_THROWS_WITH_AS(bad.round_to(Encoding::kBf16), doctest::Contains("state_encoding"), sparrow::Error);
      CHECK(at::equal(bad.compressor.at("fc.weight").tensors.at("u"), u_before));
      CHECK(bad.serialize(Encoding::kFp32).size() == fp32.size());  // fp32 stores it as today
    }
    // A non-finite value in a slot bf16 keeps in fp32 is stored as fp32 would.
    ClientState q = s.deep_copy();
    q.compressor.at("fc.bias").tensors.at("q").view(-1)[0] = std::numeric_limits<float>::infinity();
    CHECK(std::isinf(ClientState::deserialize(q.serialize(Encoding::kBf16))
                         .compressor.at("fc.bias")
                         .tensors.at("q")
                         .view(-1)[0]
                         .item<float>()));
  }
  SUBCASE("every truncation and a wrong stored form are refused") {
    for (size_t n = 0; n < bf16.size(); n += (n < 200 ? 1 : 97))
      CHECK_THROWS_AS(ClientState::deserialize(bf16.substr(0, n)), sparrow::FormatError);
    CHECK_THROWS_AS(ClientState::deserialize(bf16 + "x"), sparrow::FormatError);
    std::string b = bf16;
    b[8] = 7;  // unknown encoding
    CHECK_THROWS_WITH_AS(ClientState::deserialize(b), doctest::Contains("encoding"), sparrow::FormatError);
    // The int64 control stored as bf16: not a narrowing the format has.
    ClientState c;
    c.control["n"] = at::arange(3, at::TensorOptions().dtype(at::kLong));
    std::string cb = c.serialize(Encoding::kBf16);
    const size_t at = cb.rfind('n');
    REQUIRE(at != std::string::npos);
    CHECK(static_cast<uint8_t>(cb[at + 1]) == 5);
    CHECK(static_cast<uint8_t>(cb[at + 2]) == 5);
    cb[at + 2] = 4;
    CHECK_THROWS_WITH_AS(ClientState::deserialize(cb), doctest::Contains("stored as"), sparrow::FormatError);
  }
}

TEST_CASE("client state: a version 1 record (every database before state_encoding) still loads") {
  // Written by hand as docs/state.md describes version 1, not by this build's
  // serialize(): rng, rounds, one compressor entry (a compression::State blob)
  // and one float32 control.
  using sparrow::core::put_raw;
  sparrow::compression::State cs;
  cs.step = 4;
  cs.last_round = 2;
  cs.tensors["residual"] = at::tensor({0.1f, -0.2f, 0.3f});
  const std::string blob = cs.serialize();
  std::string v1 = "SPCL";
  put_raw<uint32_t>(v1, 1);
  put_raw<uint64_t>(v1, 77);
  put_raw<uint64_t>(v1, 5);
  put_raw<uint32_t>(v1, 1);
  put_raw<uint32_t>(v1, 2);
  v1 += "fc";
  put_raw<uint64_t>(v1, blob.size());
  v1 += blob;
  put_raw<uint32_t>(v1, 1);
  put_raw<uint32_t>(v1, 1);
  v1 += "c";
  put_raw<uint8_t>(v1, 1);   // float32
  put_raw<uint32_t>(v1, 1);  // dims
  put_raw<int64_t>(v1, 2);
  const float c[2] = {1.5f, 0.1f};
  v1.append(reinterpret_cast<const char*>(c), 8);

  const ClientState s = ClientState::deserialize(v1);
  CHECK(s.rng == 77);
  CHECK(s.rounds == 5);
  CHECK(s.compressor.at("fc").step == 4);
  CHECK(s.compressor.at("fc").last_round == 2);
  CHECK(at::equal(s.compressor.at("fc").tensors.at("residual"), cs.tensors.at("residual")));  // exact
  CHECK(at::equal(s.control.at("c"), at::tensor({1.5f, 0.1f})));
  CHECK(s.serialize(Encoding::kFp32) == v1);  // fp32 still writes exactly this
}

TEST_CASE("store with bf16: cache and file agree, rows of either encoding load, non-finite refused") {
  TempDb db("store");
  const ClientState s = mixed_state();
  ClientStateStore::Options bf;
  bf.encoding = Encoding::kBf16;
  {
    auto store = ClientStateStore::open(db.path(), bf);
    store->put(1, s);
    ClientState moved = s.deep_copy();
    store->put(2, std::move(moved));
    check_bf16_of(s, *store->get(1));  // from the cache: already what the file will hold
    check_bf16_of(s, *store->get(2));
    ClientState bad = s.deep_copy();
    bad.control.at("fc.weight").view(-1)[0] = std::numeric_limits<float>::infinity();
    CHECK_THROWS_WITH_AS(store->put(3, bad), doctest::Contains("control 'fc.weight'"), sparrow::Error);
    CHECK_FALSE(store->get(3).has_value());
    store->flush();
    ClientStateStore::Options none;
    none.cache_bytes = 0;  // an observer reading the file
    auto file = ClientStateStore::open(db.path(), none);
    check_bf16_of(s, *file->get(1));
    check_bf16_of(s, *file->get(2));
  }
  {
    // fp32 rows next to bf16 ones: a store of either encoding reads both, and
    // writes only new rows its way.
    auto fp = ClientStateStore::open(db.path());
    fp->put(4, s);
    fp->flush();
    check_bf16_of(s, *fp->get(1));
    CHECK(at::equal(fp->get(4)->control.at("fc.weight"), s.control.at("fc.weight")));
  }
  {
    auto again = ClientStateStore::open(db.path(), bf);
    CHECK(at::equal(again->get(4)->control.at("fc.weight"), s.control.at("fc.weight")));  // still exact
    check_bf16_of(s, *again->get(1));
  }
}

TEST_CASE("store with bf16: a residual-dominated state file is at most 55% of the fp32 one") {
  TempDb a("size32"), b("size16");
  at::manual_seed(11);
  ClientState dgc;
  for (const char* name : {"fc1.weight", "fc2.weight"}) {
    sparrow::compression::State cs;
    cs.tensors["u"] = at::randn({200, 100});
    cs.tensors["v"] = at::randn({200, 100});
    dgc.compressor[name] = cs;
  }
  ClientStateStore::Options bf;
  bf.encoding = Encoding::kBf16;
  {
    auto s32 = ClientStateStore::open(a.path());
    auto s16 = ClientStateStore::open(b.path(), bf);
    for (int64_t c = 0; c < 40; ++c) {
      s32->put(c, dgc);
      s16->put(c, dgc);
    }
  }  // closing merges the -wal files
  const auto n32 = std::filesystem::file_size(a.path()), n16 = std::filesystem::file_size(b.path());
  INFO("fp32 " << n32 << " bytes, bf16 " << n16);
  CHECK(n32 > 40u * 4 * 80000);
  CHECK(n16 * 100 <= n32 * 55);
}
