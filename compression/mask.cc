#include "compression/mask.h"

#include <ATen/ATen.h>

#include <cmath>

#include "compression/codec_util.h"
#include "compression/dgc.h"
#include "core/error.h"

namespace sparrow::compression {
namespace {

at::Tensor positions_tensor(const std::vector<int64_t>& idx) {
  at::Tensor out = at::empty({static_cast<int64_t>(idx.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(idx.begin(), idx.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

at::Tensor step_mask(const at::Tensor& step, double ratio) {
  SPARROW_CHECK(ratio > 0.0 && ratio <= 1.0, "step_mask: ratio " << ratio << " must be in (0, 1]");
  const at::Tensor s = step.to(at::kFloat).contiguous().cpu();
  const int64_t n = s.numel();
  const int64_t k = std::min<int64_t>(n, static_cast<int64_t>(std::ceil(ratio * static_cast<double>(n))));
  const float* p = s.data_ptr<float>();
  // The step's nonzeros first: a sparse step (a sparse aggregate under plain
  // FedAvg) would otherwise make every zero a top-k candidate.
  std::vector<int64_t> nz;
  for (int64_t i = 0; i < n; ++i)
    if (p[i] != 0.0f) nz.push_back(i);
  std::vector<int64_t> idx;
  if (static_cast<int64_t>(nz.size()) <= k) {
    idx = std::move(nz);
  } else if (static_cast<int64_t>(nz.size()) == n) {
    idx = detail::topk_abs_indices(p, n, k);
  } else {
    std::vector<float> vals(nz.size());
    for (size_t j = 0; j < nz.size(); ++j) vals[j] = p[nz[j]];
    const std::vector<int64_t> pick = detail::topk_abs_indices(vals.data(), static_cast<int64_t>(vals.size()), k);
    idx.reserve(pick.size());
    for (const int64_t j : pick) idx.push_back(nz[static_cast<size_t>(j)]);  // ascending, as pick is
  }
  return positions_tensor(idx);
}

Encoded mask_encoded(const at::Tensor& mask, const std::vector<int64_t>& shape) {
  const at::Tensor m = mask.contiguous();
  const std::vector<float> ones(static_cast<size_t>(m.numel()), 1.0f);
  return detail::make_sparse(shape, m.data_ptr<int64_t>(), ones.data(), static_cast<uint64_t>(m.numel()),
                             ValueType::kSign, 1.0f, detail::IndexMode::kRice);
}

void check_mask(const Encoded& e, const Context& ctx) {
  if (e.format == Format::kSparse && e.index_coding == IndexCoding::kMask) (void)detail::mask_layout_for(e, ctx);
}

at::Tensor mask_positions(const Encoded& e) {
  validate(e);
  SPARROW_CHECK_T(FormatError, e.format == Format::kSparse && e.index_coding != IndexCoding::kMask,
                  "mask: expected a sparse tensor with its own positions");
  return positions_tensor(detail::decode_indices(e));
}

std::string mask_key(const std::string& name) { return "mask/" + name; }

void put_step_masks(std::map<std::string, at::Tensor>& shared, const std::map<std::string, at::Tensor>& before,
                    const std::map<std::string, at::Tensor>& after, double ratio) {
  for (const auto& [name, w] : after) shared[mask_key(name)] = mask_to_weights(step_mask(w - before.at(name), ratio));
}

at::Tensor mask_to_weights(const at::Tensor& mask) {
  const at::Tensor m = mask.contiguous();
  const int64_t k = m.numel();
  at::Tensor w = at::empty({k, 2}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* p = m.data_ptr<int64_t>();
  float* o = w.data_ptr<float>();
  for (int64_t i = 0; i < k; ++i) {
    o[2 * i] = static_cast<float>(p[i] >> 20);
    o[2 * i + 1] = static_cast<float>(p[i] & 0xfffff);
  }
  return w;
}

at::Tensor mask_from_weights(const at::Tensor& w, int64_t numel) {
  SPARROW_CHECK_T(FormatError, w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(1) == 2,
                  "mask: expected a [m, 2] float32 tensor of positions");
  const at::Tensor c = w.contiguous();
  const int64_t k = c.size(0);
  SPARROW_CHECK_T(FormatError, k <= numel, "mask: " << k << " positions for " << numel << " elements");
  at::Tensor out = at::empty({k}, at::TensorOptions().dtype(at::kLong));
  const float* p = c.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) {
    const float hi = p[2 * i], lo = p[2 * i + 1];
    SPARROW_CHECK_T(
        FormatError,
        hi >= 0.0f && hi < 1048576.0f && lo >= 0.0f && lo < 1048576.0f && hi == std::floor(hi) && lo == std::floor(lo),
        "mask: position " << i << " is not a (hi, lo) pair of 20-bit integers");
    o[i] = (static_cast<int64_t>(hi) << 20) | static_cast<int64_t>(lo);
    SPARROW_CHECK_T(FormatError, o[i] < numel && (i == 0 || o[i] > o[i - 1]),
                    "mask: positions are not ascending within [0, " << numel << ")");
  }
  return out;
}

}  // namespace sparrow::compression
