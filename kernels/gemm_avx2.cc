// The AVX2 + FMA variant of gemm() (gemm.h), compiled with -mavx2 -mfma on
// x86-64 only; gemm_cpu.cc calls it only where kernels/cpu.h enables avx2.
// Nothing may be included before gemm_eigen.h that would emit inline
// functions shared with other files.
#if defined(__x86_64__) && defined(__AVX2__)
#define Eigen sparrow_kernels_eigen_avx2
#define SPARROW_KERNELS_GEMM_FN gemm_avx2
#include "kernels/gemm_eigen.h"
#endif
