// The codecs without LibTorch (flat_codec.h): the registry of the torch-free
// kernels, flat::State and its bytes, flat::decode_add.
#include "compression/flat_codec.h"

#include <algorithm>
#include <cstring>

#include "compression/codec_bits.h"
#include "compression/codec_kernel.h"
#include "compression/decoders.h"
#include "compression/lowrank_kernel.h"
#include "core/error.h"
#include "core/spec.h"

namespace sparrow::compression {

namespace detail {

std::unique_ptr<Kernel> make_kernel(Spec& spec) {
  const std::string& m = spec.method();
  if (m == "none" || m == "fp16" || m == "bf16") return make_dense_kernel(m, spec);
  if (m == "topk" || m == "stc" || m == "randomk" || m == "threshold" || m == "tcs") return make_sparse_kernel(m, spec);
  if (m == "dgc") return make_dgc_kernel(parse_dgc_options(spec));
  if (m == "qsgd") return make_qsgd_kernel(spec);
  if (m == "terngrad") return make_terngrad_kernel(spec);
  if (m == "sign") return make_sign_kernel(spec.get_bool("ef", true));
  if (m == "powersgd") return make_powersgd_kernel(spec);
  if (m == "acp") return make_acp_kernel(spec);
  return nullptr;
}

std::vector<std::string> kernel_methods() {
  return {"acp",     "bf16", "dgc", "fp16", "none",     "powersgd",  "qsgd",
          "randomk", "sign", "stc", "tcs",  "terngrad", "threshold", "topk"};
}

}  // namespace detail

namespace flat {
namespace {

int64_t checked_numel(const std::vector<int64_t>& shape, const char* what) {
  int64_t n = 1;
  for (int64_t d : shape) {
    SPARROW_CHECK(d >= 0, what << ": negative dimension " << d);
    n *= d;
  }
  return n;
}

detail::CodecView view_of(const Context& ctx) {
  detail::CodecView v;
  v.name = ctx.name;
  v.seed = ctx.seed;
  v.num_workers = ctx.num_workers;
  v.round = ctx.round;
  v.share_mean = ctx.share_mean;
  v.has_mask = ctx.has_mask;
  if (ctx.has_mask) {
    v.mask = ctx.mask.data();
    v.mask_size = static_cast<int64_t>(ctx.mask.size());
  }
  if (ctx.has_shared_factor) {  // acp
    v.has_shared = true;
    v.shared = ctx.shared_factor.data.data();
    v.shared_size = static_cast<int64_t>(ctx.shared_factor.data.size());
    v.shared_shape = ctx.shared_factor.shape.data();
    v.shared_dims = ctx.shared_factor.shape.size();
  }
  return v;
}

// flat::State's tensors as the kernel's slots, written in place.
class FlatSlots final : public detail::Slots {
 public:
  explicit FlatSlots(State& state) : state_(state) {}
  float* slot(const char* name, const std::vector<int64_t>& shape) override {
    return state_.slot(name, shape).data.data();
  }
  float* find(const char* name, int64_t* n) override {
    auto it = state_.tensors.find(name);
    if (it == state_.tensors.end()) return nullptr;
    *n = static_cast<int64_t>(it->second.data.size());
    return it->second.data.data();
  }
  void erase(const char* name) override { state_.tensors.erase(name); }
  uint64_t& step() override { return state_.step; }
  int64_t& last_round() override { return state_.last_round; }

 private:
  State& state_;
};

class KernelCodec final : public Codec {
 public:
  explicit KernelCodec(std::unique_ptr<detail::Kernel> k) : kernel_(std::move(k)), method_(kernel_->method()) {}
  std::string method() const override { return method_; }
  Encoded encode(const float* x, const std::vector<int64_t>& shape, State& state, const Context& ctx) const override {
    const int64_t n = checked_numel(shape, method_.c_str());
    SPARROW_CHECK(x != nullptr || n == 0, method_ << ": input is null");
    detail::check_finite_input(x, n, method_.c_str());
    FlatSlots slots(state);
    return kernel_->encode(x, shape, slots, view_of(ctx));
  }
  double mask_ratio() const override { return kernel_->mask_ratio(); }
  bool share_mean() const override { return kernel_->share_mean(); }

 private:
  std::unique_ptr<detail::Kernel> kernel_;
  std::string method_;
};

// flat::State as the slots state_format writes.
std::vector<state_format::SlotView> slot_views(const State& s) {
  std::vector<state_format::SlotView> v;
  v.reserve(s.tensors.size());
  for (const auto& [name, t] : s.tensors)
    v.push_back({&name, t.shape.data(), t.shape.size(), t.data.data(), t.data.size()});
  return v;
}

}  // namespace

Tensor& State::slot(const std::string& key, const std::vector<int64_t>& shape) {
  auto it = tensors.find(key);
  if (it == tensors.end() || it->second.shape != shape) {
    Tensor z;
    z.shape = shape;
    z.data.assign(static_cast<size_t>(checked_numel(shape, "compressor state")), 0.0f);
    it = tensors.insert_or_assign(key, std::move(z)).first;
  }
  return it->second;
}

std::string State::serialize() const { return state_format::write({step, last_round}, slot_views(*this)); }
uint64_t State::serialized_size() const { return state_format::size(slot_views(*this)); }
void State::serialize_to(const state_format::Sink& sink) const {
  state_format::write({step, last_round}, slot_views(*this), sink);
}

State State::deserialize(const char* p, size_t n) {
  State s;
  const state_format::Header h = state_format::read(p, n, [&s](std::string name, const std::vector<int64_t>& shape) {
    Tensor& t = s.tensors[std::move(name)];
    t.shape = shape;
    t.data.resize(static_cast<size_t>(checked_numel(shape, "compressor state")));
    return t.data.data();
  });
  s.step = h.step;
  s.last_round = h.last_round;
  return s;
}

std::unique_ptr<Codec> make_codec(const std::string& text) {
  Spec spec = Spec::parse(text);
  std::unique_ptr<detail::Kernel> kernel = detail::make_kernel(spec);
  if (!kernel) {
    std::string known;
    for (const std::string& m : flat_methods()) known += (known.empty() ? "" : ", ") + m;
    throw ConfigError("unknown compression method '" + spec.method() + "' (known without LibTorch: " + known + ")");
  }
  spec.check_all_consumed();
  return std::make_unique<KernelCodec>(std::move(kernel));
}

std::vector<std::string> flat_methods() { return detail::kernel_methods(); }

namespace {

void decode_into(const Encoded& e, float* out, float weight, const detail::CodecView& ctx) {
  switch (e.format) {
    case Format::kDense:
      return detail::decode_dense_add(e, out, weight);
    case Format::kSparse:
      return detail::decode_sparse_add(e, out, weight, ctx);
    case Format::kQuantized:
      return detail::decode_quantized_add(e, out, weight);
    case Format::kTernary:
      return detail::decode_ternary_add(e, out, weight);
    case Format::kSign:
      return detail::decode_sign_add(e, out, weight);
    case Format::kLowRank:
    case Format::kLowRankSparse:
      return detail::decode_lowrank_add(e, out, weight);
    case Format::kLowRankFactor:
      return detail::decode_factor_add(e, out, weight, ctx);
  }
  throw FormatError("unknown tensor format");
}

}  // namespace

void decode_add(const Encoded& e, float* out, int64_t n, float weight, const Context& ctx) {
  validate(e);
  SPARROW_CHECK_T(FormatError, n == e.numel(), "decode_add: output has " << n << " elements, update has " << e.numel());
  const detail::CodecView view = view_of(ctx);
  // As compression::decode_add: bit-stream formats decode into scratch first,
  // so that a stream found bad half way leaves `out` untouched.
  if (detail::format_decodes_late(e.format)) {
    std::vector<float> scratch(static_cast<size_t>(n), 0.0f);
    decode_into(e, scratch.data(), weight, view);
    for (int64_t i = 0; i < n; ++i) out[i] += scratch[static_cast<size_t>(i)];
    return;
  }
  decode_into(e, out, weight, view);
}

Tensor shared_factor_of(const Encoded& e) {
  validate(e);
  Tensor f;
  if (e.format != Format::kLowRankFactor) {
    f.shape = e.shape;
    f.data.assign(static_cast<size_t>(e.numel()), 0.0f);
    decode_add(e, f.data.data(), e.numel(), 1.0f);
    return f;
  }
  const int64_t k = e.params[3] == 0 ? e.params[0] : e.params[1], r = e.params[2];
  f.shape = {k, r};
  f.data.resize(static_cast<size_t>(k * r));
  detail::unpack_factor(e, 0, k, r, f.data.data());
  return f;
}

}  // namespace flat
}  // namespace sparrow::compression
