// PowerSGD's kernel without LibTorch (codec_kernel.h): what flat::make_codec
// ("powersgd:...") runs, for the lite client. The LibTorch codec
// (powersgd.cc, which says why each step is there) runs the same steps over the
// same lowrank_kernel.h functions, with the same state slots ("residual": the
// input's shape; "q": cols × r) and the same seeded initial Q, so both give the
// same bytes and the same state (tests/compression/flat_powersgd_test.cc).
#include <algorithm>
#include <cmath>

#include "compression/codec_kernel.h"
#include "compression/lowrank_kernel.h"

namespace sparrow::compression::detail {
namespace {

class PowerSgdKernel final : public Kernel {
 public:
  explicit PowerSgdKernel(const PowerSgdOptions& o) : o_(o) {}
  std::string method() const override { return "powersgd"; }

  Encoded encode(const float* x, const std::vector<int64_t>& shape, Slots& slots, const CodecView& ctx) const override {
    Encoded e;
    e.shape = shape;
    ++slots.step();
    if (!lowrank_compressible(shape, o_.rank, o_.min_rate)) {
      e.format = Format::kDense;
      pack_values(x, static_cast<uint64_t>(numel_of(shape)), ValueType::kF32, e.values);
      return e;
    }
    const LowRankDims d = lowrank_dims(shape, o_.rank);
    const int64_t n = d.rows, m = d.cols, r = d.rank;
    const uint64_t key = tensor_key(ctx);

    // Q: last step's Q (warm start) or the seeded one. A missing or reshaped
    // "q" slot reads as zeros, which orthonormalize_refill refills with
    // exactly the seeded factor's entries: the LibTorch codec's cold start.
    std::vector<float> q(static_cast<size_t>(m * r));
    if (o_.warm_start) {
      const float* stored = slots.slot("q", {m, r});
      std::copy(stored, stored + m * r, q.begin());
      orthonormalize_refill(q.data(), m, r, key);
    } else {
      initial_factor(key, m, r, q.data());
    }

    if (o_.ef) age_state(slots, ctx, o_.stale, {"residual"});
    // M' = M + E is built in the residual slot during the first product's pass.
    float* res = o_.ef ? slots.slot("residual", shape) : nullptr;
    const float* mc = o_.ef ? res : x;
    std::vector<float> p(static_cast<size_t>(n * r));
    if (o_.ef) {
      skinny_mm(res, x, res, n, m, q.data(), r, p.data());
    } else {
      skinny_mm(x, nullptr, nullptr, n, m, q.data(), r, p.data());
    }
    orthonormalize(p.data(), n, r);
    for (int64_t step = 1; step < o_.iters; ++step) {
      skinny_mm_t(mc, nullptr, nullptr, n, m, p.data(), r, q.data());
      orthonormalize_refill(q.data(), m, r, key);
      skinny_mm(mc, nullptr, nullptr, n, m, q.data(), r, p.data());
      orthonormalize(p.data(), n, r);
    }
    e.format = Format::kLowRank;
    e.value_type = o_.vt;
    e.params = {static_cast<uint32_t>(n), static_cast<uint32_t>(m), static_cast<uint32_t>(r)};
    e.values.reserve(value_bytes(o_.vt, static_cast<uint64_t>((n + m) * r)));
    // P as the receiver will see it, then Q = M'ᵀ P̃ against that P̃.
    pack_factor(p.data(), n, r, o_.vt, e);
    skinny_mm_t(mc, nullptr, nullptr, n, m, p.data(), r, q.data());
    pack_factor(q.data(), m, r, o_.vt, e);

    if (o_.ef) rank_update(res, n, m, p.data(), q.data(), r, -1.0f);  // E = M' − P·Qᵀ
    if (o_.sparse > 0.0) add_sparse_correction(res, n * m, o_.sparse, o_.vt, e);
    if (o_.warm_start) {
      float* stored = slots.slot("q", {m, r});
      std::copy(q.begin(), q.end(), stored);
    } else {
      slots.erase("q");
    }
    return e;
  }

 private:
  PowerSgdOptions o_;
};

}  // namespace

std::unique_ptr<Kernel> make_powersgd_kernel(Spec& spec) {
  return std::make_unique<PowerSgdKernel>(parse_powersgd_options(spec));
}

}  // namespace sparrow::compression::detail
