#include "tests/sparrow_test.h"

#include <cstring>

#include <cstdio>
#include <fstream>

#include "core/error.h"
#include "core/npy.h"

namespace npy = sparrow::npy;
using sparrow::FormatError;

TEST_CASE("npy: round trip of several shapes") {
  for (std::vector<int64_t> shape : {std::vector<int64_t>{}, {5}, {2, 3}, {2, 0, 4}, {3, 1, 2, 2}}) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<float> data(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) data[static_cast<size_t>(i)] = 0.5f * static_cast<float>(i) - 1.0f;
    const std::string bytes = npy::serialize(shape, data.data());
    CHECK(bytes.size() % 64 == static_cast<size_t>(n * 4) % 64);
    npy::Array a = npy::parse(bytes);
    CHECK(a.shape == shape);
    CHECK(a.data == data);
  }
}

TEST_CASE("npy: file write and read") {
  const std::string path = "npy_test_roundtrip.npy";
  std::vector<float> data = {1, 2, 3, 4, 5, 6};
  npy::write(path, {3, 2}, data.data());
  npy::Array a = npy::read(path);
  CHECK(a.shape == std::vector<int64_t>{3, 2});
  CHECK(a.data == data);
  std::remove(path.c_str());
  CHECK_THROWS_AS(npy::read("does-not-exist.npy"), FormatError);
}

TEST_CASE("npy: float64 (numpy's default) is converted only when asked, out-of-range values refused") {
  std::vector<float> data = {1, 2, 3, 4};
  std::string f64 = npy::serialize({2, 2}, data.data());
  // The same header as '<f8' with 8-byte values.
  f64.replace(f64.find("<f4"), 3, "<f8");
  const size_t start = f64.size() - 16;
  std::string body;
  for (double v : {0.1, -2.5, 1e-30, 3.0}) body.append(reinterpret_cast<const char*>(&v), 8);
  f64 = f64.substr(0, start) + body;
  CHECK_THROWS_AS(npy::parse(f64), FormatError);  // not without the option
  const npy::Array a = npy::parse(f64, /*convert_float64=*/true);
  CHECK(a.from_float64);
  CHECK(a.shape == std::vector<int64_t>{2, 2});
  CHECK(a.data[0] == 0.1f);
  CHECK(a.data[1] == -2.5f);
  CHECK(a.data[3] == 3.0f);
  CHECK_FALSE(npy::parse(npy::serialize({2, 2}, data.data()), true).from_float64);
  std::string big = f64;
  const double huge = 1e300;
  std::memcpy(&big[start + 8], &huge, 8);
  CHECK_THROWS_WITH_AS(npy::parse(big, true), doctest::Contains("does not fit float32"), FormatError);
  CHECK_THROWS_AS(npy::parse(f64.substr(0, f64.size() - 1), true), FormatError);  // truncated
}

TEST_CASE("npy: rejects malformed input") {
  std::vector<float> data = {1, 2, 3, 4};
  const std::string good = npy::serialize({2, 2}, data.data());
  SUBCASE("truncated anywhere") {
    for (size_t len = 0; len < good.size(); ++len) CHECK_THROWS_AS(npy::parse(good.substr(0, len)), FormatError);
  }
  SUBCASE("trailing bytes") { CHECK_THROWS_AS(npy::parse(good + "x"), FormatError); }
  SUBCASE("wrong dtype") {
    std::string bad = good;
    bad.replace(bad.find("<f4"), 3, "<f8");
    CHECK_THROWS_AS(npy::parse(bad), FormatError);
    bad = good;
    bad.replace(bad.find("<f4"), 3, ">f4");
    CHECK_THROWS_AS(npy::parse(bad), FormatError);
  }
  SUBCASE("fortran order") {
    std::string bad = good;
    bad.replace(bad.find("False"), 5, "True ");
    CHECK_THROWS_AS(npy::parse(bad), FormatError);
  }
  SUBCASE("bad magic") {
    std::string bad = good;
    bad[1] = 'X';
    CHECK_THROWS_AS(npy::parse(bad), FormatError);
  }
  SUBCASE("bad shape") {
    std::string bad = good;
    bad.replace(bad.find("(2, 2)"), 6, "(2,-2)");
    CHECK_THROWS_AS(npy::parse(bad), FormatError);
  }
}
