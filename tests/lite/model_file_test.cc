// The lite model file: round trip, and refusal of anything damaged, with the
// file named in the message.
#include "tests/sparrow_test.h"
// sparrow_test.h first: it drops glog's CHECK macros before doctest's.
#include <cstdio>
#include <cstring>
#include <fstream>

#include "lite/model_file.h"

namespace {

using namespace sparrow::lite;

ModelSpec small_spec() {
  ModelSpec m = builtin_spec("cnn");
  return m;
}

std::vector<float> ramp(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 1000) * 1e-3f - 0.5f;
  return v;
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

}  // namespace

TEST_CASE("lite model file round-trips every layer kind") {
  ModelSpec m;
  m.input_shape = {6};
  LayerSpec emb;
  emb.kind = LayerKind::kEmbedding;
  emb.in = 20;
  emb.out = 4;
  emb.param_names = {"emb_weight"};
  emb.param_shapes = {{20, 4}};
  LayerSpec ln;
  ln.kind = LayerKind::kLayerNorm;
  ln.in = 4;
  ln.eps = 1e-6f;
  ln.param_names = {"ln_weight", "ln_bias"};
  ln.param_shapes = {{4}, {4}};
  LayerSpec gelu;
  gelu.kind = LayerKind::kGelu;
  gelu.flag = 1;
  LayerSpec drop;
  drop.kind = LayerKind::kDropout;
  drop.p = 0.3f;
  LayerSpec flat;
  flat.kind = LayerKind::kFlatten;
  LayerSpec fc;
  fc.kind = LayerKind::kLinear;
  fc.in = 24;
  fc.out = 3;
  fc.bias = 0;
  fc.param_names = {"fc_weight"};
  fc.param_shapes = {{3, 24}};
  m.layers = {emb, ln, gelu, drop, flat, fc};
  const std::vector<float> values = ramp(Model(m).num_values());
  const auto bytes = encode_model_file(m, values);
  ModelFile f = decode_model_file(bytes.data(), bytes.size(), "mem");
  CHECK(f.values == values);
  CHECK(f.spec.input_shape == m.input_shape);
  REQUIRE(f.spec.layers.size() == m.layers.size());
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const LayerSpec &a = f.spec.layers[i], &b = m.layers[i];
    CHECK(a.kind == b.kind);
    CHECK(a.in == b.in);
    CHECK(a.out == b.out);
    CHECK(a.bias == b.bias);
    CHECK(a.flag == b.flag);
    CHECK(a.p == b.p);
    CHECK(a.eps == b.eps);
    CHECK(a.param_names == b.param_names);
    CHECK(a.param_shapes == b.param_shapes);
  }
  CHECK(encode_model_file(f.spec, f.values) == bytes);
}

TEST_CASE("lite model file saves, loads and refuses damage naming the file") {
  const std::string path = "lite_model_file_test.lite";
  const ModelSpec m = small_spec();
  const std::vector<float> values = ramp(Model(m).num_values());
  save_model_file(path, m, values);
  auto model = load_model(path);
  CHECK(model->get_values() == values);
  CHECK(model->param_names() == std::vector<std::string>{"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                                         "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"});

  std::ifstream in(path, std::ios::binary);
  const std::vector<uint8_t> good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string bad = "lite_model_file_test_bad.lite";
  auto refused = [&](const std::vector<uint8_t>& bytes, const std::string& why) {
    write_bytes(bad, bytes);
    CHECK_THROWS_WITH_AS(load_model(bad), doctest::Contains(bad.c_str()), sparrow::FormatError);
    CHECK_THROWS_WITH_AS(load_model(bad), doctest::Contains(why.c_str()), sparrow::FormatError);
  };
  SUBCASE("truncated anywhere") {
    for (size_t len : {size_t{0}, size_t{5}, size_t{12}, size_t{40}, good.size() / 2, good.size() - 1}) {
      INFO("length " << len);
      refused(std::vector<uint8_t>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(len)), len < 8 ? "magic"
                                                                                                   : len < 28
                                                                                                       ? "truncated"
                                                                                                       : "checksum");
    }
  }
  SUBCASE("a flipped bit in the architecture or the weights") {
    for (size_t at : {size_t{20}, size_t{60}, good.size() / 2, good.size() - 9}) {
      auto b = good;
      b[at] ^= 0x10;
      refused(b, "checksum");
    }
  }
  SUBCASE("another format, version or trailing bytes") {
    auto b = good;
    b[0] = 'X';
    refused(b, "magic");
    b = good;
    b[8] = 2;
    refused(b, "version 2");
    b = good;
    b.push_back(0);
    refused(b, "checksum");
  }
  SUBCASE("a missing file") {
    CHECK_THROWS_WITH_AS(load_model("lite_model_file_test_none.lite"),
                         doctest::Contains("lite_model_file_test_none.lite"), sparrow::Error);
  }
  std::remove(path.c_str());
  std::remove(bad.c_str());
}

TEST_CASE("lite model file refuses a consistent file whose model does not build") {
  // A well-formed, checksummed file whose layer kind is unknown to this runtime.
  ModelSpec m = builtin_spec("logreg", 5, 3);
  auto bytes = encode_model_file(m, std::vector<float>(18, 0.0f));
  // The first layer's kind follows magic, version, flags, input rank and dim, layer count.
  const size_t kind_at = 8 + 4 + 4 + 4 + 8 + 4;
  REQUIRE(bytes[kind_at] == 1);
  bytes[kind_at] = 99;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i + 8 < bytes.size(); ++i) h = (h ^ bytes[i]) * 0x100000001b3ull;
  std::memcpy(bytes.data() + bytes.size() - 8, &h, 8);
  CHECK_THROWS_WITH_AS(decode_model_file(bytes.data(), bytes.size(), "odd.lite"), doctest::Contains("layer kind 99"),
                       sparrow::FormatError);
}
