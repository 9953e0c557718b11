#pragma once
// Matrix products on row-major float arrays, the only heavy math of the
// runtime. Eigen does the work (header-only; vectorised for SSE/AVX and NEON);
// its headers stay inside gemm.cc and gemm_avx512.cc (gemm_eigen.h) so that
// nothing else is compiled with them.
//
// Variants: "base", compiled with SPARROW_LITE_ARCH_FLAGS (AVX2+FMA by
// default on x86-64, NEON on aarch64), and on x86-64 "avx512", chosen at run
// time when the CPU has AVX-512 F, VL and DQ. One binary stays portable to
// AVX2 machines and is faster on AVX-512 ones.

#include <cstdint>
#include <string>
#include <vector>

namespace sparrow::lite {

// C[m, n] = alpha * op(A) op(B) + beta * C, with op(A) [m, k] (A itself, or the
// transpose of a [k, m] array when ta), op(B) [k, n] likewise; all
// row-major and contiguous. beta = 0 ignores what C held (NaN included).
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, const float* b, float beta,
          float* c);

// The instruction set gemm() runs now ("AVX-512", "AVX2+FMA", "SSE2", "NEON", ...).
const char* simd_name();

// The variants this build holds that this CPU can run, best last ("base",
// then "avx512" where available).
std::vector<std::string> gemm_variants();

// Picks the variant gemm() runs: one of gemm_variants(), or "" for the best
// (the default, unless the environment sets SPARROW_LITE_SIMD=base at the
// first call). For tests and measurements; not safe while another thread is
// in gemm(). Throws sparrow::Error naming the variants for any other name.
void set_gemm_variant(const std::string& name);

// Throws sparrow::Error when this CPU lacks an instruction set the runtime was
// compiled for (a build with SPARROW_LITE_ARCH_FLAGS=-mavx2;-mfma on an older
// x86 CPU), instead of dying of SIGILL mid-step. Model loading calls it.
void check_cpu();

}  // namespace sparrow::lite
