// conv1's kernels (kernels/conv5x5.h): im2col + GEMM (kernels/linear.h's
// gemm_nn) and the dispatch to the fused AVX-512 kernel.
#include <algorithm>

#include "core/error.h"
#include "kernels/conv5x5.h"
#include "kernels/cpu.h"
#include "kernels/linear.h"
#include "kernels/pool.h"
#include "kernels/pool_avx512.h"
#include "kernels/reduce.h"

namespace sparrow::kernels {

void im2col5x5(const float* x, int64_t h, int64_t w, float* col) {
  for (int64_t ky = 0; ky < 5; ++ky)
    for (int64_t kx = 0; kx < 5; ++kx) {
      float* dst = col + (ky * 5 + kx) * h * w;  // x shifted by (ky - 2, kx - 2), zero outside
      for (int64_t y = 0; y < h; ++y) {
        const int64_t sy = y + ky - 2;
        float* row = dst + y * w;
        if (sy < 0 || sy >= h) {
          std::fill(row, row + w, 0.0f);
          continue;
        }
        // Columns [x0, x1) read the image; the rest are padding.
        const int64_t x0 = std::min<int64_t>(w, std::max<int64_t>(0, 2 - kx));
        const int64_t x1 = std::max<int64_t>(x0, std::min<int64_t>(w, w + 2 - kx));
        std::fill(row, row + x0, 0.0f);
        std::copy(x + sy * w + x0 + kx - 2, x + sy * w + x1 + kx - 2, row + x0);
        std::fill(row + x1, row + w, 0.0f);
      }
    }
}

void conv5x5_one_channel(const float* x, int64_t h, int64_t w, const float* weight, const float* bias, int64_t cout,
                         float* out, float* col) {
  const int64_t hw = h * w;
  im2col5x5(x, h, w, col);
  for (int64_t co = 0; co < cout; ++co) std::fill(out + co * hw, out + (co + 1) * hw, bias[co]);
  gemm_nn(cout, hw, 25, weight, col, out, true);
}

void conv5x5_one_channel_weight_grad(const float* x, int64_t h, int64_t w, const float* dy, int64_t cout, float* gw,
                                     float* gb, float* col, float* colt) {
  const int64_t hw = h * w;
  im2col5x5(x, h, w, col);
  transpose(col, 25, hw, colt);  // [hw, 25]
  gemm_nn(cout, 25, hw, dy, colt, gw, true);
  for (int64_t co = 0; co < cout; ++co) gb[co] += detail::sum(dy + co * hw, hw);
}

void conv5x5_one_channel_relu_pool(const float* x, int64_t h, int64_t w, const float* weight, const float* bias,
                                   int64_t cout, float* out, int32_t* arg, float* scratch) {
  SPARROW_CHECK(h % 2 == 0 && w % 2 == 0, "conv5x5_one_channel_relu_pool: " << h << "x" << w << " image (even sides)");
#ifdef SPARROW_KERNELS_POOL_AVX512
  if (isa_enabled(Isa::kAvx512) && w <= 32 && h <= avx512::kConv1MaxH && cout % 4 == 0)
    return avx512::conv5x5_one_channel_relu_pool(x, h, w, weight, bias, cout, out, arg);
#endif
  float* conv = scratch + 25 * h * w;
  conv5x5_one_channel(x, h, w, weight, bias, cout, conv, scratch);
  relu_maxpool2(conv, cout, h, w, out, arg);
}

}  // namespace sparrow::kernels
