// The codecs without LibTorch (compression/flat_codec.h) against the LibTorch
// codecs: the same Encoded, byte for byte, and the same state after every step,
// the same state bytes, the same decode, the same errors. Plus the pieces the
// two no longer share with LibTorch: fp16/bf16 rounding against c10's, and the
// stale-state factor against ATen's mul_.
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "compression/codec_bits.h"
#include "compression/codec_util.h"
#include "compression/compressor.h"
#include "compression/flat_codec.h"
#include "core/error.h"
#include "tests/compression/flat_test_util.h"

using namespace sparrow::compression;
namespace fl = sparrow::compression::flat;
namespace cd = sparrow::compression::detail;
using namespace sparrow::compression::flat_test;

namespace {

// n ascending distinct positions in [0, numel), from `seed`.
std::vector<int64_t> mask_positions(int64_t numel, int64_t n, uint64_t seed) {
  return cd::seeded_indices(seed, static_cast<uint64_t>(std::min(n, numel)), numel);
}

at::Tensor as_tensor(const std::vector<int64_t>& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
  return t;
}

struct Contexts {
  Context torch;
  fl::Context flat;
};

Contexts contexts(const std::string& name, int64_t round, const std::vector<int64_t>* mask) {
  Contexts c;
  c.torch.name = c.flat.name = name;
  c.torch.seed = c.flat.seed = 17;
  c.torch.num_workers = c.flat.num_workers = 4;
  c.torch.round = c.flat.round = round;
  if (mask) {
    c.torch.mask = as_tensor(*mask);
    c.flat.has_mask = true;
    c.flat.mask = *mask;
  }
  return c;
}

// Both decodes of e into the same starting buffer, weight w: equal bytes.
void check_same_decode(const Encoded& e, const Contexts& c, float w) {
  const int64_t n = e.numel();
  at::Tensor start = at::randn({n});
  at::Tensor torch_out = start.clone();
  std::vector<float> flat_out(start.data_ptr<float>(), start.data_ptr<float>() + n);
  const std::string te = error_of([&] { decode_add(e, torch_out, w, c.torch); });
  const std::string fe = error_of([&] { fl::decode_add(e, flat_out.data(), n, w, c.flat); });
  CHECK(te == fe);
  CHECK(std::memcmp(torch_out.data_ptr<float>(), flat_out.data(), static_cast<size_t>(n) * sizeof(float)) == 0);
}

// Runs one spec on both sides over `steps` steps of shape `shape`, comparing
// everything after each.
void run_both(const std::string& spec, const std::vector<int64_t>& shape, const std::vector<int64_t>& rounds) {
  INFO("spec " << spec << ", shape of " << shape.size() << " dims, " << cd::numel_of(shape) << " values");
  auto torch_codec = make_compressor(spec);
  auto flat_codec = fl::make_codec(spec);
  CHECK(flat_codec->method() == torch_codec->method());
  CHECK(flat_codec->mask_ratio() == torch_codec->mask_ratio());
  CHECK(flat_codec->share_mean() == torch_codec->share_mean());
  State ts;
  fl::State fs;
  const int64_t n = cd::numel_of(shape);
  at::manual_seed(static_cast<uint64_t>(std::hash<std::string>()(spec) % 1000) + static_cast<uint64_t>(n));
  for (size_t s = 0; s < rounds.size(); ++s) {
    INFO("step " << s << ", round " << rounds[s]);
    at::Tensor x = at::randn(shape) * (s % 2 ? 0.01 : 3.0);
    if (s == 2 && n > 4) x.view({-1}).slice(0, 0, n / 3).zero_();  // exact zeros: top-k of fewer nonzeros
    // TCS: a mask from the second step on (as a server broadcasts one).
    std::vector<int64_t> mask;
    const bool masked = torch_codec->mask_ratio() > 0.0 && s > 0;
    if (masked) mask = mask_positions(n, static_cast<int64_t>(std::ceil(torch_codec->mask_ratio() * n)), 100 + s);
    const Contexts c = contexts("layer.w", rounds[s], masked ? &mask : nullptr);
    Encoded te, fe;
    const std::string terr = error_of([&] { te = torch_codec->encode(x, ts, c.torch); });
    const std::string ferr = error_of([&] { fe = flat_codec->encode(x.data_ptr<float>(), shape, fs, c.flat); });
    CHECK(terr == ferr);
    if (terr.empty()) {
      check_same(te, fe);
      check_same_decode(te, c, 1.0f);
      check_same_decode(te, c, -0.25f);
    }
    check_same(ts, fs);
  }
}

const std::vector<std::string>& specs() {
  static const std::vector<std::string> s = {
      "none",
      "fp16",
      "bf16",
      "topk:ratio=0.01",
      "topk:ratio=0.05,values=fp16,index=rice",
      "topk:ratio=0.02,values=int8,ef=1",
      "topk:ratio=0.02,values=bf16,ef=1,decay=0.5,max_age=3",
      "stc:ratio=0.01",
      "stc:ratio=0.03,values=int8,index=auto,decay=0.9",
      "stc:ratio=0.01,values=fp32,ef=0",
      "randomk:ratio=0.01",
      "randomk:ratio=0.05,ef=1",
      "threshold:tau=1.5",
      "threshold:tau=2,ef=0",
      "dgc:ratio=0.01",
      "dgc:ratio=0.001,momentum=0.9,clip=1,warmup=4",
      "dgc:ratio=0.05,dense1d=0,values=int8,index=rice,decay=0.5,max_age=2",
      "dgc:ratio=0.1,sample=1,values=fp16,momentum=0.5",
      "dgc:ratio=0.02,values=bf16,warmup=8,clip=0.5",
      "qsgd:levels=16",
      "qsgd:levels=4,bucket=100",
      "sign",
      "sign:ef=0",
      "terngrad",
      "terngrad:clip=2.5",
      "tcs:ratio=0.05,extra=0.01",
      "tcs:ratio=0.1,keep=0.3,values=sign,ef=0",
      "tcs:ratio=0.1,keep=0.5,share=mean,values=int8,block=16,decay=0.5,max_age=2",
      "tcs:ratio=0.05,values=fp16",
      "tcs:mask=all,keep=0.09,share=mean,values=sign,ef=0",
      "tcs:mask=all,keep=0.3,values=int8,block=64",
  };
  return s;
}

}  // namespace

TEST_CASE("flat codecs: every registered method runs without LibTorch, unknown ones are refused") {
  const std::vector<std::string> methods = fl::flat_methods();
  for (const char* m : {"none", "fp16", "bf16", "topk", "stc", "randomk", "threshold", "tcs", "dgc", "qsgd", "terngrad",
                        "sign", "powersgd", "acp"})
    CHECK(std::find(methods.begin(), methods.end(), m) != methods.end());
  // Every method LibTorch registers runs without it too, and no other.
  std::vector<std::string> all = registered_methods();
  std::sort(all.begin(), all.end());
  CHECK(methods == all);
  CHECK(error_of([] { fl::make_codec("bogus"); }).rfind("ConfigError: unknown compression method 'bogus'", 0) == 0);
  // Bad keys and values: the LibTorch registry's very messages.
  for (const char* spec : {"topk:ratio=2", "topk:foo=1", "dgc:momentum=1", "qsgd", "qsgd:levels=0", "threshold",
                           "tcs:share=mean", "tcs:mask=all,extra=0.1", "stc:values=sign,decay=2", "sign:ef=maybe"}) {
    INFO(spec);
    const std::string flat = error_of([&] { fl::make_codec(spec); });
    CHECK(!flat.empty());
    CHECK(flat == error_of([&] { make_compressor(spec); }));
  }
}

TEST_CASE("flat codecs: same bytes, states and decodes as the LibTorch codecs over several steps") {
  // Rounds with gaps (a client that skips rounds: decay and max_age act), and
  // a run without rounds (the tensor's own step count, DGC's warm-up by step).
  const std::vector<int64_t> with_gaps = {0, 1, 4, 5, 9, 10};
  const std::vector<int64_t> no_rounds = {-1, -1, -1, -1};
  const std::vector<std::vector<int64_t>> shapes = {{3000}, {40, 50}, {7}, {70000}, {}};
  for (const std::string& spec : specs()) {
    for (const auto& shape : shapes) run_both(spec, shape, with_gaps);
    run_both(spec, {600, 3}, no_rounds);
  }
}

TEST_CASE("flat codecs: a non-finite input is refused with the same error, before any state changes") {
  for (const std::string& spec : specs()) {
    INFO(spec);
    auto torch_codec = make_compressor(spec);
    auto flat_codec = fl::make_codec(spec);
    State ts;
    fl::State fs;
    const Contexts c = contexts("w", 0, nullptr);
    at::Tensor x = at::randn({100, 10});
    torch_codec->encode(x, ts, c.torch);
    flat_codec->encode(x.data_ptr<float>(), {100, 10}, fs, c.flat);
    const std::string before = fs.serialize();
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      at::Tensor y = at::randn({100, 10});
      y.view({-1})[517] = bad;
      const std::string terr = error_of([&] { torch_codec->encode(y, ts, c.torch); });
      const std::string ferr = error_of([&] { flat_codec->encode(y.data_ptr<float>(), {100, 10}, fs, c.flat); });
      CHECK(!ferr.empty());
      CHECK(terr == ferr);
      CHECK(fs.serialize() == before);
      check_same(ts, fs);
    }
  }
}

TEST_CASE("flat decode_add: malformed updates and wrong sizes give the same errors and leave out unchanged") {
  auto topk = make_compressor("topk:ratio=0.1");
  auto qsgd = make_compressor("qsgd:levels=8");
  auto tern = make_compressor("terngrad");
  State st;
  const at::Tensor x = at::randn({1000});
  const Encoded sparse = topk->encode(x, st, {});
  const Encoded quant = qsgd->encode(x, st, {});
  const Encoded ternary = tern->encode(x, st, {});
  std::vector<Encoded> bad;
  Encoded e = sparse;
  e.values.resize(e.values.size() - 4);  // one value short
  bad.push_back(e);
  e = sparse;
  e.indices.push_back(0x80);  // a truncated varint
  bad.push_back(e);
  e = sparse;
  e.count += 1;
  bad.push_back(e);
  e = quant;
  e.values.resize(e.values.size() / 2);  // the Elias-gamma stream ends early: found while decoding
  bad.push_back(e);
  e = ternary;
  e.values[3] = 0xff;  // code 3: found while decoding
  bad.push_back(e);
  e = ternary;
  e.scales[0] = std::numeric_limits<float>::quiet_NaN();
  bad.push_back(e);
  for (size_t i = 0; i < bad.size(); ++i) {
    INFO("malformed update " << i);
    at::Tensor torch_out = at::randn({1000});
    std::vector<float> flat_out(torch_out.data_ptr<float>(), torch_out.data_ptr<float>() + 1000);
    const std::vector<float> start = flat_out;
    const std::string terr = error_of([&] { decode_add(bad[i], torch_out, 1.0f); });
    const std::string ferr = error_of([&] { fl::decode_add(bad[i], flat_out.data(), 1000, 1.0f); });
    CHECK(ferr.rfind("FormatError: ", 0) == 0);
    CHECK(terr == ferr);
    CHECK(flat_out == start);
    CHECK(std::memcmp(torch_out.data_ptr<float>(), start.data(), 4000) == 0);
  }
  std::vector<float> out(999, 1.0f);
  const std::string wrong_n = error_of([&] { fl::decode_add(sparse, out.data(), 999, 1.0f); });
  at::Tensor t999 = at::ones({999});
  CHECK(wrong_n == error_of([&] { decode_add(sparse, t999, 1.0f); }));
  CHECK(wrong_n.rfind("FormatError: ", 0) == 0);
  CHECK(out == std::vector<float>(999, 1.0f));

  // A masked update needs the same mask on both sides.
  auto tcs = make_compressor("tcs:ratio=0.05");
  const std::vector<int64_t> mask = mask_positions(1000, 50, 3);
  const Contexts with = contexts("w", 2, &mask);
  const Encoded masked = tcs->encode(x, st, with.torch);
  check_same_decode(masked, with, 0.5f);
  const Contexts without = contexts("w", 2, nullptr);
  std::vector<float> o(1000, 0.0f);
  const std::string no_mask = error_of([&] { fl::decode_add(masked, o.data(), 1000, 1.0f, without.flat); });
  CHECK(no_mask.find("made for a mask of 50 positions") != std::string::npos);
  CHECK(o == std::vector<float>(1000, 0.0f));

  // The low-rank formats: tests/compression/flat_powersgd_test.cc.
}

TEST_CASE("flat::State: the same bytes as compression::State, both ways, and version 1 read") {
  State t;
  t.step = 42;
  t.last_round = 7;
  t.tensors["u"] = at::randn({3, 4});
  t.tensors["residual"] = at::randn({5});
  t.tensors["empty"] = at::zeros({0, 2});
  const std::string bytes = t.serialize();
  const fl::State f = fl::State::deserialize(bytes);
  check_same(t, f);
  CHECK(f.serialize() == bytes);
  check_same(State::deserialize(f.serialize()), f);
  // Version 1 (no last_round) reads as last_round = -1, on both sides.
  std::string v1 = bytes.substr(0, 4) + std::string("\x01\x00\x00\x00", 4) + bytes.substr(8, 8) + bytes.substr(24);
  const fl::State f1 = fl::State::deserialize(v1);
  CHECK(f1.last_round == -1);
  check_same(State::deserialize(v1), f1);
  // Malformed bytes: the same FormatError.
  for (const std::string& b :
       {bytes.substr(0, bytes.size() - 1), bytes + "x", std::string("SPSX") + bytes.substr(4), bytes.substr(0, 3)})
    CHECK(error_of([&] { fl::State::deserialize(b); }) == error_of([&] { State::deserialize(b); }));
  // slot(): zeros of the shape, reset when the shape changes.
  fl::State s;
  s.slot("r", {2, 3}).data[4] = 1.5f;
  CHECK(s.slot("r", {2, 3}).data[4] == 1.5f);
  CHECK(s.slot("r", {3, 2}).data == std::vector<float>(6, 0.0f));
}

TEST_CASE("codec core: fp16 and bf16 rounding equal c10's for every class of float") {
  // Every 2^32/97-th bit pattern (all exponents, both signs, NaNs, infinities,
  // subnormals) and the exact halfway cases around each fp16/bf16 value.
  auto check_one = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    const uint16_t h = cd::fp16_from_float(f), b = cd::bf16_from_float(f);
    if (h != c10::Half(f).x || b != c10::BFloat16(f).x) {
      FAIL_CHECK("bits " << u << ": fp16 " << h << " vs " << c10::Half(f).x << ", bf16 " << b << " vs "
                         << c10::BFloat16(f).x);
      return false;
    }
    return true;
  };
  bool ok = true;
  for (uint64_t u = 0; u <= 0xffffffffull && ok; u += 97) ok = check_one(static_cast<uint32_t>(u));
  for (uint32_t h = 0; h < 65536 && ok; ++h) {
    const float f16 = static_cast<float>(c10::Half(static_cast<uint16_t>(h), c10::Half::from_bits()));
    uint32_t bits;
    std::memcpy(&bits, &f16, 4);
    for (uint32_t d : {0u, 1u, 0xfffu, 0x1000u, 0x1001u}) ok = ok && check_one(bits + d) && check_one(bits - d);
    ok = ok && check_one((h << 16) | 0x8000u) && check_one((h << 16) | 0x7fffu);  // bf16 halfway and below
    const float back = cd::fp16_to_float(static_cast<uint16_t>(h));
    CHECK((std::memcmp(&back, &f16, 4) == 0 || (std::isnan(back) && std::isnan(f16))));
    const float b16 = cd::bf16_to_float(static_cast<uint16_t>(h));
    const float c10b = static_cast<float>(c10::BFloat16(static_cast<uint16_t>(h), c10::BFloat16::from_bits()));
    CHECK((std::memcmp(&b16, &c10b, 4) == 0));
  }
  CHECK(ok);
}

namespace {

// One named buffer as kernel slots, to age without LibTorch.
struct VectorSlots final : cd::Slots {
  std::vector<float> data;
  uint64_t step_ = 0;
  int64_t last_ = -1;
  float* slot(const char*, const std::vector<int64_t>&) override { return data.data(); }
  float* find(const char*, int64_t* n) override {
    *n = static_cast<int64_t>(data.size());
    return data.data();
  }
  void erase(const char*) override { data.clear(); }
  uint64_t& step() override { return step_; }
  int64_t& last_round() override { return last_; }
};

}  // namespace

TEST_CASE("codec core: stale-state ageing multiplies as ATen's mul_ does, and resets as zero_") {
  for (double decay : {0.3, 0.5, 0.9, 0.123456789}) {
    for (int64_t skipped : {1, 2, 5}) {
      INFO("decay " << decay << ", " << skipped << " rounds skipped");
      const cd::StalePolicy policy{decay, 4};
      State t;
      t.last_round = 10;
      t.tensors["residual"] = at::randn({4096}) * 1e3;
      VectorSlots v;
      v.last_ = 10;
      v.data.assign(t.tensors["residual"].data_ptr<float>(), t.tensors["residual"].data_ptr<float>() + 4096);
      Context c;
      c.round = 10 + skipped + 1;
      CHECK(cd::age_state(t, c, policy, {"residual"}) == skipped);
      CHECK(cd::age_state(v, cd::view_of(c), policy, {"residual"}) == skipped);
      CHECK(v.last_ == t.last_round);
      CHECK(std::memcmp(v.data.data(), t.tensors["residual"].data_ptr<float>(), 4096 * 4) == 0);
    }
  }
  // More than max_age rounds skipped: all zero (+0.0, as zero_()).
  VectorSlots v;
  v.last_ = 0;
  v.data.assign(8, -2.0f);
  Context c;
  c.round = 10;
  CHECK(cd::age_state(v, cd::view_of(c), cd::StalePolicy{0.5, 3}, {"residual"}) == 9);
  for (float f : v.data) CHECK((f == 0.0f && !std::signbit(f)));
}
