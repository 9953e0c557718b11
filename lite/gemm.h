#pragma once
// Matrix products on row-major float arrays, the only heavy math of the
// runtime. Eigen does the work (header-only; vectorised for SSE/AVX and NEON);
// its headers stay inside gemm.cc so that nothing else is compiled with them.

#include <cstdint>

namespace sparrow::lite {

// C[m, n] = alpha * op(A) op(B) + beta * C, with op(A) [m, k] (A itself, or the
// transpose of a [k, m] array when ta), op(B) [k, n] likewise; all
// row-major and contiguous. beta = 0 ignores what C held (NaN included).
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b, float beta,
          float* c);

// The instruction set the math was compiled for ("AVX2+FMA", "SSE2", "NEON", ...).
const char* simd_name();

// Throws sparrow::Error when this CPU lacks an instruction set the runtime was
// compiled for (a build with SPARROW_LITE_ARCH_FLAGS=-mavx2;-mfma on an older
// x86 CPU), instead of dying of SIGILL mid-step. Model loading calls it.
void check_cpu();

}  // namespace sparrow::lite
