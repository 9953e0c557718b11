#include "lite/gemm.h"

#include <Eigen/Core>

#include "lite/tensor.h"

namespace sparrow::lite {
namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Map = Eigen::Map<RowMat>;
using CMap = Eigen::Map<const RowMat>;

template <typename A, typename B>
void run(const A& a, const B& b, float alpha, float beta, Map& c) {
  if (beta == 0.0f) {
    if (alpha == 1.0f)
      c.noalias() = a * b;
    else
      c.noalias() = alpha * (a * b);
  } else {
    if (beta != 1.0f) c *= beta;
    if (alpha == 1.0f)
      c.noalias() += a * b;
    else
      c.noalias() += alpha * (a * b);
  }
}

}  // namespace

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b, float beta,
          float* c) {
  Map cm(c, m, n);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.0f)
      cm.setZero();
    else
      cm *= beta;
    return;
  }
  CMap am(a, ta ? k : m, ta ? m : k);
  CMap bm(b, tb ? n : k, tb ? k : n);
  if (ta && tb)
    run(am.transpose(), bm.transpose(), alpha, beta, cm);
  else if (ta)
    run(am.transpose(), bm, alpha, beta, cm);
  else if (tb)
    run(am, bm.transpose(), alpha, beta, cm);
  else
    run(am, bm, alpha, beta, cm);
}

const char* simd_name() {
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
