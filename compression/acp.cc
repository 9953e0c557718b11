// acp:rank=r[,ef=0|1][,values=fp32|fp16|bf16|int8][,decay=D,max_age=A] — ACP-SGD (Zhang, Zhang, Shi, Chu, Li,
// "Evaluation and optimization of gradient compression for distributed deep learning", ICDCS 2023; code
// lzhangbv/acpsgd). Alternating compressed power iteration: each round a client sends one factor against the
// aggregator's shared, orthonormal other factor, so the aggregate is a plain (weighted) sum of factors and one round
// trip suffices. Error feedback is local, E = (M + E) − P·Qᵀ with the factor this client sent (as in acpsgd.py), as the
// aggregator decodes it (values= other than fp32 rounds it: protocol 1.4). The aggregator side is in lowrank.h.
//
// The client's encode and the decoder are torch-free (acp_cpu.cc, in the codec core): this codec runs that kernel for
// CPU tensors, as the lite client's flat::make_codec("acp:...") does, so both give the same bytes and state.
#include <ATen/ATen.h>

#include <cstring>

#include "compression/codec_kernel.h"
#include "compression/codec_util.h"
#include "compression/compressor.h"
#include "compression/formats.h"
#include "compression/lowrank.h"
#include "compression/torch_codec.h"
#include "core/spec.h"

namespace sparrow::compression {
namespace {

// Fixed key for refilling vanished columns of the next shared factor. Only the
// aggregator computes S_{t+1} (and broadcasts it), so it needs no per-run seed.
constexpr uint64_t kRefillKey = 0x5350415252414350ull;  // "SPARRACP"

int which_of(int64_t round) { return detail::acp_which(round); }

// The factor (rows or cols) × r that `shared` must be when the sent factor is `which`.
void check_shared(const at::Tensor& s, int64_t rows, int64_t cols, int64_t r, int which, const char* what) {
  const int64_t k = which == 0 ? cols : rows;
  SPARROW_CHECK_T(FormatError, s.dim() == 2 && s.size(0) == k && s.size(1) == r,
                  what << ": shared factor has shape " << s.sizes() << ", expected [" << k << ", " << r << "] ("
                       << (which == 0 ? "Q^ for a P round" : "P^ for a Q round") << ")");
  SPARROW_CHECK_T(FormatError, s.scalar_type() == at::kFloat && s.device().is_cpu(),
                  what << ": shared factor must be float32 on the CPU");
  SPARROW_CHECK_T(FormatError, all_finite(s), what << ": shared factor is not finite");
}

// out (rows × cols, contiguous) += weight · F·Sᵀ (which = 0) or S·Fᵀ (which = 1).
void expand_add(const at::Tensor& f, const at::Tensor& s, int which, int64_t rows, int64_t cols, at::Tensor& out,
                float weight) {
  const at::Tensor fc = f.contiguous(), sc = s.contiguous();
  const at::Tensor& left = which == 0 ? fc : sc;
  const at::Tensor& right = which == 0 ? sc : fc;
  detail::rank_update(out.data_ptr<float>(), rows, cols, left.data_ptr<float>(), right.data_ptr<float>(), fc.size(1),
                      weight);
}

// ctx with its shared factor made contiguous when it is a float32 CPU tensor
// that is not (the kernel reads it in place, view_of borrows it); nullptr when
// ctx can be used as it is.
std::unique_ptr<Context> with_contiguous_shared(const Context& ctx) {
  const at::Tensor& s = ctx.shared_factor;
  if (!s.defined() || s.is_contiguous() || s.scalar_type() != at::kFloat || !s.device().is_cpu()) return nullptr;
  auto c = std::make_unique<Context>(ctx);
  c->shared_factor = s.contiguous();
  return c;
}

// The LibTorch acp: the torch-free kernel (acp_cpu.cc) run on the input and on
// the State's tensors in place, as every CPU codec. The shared factor is the
// one input the generic shell does not pass as is (a non-contiguous one).
class AcpCompressor final : public detail::KernelCompressor {
 public:
  explicit AcpCompressor(Spec& spec) : KernelCompressor(detail::make_acp_kernel(spec)) {}
  Encoded encode(const at::Tensor& x, State& state, const Context& ctx) const override {
    if (auto c = with_contiguous_shared(ctx)) return KernelCompressor::encode(x, state, *c);
    return KernelCompressor::encode(x, state, ctx);
  }
};

}  // namespace

// ---- aggregator side (lowrank.h) ----------------------------------------------

int acp_sent_factor(int64_t round) { return which_of(round); }

std::vector<int64_t> acp_sent_shape(const LowRankDims& d, int64_t round) {
  return {which_of(round) == 0 ? d.rows : d.cols, d.rank};
}

std::vector<int64_t> acp_shared_shape(const LowRankDims& d, int64_t round) {
  return {which_of(round) == 0 ? d.cols : d.rows, d.rank};
}

at::Tensor acp_initial_factor(const Context& ctx, int64_t rows, int64_t cols, int64_t rank, int which) {
  SPARROW_CHECK(rows >= 1 && cols >= 1 && rank >= 1, "acp_initial_factor: need rows, cols, rank >= 1");
  SPARROW_CHECK(which == 0 || which == 1, "acp_initial_factor: which must be 0 (P) or 1 (Q)");
  const int64_t r = std::min({rank, rows, cols});
  const int64_t k = which == 0 ? rows : cols;
  at::Tensor f = at::empty({k, r}, at::TensorOptions().dtype(at::kFloat));
  detail::initial_factor(detail::tensor_key(ctx), k, r, f.data_ptr<float>());
  return f;
}

at::Tensor acp_initial_shared(const Context& ctx, const LowRankDims& d, int64_t round) {
  return acp_initial_factor(ctx, d.rows, d.cols, d.rank, 1 - which_of(round));
}

at::Tensor acp_factor(const Encoded& e) {
  validate(e);
  SPARROW_CHECK_T(FormatError, e.format == Format::kLowRankFactor,
                  "acp: expected a low-rank factor, got format " << format_name(e.format));
  const int64_t k = e.params[3] == 0 ? e.params[0] : e.params[1];
  return detail::factor_of(e, 0, k, e.params[2]);
}

void acp_add_factor(const Encoded& e, int64_t round, at::Tensor& acc, float weight) {
  SPARROW_CHECK(acc.defined() && acc.scalar_type() == at::kFloat && acc.is_contiguous() && acc.device().is_cpu(),
                "acp_add_factor: accumulator must be a contiguous float32 CPU tensor");
  const at::Tensor f = acp_factor(e);
  SPARROW_CHECK_T(FormatError, static_cast<int>(e.params[3]) == which_of(round),
                  "acp: round " << round << " expects factor " << (which_of(round) == 0 ? "P" : "Q") << ", got "
                                << (e.params[3] == 0 ? "P" : "Q"));
  SPARROW_CHECK_T(FormatError, acc.sizes().equals(f.sizes()),
                  "acp: factor has shape " << f.sizes() << ", accumulator " << acc.sizes());
  acc.add_(f, weight);
}

Encoded acp_factor_encoded(const at::Tensor& factor, const std::vector<int64_t>& shape, int64_t round) {
  SPARROW_CHECK(factor.defined() && factor.dim() == 2 && factor.scalar_type() == at::kFloat && factor.device().is_cpu(),
                "acp_factor_encoded: factor must be a 2-D float32 CPU tensor");
  const int which = which_of(round);
  const int64_t r = factor.size(1);
  const LowRankDims d = lowrank_dims(shape, r);
  SPARROW_CHECK(d.rank == r && factor.size(0) == (which == 0 ? d.rows : d.cols),
                "acp_factor_encoded: factor " << factor.sizes() << " does not fit a tensor of " << d.rows << "x"
                                              << d.cols << " in round " << round);
  Encoded e;
  e.format = Format::kLowRankFactor;
  e.shape = shape;
  e.params = {static_cast<uint32_t>(d.rows), static_cast<uint32_t>(d.cols), static_cast<uint32_t>(r),
              static_cast<uint32_t>(which)};
  const at::Tensor c = factor.contiguous();
  detail::pack_values(c.data_ptr<float>(), static_cast<uint64_t>(c.numel()), ValueType::kF32, e.values);
  return e;
}

void acp_update_add(const at::Tensor& factor, const at::Tensor& shared, int64_t round, at::Tensor& out, float weight) {
  SPARROW_CHECK(out.defined() && out.scalar_type() == at::kFloat && out.is_contiguous() && out.device().is_cpu(),
                "acp_update_add: output must be a contiguous float32 CPU tensor");
  SPARROW_CHECK(factor.defined() && factor.dim() == 2 && factor.scalar_type() == at::kFloat,
                "acp_update_add: factor must be a 2-D float32 tensor");
  SPARROW_CHECK(out.dim() >= 1 && out.size(0) > 0, "acp_update_add: output must have at least one row");
  const int which = which_of(round);
  const int64_t r = factor.size(1);
  const int64_t rows = out.size(0), cols = out.numel() / rows;
  SPARROW_CHECK(factor.size(0) == (which == 0 ? rows : cols), "acp_update_add: factor "
                                                                  << factor.sizes() << " does not fit a " << rows << "x"
                                                                  << cols << " matrix in round " << round);
  check_shared(shared, rows, cols, r, which, "acp_update_add");
  expand_add(factor.contiguous(), shared.contiguous(), which, rows, cols, out, weight);
}

at::Tensor acp_update(const at::Tensor& factor, const at::Tensor& shared, int64_t round,
                      const std::vector<int64_t>& shape) {
  at::Tensor out = at::zeros(shape, at::TensorOptions().dtype(at::kFloat));
  acp_update_add(factor, shared, round, out, 1.0f);
  return out;
}

at::Tensor acp_next_shared(const at::Tensor& mean_factor) {
  SPARROW_CHECK(mean_factor.defined() && mean_factor.dim() == 2 && mean_factor.scalar_type() == at::kFloat &&
                    mean_factor.device().is_cpu(),
                "acp_next_shared: factor must be a 2-D float32 CPU tensor");
  at::Tensor s = mean_factor.contiguous().clone();
  detail::orthonormalize_refill(s, kRefillKey);
  return s;
}

namespace detail {

void decode_factor_add(const Encoded& e, at::Tensor& out, float weight, const Context& ctx) {
  auto c = with_contiguous_shared(ctx);
  decode_factor_add(e, out.data_ptr<float>(), weight, view_of(c ? *c : ctx));
}

void register_acp() {
  register_compressor("acp",
                      [](Spec& spec) -> std::unique_ptr<Compressor> { return std::make_unique<AcpCompressor>(spec); });
}

}  // namespace detail
}  // namespace sparrow::compression
