// The pieces the lite client computes without LibTorch against the LibTorch
// code they must equal: SecAgg+'s ring quantisation
// (federation::quantise_update), local DP (federation::local_dp_update), the
// model digest (core::model_digest) of the lite model against the LibTorch
// one, and the labels of a data folder.
#include "tests/sparrow_test.h"
// sparrow_test.h first (glog/doctest CHECK clash).
#include <torch/torch.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/model_digest.h"
#include "core/models.h"
#include "federation/client_pipeline.h"
#include "lite/model.h"
#include "liteclient/data.h"
#include "liteclient/layout.h"
#include "liteclient/local_dp.h"
#include "liteclient/ring.h"
#include "secagg/secagg.h"

namespace {

using namespace sparrow;

liteclient::Layout mlp_layout() {
  lite::Model m(lite::builtin_spec("mlp"));
  return liteclient::Layout::make(m.param_names(), m.param_shapes());
}

std::string npy(const std::string& descr, size_t n, const void* data, size_t width) {
  std::string h = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + std::to_string(n) + ",), }";
  while ((10 + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += static_cast<char>(h.size() & 0xff);
  out += static_cast<char>(h.size() >> 8);
  out += h;
  out.append(static_cast<const char*>(data), n * width);
  return out;
}

}  // namespace

TEST_CASE("liteclient ring: quantise_update over flat floats gives federation::quantise_update's bytes") {
  const liteclient::Layout l = mlp_layout();
  torch::manual_seed(11);
  std::map<std::string, at::Tensor> delta;
  std::vector<float> flat;
  for (size_t k = 0; k < l.names.size(); ++k) {
    // Some coordinates beyond the clip, so clipping is compared too.
    const at::Tensor t = torch::randn(l.shapes[k]) * 0.4;
    delta[l.names[k]] = t;
    const float* p = t.data_ptr<float>();
    flat.insert(flat.end(), p, p + t.numel());
  }
  const double clip = 1.0, weight = 0.3;
  const double scale = secagg::ring_scale(5, clip);
  for (uint64_t key : {uint64_t{1}, uint64_t{0xfeedbeefULL}}) {
    const federation::RingUpdate ref = federation::quantise_update(l.names, delta, weight, clip, scale, key);
    const liteclient::RingUpdate got = liteclient::quantise_update(l, flat, weight, clip, scale, key);
    REQUIRE(got.x.size() == ref.x.size());
    CHECK(std::memcmp(got.x.data(), ref.x.data(), got.x.size() * sizeof(uint32_t)) == 0);
    CHECK(got.clipped == ref.clipped);
    CHECK(got.clipped > 0);
  }
  // Another key rounds differently: the comparison can tell.
  const auto a = liteclient::quantise_update(l, flat, weight, clip, scale, 1);
  const auto b = liteclient::quantise_update(l, flat, weight, clip, scale, 2);
  CHECK(a.x != b.x);
  flat.pop_back();
  CHECK_THROWS_AS(liteclient::quantise_update(l, flat, weight, clip, scale, 1), Error);
}

TEST_CASE("liteclient layout: the lite model's digest is the LibTorch model's, names and offsets in model order") {
  for (const char* name : {"mlp", "cnn"}) {
    lite::Model m(lite::builtin_spec(name));
    const auto l = liteclient::Layout::make(m.param_names(), m.param_shapes());
    CHECK(liteclient::model_digest(l) == core::model_digest(*core::make_model(name, 0)));
    CHECK(l.total == m.num_values());
    int64_t off = 0;
    for (size_t k = 0; k < l.names.size(); ++k) {
      CHECK(l.offsets[k] == off);
      CHECK(l.find(l.names[k]) == static_cast<int64_t>(k));
      off += l.sizes[k];
    }
  }
  // Another model: another digest (the server would refuse the Hello).
  CHECK(liteclient::model_digest(mlp_layout()) != core::model_digest(*core::make_model("cnn", 0)));
  CHECK_THROWS_AS(liteclient::Layout::make({"a", "a"}, {{1}, {2}}), Error);
}

TEST_CASE("liteclient data: labels of every integer dtype and whole floats, others refused") {
  const int64_t i8[3] = {0, 9, 4};
  CHECK(liteclient::parse_npy_labels(npy("<i8", 3, i8, 8), "y.npy") == std::vector<int64_t>{0, 9, 4});
  const uint8_t u1[2] = {7, 1};
  CHECK(liteclient::parse_npy_labels(npy("|u1", 2, u1, 1), "y.npy") == std::vector<int64_t>{7, 1});
  const float f4[2] = {2.0f, 3.0f};
  CHECK(liteclient::parse_npy_labels(npy("<f4", 2, f4, 4), "y.npy") == std::vector<int64_t>{2, 3});
  const float half[1] = {2.5f};
  CHECK_THROWS_AS(liteclient::parse_npy_labels(npy("<f4", 1, half, 4), "y.npy"), FormatError);
  CHECK_THROWS_AS(liteclient::parse_npy_labels(npy("<c8", 1, i8, 8), "y.npy"), FormatError);
  std::string cut = npy("<i8", 3, i8, 8);
  cut.pop_back();
  CHECK_THROWS_AS(liteclient::parse_npy_labels(cut, "y.npy"), FormatError);
}

TEST_CASE("liteclient local DP: clipping and noise give federation::local_dp_update's floats") {
  const liteclient::Layout l = mlp_layout();
  torch::manual_seed(5);
  std::map<std::string, at::Tensor> ref;
  std::vector<float> flat;
  for (size_t k = 0; k < l.names.size(); ++k) {
    const at::Tensor t = torch::randn(l.shapes[k]) * 0.01;
    ref[l.names[k]] = t.clone();
    const float* p = t.data_ptr<float>();
    flat.insert(flat.end(), p, p + t.numel());
  }
  SUBCASE("clipped") {
    const double norm_ref = federation::local_dp_update(ref, 0.5, 0.3, 99);
    const double norm = liteclient::local_dp_update(l, flat, 0.5, 0.3, 99);
    CHECK(norm == doctest::Approx(norm_ref).epsilon(1e-12));
    CHECK(norm > 0.5);  // the clip took effect
  }
  SUBCASE("within the clip") {
    federation::local_dp_update(ref, 1e6, 0.3, 7);
    liteclient::local_dp_update(l, flat, 1e6, 0.3, 7);
  }
  size_t same = 0;
  for (size_t k = 0; k < l.names.size(); ++k) {
    const at::Tensor t = ref.at(l.names[k]).contiguous();
    same += std::memcmp(t.data_ptr<float>(), flat.data() + l.offsets[k], sizeof(float) * t.numel()) == 0;
  }
  CHECK(same == l.names.size());
  CHECK_THROWS_AS(liteclient::parse_local_dp("central:clip=1,noise=1"), ConfigError);
  CHECK(liteclient::parse_local_dp("none").on == false);
  const auto d = liteclient::parse_local_dp("local:clip=2,noise=0.5,delta=1e-6");
  CHECK(d.on);
  CHECK(d.clip == 2);
  CHECK(d.noise == 0.5);
  CHECK(d.delta == 1e-6);
}
