// gemm() against a double-precision reference, in every variant this build
// and CPU can run (the baseline and, on an AVX-512 x86-64 CPU, the AVX-512
// build that gemm() picks there by default): the layers' tests against
// LibTorch run on the default variant only.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "lite/gemm.h"

namespace {

using namespace sparrow::lite;

std::vector<float> random(size_t n, uint64_t key) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = sparrow::rng::uniform01(key, i) * 2 - 1;
  return v;
}

// Restores the default variant when a test case ends, passed or not.
struct VariantGuard {
  ~VariantGuard() { set_gemm_variant(""); }
};

}  // namespace

TEST_CASE("lite gemm: every variant equals a double-precision reference") {
  VariantGuard guard;
  struct Dims {
    int64_t m, n, k;
  };
  // Odd sizes off every kernel's register block, and the CNN's conv2 shape.
  const Dims dims[] = {{1, 1, 1}, {3, 5, 7}, {17, 33, 65}, {64, 196, 800}, {50, 3, 129}};
  for (const std::string& variant : gemm_variants()) {
    set_gemm_variant(variant);
    for (const Dims& d : dims)
      for (int t = 0; t < 4; ++t) {
        const bool ta = t & 1, tb = t & 2;
        const float alpha = t == 3 ? 0.5f : 1.0f, beta = t >= 2 ? 1.5f : 0.0f;
        const auto a = random(static_cast<size_t>(d.m * d.k), 1), b = random(static_cast<size_t>(d.k * d.n), 2);
        auto c = random(static_cast<size_t>(d.m * d.n), 3);
        const auto c0 = c;
        gemm(ta, tb, d.m, d.n, d.k, alpha, a.data(), b.data(), beta, c.data());
        double worst = 0;
        for (int64_t i = 0; i < d.m; ++i)
          for (int64_t j = 0; j < d.n; ++j) {
            double s = 0, mag = 0;
            for (int64_t p = 0; p < d.k; ++p) {
              const double x = a[static_cast<size_t>(ta ? p * d.m + i : i * d.k + p)];
              const double y = b[static_cast<size_t>(tb ? j * d.k + p : p * d.n + j)];
              s += x * y;
              mag += std::abs(x * y);
            }
            const double want = alpha * s + beta * c0[static_cast<size_t>(i * d.n + j)];
            const double scale = std::abs(alpha) * mag + std::abs(beta * c0[static_cast<size_t>(i * d.n + j)]) + 1e-30;
            worst = std::max(worst, std::abs(c[static_cast<size_t>(i * d.n + j)] - want) / scale);
          }
        INFO("variant " << variant << ", m n k " << d.m << " " << d.n << " " << d.k << ", ta " << ta << " tb " << tb);
        CHECK(worst < 1e-5);
      }
  }
}

TEST_CASE("lite gemm: beta 0 ignores NaN in C, k 0 scales C") {
  VariantGuard guard;
  for (const std::string& variant : gemm_variants()) {
    set_gemm_variant(variant);
    const std::vector<float> a = {1, 2, 3, 4}, b = {5, 6, 7, 8};
    std::vector<float> c(4, std::nanf(""));
    gemm(false, false, 2, 2, 2, 1.0f, a.data(), b.data(), 0.0f, c.data());
    CHECK(c == std::vector<float>{19, 22, 43, 50});
    gemm(false, false, 2, 2, 0, 1.0f, a.data(), b.data(), 2.0f, c.data());
    CHECK(c == std::vector<float>{38, 44, 86, 100});
  }
}

TEST_CASE("lite gemm: variants are named, an unknown one is refused") {
  VariantGuard guard;
  const auto variants = gemm_variants();
  REQUIRE(!variants.empty());
  CHECK(variants.front() == "base");
  CHECK_THROWS_AS(set_gemm_variant("avx1024"), sparrow::Error);
  if (std::find(variants.begin(), variants.end(), "avx512") != variants.end()) {
    set_gemm_variant("avx512");
    CHECK(std::string(simd_name()) == "AVX-512");
  }
  set_gemm_variant("base");
  CHECK(std::string(simd_name()) != "");
}
