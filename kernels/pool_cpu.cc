// The reference pooling loops (portable; cloned per ISA by the compiler,
// kernels/simd.h) and the dispatch to the AVX-512 variant.
#include "core/error.h"
#include "kernels/cpu.h"
#include "kernels/pool.h"
#include "kernels/pool_avx512.h"
#include "kernels/pool_math.h"
#include "kernels/simd.h"

namespace sparrow::kernels {
namespace {

using detail::relu_max4;

// One row of windows: in0/in1 the two input rows (2 n values each).
SPARROW_SIMD_CLONES
void relu_maxpool2_row(const float* __restrict in0, const float* __restrict in1, int64_t n, float* __restrict out,
                       int32_t* __restrict arg) {
  for (int64_t x = 0; x < n; ++x) {
    float which;
    relu_max4(in0[2 * x], in0[2 * x + 1], in1[2 * x], in1[2 * x + 1], out[x], which);
    if (arg) arg[x] = static_cast<int32_t>(which);
  }
}

SPARROW_SIMD_CLONES
void relu_maxpool2_backward_row(const int32_t* __restrict arg, const float* __restrict dout, int64_t n,
                                float* __restrict din0, float* __restrict din1) {
  for (int64_t x = 0; x < n; ++x) {
    const float q = static_cast<float>(arg[x]), d = dout[x];
    din0[2 * x] = q == 0.0f ? d : 0.0f;
    din0[2 * x + 1] = q == 1.0f ? d : 0.0f;
    din1[2 * x] = q == 2.0f ? d : 0.0f;
    din1[2 * x + 1] = q == 3.0f ? d : 0.0f;
  }
}

}  // namespace

void relu_maxpool2(const float* in, int64_t planes, int64_t h, int64_t w, float* out, int32_t* arg) {
  SPARROW_CHECK(h % 2 == 0 && w % 2 == 0, "relu_maxpool2: " << h << "x" << w << " planes (even sides)");
  const int64_t oh = h / 2, ow = w / 2;
#ifdef SPARROW_KERNELS_POOL_AVX512
  if (isa_enabled(Isa::kAvx512)) return avx512::relu_maxpool2(in, planes * oh, ow, out, arg);
#endif
  for (int64_t r = 0; r < planes * oh; ++r)
    relu_maxpool2_row(in + 2 * r * w, in + (2 * r + 1) * w, ow, out + r * ow, arg ? arg + r * ow : nullptr);
}

void relu_maxpool2_backward(const int32_t* arg, const float* dout, int64_t planes, int64_t h, int64_t w, float* din) {
  SPARROW_CHECK(h % 2 == 0 && w % 2 == 0, "relu_maxpool2_backward: " << h << "x" << w << " planes (even sides)");
  const int64_t oh = h / 2, ow = w / 2;
#ifdef SPARROW_KERNELS_POOL_AVX512
  if (isa_enabled(Isa::kAvx512)) return avx512::relu_maxpool2_backward(arg, dout, planes * oh, ow, din);
#endif
  for (int64_t r = 0; r < planes * oh; ++r)
    relu_maxpool2_backward_row(arg + r * ow, dout + r * ow, ow, din + 2 * r * w, din + (2 * r + 1) * w);
}

}  // namespace sparrow::kernels
