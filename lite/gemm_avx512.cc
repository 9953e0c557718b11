// The AVX-512 variant of gemm() (gemm.h), compiled with -mavx512f -mavx512vl
// -mavx512dq -mfma on x86-64 only; gemm.cc calls it only on a CPU that has
// them. About 1.1x the AVX2+FMA build on the CNN's conv2 GEMMs (docs/lite.md).
//
// Eigen's namespace is renamed here (gemm_eigen.h says why): this file's
// Eigen templates get symbols of their own and never replace the baseline
// build's. Nothing else may be included before gemm_eigen.h that would emit
// inline functions shared with other files.
#if defined(__x86_64__) && defined(__AVX512F__)
// GCC 12 reports its own AVX-512 intrinsics, inlined into Eigen, as maybe uninitialised.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define Eigen sparrow_lite_eigen_avx512
#define SPARROW_LITE_GEMM_FN gemm_avx512
#include "lite/gemm_eigen.h"
#endif
