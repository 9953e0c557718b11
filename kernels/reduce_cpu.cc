#include "kernels/reduce.h"

#include "kernels/simd.h"

namespace sparrow::kernels::detail {

SPARROW_SIMD_CLONES
float sum(const float* __restrict x, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += x[i + j];
  float s = 0;
  for (; i < n; ++i) s += x[i];
  for (float p : part) s += p;
  return s;
}

}  // namespace sparrow::kernels::detail
