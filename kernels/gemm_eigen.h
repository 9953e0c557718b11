#pragma once
// The GEMM on Eigen, written once and compiled once per instruction set
// (gemm.h). Private to gemm_cpu.cc, gemm_avx2.cc and gemm_avx512.cc.
//
// A file that includes this defines SPARROW_KERNELS_GEMM_FN, the name of the
// function to define, and renames Eigen's namespace by macro first: Eigen is
// all inline templates, and two copies with the same symbol names compiled
// for different instruction sets would be merged by the linker into one,
// which could hand AVX-512 code to an AVX2 CPU.

#include <Eigen/Core>
#include <cstdint>

namespace sparrow::kernels::detail {
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

// gemm.h's contract; m, n, k > 0 (gemm() handles the empty cases).
void SPARROW_KERNELS_GEMM_FN(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                             const float* b, float beta, float* c) {
  Map cm(c, m, n);
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

}  // namespace sparrow::kernels::detail
