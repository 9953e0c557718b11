// ACP-SGD's kernel without LibTorch (codec_kernel.h): what both the LibTorch
// codec (acp.cc, a shell that registers it for CPU tensors) and
// flat::make_codec("acp:...") (the lite client) run, so both give the same
// bytes and the same state ("residual", the input's shape) by construction.
// acp.cc's header says what ACP does; lowrank.h has the aggregator's side.
//
// The one input besides the tensor and its state is the round's shared factor
// (CodecView::shared: the server's S_t in Task.shared, compression::Context::
// shared_factor or flat::Context::shared_factor); without one, every party
// derives the seeded initial factor, S_0.
#include <cmath>
#include <sstream>

#include "compression/codec_kernel.h"
#include "compression/lowrank_kernel.h"

namespace sparrow::compression::detail {
namespace {

std::string shape_text(const int64_t* dims, size_t n) {
  std::ostringstream o;
  o << '[';
  for (size_t i = 0; i < n; ++i) o << (i ? ", " : "") << dims[i];
  o << ']';
  return o.str();
}

class AcpKernel final : public Kernel {
 public:
  explicit AcpKernel(const AcpOptions& o) : o_(o) {}
  std::string method() const override { return "acp"; }

  Encoded encode(const float* x, const std::vector<int64_t>& shape, Slots& slots, const CodecView& ctx) const override {
    Encoded e;
    e.shape = shape;
    const int64_t round = ctx.round >= 0 ? ctx.round : static_cast<int64_t>(slots.step());
    if (!lowrank_compressible(shape, o_.rank)) {
      ++slots.step();
      e.format = Format::kDense;
      pack_values(x, static_cast<uint64_t>(numel_of(shape)), ValueType::kF32, e.values);
      return e;
    }
    const LowRankDims d = lowrank_dims(shape, o_.rank);
    const int64_t n = d.rows, m = d.cols, r = d.rank;
    const int which = acp_which(round);
    // Checked before the state changes, so a bad shared factor leaves it intact.
    std::vector<float> derived;
    const float* s = acp_shared_factor(ctx, n, m, r, which, "acp encode", derived);
    if (o_.ef) age_state(slots, ctx, o_.stale, {"residual"});

    // M' = M + E is built in the residual slot during the product's pass.
    float* res = o_.ef ? slots.slot("residual", shape) : nullptr;
    const float* src = o_.ef ? res : x;
    const float* add = o_.ef ? x : nullptr;
    const int64_t k = which == 0 ? n : m;
    std::vector<float> f(static_cast<size_t>(k * r));
    if (which == 0) {
      skinny_mm(src, add, res, n, m, s, r, f.data());  // P = M'·Q̂
    } else {
      skinny_mm_t(src, add, res, n, m, s, r, f.data());  // Q = M'ᵀ·P̂
    }
    e.format = Format::kLowRankFactor;
    e.value_type = o_.vt;
    e.params = {static_cast<uint32_t>(n), static_cast<uint32_t>(m), static_cast<uint32_t>(r),
                static_cast<uint32_t>(which)};
    pack_factor(f.data(), k, r, o_.vt, e);  // f is now what the aggregator decodes
    if (o_.ef) {                            // E = M' − P·Q̂ᵀ or M' − P̂·Qᵀ
      if (which == 0) {
        rank_update(res, n, m, f.data(), s, r, -1.0f);
      } else {
        rank_update(res, n, m, s, f.data(), r, -1.0f);
      }
    }
    ++slots.step();
    return e;
  }

 private:
  AcpOptions o_;
};

}  // namespace

const float* acp_shared_factor(const CodecView& ctx, int64_t rows, int64_t cols, int64_t r, int which, const char* what,
                               std::vector<float>& derived) {
  const int64_t k = which == 0 ? cols : rows;
  if (!ctx.has_shared) {
    derived.resize(static_cast<size_t>(k * r));
    initial_factor(tensor_key(ctx), k, r, derived.data());
    return derived.data();
  }
  SPARROW_CHECK_T(FormatError, ctx.shared_dims == 2 && ctx.shared_shape[0] == k && ctx.shared_shape[1] == r,
                  what << ": shared factor has shape " << shape_text(ctx.shared_shape, ctx.shared_dims)
                       << ", expected [" << k << ", " << r << "] ("
                       << (which == 0 ? "Q^ for a P round" : "P^ for a Q round") << ")");
  SPARROW_CHECK_T(FormatError, !ctx.shared_malformed && ctx.shared != nullptr,
                  what << ": shared factor must be float32 on the CPU");
  SPARROW_CHECK_T(FormatError, ctx.shared_size == k * r,
                  what << ": shared factor has " << ctx.shared_size << " values for its shape");
  for (int64_t i = 0; i < k * r; ++i)
    SPARROW_CHECK_T(FormatError, std::isfinite(ctx.shared[i]), what << ": shared factor is not finite");
  return ctx.shared;
}

void decode_factor_add(const Encoded& e, float* out, float weight, const CodecView& ctx) {
  const int64_t rows = e.params[0], cols = e.params[1], r = e.params[2];
  const int which = static_cast<int>(e.params[3]);
  std::vector<float> derived;
  const float* s = acp_shared_factor(ctx, rows, cols, r, which, "acp decode", derived);
  std::vector<float> f(static_cast<size_t>((which == 0 ? rows : cols) * r));
  unpack_factor(e, 0, which == 0 ? rows : cols, r, f.data());
  if (which == 0) {
    rank_update(out, rows, cols, f.data(), s, r, weight);  // F·Q̂ᵀ
  } else {
    rank_update(out, rows, cols, s, f.data(), r, weight);  // P̂·Fᵀ
  }
}

AcpOptions parse_acp_options(Spec& spec) {
  AcpOptions o;
  SPARROW_CHECK_T(ConfigError, spec.has("rank"), "acp: 'rank' is required (e.g. acp:rank=4)");
  o.rank = spec.get_int("rank", 0);
  SPARROW_CHECK_T(ConfigError, o.rank >= 1, "acp: rank must be >= 1, got " << o.rank);
  o.ef = spec.get_bool("ef", true);
  o.stale = parse_stale_policy(spec, "acp", o.ef);
  o.vt = parse_value_type(spec.get_string("values", "fp32"));  // fp32|fp16|bf16|int8
  return o;
}

std::unique_ptr<Kernel> make_acp_kernel(Spec& spec) { return std::make_unique<AcpKernel>(parse_acp_options(spec)); }

}  // namespace sparrow::compression::detail
