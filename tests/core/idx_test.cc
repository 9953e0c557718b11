#include "tests/sparrow_test.h"

#include <ATen/ATen.h>
#include <zlib.h>

#include <cstdio>
#include <fstream>
#include <sys/stat.h>

#include "core/error.h"
#include "core/idx.h"
#include "core/models.h"

using sparrow::FormatError;

namespace {

std::string idx_bytes(const std::vector<int>& shape, const std::vector<uint8_t>& data) {
  std::string b = {0, 0, 8, static_cast<char>(shape.size())};
  for (int d : shape) {
    b += static_cast<char>((d >> 24) & 0xff);
    b += static_cast<char>((d >> 16) & 0xff);
    b += static_cast<char>((d >> 8) & 0xff);
    b += static_cast<char>(d & 0xff);
  }
  b.append(data.begin(), data.end());
  return b;
}

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  gzclose(f);
}

}  // namespace

TEST_CASE("idx: plain and gzip files") {
  std::vector<uint8_t> data(2 * 3 * 4);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7);
  const std::string bytes = idx_bytes({2, 3, 4}, data);
  { std::ofstream("idx_test_plain.idx", std::ios::binary) << bytes; }
  write_gz("idx_test.idx.gz", bytes);
  for (const char* path : {"idx_test_plain.idx", "idx_test.idx.gz"}) {
    at::Tensor t = sparrow::core::read_idx(path);
    CHECK(t.sizes() == at::IntArrayRef({2, 3, 4}));
    CHECK(t.flatten()[5].item<int>() == 35);
  }
  SUBCASE("truncated data") {
    write_gz("idx_test_bad.idx.gz", bytes.substr(0, bytes.size() - 3));
    CHECK_THROWS_AS(sparrow::core::read_idx("idx_test_bad.idx.gz"), FormatError);
  }
  SUBCASE("truncated gzip stream") {
    std::ifstream in("idx_test.idx.gz", std::ios::binary);
    std::string gz((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream("idx_test_cut.idx.gz", std::ios::binary) << gz.substr(0, gz.size() / 2);
    CHECK_THROWS_AS(sparrow::core::read_idx("idx_test_cut.idx.gz"), FormatError);
  }
  SUBCASE("more data than the header says") {
    write_gz("idx_test_bad.idx.gz", bytes + "xyz");
    CHECK_THROWS_WITH_AS(sparrow::core::read_idx("idx_test_bad.idx.gz"),
                         doctest::Contains("27 data bytes, header says 24"), FormatError);
  }
  SUBCASE("header cut short") {
    write_gz("idx_test_bad.idx.gz", bytes.substr(0, 9));
    CHECK_THROWS_WITH_AS(sparrow::core::read_idx("idx_test_bad.idx.gz"), doctest::Contains("bad IDX header"),
                         FormatError);
  }
  SUBCASE("wrong type byte") {
    std::string bad = bytes;
    bad[2] = 0x0d;  // float
    write_gz("idx_test_bad.idx.gz", bad);
    CHECK_THROWS_AS(sparrow::core::read_idx("idx_test_bad.idx.gz"), FormatError);
  }
  CHECK_THROWS_AS(sparrow::core::read_idx("no-such-file.gz"), FormatError);
  for (const char* p : {"idx_test_plain.idx", "idx_test.idx.gz", "idx_test_bad.idx.gz", "idx_test_cut.idx.gz"})
    std::remove(p);
}

TEST_CASE("idx: Fashion-MNIST from the Debian package") {
  struct stat st;
  if (::stat(sparrow::core::kFashionMnistDir, &st) != 0) {
    MESSAGE("dataset-fashion-mnist not installed; skipped");
    return;
  }
  auto test = sparrow::core::load_mnist_format(sparrow::core::kFashionMnistDir, "test");
  CHECK(test.images.sizes() == at::IntArrayRef({10000, 1, 28, 28}));
  CHECK(test.labels.sizes() == at::IntArrayRef({10000}));
  CHECK(test.labels.min().item<int64_t>() == 0);
  CHECK(test.labels.max().item<int64_t>() == 9);
  // Normalised with the training set's mean and std: roughly zero mean, unit variance.
  CHECK(std::abs(test.images.mean().item<double>()) < 0.1);
  CHECK(test.images.std().item<double>() == doctest::Approx(1.0).epsilon(0.1));
  // The one-pass table gives exactly the floats of ATen's whole-tensor expression.
  const at::Tensor raw =
      sparrow::core::read_idx(std::string(sparrow::core::kFashionMnistDir) + "/t10k-images-idx3-ubyte.gz");
  const at::Tensor expected = ((raw.to(at::kFloat).div_(255.0f) - 0.2860f) / 0.3530f).unsqueeze(1);
  CHECK(at::equal(test.images, expected));
  CHECK_THROWS_AS(sparrow::core::normalize_bytes(raw.to(at::kFloat), 0.f, 1.f), FormatError);
  // Gathering rows while normalising (the simulator's client-major copy) is
  // index_select of the normalised images; the uint8 load is the file's bytes.
  const at::Tensor rows = at::randperm(10000, at::kLong).narrow(0, 0, 777);
  CHECK(at::equal(sparrow::core::normalize_bytes(raw, 0.2860f, 0.3530f, rows),
                  expected.squeeze(1).index_select(0, rows)));
  CHECK_THROWS(sparrow::core::normalize_bytes(raw, 0.2860f, 0.3530f, at::full({1}, 10000, at::kLong)));
  const auto bytes = sparrow::core::load_mnist_bytes(sparrow::core::kFashionMnistDir, "test");
  CHECK(at::equal(bytes.images.squeeze(1), raw));
  CHECK(at::equal(bytes.labels, test.labels));
  CHECK_THROWS_AS(sparrow::core::load_mnist_format("/nonexistent", "test"), sparrow::ConfigError);
}

TEST_CASE("models: mlp shapes, names and deterministic init") {
  auto a = sparrow::core::make_model("mlp", 3);
  auto b = sparrow::core::make_model("mlp", 3);
  int64_t params = 0;
  std::vector<std::string> names;
  for (const auto& p : a->named_parameters()) {
    params += p.value().numel();
    names.push_back(p.key());
  }
  CHECK(params == 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10);
  CHECK(names.front() == "fc1.weight");
  CHECK(at::equal(a->named_parameters()["fc1.weight"], b->named_parameters()["fc1.weight"]));
  CHECK(a->forward(at::zeros({5, 1, 28, 28})).sizes() == at::IntArrayRef({5, 10}));
  CHECK_THROWS_AS(sparrow::core::make_model("vgg99", 0), sparrow::ConfigError);
}
