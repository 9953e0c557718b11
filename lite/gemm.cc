#include "lite/gemm.h"

#include <cstdlib>

#include "lite/tensor.h"

#define SPARROW_LITE_GEMM_FN gemm_base
#include "lite/gemm_eigen.h"

namespace sparrow::lite {
namespace detail {
#if defined(SPARROW_LITE_GEMM_AVX512)
// gemm_avx512.cc; called only where cpu_has_avx512().
void gemm_avx512(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b,
                 float beta, float* c);
#endif
}  // namespace detail

namespace {

using GemmFn = void (*)(bool, bool, int64_t, int64_t, int64_t, float, const float*, const float*, float, float*);

bool cpu_has_avx512() {
#if defined(SPARROW_LITE_GEMM_AVX512)
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return yes;
#else
  return false;
#endif
}

GemmFn pick(const std::string& name) {
#if defined(SPARROW_LITE_GEMM_AVX512)
  if ((name.empty() || name == "avx512") && cpu_has_avx512()) return detail::gemm_avx512;
#endif
  if (name.empty() || name == "base") return detail::gemm_base;
  std::string known;
  for (const std::string& v : gemm_variants()) known += (known.empty() ? "" : ", ") + v;
  SPARROW_LITE_CHECK(false, "no GEMM variant '" << name << "' on this build and CPU (available: " << known << ")");
  return nullptr;
}

// Read on every call; set once from SPARROW_LITE_SIMD, then by set_gemm_variant.
GemmFn& active() {
  static GemmFn fn = [] {
    const char* env = std::getenv("SPARROW_LITE_SIMD");
    return pick(env && std::string(env) == "base" ? "base" : "");
  }();
  return fn;
}

}  // namespace

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b, float beta,
          float* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m * n; ++i) c[i] = beta == 0.0f ? 0.0f : beta * c[i];
    return;
  }
  active()(ta, tb, m, n, k, alpha, a, b, beta, c);
}

std::vector<std::string> gemm_variants() {
  std::vector<std::string> v{"base"};
  if (cpu_has_avx512()) v.emplace_back("avx512");
  return v;
}

void set_gemm_variant(const std::string& name) { active() = pick(name); }

const char* simd_name() {
#if defined(SPARROW_LITE_GEMM_AVX512)
  if (active() == detail::gemm_avx512) return "AVX-512";
#endif
#if defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "AVX2+FMA";
#elif defined(__AVX__)
  return "AVX";
#elif defined(__ARM_NEON)
  return "NEON";
#elif defined(__SSE2__)
  return "SSE2";
#else
  return "scalar";
#endif
}

void check_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#if defined(__AVX512F__)
  SPARROW_LITE_CHECK(__builtin_cpu_supports("avx512f"),
                     "this sparrow-lite build needs AVX-512 (compiled with SPARROW_LITE_ARCH_FLAGS) and this CPU "
                     "lacks it: rebuild with -DSPARROW_LITE_ARCH_FLAGS= for a portable build");
#endif
#if defined(__AVX2__) || defined(__FMA__)
  SPARROW_LITE_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
                     "this sparrow-lite build needs AVX2 and FMA (compiled with SPARROW_LITE_ARCH_FLAGS) and this "
                     "CPU lacks them: rebuild with -DSPARROW_LITE_ARCH_FLAGS= for a portable build");
#endif
#endif
}

}  // namespace sparrow::lite
