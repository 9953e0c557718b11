#pragma once
// CUDA kernels for the compressors' memory-bound steps, as a plain C++ API over
// raw device pointers (no torch or CUDA headers here, so CPU-only translation
// units can include it). Implemented in kernels.cu; linked only when the build
// has SPARROW_WITH_CUDA (or compiled alone under SPARROW_CUDA_KERNELS_CHECK).
//
// Conventions: every pointer is a device pointer unless a parameter says
// "host"; `stream` is a cudaStream_t passed as void* (nullptr = the legacy
// default stream). Functions are asynchronous on `stream` unless documented as
// synchronous (those copy a result to the host and wait for it). CUDA errors
// (launch failures, bad pointers) throw std::runtime_error naming the kernel.
// Each result is bit-identical to the CPU reference named with it.

#include <cstddef>
#include <cstdint>

namespace sparrow::compression::cuda {

// ---- DGC ---------------------------------------------------------------------

// u = m·u + coef·g; v = v + u, elementwise over [0, n), with round-to-nearest
// multiplies and adds that are never contracted into FMAs: bit-identical to
// dgc.cc's dgc_step (and its SSE lanes).
void dgc_update(const float* g, float* u, float* v, int64_t n, float m, float coef, void* stream);

// ---- threshold selection (collect_abs_ge in sparse.cc) -------------------------

// Selection runs in two passes over a: per-block counts of |a[i]| >= thr, an
// exclusive scan of the counts, then a scatter in which each block writes its
// selected (index, value) pairs at its offset in ascending index order. The
// result equals collect_abs_ge (NaN never passes) plus the signed values a[i].
//
// Workspace for n elements, in bytes (block counts and offsets).
size_t select_workspace_bytes(int64_t n);
// Pass 1 (synchronous): counts and scans into `workspace`; returns the number
// of selected elements.
int64_t select_abs_ge_count(const float* a, int64_t n, float thr, void* workspace, void* stream);
// Pass 2: writes the selected indices (ascending) and values to idx/val, which
// hold the count returned by select_abs_ge_count for the same (a, n, thr,
// workspace). a must not change in between.
void select_abs_ge_scatter(const float* a, int64_t n, float thr, const void* workspace, int64_t* idx, float* val,
                           void* stream);

// out[j] = a[idx[j]] for j in [0, k).
void gather(const float* a, const int64_t* idx, int64_t k, float* out, void* stream);
// a[idx[j]] = 0 and b[idx[j]] = 0 for j in [0, k) (DGC's momentum factor masking; b may be null).
void zero_at(float* a, float* b, const int64_t* idx, int64_t k, void* stream);

// ---- sign (sign.cc) ------------------------------------------------------------

// Workspace for sum_abs over n elements, in bytes.
size_t sum_abs_workspace_bytes(int64_t n);
// Synchronous: sum over i of |g[i] + r[i]| (|g[i]| when r is null), in double.
// Per-block partial sums combined in block order, so the result is
// deterministic; its rounding may differ from sign.cc's sequential sum in the
// last bits of the double (rarely visible after the cast to float).
double sum_abs(const float* g, const float* r, int64_t n, void* workspace, void* stream);
// Packs the signs of p = g + r (p = g when r is null) into bits[(n + 7) / 8]:
// bit i (LSB first within each byte) is 1 when p[i] < 0, padding bits 0 —
// the bytes of sign.cc's Format::kSign payload. When r is not null it is
// updated to the error-feedback residual r = p - (p < 0 ? -scale : scale).
void sign_pack(const float* g, float* r, int64_t n, float scale, uint8_t* bits, void* stream);

// ---- misc ----------------------------------------------------------------------

// cudaDeviceSynchronize (for timings: sparrow-bench compress --device cuda).
void device_synchronize();

}  // namespace sparrow::compression::cuda
