// The AVX-512 variant of gemm() (gemm.h), compiled with -mavx512f -mavx512vl
// -mavx512dq -mfma on x86-64 only; gemm_cpu.cc calls it only where
// kernels/cpu.h enables avx512. Nothing may be included before gemm_eigen.h
// that would emit inline functions shared with other files.
#if defined(__x86_64__) && defined(__AVX512F__)
// GCC 12 reports its own AVX-512 intrinsics, inlined into Eigen, as maybe uninitialised.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define Eigen sparrow_kernels_eigen_avx512
#define SPARROW_KERNELS_GEMM_FN gemm_avx512
#include "kernels/gemm_eigen.h"
#endif
