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

// ---- DGC on the device, no host synchronisation (dgc_device.cu) ------------------

// One DGC step's host-side numbers (dgc.cc fills them from dgc_sample_plan).
struct DgcDeviceStep {
  int64_t n = 0;
  float momentum = 0.0f;
  float coef = 1.0f;                   // clipping factor when coef_device is null
  const float* coef_device = nullptr;  // clip > 0: the factor as one float on the device
  int64_t sample_offset = 0;           // samples |v| at sample_offset + j·sample_stride, j < sample_count
  int64_t sample_stride = 1;
  int64_t sample_count = 0;
  int64_t sample_rank = 1;  // thr0 = the sample_rank-th largest sample, 1 <= rank <= sample_count
  int64_t k = 0;            // the most indices sent: the outputs' capacity
  bool exact = false;       // every element sampled: no adaptation
  bool check_finite = true;
  // Fused variant (both set): one pass reads g, u, v and writes the new state
  // to u_out, v_out (n floats each, not aliasing u, v), flags NaN/inf and keeps
  // the candidates |v_new| >= thr0 per tile; check_finite is then implied and
  // free. With a non-finite g, u_out, v_out receive copies of u, v, so the
  // caller may take them as the state either way.
  float* u_out = nullptr;
  float* v_out = nullptr;
};

// Device workspace for dgc_encode_device, in bytes (counts per 4096-element
// tile and level, scans, samples, a control block). Contents need no
// initialisation; it must not be shared by calls in flight on other streams.
size_t dgc_device_workspace_bytes(int64_t n, int64_t sample_count);
// The same for any step, the fused variant included (its candidate slots).
size_t dgc_device_workspace_bytes(const DgcDeviceStep& step);

// The whole DGC step on the device, asynchronous on `stream`, no host copy:
// samples |v_new| (before writing), finds thr0 by radix select, updates u and v
// while counting |v| >= thr_j at the 11 levels, chooses the level (or the exact
// top-k) on the device, then writes the selected indices (ascending) and values
// v[i] to idx[0..count) and val[0..count) and zeroes u[i], v[i] (momentum factor
// masking). idx and val hold step.k entries; *count (one int64) is <= step.k.
// With check_finite and a NaN or infinity in g, *status (one int32) is 1 and
// nothing else is written: u, v unchanged, *count = 0; otherwise *status = 0.
// The selected set equals dgc.cc's CPU path (select()) for the same state: see
// select_rule.h.
void dgc_encode_device(const float* g, float* u, float* v, const DgcDeviceStep& step, void* workspace, int64_t* idx,
                       float* val, int64_t* count, int32_t* status, void* stream);

// dense[idx[j]] += weight·val[j] for j < *count (count read on the device; the
// kernel is sized for `capacity` entries). Indices must be distinct (one encoded
// update); successive folds on one stream add in launch order. weight = 1
// adds the values exactly.
void fold_sparse(const int64_t* idx, const float* val, const int64_t* count, int64_t capacity, float weight,
                 float* dense, void* stream);

// Asynchronous device-to-host copy (host memory should be pinned for overlap)
// and a synchronisation of `stream`: the one wait of dgc's encode().
void copy_to_host_async(void* host, const void* device, size_t bytes, void* stream);
void stream_synchronize(void* stream);

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
