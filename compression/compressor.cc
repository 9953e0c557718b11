#include "compression/compressor.h"

#include <ATen/ATen.h>

#include <cstring>
#include <map>
#include <mutex>

#include "compression/codec_util.h"
#include "compression/formats.h"
#include "compression/torch_codec.h"
#include "core/error.h"
#include "core/spec.h"

namespace sparrow::compression {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, Factory>& registry() {
  static std::map<std::string, Factory> r;
  return r;
}

}  // namespace

at::Tensor Compressor::decode(const Encoded& e, const Context& ctx) const { return compression::decode(e, ctx); }

namespace {

// Adds weight · decode(e) into out; may leave out half-updated on a bit-stream
// error, so only for fresh buffers. Assumes validate(e) passed and sizes match.
void decode_into(const Encoded& e, at::Tensor& out, float weight, const Context& ctx) {
  float* o = out.data_ptr<float>();
  switch (e.format) {
    case Format::kDense:
      return detail::decode_dense_add(e, o, weight);
    case Format::kSparse:
      return detail::decode_sparse_add(e, o, weight, detail::view_of(ctx));
    case Format::kQuantized:
      return detail::decode_quantized_add(e, o, weight);
    case Format::kTernary:
      return detail::decode_ternary_add(e, o, weight);
    case Format::kSign:
      return detail::decode_sign_add(e, o, weight);
    case Format::kLowRank:
    case Format::kLowRankSparse:
      return detail::decode_lowrank_add(e, out, weight);
    case Format::kLowRankFactor:
      return detail::decode_factor_add(e, out, weight, ctx);
  }
  throw FormatError("unknown tensor format");
}

}  // namespace

bool decodes_late(Format f) { return detail::format_decodes_late(f); }

bool all_finite(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  if (t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous())
    return !detail::any_nonfinite_f32(reinterpret_cast<const uint8_t*>(t.data_ptr<float>()),
                                      static_cast<uint64_t>(t.numel()));
  return at::isfinite(t).all().item<bool>();
}

at::Tensor decode(const Encoded& e, const Context& ctx) {
  validate(e);
  at::Tensor out = at::zeros(e.shape, at::TensorOptions().dtype(at::kFloat));
  decode_into(e, out, 1.0f, ctx);
  return out;
}

void decode_add(const Encoded& e, at::Tensor& out, float weight, const Context& ctx) {
  SPARROW_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.device().is_cpu(),
                "decode_add: output must be a contiguous float32 CPU tensor");
  validate(e);
  SPARROW_CHECK_T(FormatError, out.numel() == e.numel(),
                  "decode_add: output has " << out.numel() << " elements, update has " << e.numel());
  // Bit-stream formats can turn out malformed half way through (a truncated
  // Elias-gamma stream, a TernGrad code 3, nonzero padding) where validate()
  // cannot see it; they decode into scratch first so that a throw leaves `out`
  // untouched, which an aggregator folding updates into a running sum relies on.
  if (decodes_late(e.format)) {
    at::Tensor scratch = at::zeros(out.sizes(), out.options());
    decode_into(e, scratch, weight, ctx);
    out.add_(scratch);
    return;
  }
  decode_into(e, out, weight, ctx);
}

void decode_fill(const Encoded& e, at::Tensor& out, float weight, const Context& ctx) {
  SPARROW_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.device().is_cpu(),
                "decode_fill: output must be a contiguous float32 CPU tensor");
  if (e.format != Format::kDense || e.value_type != ValueType::kF32) {
    decode_add(e, out, weight, ctx);
    return;
  }
  validate(e, ValueCheck::kDeferDenseF32);
  SPARROW_CHECK_T(FormatError, out.numel() == e.numel(),
                  "decode_fill: output has " << out.numel() << " elements, update has " << e.numel());
  detail::fill_dense_f32(e, out.data_ptr<float>(), weight);
}

void decode_fill_pair(const Encoded& held, float held_weight, const Encoded& e, float weight, at::Tensor& out) {
  SPARROW_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.device().is_cpu(),
                "decode_fill_pair: output must be a contiguous float32 CPU tensor");
  for (const Encoded* x : {&held, &e}) {
    SPARROW_CHECK_T(FormatError, x->format == Format::kDense && x->value_type == ValueType::kF32,
                    "decode_fill_pair: both tensors must be dense fp32");
    SPARROW_CHECK_T(FormatError, x->numel() == out.numel(),
                    "decode_fill_pair: output has " << out.numel() << " elements, a tensor has " << x->numel());
  }
  validate(held);  // known finite: a memo lookup
  validate(e, ValueCheck::kDeferDenseF32);
  detail::fill_dense_f32_pair(held, held_weight, e, weight, out.data_ptr<float>());
}

Encoded dense_encoded(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU, at::kFloat).contiguous();
  Encoded e;
  e.format = Format::kDense;
  e.shape = c.sizes().vec();
  e.value_type = ValueType::kF32;
  const size_t bytes = static_cast<size_t>(c.numel()) * sizeof(float);
  e.values.resize_uninitialized(bytes);
  if (bytes) std::memcpy(e.values.data(), c.data_ptr<float>(), bytes);
  return e;
}

void register_compressor(const std::string& name, Factory factory) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[name] = std::move(factory);
}

void register_builtins() {
  static std::once_flag once;
  std::call_once(once, [] {
    detail::use_aten_parallel_for();
    detail::register_kernel_codecs();
    detail::register_dgc();
    detail::register_sign();
    detail::register_lowrank();
  });
}

std::unique_ptr<Compressor> make_compressor(const std::string& text) {
  register_builtins();
  Spec spec = Spec::parse(text);
  Factory factory;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(spec.method());
    if (it == registry().end()) {
      std::string known;
      for (const auto& kv : registry()) known += (known.empty() ? "" : ", ") + kv.first;
      throw ConfigError("unknown compression method '" + spec.method() + "' (known: " + known + ")");
    }
    factory = it->second;
  }
  std::unique_ptr<Compressor> c = factory(spec);
  spec.check_all_consumed();
  return c;
}

std::vector<std::string> registered_methods() {
  register_builtins();
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> names;
  for (const auto& kv : registry()) names.push_back(kv.first);
  return names;
}

}  // namespace sparrow::compression
