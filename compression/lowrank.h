#pragma once
// Low-rank compression (PowerSGD, ACP-SGD): the matrix view shared by both
// codecs, Gram–Schmidt, and the aggregator side of ACP.
//
// Both codecs view a tensor x as M = x.view(shape[0], -1) (rows × cols) and use
// r = min(rank, rows, cols). A tensor is compressed iff it has at least two
// dimensions and (rows + cols)·r·2 < rows·cols (PyTorch's min_compression_rate
// of 2); anything else (every 1-D tensor) travels as dense fp32.
//
// ACP-SGD (Zhang et al., ICDCS 2023) alternates which factor travels. In round t
// the aggregator's shared factor S_t is orthonormal and identical on every
// party; a client sends only its other factor:
//   even t: S_t = Q̂ (cols × r), client sends P = (M + E)·Q̂      (which = 0)
//   odd  t: S_t = P̂ (rows × r), client sends Q = (M + E)ᵀ·P̂     (which = 1)
// Factors are linear in M, so the aggregator averages them exactly and then
// expands once. The aggregator's flow for one tensor:
//
//   LowRankDims d = lowrank_dims(shape, rank);          // after lowrank_compressible()
//   at::Tensor shared = acp_initial_shared(ctx, d, 0);  // S_0, what clients derive themselves
//   for each round t:
//     broadcast shared; clients encode with ctx.round = t, ctx.shared_factor = shared
//     at::Tensor sum = at::zeros(acp_sent_shape(d, t)); double wsum = 0;
//     for each client update e with weight w: acp_add_factor(e, t, sum, w); wsum += w;
//     at::Tensor mean = sum / wsum;                      // F̄_t
//     at::Tensor update = acp_update(mean, shared, t, shape);   // F̄·Ŝᵀ or Ŝ·F̄ᵀ
//     shared = acp_next_shared(mean);                    // S_{t+1} = orth(F̄_t)
//
// update equals the weighted mean of the clients' decode()s (with
// ctx.shared_factor = shared), up to float rounding. A partial aggregate
// (hierarchy) is again a factor: acp_factor_encoded() turns it into an Encoded.
// All tensors here are float32 on the CPU; factors are row-major (k × r).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "compression/compressor.h"
#include "compression/encoded.h"
#include "compression/lowrank_kernel.h"

namespace sparrow::compression {

// LowRankDims, lowrank_dims and lowrank_compressible: lowrank_kernel.h.

// Orthonormalises the columns of a 2-D float32 CPU matrix in place: modified
// Gram–Schmidt, each column projected twice ("twice is enough"), accumulated in
// double. A column whose remaining norm is below 1e-8 × (largest input column
// norm), or not finite, is set to zero instead of being divided by ~0, so the
// result never holds NaN from a zero or dependent column. Deterministic and
// single-threaded: every party gets the same bits from the same input.
void orthonormalize_columns(at::Tensor& m);

// ---- ACP aggregator side -------------------------------------------------------

// Which factor clients send in `round`: 0 (P) when even, 1 (Q) when odd.
int acp_sent_factor(int64_t round);
// Shape of the factor clients send in `round` ({rows, r} or {cols, r}) and of
// the shared factor they need ({cols, r} or {rows, r}).
std::vector<int64_t> acp_sent_shape(const LowRankDims& d, int64_t round);
std::vector<int64_t> acp_shared_shape(const LowRankDims& d, int64_t round);

// The seeded initial factor every party derives without communication:
// which = 0 gives P̂ (rows × r), 1 gives Q̂ (cols × r); entry (i, j) is
// rng::normal(tensor_key(ctx), i·r + j), then orthonormalised. Depends only on
// (ctx.seed, ctx.name, rows, cols, rank); rank is clamped to min(rows, cols).
at::Tensor acp_initial_factor(const Context& ctx, int64_t rows, int64_t cols, int64_t rank, int which);
// The initial shared factor for `round` (Q̂ when even, P̂ when odd): what a
// client uses when ctx.shared_factor is undefined.
at::Tensor acp_initial_shared(const Context& ctx, const LowRankDims& d, int64_t round);

// The factor an ACP update carries, as a {k, r} tensor. Validates e; FormatError
// when it is not kLowRankFactor.
at::Tensor acp_factor(const Encoded& e);
// acc += weight · factor of e. Throws FormatError when e is not the factor sent
// in `round` or its shape differs from acc's (acc: float32, contiguous, CPU).
void acp_add_factor(const Encoded& e, int64_t round, at::Tensor& acc, float weight);
// Wraps a (summed or averaged) factor of `round` as a kLowRankFactor Encoded of
// a tensor of `shape`, e.g. to forward a partial aggregate up a hierarchy.
Encoded acp_factor_encoded(const at::Tensor& factor, const std::vector<int64_t>& shape, int64_t round);

// The decoded update of `round` from a factor (typically the clients' mean F̄)
// and that round's shared factor: F̄·Q̂ᵀ (even) or P̂·F̄ᵀ (odd), shaped `shape`.
// Throws sparrow::Error on inconsistent shapes.
at::Tensor acp_update(const at::Tensor& factor, const at::Tensor& shared, int64_t round,
                      const std::vector<int64_t>& shape);
// out += weight · acp_update(...), without a temporary (out: float32, contiguous).
void acp_update_add(const at::Tensor& factor, const at::Tensor& shared, int64_t round, at::Tensor& out, float weight);

// The shared factor of the next round: orthonormalize_columns(F̄) on a copy. A
// column that vanishes (no client signal along it) is refilled from a fixed
// pseudo-random stream and re-orthonormalised, so the rank cannot collapse for
// good: a zero column in S would stay zero in every later factor.
at::Tensor acp_next_shared(const at::Tensor& mean_factor);

}  // namespace sparrow::compression

namespace sparrow::compression::detail {
// Internal to compression/ (powersgd.cc, acp.cc).

// orthonormalize_columns, then any column that came out zero is refilled with
// rng::normal(key, i·r + j) and the whole matrix orthonormalised again.
// Returns the number of columns still zero afterwards (normally 0).
int64_t orthonormalize_refill(at::Tensor& m, uint64_t key);
// Factor `part` of a validated low-rank e as a new {k, r} fp32 tensor: part 0
// is P (kLowRank) or the one factor (kLowRankFactor), part 1 is Q (kLowRank),
// which follows P's rows·r values. Unpacks e.value_type: fp32, fp16, bf16, or
// int8 with one scale per factor column (e.scales: P's r, then Q's r).
at::Tensor factor_of(const Encoded& e, int part, int64_t k, int64_t r);
// Appends factor f ({k, r} fp32, contiguous) to e.values in type vt (kInt8: its
// r column scales max|column| / 127 to e.scales) and overwrites f with what a
// receiver decodes, so error feedback keeps the rounding. vt: kF32, kF16, kBF16, kInt8.
// kF16 and kBF16 saturate at their largest finite value (the excess stays in
// E); a non-finite entry (an fp32 overflow of the product) throws sparrow::Error.
void pack_factor(at::Tensor& f, ValueType vt, Encoded& e);
// Registers "acp" (acp.cc); called by register_lowrank() in powersgd.cc.
void register_acp();

// The skinny products (skinny_mm, skinny_mm_t, rank_update): lowrank_kernel.h.
}  // namespace sparrow::compression::detail
