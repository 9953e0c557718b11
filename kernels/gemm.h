#pragma once
// Matrix products on row-major float arrays: the lite runtime's only heavy
// math, and the reference the other GEMMs here are tested against. Eigen does
// the work (header-only); its headers stay inside gemm_eigen.h, compiled once
// per variant:
//   reference  gemm_cpu.cc, the architecture's baseline (SSE2 on x86-64,
//              NEON on aarch64): runs on any CPU of the architecture;
//   avx2       gemm_avx2.cc, AVX2 + FMA (x86-64);
//   avx512     gemm_avx512.cc, AVX-512 (x86-64; 1.1x avx2 on the CNN's conv2).
// gemm() runs the best one kernels/cpu.h enables.

#include <cstdint>

namespace sparrow::kernels {

// C[m, n] = alpha * op(A) op(B) + beta * C, with op(A) [m, k] (A itself, or the
// transpose of a [k, m] array when ta), op(B) [k, n] likewise; all
// row-major and contiguous. beta = 0 ignores what C held (NaN included).
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b, float beta,
          float* c);

// What gemm() runs on now: "AVX-512", "AVX2+FMA", or the reference's
// instruction set ("SSE2", "NEON", "scalar").
const char* gemm_isa_name();

}  // namespace sparrow::kernels
