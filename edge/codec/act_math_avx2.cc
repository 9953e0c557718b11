// The AVX2 + FMA variant of act_math.h's products and QR (act_math_eigen.h),
// compiled with -mavx2 -mfma on x86-64 only; act_math.cc calls it only on a
// CPU that has them. Eigen's namespace is renamed (act_math_eigen.h says why);
// nothing may be included before act_math_eigen.h that would emit inline
// functions shared with other files.
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#define Eigen sparrow_act_eigen_avx2
#define SPARROW_ACT_MATH_NS avx2
#include "edge/codec/act_math_eigen.h"
#endif
