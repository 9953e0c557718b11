#pragma once
// The AVX-512 variants of kernels/pool.h and kernels/conv5x5.h (private to
// kernels/): pool_avx512.cc. Built with GCC on x86-64, where
// SPARROW_KERNELS_POOL_AVX512 is defined; callers check isa_enabled(kAvx512).

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPARROW_KERNELS_POOL_AVX512 1
#endif

namespace sparrow::kernels::avx512 {

// relu_maxpool2 over `rows` rows of ow windows (rows = planes * h / 2).
void relu_maxpool2(const float* in, int64_t rows, int64_t ow, float* out, int32_t* arg);
void relu_maxpool2_backward(const int32_t* arg, const float* dout, int64_t rows, int64_t ow, float* din);

// conv5x5_one_channel_relu_pool for w <= 32, h <= kConv1MaxH, cout a multiple of 4.
constexpr int64_t kConv1MaxH = 60;
void conv5x5_one_channel_relu_pool(const float* x, int64_t h, int64_t w, const float* weight, const float* bias,
                                   int64_t cout, float* out, int32_t* arg);

}  // namespace sparrow::kernels::avx512
