#include "compression/update_norm.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <vector>

#include "compression/codec_util.h"
#include "compression/lowrank.h"
#include "core/error.h"

namespace sparrow::compression {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double norm_of(const at::Tensor& t) {
  if (t.numel() == 0) return 0.0;
  const double n = at::linalg_vector_norm(t.to(at::kDouble), 2).item<double>();
  return std::isnan(n) ? kInf : n;
}

}  // namespace

double lowrank_norm(const at::Tensor& a, const at::Tensor& b) {
  SPARROW_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1),
                "lowrank_norm: factors " << a.sizes() << " and " << b.sizes() << " do not share a rank");
  if (a.numel() == 0 || b.numel() == 0) return 0.0;
  const at::Tensor ad = a.to(at::kDouble), bd = b.to(at::kDouble);
  const double s = (ad.t().mm(ad) * bd.t().mm(bd)).sum().item<double>();
  if (!std::isfinite(s)) return kInf;
  return std::sqrt(std::max(s, 0.0));  // rounding may leave a tiny negative for a zero product
}

double decoded_norm(const Encoded& e, const Context& ctx) {
  switch (e.format) {
    case Format::kDense:
      if (e.value_type == ValueType::kF32) {
        const uint64_t n = e.values.size() / 4;
        // A view of the values (read only): float accumulation suffices for
        // a bound, and an overflow gives +inf, which is refused.
        const at::Tensor v = at::from_blob(const_cast<uint8_t*>(e.values.data()), {static_cast<int64_t>(n)},
                                           at::TensorOptions().dtype(at::kFloat));
        const double f = n == 0 ? 0.0 : at::linalg_vector_norm(v, 2).item<double>();
        return std::isfinite(f) ? f : kInf;
      }
      return norm_of(decode(e, ctx));
    case Format::kSparse: {
      std::vector<float> vals(e.count);
      detail::unpack_sparse_values(e, vals.data());
      double s = 0.0;
      for (const float v : vals) s += static_cast<double>(v) * v;
      return std::isfinite(s) ? std::sqrt(s) : kInf;
    }
    case Format::kLowRank: {
      const int64_t rows = e.params[0], cols = e.params[1], r = e.params[2];
      return lowrank_norm(detail::factor_of(e, 0, rows, r), detail::factor_of(e, 1, cols, r));
    }
    case Format::kLowRankFactor:
      throw Error("decoded_norm: an ACP factor's norm needs the shared factor (use lowrank_norm)");
    case Format::kQuantized:
    case Format::kTernary:
    case Format::kSign:
    case Format::kLowRankSparse:
      break;
  }
  return norm_of(decode(e, ctx));
}

}  // namespace sparrow::compression
