// powersgd:rank=r[,warm_start=0|1][,ef=0|1][,values=fp32|fp16|bf16|int8]
//          [,iters=N][,min_rate=R][,decay=D,max_age=A][,sparse=S]
// PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019), one power-iteration step
// per encode (iters=N: N steps, the wire unchanged). values= sets the factors'
// type on the wire (protocol 1.4 for all but fp32; int8 with one scale per
// factor column); the rounding stays in E. decay/max_age age the residual of a
// client that skipped rounds (codec_util.h's StalePolicy). A matrix travels as
// factors only when they are at least min_rate (default 2, as PyTorch's
// min_compression_rate) times smaller than it (the factors alone, without a
// sparse correction); otherwise dense fp32.
// sparse=S (protocol 1.5, Format::kLowRankSparse): the ceil(S·numel) largest
// entries of what the factors leave, E = M' − P·Qᵀ, travel with them (Rice-coded
// positions, values of the factors' type), so a client's largest errors do not
// wait in its residual for the next round it is sampled in.
//
// This is PyTorch's powerSGD_hook with the all-reduces removed (N = 1): in
// federated learning each client sends both of its own factors in one message,
// so there is no mid-step exchange of P. Consequences:
//  - error feedback is local: E = (M + E) − P·Qᵀ with this client's own P, Q
//    (the hook uses local − global reconstruction);
//  - the aggregator cannot sum factors (Σ P_i Q_iᵀ ≠ (Σ P_i)(Σ Q_i)ᵀ), it sums
//    the decoded P·Qᵀ. `acp` is the variant whose aggregation is linear.
//
// Its arithmetic (the matrix view, Gram–Schmidt, the skinny products, the
// factors' coding, the decoder of kLowRank) is torch-free, in lowrank_cpu.cc
// (lowrank_kernel.h), shared with ACP (acp.cc) and with the flat powersgd
// kernel (powersgd_cpu.cc: these steps over Slots, for the lite client); the
// wrappers here take at::Tensor.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "compression/codec_util.h"
#include "compression/formats.h"
#include "compression/lowrank.h"
#include "core/spec.h"

namespace sparrow::compression {

void orthonormalize_columns(at::Tensor& m) {
  SPARROW_CHECK(m.defined() && m.dim() == 2 && m.scalar_type() == at::kFloat && m.device().is_cpu(),
                "orthonormalize_columns: expected a 2-D float32 CPU matrix");
  if (m.is_contiguous()) {
    detail::orthonormalize(m.data_ptr<float>(), m.size(0), m.size(1));
    return;
  }
  at::Tensor c = m.contiguous();
  detail::orthonormalize(c.data_ptr<float>(), c.size(0), c.size(1));
  m.copy_(c);
}

namespace detail {

int64_t orthonormalize_refill(at::Tensor& m, uint64_t key) {
  SPARROW_CHECK(m.defined() && m.dim() == 2 && m.scalar_type() == at::kFloat && m.device().is_cpu(),
                "orthonormalize_refill: expected a 2-D float32 CPU matrix");
  SPARROW_CHECK(m.is_contiguous(), "orthonormalize_refill: matrix must be contiguous");
  return orthonormalize_refill(m.data_ptr<float>(), m.size(0), m.size(1), key);
}

at::Tensor factor_of(const Encoded& e, int part, int64_t k, int64_t r) {
  at::Tensor f = at::empty({k, r}, at::TensorOptions().dtype(at::kFloat));
  unpack_factor(e, part, k, r, f.data_ptr<float>());
  return f;
}

void pack_factor(at::Tensor& f, ValueType vt, Encoded& e) {
  pack_factor(f.data_ptr<float>(), f.size(0), f.size(1), vt, e);
}

void decode_lowrank_add(const Encoded& e, at::Tensor& out, float weight) {
  decode_lowrank_add(e, out.data_ptr<float>(), weight);
}

namespace {

class PowerSgdCompressor final : public Compressor {
 public:
  explicit PowerSgdCompressor(const PowerSgdOptions& o)
      : rank_(o.rank),
        warm_start_(o.warm_start),
        ef_(o.ef),
        vt_(o.vt),
        iters_(o.iters),
        min_rate_(o.min_rate),
        stale_(o.stale),
        sparse_(o.sparse) {}
  std::string method() const override { return "powersgd"; }

  Encoded encode(const at::Tensor& x_in, State& state, const Context& ctx) const override {
    const at::Tensor x = as_input(x_in, "powersgd");
    Encoded e;
    e.shape = shape_of(x);
    ++state.step;
    if (!lowrank_compressible(e.shape, rank_, min_rate_)) {
      e.format = Format::kDense;
      pack_values(x.data_ptr<float>(), static_cast<uint64_t>(x.numel()), ValueType::kF32, e.values);
      return e;
    }
    const LowRankDims d = lowrank_dims(e.shape, rank_);
    const int64_t n = d.rows, m = d.cols, r = d.rank;

    // Q: last step's Q (warm start) or the seeded one, orthonormalised. A stored
    // Q that lost columns (e.g. after an all-zero input, Q = M'ᵀP = 0) is refilled
    // from the seeded stream, or the iteration would stay stuck at zero.
    at::Tensor q;
    auto it = state.tensors.find("q");
    if (warm_start_ && it != state.tensors.end() && it->second.dim() == 2 && it->second.size(0) == m &&
        it->second.size(1) == r) {
      q = it->second.contiguous().clone();
      detail::orthonormalize_refill(q, tensor_key(ctx));
    } else {
      q = acp_initial_factor(ctx, n, m, r, 1);
    }

    if (ef_) detail::age_state(state, ctx, stale_, {"residual"});
    // M' = M + E is built in the residual slot during the first product's pass.
    const float* xp = x.data_ptr<float>();
    float* res = ef_ ? detail::residual_data(state, x) : nullptr;
    const float* mc = ef_ ? res : xp;
    at::Tensor p = at::empty({n, r}, at::TensorOptions().dtype(at::kFloat));
    if (ef_) {
      detail::skinny_mm(res, xp, res, n, m, q.data_ptr<float>(), r, p.data_ptr<float>());
    } else {
      detail::skinny_mm(xp, nullptr, nullptr, n, m, q.data_ptr<float>(), r, p.data_ptr<float>());
    }
    orthonormalize_columns(p);
    // iters > 1: more power steps on M' before the final Q, for a P closer to
    // M's top-r left singular space (a client's warm-start Q is from the last
    // round it took part in, and in FL that is usually many rounds ago).
    for (int64_t step = 1; step < iters_; ++step) {
      detail::skinny_mm_t(mc, nullptr, nullptr, n, m, p.data_ptr<float>(), r, q.data_ptr<float>());
      detail::orthonormalize_refill(q, tensor_key(ctx));
      detail::skinny_mm(mc, nullptr, nullptr, n, m, q.data_ptr<float>(), r, p.data_ptr<float>());
      orthonormalize_columns(p);
    }
    e.format = Format::kLowRank;
    e.value_type = vt_;
    e.params = {static_cast<uint32_t>(n), static_cast<uint32_t>(m), static_cast<uint32_t>(r)};
    e.values.reserve(value_bytes(vt_, static_cast<uint64_t>((n + m) * r)));
    // P as the receiver will see it (rounded to vt_), then Q = M'ᵀ P̃ against
    // that P̃, so Q absorbs P's rounding; E = M' − P̃·Q̃ᵀ keeps the rest.
    pack_factor(p, vt_, e);
    q = at::empty({m, r}, at::TensorOptions().dtype(at::kFloat));
    detail::skinny_mm_t(mc, nullptr, nullptr, n, m, p.data_ptr<float>(), r, q.data_ptr<float>());
    pack_factor(q, vt_, e);

    if (ef_) detail::rank_update(res, n, m, p.data_ptr<float>(), q.data_ptr<float>(), r, -1.0f);  // E = M' − P·Qᵀ
    if (sparse_ > 0.0) detail::add_sparse_correction(res, n * m, sparse_, vt_, e);
    if (warm_start_) {
      state.tensors.insert_or_assign("q", q);
    } else {
      state.tensors.erase("q");
    }
    return e;
  }

 private:
  int64_t rank_;
  bool warm_start_;
  bool ef_;
  ValueType vt_;
  int64_t iters_;
  double min_rate_;
  detail::StalePolicy stale_;
  double sparse_;
};

}  // namespace

void register_lowrank() {
  register_compressor("powersgd", [](Spec& spec) -> std::unique_ptr<Compressor> {
    return std::make_unique<PowerSgdCompressor>(parse_powersgd_options(spec));
  });
  register_acp();
}

}  // namespace detail
}  // namespace sparrow::compression
