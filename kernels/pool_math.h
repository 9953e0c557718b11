#pragma once
// The ReLU + 2x2 max pooling rule every pooling kernel here follows (private
// to kernels/: pool_cpu.cc and winograd_cpu.cc's fused output transform).

namespace sparrow::kernels::detail {

// The ReLU + max of one 2x2 window (v0 v1 / v2 v3, row-major) as ATen's relu
// then max_pool2d compute it: the first of equal maxima wins; a NaN wins over
// numbers (the last one, as ATen's `val > max || isnan(val)` scan) and passes
// the ReLU. which: the winner 0..3, or 4 when the ReLU zeroed the window (no
// gradient flows). Branch-free float selects, so callers' loops vectorise.
[[gnu::always_inline]] inline void relu_max4(float v0, float v1, float v2, float v3, float& out, float& which) {
  // Each test as a float flag, summed for "or": GCC vectorises float selects
  // on them, not selects on combined bools.
  const float c01 = (v1 > v0 ? 1.0f : 0.0f) + (v1 != v1 ? 1.0f : 0.0f);
  const float c23 = (v3 > v2 ? 1.0f : 0.0f) + (v3 != v3 ? 1.0f : 0.0f);
  const float b01 = c01 > 0 ? v1 : v0, w01 = c01 > 0 ? 1.0f : 0.0f;
  const float b23 = c23 > 0 ? v3 : v2, w23 = c23 > 0 ? 3.0f : 2.0f;
  const float c = (b23 > b01 ? 1.0f : 0.0f) + (b23 != b23 ? 1.0f : 0.0f);
  const float best = c > 0 ? b23 : b01, w = c > 0 ? w23 : w01;
  const float keep = (best > 0 ? 1.0f : 0.0f) + (best != best ? 1.0f : 0.0f);
  out = keep > 0 ? best : 0.0f;
  which = keep > 0 ? w : 4.0f;
}

}  // namespace sparrow::kernels::detail
