#pragma once
// The CPU fast path of the built-in models' Linear layers: one client's
// training step through a chain of Linear layers (ReLU after all but the
// last) and the softmax cross-entropy, on raw float arrays, without ATen
// dispatch, autograd or allocation per step.
//
// Every GEMM is a small one with the minibatch as one side (32 by default):
// OpenBLAS packs the weight matrix on every such call, which costs as much as
// the arithmetic at these sizes. With libxsmm (Debian's libxsmm-dev; CMake
// finds it and defines SPARROW_HAVE_LIBXSMM) the GEMMs are JIT-generated
// kernels that read the operands in place: 98-115 GFLOP/s against OpenBLAS's
// 71-89 on the MLP's and the CNN head's shapes on the 2-vCPU CI machine
// (docs/performance.md). Without it the BLAS LibTorch uses (sgemm_) runs them.
// Layouts are chosen so that every GEMM is untransposed: activations are kept
// feature-major ([features, B]) for the forward GEMM W h and batch-major
// ([B, features]) for the weight gradient dz h^T and the input gradient
// dz^T W; the transposes in between are of activations, never of weights.

#include <cstdint>
#include <vector>

namespace sparrow::kernels {

// One Linear layer: weight [out, in] and bias [out], row-major, and where its
// gradient goes: gw = beta gw + alpha dL/dW (same for gb). gw may be w itself
// (the SGD step fused into the backward): w is read for the last time before
// gw is written.
struct LinearRef {
  int64_t in = 0, out = 0;
  const float* w = nullptr;
  const float* b = nullptr;
  float* gw = nullptr;
  float* gb = nullptr;
};

// One client's step: xt [batch, layers[0].in] batch-major input; y [batch]
// labels in [0, layers.back().out); wt [batch] per-sample loss weights.
// Returns sum_i wt_i * CE_i; accumulates the gradients as LinearRef says
// (alpha, beta as Model::loss_backward_clients); writes the input gradient
// [batch, in] into dxt when not null. Labels out of range are the caller's
// to reject (models check them before any step).
double linear_chain_step(int64_t batch, const float* xt, const std::vector<LinearRef>& layers, const int64_t* y,
                         const float* wt, float* dxt, float alpha, float beta);

// Row-major C[m, n] = A[m, k] B[k, n] (accumulate: C += A B), contiguous
// operands (lda = k, ldb = n, ldc = n). libxsmm or the BLAS, as above.
void gemm_nn(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c, bool accumulate);

// Row-major C[m, n] = A^T B with A [k, m] and B [k, n] (accumulate: C += A^T B),
// contiguous operands; the reduction runs over the rows of both.
void gemm_tn(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c, bool accumulate);

// Row-major C[m, n] = A B^T with A [m, k] and B [n, k] (accumulate: C += A B^T),
// contiguous operands; the BLAS (libxsmm has no JIT kernel for it), or the
// reference while it is forced.
void gemm_nt(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c, bool accumulate);

// dst [cols, rows] = src [rows, cols]^T, row-major, not overlapping
// (libxsmm's JIT transpose, or a tiled loop).
void transpose(const float* src, int64_t rows, int64_t cols, float* dst);

// "libxsmm (<target>)" or "BLAS": what gemm_nn runs on, for logs.
const char* gemm_backend();

}  // namespace sparrow::kernels
