// gemm() against a double-precision reference in every variant this build
// and CPU can run (reference, avx2, avx512), and the CPU probe and its
// override (kernels/cpu.h). LibTorch-free: also runs in a device build.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/cpu.h"
#include "kernels/gemm.h"
#include "tests/kernels/variants.h"

namespace {

using namespace sparrow::kernels;
using sparrow::kernels::testing::for_each_variant;

std::vector<float> random(size_t n, uint64_t key) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = sparrow::rng::uniform01(key, i) * 2 - 1;
  return v;
}

}  // namespace

TEST_CASE("kernels gemm: every variant equals a double-precision reference") {
  struct Dims {
    int64_t m, n, k;
  };
  // Odd sizes off every kernel's register block, and the CNN's conv2 shape.
  const Dims dims[] = {{1, 1, 1}, {3, 5, 7}, {17, 33, 65}, {64, 196, 800}, {50, 3, 129}};
  for_each_variant([&](Isa) {
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
        INFO("m n k " << d.m << " " << d.n << " " << d.k << ", ta " << ta << " tb " << tb);
        CHECK(worst < 1e-5);
      }
  });
}

TEST_CASE("kernels gemm: beta 0 ignores NaN in C, k 0 scales C") {
  for_each_variant([](Isa) {
    const std::vector<float> a = {1, 2, 3, 4}, b = {5, 6, 7, 8};
    std::vector<float> c(4, std::nanf(""));
    gemm(false, false, 2, 2, 2, 1.0f, a.data(), b.data(), 0.0f, c.data());
    CHECK(c == std::vector<float>{19, 22, 43, 50});
    gemm(false, false, 2, 2, 0, 1.0f, a.data(), b.data(), 2.0f, c.data());
    CHECK(c == std::vector<float>{38, 44, 86, 100});
  });
}

TEST_CASE("kernels cpu: variants are ordered, forced in scope, named in gemm_isa_name") {
  const std::vector<Isa> have = supported_isas();
  REQUIRE(!have.empty());
  CHECK(have.front() == Isa::kReference);
  CHECK(
      std::is_sorted(have.begin(), have.end(), [](Isa a, Isa b) { return static_cast<int>(a) < static_cast<int>(b); }));
  const CpuFeatures& f = cpu_features();
  CHECK(f.avx512 == (have.back() == Isa::kAvx512));
  CHECK(f.avx2_fma == (have.size() >= 2));
  const Isa before = max_isa();
  {
    ScopedIsa ref(Isa::kReference);
    CHECK(max_isa() == Isa::kReference);
    CHECK_FALSE(libraries_enabled());
    CHECK_FALSE(isa_enabled(Isa::kAvx2));
    const std::string name = gemm_isa_name();
    CHECK(name != "AVX-512");
    CHECK(name != "AVX2+FMA");
    if (f.avx2_fma) {
      ScopedIsa avx2(Isa::kAvx2);
      CHECK(isa_enabled(Isa::kAvx2));
      CHECK_FALSE(isa_enabled(Isa::kAvx512));
      CHECK(libraries_enabled());
      CHECK(std::string(gemm_isa_name()) == "AVX2+FMA");
    }
    CHECK(max_isa() == Isa::kReference);  // restored
  }
  CHECK(max_isa() == before);
  if (!f.avx512) {
    CHECK_THROWS_AS(static_cast<void>(ScopedIsa(Isa::kAvx512)), sparrow::Error);
  } else {
    ScopedIsa top(Isa::kAvx512);
    CHECK(std::string(gemm_isa_name()) == "AVX-512");
  }
}

TEST_CASE("kernels cpu: SPARROW_KERNELS limits the variants") {
  // Set by CTest for this binary's second run (tests/CMakeLists.txt); without
  // it the default is the best the CPU has.
  const char* env = std::getenv("SPARROW_KERNELS");
  const std::string v = env ? env : "";
  if (v == "reference") {
    CHECK(max_isa() == Isa::kReference);
    CHECK_FALSE(libraries_enabled());
  } else if (v.empty() || v == "auto") {
    CHECK(max_isa() == supported_isas().back());
    CHECK(libraries_enabled());
  }
}
