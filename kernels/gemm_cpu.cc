// gemm() (gemm.h): the reference variant, compiled for the architecture's
// baseline, and the dispatch to the vectorised ones. Eigen's namespace is
// renamed here too (gemm_eigen.h says why).
#define Eigen sparrow_kernels_eigen_reference
#define SPARROW_KERNELS_GEMM_FN gemm_reference
#include "kernels/gemm_eigen.h"
#undef Eigen

#include "kernels/cpu.h"
#include "kernels/gemm.h"

namespace sparrow::kernels {
namespace detail {
#if defined(SPARROW_KERNELS_X86)
// gemm_avx2.cc and gemm_avx512.cc.
void gemm_avx2(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b,
               float beta, float* c);
void gemm_avx512(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b,
                 float beta, float* c);
#endif
}  // namespace detail

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b, float beta,
          float* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m * n; ++i) c[i] = beta == 0.0f ? 0.0f : beta * c[i];
    return;
  }
#if defined(SPARROW_KERNELS_X86)
  const Isa isa = max_isa();
  if (isa == Isa::kAvx512) return detail::gemm_avx512(ta, tb, m, n, k, alpha, a, b, beta, c);
  if (isa == Isa::kAvx2) return detail::gemm_avx2(ta, tb, m, n, k, alpha, a, b, beta, c);
#endif
  detail::gemm_reference(ta, tb, m, n, k, alpha, a, b, beta, c);
}

const char* gemm_isa_name() {
#if defined(SPARROW_KERNELS_X86)
  const Isa isa = max_isa();
  if (isa == Isa::kAvx512) return "AVX-512";
  if (isa == Isa::kAvx2) return "AVX2+FMA";
#endif
#if defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "AVX2+FMA";
#elif defined(__ARM_NEON)
  return "NEON";
#elif defined(__SSE2__)
  return "SSE2";
#else
  return "scalar";
#endif
}

}  // namespace sparrow::kernels
