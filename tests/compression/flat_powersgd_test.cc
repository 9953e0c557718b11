// PowerSGD without LibTorch (flat::make_codec("powersgd:..."), the lite
// client's) against the LibTorch codec: the same Encoded byte for byte (so the
// decoded P·Qᵀ agrees exactly, well within the 1e-5 the lite client promises),
// the same state after every step and across a hand-over of the state bytes
// between the two, the same errors; and flat::decode_add of kLowRank and
// kLowRankSparse against compression::decode_add (acp: flat_acp_test.cc).
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "compression/codec_bits.h"
#include "compression/compressor.h"
#include "compression/flat_codec.h"
#include "core/error.h"
#include "tests/compression/flat_test_util.h"

using namespace sparrow::compression;
namespace fl = sparrow::compression::flat;
namespace cd = sparrow::compression::detail;
using namespace sparrow::compression::flat_test;

namespace {

// Largest |a − b| / largest |a| (0 when a is all zero and b equals it).
double rel_diff(const float* a, const float* b, int64_t n) {
  double diff = 0.0, scale = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(a[i])));
  }
  return scale > 0.0 ? diff / scale : diff;
}

// The decoded update of e by each side, from zeros.
void check_decodes_agree(const Encoded& e) {
  const int64_t n = e.numel();
  at::Tensor torch_out = at::zeros({n});
  std::vector<float> flat_out(static_cast<size_t>(n), 0.0f);
  decode_add(e, torch_out, 1.0f);
  fl::decode_add(e, flat_out.data(), n, 1.0f);
  CHECK(rel_diff(torch_out.data_ptr<float>(), flat_out.data(), n) <= 1e-6);
}

struct Contexts {
  Context torch;
  fl::Context flat;
};

Contexts contexts(const std::string& name, int64_t round) {
  Contexts c;
  c.torch.name = c.flat.name = name;
  c.torch.seed = c.flat.seed = 23;
  c.torch.round = c.flat.round = round;
  return c;
}

// One step on both sides; the inputs of step s: random, scaled, an all-zero
// one at step 3 (Q = M'ᵀP = 0 with ef=0: the warm start must refill).
void step_both(Compressor& tc, fl::Codec& fc, State& ts, fl::State& fs, const std::vector<int64_t>& shape, size_t s,
               int64_t round) {
  INFO("step " << s << ", round " << round);
  at::Tensor x = at::randn(shape) * (s % 2 ? 0.01 : 3.0);
  if (s == 3) x.zero_();
  const Contexts c = contexts("conv.weight", round);
  Encoded te, fe;
  const std::string terr = error_of([&] { te = tc.encode(x, ts, c.torch); });
  const std::string ferr = error_of([&] { fe = fc.encode(x.data_ptr<float>(), shape, fs, c.flat); });
  CHECK(terr == ferr);
  if (terr.empty()) {
    check_same(te, fe);
    check_decodes_agree(te);
  }
  check_same(ts, fs);
}

void run_both(const std::string& spec, const std::vector<std::vector<int64_t>>& shapes) {
  INFO("spec " << spec);
  auto tc = make_compressor(spec);
  auto fc = fl::make_codec(spec);
  CHECK(fc->method() == tc->method());
  at::manual_seed(static_cast<uint64_t>(std::hash<std::string>()(spec) % 1000));
  const std::vector<int64_t> rounds = {0, 1, 4, 5, 9, 10, 11};
  for (const auto& shape : shapes) {
    INFO("shape of " << shape.size() << " dims, " << cd::numel_of(shape) << " values");
    State ts;
    fl::State fs;
    for (size_t s = 0; s < rounds.size(); ++s) step_both(*tc, *fc, ts, fs, shape, s, rounds[s]);
    // The state bytes of one read by the other: each carries on from the other's.
    State ts2 = State::deserialize(fs.serialize());
    fl::State fs2 = fl::State::deserialize(ts.serialize());
    for (size_t s = 0; s < 2; ++s) step_both(*tc, *fc, ts2, fs2, shape, s + 10, 20 + static_cast<int64_t>(s));
  }
}

}  // namespace

TEST_CASE("flat powersgd: same bytes, decodes and states as the LibTorch codec over several steps") {
  // 2-D, a 4-D conv weight, a tall and a wide matrix, and a 1-D bias (dense).
  const std::vector<std::vector<int64_t>> shapes = {{40, 50}, {16, 3, 5, 5}, {600, 3}, {3, 700}, {7}, {300}};
  for (const char* spec : {
           "powersgd:rank=1",
           "powersgd:rank=2",
           "powersgd:rank=3,values=fp16",
           "powersgd:rank=4,values=bf16",
           "powersgd:rank=2,values=int8",
           "powersgd:rank=4,warm_start=0",
           "powersgd:rank=2,ef=0",
           "powersgd:rank=1,ef=0,warm_start=0,values=int8",
           "powersgd:rank=3,iters=3",
           "powersgd:rank=2,decay=0.5,max_age=3",
           "powersgd:rank=2,min_rate=1",
           "powersgd:rank=2,sparse=0.01",
           "powersgd:rank=3,sparse=0.05,values=int8",
           "powersgd:rank=1,sparse=0.02,values=fp16,warm_start=0",
       })
    run_both(spec, shapes);
}

TEST_CASE("flat powersgd: a changed shape resets the warm-start Q and the residual on both sides") {
  auto tc = make_compressor("powersgd:rank=2");
  auto fc = fl::make_codec("powersgd:rank=2");
  State ts;
  fl::State fs;
  at::manual_seed(5);
  step_both(*tc, *fc, ts, fs, {40, 50}, 0, 0);
  step_both(*tc, *fc, ts, fs, {50, 40}, 1, 1);
  step_both(*tc, *fc, ts, fs, {2000}, 2, 2);  // dense: the state stays
  step_both(*tc, *fc, ts, fs, {50, 40}, 4, 3);
}

TEST_CASE("flat powersgd: a 1-D tensor and a too-small matrix travel dense fp32, as in LibTorch") {
  auto fc = fl::make_codec("powersgd:rank=4");
  fl::State fs;
  const std::vector<float> x(100, 0.5f);
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{100}, std::vector<int64_t>{10, 10}}) {
    const Encoded e = fc->encode(x.data(), shape, fs, {});
    CHECK(e.format == Format::kDense);
    CHECK(e.value_type == ValueType::kF32);
    CHECK(e.shape == shape);
  }
  CHECK(fs.tensors.empty());
  CHECK(fs.step == 2);
}

TEST_CASE("flat powersgd: bad specs and inputs give the LibTorch codec's errors") {
  for (const char* spec : {"powersgd", "powersgd:rank=0", "powersgd:rank=2,iters=17", "powersgd:rank=2,sparse=2",
                           "powersgd:rank=2,sparse=0.1,ef=0", "powersgd:rank=2,values=fp8",
                           "powersgd:rank=2,min_rate=0.5", "powersgd:rank=2,decay=0.5,ef=0", "powersgd:rank=2,foo=1"}) {
    INFO(spec);
    const std::string flat = error_of([&] { fl::make_codec(spec); });
    CHECK(flat.rfind("ConfigError: ", 0) == 0);
    CHECK(flat == error_of([&] { make_compressor(spec); }));
  }
  auto tc = make_compressor("powersgd:rank=2");
  auto fc = fl::make_codec("powersgd:rank=2");
  State ts;
  fl::State fs;
  at::Tensor x = at::randn({30, 40});
  x.view({-1})[517] = std::numeric_limits<float>::quiet_NaN();
  const std::string terr = error_of([&] { tc->encode(x, ts, {}); });
  const std::string ferr = error_of([&] { fc->encode(x.data_ptr<float>(), {30, 40}, fs, {}); });
  CHECK(!ferr.empty());
  CHECK(terr == ferr);
  CHECK(fs.tensors.empty());
  CHECK(fs.step == 0);
  // An overflowing product: both refuse the non-finite factor.
  at::Tensor big = at::full({30, 40}, 3e38f);
  CHECK(error_of([&] { tc->encode(big, ts, {}); }) == error_of([&] {
          fc->encode(big.data_ptr<float>(), {30, 40}, fs, {});
        }));
}

TEST_CASE("flat decode_add: kLowRank and kLowRankSparse as compression::decode_add") {
  at::manual_seed(9);
  for (const char* spec : {"powersgd:rank=3", "powersgd:rank=2,values=int8", "powersgd:rank=2,sparse=0.05,values=bf16",
                           "powersgd:rank=4,sparse=0.02,values=int8"}) {
    INFO(spec);
    auto tc = make_compressor(spec);
    State ts;
    const Encoded e = tc->encode(at::randn({16, 3, 5, 5}), ts, {});
    REQUIRE((e.format == Format::kLowRank || e.format == Format::kLowRankSparse));
    for (float w : {1.0f, -0.3f}) {
      at::Tensor start = at::randn({1200});
      at::Tensor torch_out = start.clone();
      std::vector<float> flat_out(start.data_ptr<float>(), start.data_ptr<float>() + 1200);
      decode_add(e, torch_out, w);
      fl::decode_add(e, flat_out.data(), 1200, w);
      CHECK(rel_diff(torch_out.data_ptr<float>(), flat_out.data(), 1200) <= 1e-6);
    }
    // Malformed: the same FormatError, out unchanged.
    Encoded bad = e;
    bad.values.resize(bad.values.size() - 1);
    std::vector<float> out(1200, 1.0f);
    at::Tensor tout = at::ones({1200});
    const std::string ferr = error_of([&] { fl::decode_add(bad, out.data(), 1200, 1.0f); });
    CHECK(ferr.rfind("FormatError: ", 0) == 0);
    CHECK(ferr == error_of([&] { decode_add(bad, tout, 1.0f); }));
    CHECK(out == std::vector<float>(1200, 1.0f));
    if (e.format == Format::kLowRankSparse) {
      bad = e;
      bad.indices.assign(bad.indices.size(), 0xff);  // positions past the end
      const std::string perr = error_of([&] { fl::decode_add(bad, out.data(), 1200, 1.0f); });
      CHECK(perr.rfind("FormatError: ", 0) == 0);
      CHECK(out == std::vector<float>(1200, 1.0f));
    }
    std::vector<float> short_out(1199, 0.0f);
    CHECK(error_of([&] { fl::decode_add(e, short_out.data(), 1199, 1.0f); }).rfind("FormatError: ", 0) == 0);
  }
}
