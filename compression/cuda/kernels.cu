// CUDA implementations of compression/cuda/kernels.h. Host code compiles
// without LibTorch; see the header for the contracts.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "compression/cuda/kernels.h"

namespace sparrow::compression::cuda {
namespace {

constexpr int kThreads = 256;                 // threads per block (8 warps)
constexpr int kItems = 16;                    // elements per thread per tile
constexpr int64_t kTile = kThreads * kItems;  // elements per block in selection and sum_abs
constexpr int kScanThreads = 1024;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("sparrow cuda: ") + what + ": " + cudaGetErrorString(err));
}

int64_t tiles(int64_t n) { return (n + kTile - 1) / kTile; }

unsigned grid_for(int64_t work, int per_block) {
  const int64_t g = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(g < 1 ? 1 : g);
}

// ---- kernels -------------------------------------------------------------------

__global__ void dgc_update_kernel(const float* g, float* u, float* v, int64_t n, float m, float coef) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    // __fmul_rn/__fadd_rn are never contracted into an FMA: same rounding as the CPU.
    const float uu = __fadd_rn(__fmul_rn(m, u[i]), __fmul_rn(g[i], coef));
    u[i] = uu;
    v[i] = __fadd_rn(v[i], uu);
  }
}

// counts[b] = #{i in tile b : |a[i]| >= thr}. NaN compares false, as on the CPU.
__global__ void select_count_kernel(const float* a, int64_t n, float thr, int64_t* counts) {
  __shared__ int warp_sums[kThreads / 32];
  const int64_t base = blockIdx.x * kTile;
  int c = 0;
  for (int r = 0; r < kItems; ++r) {
    const int64_t i = base + r * kThreads + threadIdx.x;
    c += (i < n && fabsf(a[i]) >= thr) ? 1 : 0;
  }
  for (int off = 16; off > 0; off >>= 1) c += __shfl_down_sync(0xffffffffu, c, off);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = c;
  __syncthreads();
  if (threadIdx.x == 0) {
    int t = 0;
    for (int w = 0; w < kThreads / 32; ++w) t += warp_sums[w];
    counts[blockIdx.x] = t;
  }
}

// In place: x[0..b) becomes its exclusive scan and x[b] the total. One block.
__global__ void exclusive_scan_kernel(int64_t* x, int64_t b) {
  __shared__ int64_t s[kScanThreads];
  const int64_t seg = (b + kScanThreads - 1) / kScanThreads;
  const int64_t lo = threadIdx.x * seg, hi = lo + seg < b ? lo + seg : b;
  int64_t sum = 0;
  for (int64_t i = lo; i < hi; ++i) sum += x[i];
  s[threadIdx.x] = sum;
  __syncthreads();
  for (int off = 1; off < kScanThreads; off <<= 1) {  // Hillis-Steele inclusive scan
    const int64_t add = threadIdx.x >= off ? s[threadIdx.x - off] : 0;
    __syncthreads();
    s[threadIdx.x] += add;
    __syncthreads();
  }
  int64_t run = s[threadIdx.x] - sum;
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t c = x[i];
    x[i] = run;
    run += c;
  }
  if (threadIdx.x == kScanThreads - 1) x[b] = s[kScanThreads - 1];
}

// Writes tile b's selected elements from offsets[b] on, ascending: the tile is
// processed in rounds of kThreads consecutive elements, each ranked by a
// warp ballot and the preceding warps' counts.
__global__ void select_scatter_kernel(const float* a, int64_t n, float thr, const int64_t* offsets, int64_t* idx,
                                      float* val) {
  __shared__ int warp_counts[kThreads / 32];
  __shared__ int warp_base[kThreads / 32 + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned lt_mask = (1u << lane) - 1u;
  const int64_t base = blockIdx.x * kTile;
  int64_t out = offsets[blockIdx.x];
  for (int r = 0; r < kItems; ++r) {
    const int64_t i = base + r * kThreads + threadIdx.x;
    float x = 0.0f;
    bool sel = false;
    if (i < n) {
      x = a[i];
      sel = fabsf(x) >= thr;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, sel);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    if (threadIdx.x == 0) {
      int t = 0;
      for (int w = 0; w < kThreads / 32; ++w) {
        warp_base[w] = t;
        t += warp_counts[w];
      }
      warp_base[kThreads / 32] = t;
    }
    __syncthreads();
    if (sel) {
      const int64_t pos = out + warp_base[warp] + __popc(ballot & lt_mask);
      idx[pos] = i;
      val[pos] = x;
    }
    out += warp_base[kThreads / 32];
    __syncthreads();  // warp_base is rewritten in the next round
  }
}

__global__ void gather_kernel(const float* a, const int64_t* idx, int64_t k, float* out) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[j] = a[idx[j]];
}

__global__ void zero_at_kernel(float* a, float* b, const int64_t* idx, int64_t k) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    a[idx[j]] = 0.0f;
    if (b) b[idx[j]] = 0.0f;
  }
}

// partial[b] = sum over tile b of |g + r| in double, in a fixed tree order.
__global__ void sum_abs_kernel(const float* g, const float* r, int64_t n, double* partial) {
  __shared__ double s[kThreads];
  const int64_t base = blockIdx.x * kTile;
  double acc = 0.0;
  for (int k = 0; k < kItems; ++k) {
    const int64_t i = base + k * kThreads + threadIdx.x;
    if (i < n) acc += fabs(static_cast<double>(r ? __fadd_rn(g[i], r[i]) : g[i]));
  }
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int off = kThreads / 2; off > 0; off >>= 1) {
    if (threadIdx.x < off) s[threadIdx.x] += s[threadIdx.x + off];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

// partial[b] = the sum of partial[0..b), in a fixed order. One block.
__global__ void sum_partials_kernel(double* partial, int64_t b) {
  __shared__ double s[kScanThreads];
  const int64_t seg = (b + kScanThreads - 1) / kScanThreads;
  const int64_t lo = threadIdx.x * seg, hi = lo + seg < b ? lo + seg : b;
  double acc = 0.0;
  for (int64_t i = lo; i < hi; ++i) acc += partial[i];
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int off = kScanThreads / 2; off > 0; off >>= 1) {
    if (threadIdx.x < off) s[threadIdx.x] += s[threadIdx.x + off];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[b] = s[0];
}

// One thread per output byte: bit j of byte q is p[8q + j] < 0 (LSB first).
__global__ void sign_pack_kernel(const float* g, float* r, int64_t n, float scale, uint8_t* bits) {
  const int64_t nbytes = (n + 7) / 8;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < nbytes;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    unsigned byte = 0;
    for (int j = 0; j < 8; ++j) {
      const int64_t i = q * 8 + j;
      if (i >= n) break;
      const float p = r ? __fadd_rn(g[i], r[i]) : g[i];
      const bool neg = p < 0.0f;
      byte |= static_cast<unsigned>(neg) << j;
      if (r) r[i] = __fsub_rn(p, neg ? -scale : scale);
    }
    bits[q] = static_cast<uint8_t>(byte);
  }
}

constexpr int kMaxGrid = 65535 * 4;

}  // namespace

// ---- host API ---------------------------------------------------------------------

void dgc_update(const float* g, float* u, float* v, int64_t n, float m, float coef, void* stream) {
  if (n <= 0) return;
  const unsigned grid = grid_for(n, kThreads) < kMaxGrid ? grid_for(n, kThreads) : kMaxGrid;
  dgc_update_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(g, u, v, n, m, coef);
  check(cudaGetLastError(), "dgc_update");
}

size_t select_workspace_bytes(int64_t n) { return static_cast<size_t>(tiles(n) + 1) * sizeof(int64_t); }

int64_t select_abs_ge_count(const float* a, int64_t n, float thr, void* workspace, void* stream) {
  if (n <= 0) return 0;
  const int64_t b = tiles(n);
  auto* offsets = static_cast<int64_t*>(workspace);
  select_count_kernel<<<static_cast<unsigned>(b), kThreads, 0, as_stream(stream)>>>(a, n, thr, offsets);
  check(cudaGetLastError(), "select_abs_ge_count (count)");
  exclusive_scan_kernel<<<1, kScanThreads, 0, as_stream(stream)>>>(offsets, b);
  check(cudaGetLastError(), "select_abs_ge_count (scan)");
  int64_t total = 0;
  check(cudaMemcpyAsync(&total, offsets + b, sizeof total, cudaMemcpyDeviceToHost, as_stream(stream)),
        "select_abs_ge_count (copy)");
  check(cudaStreamSynchronize(as_stream(stream)), "select_abs_ge_count (sync)");
  return total;
}

void select_abs_ge_scatter(const float* a, int64_t n, float thr, const void* workspace, int64_t* idx, float* val,
                           void* stream) {
  if (n <= 0) return;
  select_scatter_kernel<<<static_cast<unsigned>(tiles(n)), kThreads, 0, as_stream(stream)>>>(
      a, n, thr, static_cast<const int64_t*>(workspace), idx, val);
  check(cudaGetLastError(), "select_abs_ge_scatter");
}

void gather(const float* a, const int64_t* idx, int64_t k, float* out, void* stream) {
  if (k <= 0) return;
  const unsigned grid = grid_for(k, kThreads) < kMaxGrid ? grid_for(k, kThreads) : kMaxGrid;
  gather_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(a, idx, k, out);
  check(cudaGetLastError(), "gather");
}

void zero_at(float* a, float* b, const int64_t* idx, int64_t k, void* stream) {
  if (k <= 0) return;
  const unsigned grid = grid_for(k, kThreads) < kMaxGrid ? grid_for(k, kThreads) : kMaxGrid;
  zero_at_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(a, b, idx, k);
  check(cudaGetLastError(), "zero_at");
}

size_t sum_abs_workspace_bytes(int64_t n) { return static_cast<size_t>(tiles(n) + 1) * sizeof(double); }

double sum_abs(const float* g, const float* r, int64_t n, void* workspace, void* stream) {
  if (n <= 0) return 0.0;
  const int64_t b = tiles(n);
  auto* partial = static_cast<double*>(workspace);
  sum_abs_kernel<<<static_cast<unsigned>(b), kThreads, 0, as_stream(stream)>>>(g, r, n, partial);
  check(cudaGetLastError(), "sum_abs (blocks)");
  sum_partials_kernel<<<1, kScanThreads, 0, as_stream(stream)>>>(partial, b);
  check(cudaGetLastError(), "sum_abs (total)");
  double total = 0.0;
  check(cudaMemcpyAsync(&total, partial + b, sizeof total, cudaMemcpyDeviceToHost, as_stream(stream)),
        "sum_abs (copy)");
  check(cudaStreamSynchronize(as_stream(stream)), "sum_abs (sync)");
  return total;
}

void sign_pack(const float* g, float* r, int64_t n, float scale, uint8_t* bits, void* stream) {
  if (n <= 0) return;
  const int64_t nbytes = (n + 7) / 8;
  const unsigned grid = grid_for(nbytes, kThreads) < kMaxGrid ? grid_for(nbytes, kThreads) : kMaxGrid;
  sign_pack_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(g, r, n, scale, bits);
  check(cudaGetLastError(), "sign_pack");
}

void device_synchronize() { check(cudaDeviceSynchronize(), "device_synchronize"); }

}  // namespace sparrow::compression::cuda
