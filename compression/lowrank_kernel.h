#pragma once
// The low-rank codecs' arithmetic without LibTorch (lowrank_cpu.cc, target
// sparrow_codec_core): the matrix view, Gram–Schmidt, the skinny products, the
// factors' value coding and the kLowRank(Sparse) decoder, over raw row-major
// float32 buffers. PowerSGD and ACP over LibTorch (powersgd.cc, acp.cc) and the
// flat powersgd kernel (powersgd_cpu.cc, the lite client) run these same
// functions, so they give the same bits; ACP's encode and decode are wholly
// here (acp_cpu.cc), the LibTorch codec a shell over them. Internal to
// compression/.

#include <cstdint>
#include <vector>

#include "compression/codec_bits.h"
#include "compression/encoded.h"

namespace sparrow::compression {

// The matrix view of a tensor: rows = shape[0], cols = numel / rows,
// rank = min(requested rank, rows, cols). All zero for a 0-D or empty tensor.
struct LowRankDims {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t rank = 0;
};
LowRankDims lowrank_dims(const std::vector<int64_t>& shape, int64_t rank);

// True iff PowerSGD/ACP with this rank send factors for a tensor of this shape
// (at least 2-D, rank >= 1, rows and cols fit the wire's uint32 params, and
// rows·cols > (rows + cols)·r·min_rate). min_rate: PyTorch's
// min_compression_rate; 2 for acp, powersgd's min_rate=.
bool lowrank_compressible(const std::vector<int64_t>& shape, int64_t rank, double min_rate = 2.0);

}  // namespace sparrow::compression

namespace sparrow::compression::detail {

// Orthonormalises the columns of a row-major n × r matrix in place (modified
// Gram–Schmidt, each column projected twice, in double; a column whose
// remaining norm is below 1e-8 × the largest input column norm, or not finite,
// becomes zero). Single-threaded and deterministic. Returns the zero columns.
int64_t orthonormalize(float* a, int64_t n, int64_t r);
// orthonormalize, then any column that came out zero is refilled with
// rng::normal(key, i·r + j) and the whole matrix orthonormalised again.
// Returns the number of columns still zero afterwards (normally 0).
int64_t orthonormalize_refill(float* a, int64_t n, int64_t r, uint64_t key);
// The seeded k × r factor every party derives without communication: entry
// (i, j) is rng::normal(key, i·r + j), then orthonormalised.
void initial_factor(uint64_t key, int64_t k, int64_t r, float* out);

// Kernels for the skinny products with a row-major n × m matrix A and small r
// (reference BLAS handles these shapes badly). Each reads A once, runs in
// parallel over rows (detail::parallel_for), and gives the same bits for any
// thread count. In the first two, when x is non-null the pass uses A + x and,
// when sum is non-null, stores A + x there (sum may equal a: error-feedback
// compensation fused into the product's pass).
// out (n × r) = (A [+ x]) · B, with B m × r row-major.
void skinny_mm(const float* a, const float* x, float* sum, int64_t n, int64_t m, const float* b, int64_t r, float* out);
// out (m × r) = (A [+ x])ᵀ · P, with P n × r row-major.
void skinny_mm_t(const float* a, const float* x, float* sum, int64_t n, int64_t m, const float* p, int64_t r,
                 float* out);
// A += alpha · P·Qᵀ, with P n × r and Q m × r row-major.
void rank_update(float* a, int64_t n, int64_t m, const float* p, const float* q, int64_t r, float alpha);

// Factor `part` of a validated low-rank e into out (k × r fp32): part 0 is P
// (kLowRank) or the one factor (kLowRankFactor), part 1 is Q (kLowRank), which
// follows P's rows·r values. Unpacks e.value_type: fp32, fp16, bf16, or int8
// with one scale per factor column (e.scales: P's r, then Q's r).
void unpack_factor(const Encoded& e, int part, int64_t k, int64_t r, float* out);
// Appends factor a (k × r fp32) to e.values in type vt (kInt8: its r column
// scales max|column| / 127 to e.scales) and overwrites a with what a receiver
// decodes, so error feedback keeps the rounding. kF16 and kBF16 saturate at
// their largest finite value; a non-finite entry (an fp32 overflow of the
// product) throws sparrow::Error.
void pack_factor(float* a, int64_t k, int64_t r, ValueType vt, Encoded& e);

// powersgd's sparse=S: the ceil(S·numel) largest entries of the residual
// res (E = M' − P·Qᵀ, numel floats) are appended to e (which holds the
// factors: it becomes kLowRankSparse, positions Rice-coded, values of type vt)
// and leave res, exactly as the receiver will add them.
void add_sparse_correction(float* res, int64_t numel, double sparse, ValueType vt, Encoded& e);

// out += weight · P·Qᵀ (+ the sparse correction of kLowRankSparse) for a
// validated kLowRank or kLowRankSparse e; out holds e.numel() floats. A
// malformed position stream throws FormatError before out is touched.
void decode_lowrank_add(const Encoded& e, float* out, float weight);

// PowerSGD's options (spec keys rank, warm_start, ef, values, iters, min_rate,
// decay, max_age, sparse), parsed with the same checks and messages for the
// LibTorch codec (powersgd.cc) and the flat kernel (powersgd_cpu.cc).
struct PowerSgdOptions {
  int64_t rank = 1;
  bool warm_start = true;
  bool ef = true;
  ValueType vt = ValueType::kF32;
  int64_t iters = 1;
  double min_rate = 2.0;
  StalePolicy stale;
  double sparse = 0.0;
};
PowerSgdOptions parse_powersgd_options(Spec& spec);

// ACP's options (spec keys rank, ef, values, decay, max_age), parsed with the
// same checks and messages for the LibTorch codec and the flat kernel: both
// are the one kernel of acp_cpu.cc.
struct AcpOptions {
  int64_t rank = 1;
  bool ef = true;
  StalePolicy stale;
  ValueType vt = ValueType::kF32;
};
AcpOptions parse_acp_options(Spec& spec);

// The factor ACP sends in `round`: 0 (P) when even, 1 (Q) when odd.
inline int acp_which(int64_t round) { return (round & 1) ? 1 : 0; }

// The shared factor ACP multiplies with for a rows × cols tensor of rank r
// when factor `which` is sent: Q̂ (cols × r) for which = 0, P̂ (rows × r) for 1.
// ctx's factor, checked (shape {k, r}, float32 on the CPU, finite: FormatError
// "<what>: shared factor ..." otherwise), or without one the seeded initial
// factor (initial_factor(tensor_key(ctx), k, r)), written to `derived`.
const float* acp_shared_factor(const CodecView& ctx, int64_t rows, int64_t cols, int64_t r, int which, const char* what,
                               std::vector<float>& derived);

// out += weight · F·Q̂ᵀ (params[3] = 0) or P̂·Fᵀ (1) for a validated
// kLowRankFactor e, against ctx's shared factor (acp_shared_factor: checked
// before out is touched, the seeded one without). out holds e.numel() floats.
void decode_factor_add(const Encoded& e, float* out, float weight, const CodecView& ctx);

}  // namespace sparrow::compression::detail
