#include "compression/codec_util.h"

#include <ATen/ATen.h>

#include <cmath>

#include "core/rng.h"

namespace sparrow::compression::detail {

at::Tensor as_input(const at::Tensor& x, const char* method) {
  SPARROW_CHECK(x.defined(), method << ": input tensor is undefined");
  SPARROW_CHECK(x.scalar_type() == at::kFloat, method << ": input must be float32, got " << x.scalar_type());
  SPARROW_CHECK(x.device().is_cpu(), method << ": input must be on the CPU, got " << x.device());
  at::Tensor c = x.contiguous();
  check_finite_input(c.data_ptr<float>(), c.numel(), method);
  return c;
}

std::vector<int64_t> shape_of(const at::Tensor& x) { return std::vector<int64_t>(x.sizes().begin(), x.sizes().end()); }

CodecView view_of(const Context& ctx) {
  CodecView v;
  v.name = ctx.name;
  v.seed = ctx.seed;
  v.num_workers = ctx.num_workers;
  v.round = ctx.round;
  v.share_mean = ctx.share_mean;
  if (ctx.mask.defined()) {
    const at::Tensor& mk = ctx.mask;
    v.has_mask = true;
    v.mask_size = mk.numel();
    if (mk.scalar_type() == at::kLong && mk.dim() == 1 && mk.is_contiguous() && mk.device().is_cpu())
      v.mask = mk.data_ptr<int64_t>();
    else
      v.mask_malformed = true;
  }
  if (ctx.shared_factor.defined()) {  // ACP (acp.cc makes it contiguous first)
    const at::Tensor& s = ctx.shared_factor;
    v.has_shared = true;
    v.shared_shape = s.sizes().data();
    v.shared_dims = s.sizes().size();
    v.shared_size = s.numel();
    if (s.scalar_type() == at::kFloat && s.device().is_cpu() && s.is_contiguous())
      v.shared = s.data_ptr<float>();
    else
      v.shared_malformed = true;
  }
  return v;
}

uint64_t tensor_key(const Context& ctx) { return rng::derive(ctx.seed, rng::hash_name(ctx.name)); }
uint64_t step_key(const Context& ctx, uint64_t step) { return rng::derive(tensor_key(ctx), step); }

MaskLayout mask_layout_for(const Encoded& e, const Context& ctx) { return mask_layout_for(e, view_of(ctx)); }
const int64_t* mask_data(const Context& ctx, int64_t numel) { return mask_data(view_of(ctx), numel); }
std::vector<int64_t> decode_masked_indices(const Encoded& e, const Context& ctx) {
  return decode_masked_indices(e, view_of(ctx));
}

int64_t age_state(State& state, const Context& ctx, const StalePolicy& policy,
                  std::initializer_list<const char*> slots) {
  int64_t skipped = 0;
  if (ctx.round >= 0 && state.last_round >= 0 && ctx.round > state.last_round)
    skipped = ctx.round - state.last_round - 1;
  if (ctx.round >= 0) state.last_round = ctx.round;
  if (skipped <= 0 || !policy.active()) return skipped;
  const double factor = stale_factor(policy, skipped);
  for (const char* name : slots) {
    auto it = state.tensors.find(name);
    if (it == state.tensors.end()) continue;
    if (factor == 0.0)
      it->second.zero_();
    else
      it->second.mul_(factor);
  }
  return skipped;
}

float* residual_data(State& state, const at::Tensor& x) {
  at::Tensor& slot = state.slot("residual", x);
  if (!slot.is_contiguous()) slot = slot.contiguous();
  return slot.data_ptr<float>();
}

}  // namespace sparrow::compression::detail
