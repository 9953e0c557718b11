#pragma once
// sparrow-bench kernels (see kernel_bench.cc).

namespace sparrow::bench {

// The CNN's CPU kernels (kernels/) against what ATen runs for the
// same computation, in the same run, on one thread: conv2 + bias + ReLU + 2x2
// max pooling (Winograd F(4x4, 5x5)) forward, and forward + backward with the
// weight, bias and input gradients; conv1's ReLU + max pooling and its
// backward; conv1 + bias + ReLU + pooling fused; conv1's weight gradient;
// the whole CNN's inference at each tool's evaluation batch; the batched
// convolution of 10 stacked clients (kernels/batched_conv.h) against ATen's
// grouped one, at a 3x3 CNN's and the built-in CNN's shapes. Each line also gives the direct
// convolution's FLOPs as one large at::mm takes them ("mm_ms"), the
// machine's fp32 limit. Median of `repeat` timings.
struct KernelBenchOptions {
  int images = 256;  // per timing (conv2's batch)
  int repeat = 7;
};
int bench_kernels(const KernelBenchOptions& o);

}  // namespace sparrow::bench
