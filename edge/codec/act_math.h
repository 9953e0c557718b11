#pragma once
// The activation codecs' arithmetic over row-major float32 buffers (Eigen
// behind it): the products and the orthonormalisation of lowrank, the
// per-column affine quantisation of its factors. Internal to edge/codec/; the
// LibTorch codecs reach it only through act_codec_flat.h.

#include <cstdint>
#include <vector>

namespace sparrow::edge::flat::detail {

// The instruction set the products and the QR run with: "avx2" (x86-64 with
// AVX2 and FMA, unless SPARROW_ACT_CODEC_ISA=baseline) or "baseline". Chosen
// once per process; the two round differently.
const char* math_isa();

// out (n x m) = A (n x k) · B (k x m).
void matmul(const float* a, const float* b, int64_t n, int64_t k, int64_t m, float* out);
// out (n x m) = Aᵀ · B, with A k x n and B k x m.
void matmul_tn(const float* a, const float* b, int64_t k, int64_t n, int64_t m, float* out);
// out (n x m) = A · Bᵀ, with A n x k and B m x k.
void matmul_nt(const float* a, const float* b, int64_t n, int64_t k, int64_t m, float* out);

// Replaces the n x r matrix a (n >= r) with the reduced Q of its Householder
// QR. Eigen's reflectors follow LAPACK's sign convention (geqrf/orgqr), so
// torch's linalg_qr gives the same columns up to rounding. The columns stay
// orthonormal for rank-deficient input (a zero matrix gives I's first r).
void orthonormalize(float* a, int64_t n, int64_t r);

// n x r standard normals, rng::normal(key, i) for element i (row-major).
std::vector<float> gaussian(int64_t n, int64_t r, uint64_t key);

// Bytes of n codes at `bits` (8, or 4: two per byte).
inline uint64_t code_bytes(uint64_t n, uint32_t bits) { return bits == 8 ? n : (n + 1) / 2; }

// Affine quantisation of each column of the row-major n x r matrix m to
// `bits` (8 or 4), round to nearest even: appends (min, step) per column to
// `scales` and the codes column by column (i.e. mᵀ row-major; 4-bit two per
// byte, low nibble first, padded to a byte) to `data`.
void quantize_cols(const float* m, int64_t n, int64_t r, int bits, std::vector<float>& scales,
                   std::vector<uint8_t>& data);
// The inverse: out (n x r, row-major) = min + code * step per column, from r
// (min, step) pairs and the codes of quantize_cols. Device and cloud call it
// on the same bytes, so they hold bit-identical values.
void dequantize_cols(const float* scales, const uint8_t* codes, int64_t n, int64_t r, uint32_t bits, float* out);

}  // namespace sparrow::edge::flat::detail
