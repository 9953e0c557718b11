// The codecs without LibTorch (flat_codec.h): the registry of the torch-free
// kernels, flat::State and its bytes, flat::decode_add.
#include "compression/flat_codec.h"

#include <algorithm>
#include <cstring>

#include "compression/codec_bits.h"
#include "compression/codec_kernel.h"
#include "compression/decoders.h"
#include "compression/lowrank_kernel.h"
#include "core/bytes.h"
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
  return nullptr;
}

std::vector<std::string> kernel_methods() {
  return {"bf16", "dgc", "fp16", "none",     "powersgd",  "qsgd", "randomk",
          "sign", "stc", "tcs",  "terngrad", "threshold", "topk"};
}

}  // namespace detail

namespace flat {
namespace {

constexpr char kMagic[4] = {'S', 'P', 'S', 'T'};
constexpr uint32_t kVersion = 2;  // as compression::State (state.cc): 2 adds last_round; 1 is still read

// The methods registered only with LibTorch (compressor.h): named in the refusal.
bool needs_libtorch(const std::string& method) { return method == "acp"; }

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

std::string State::serialize() const {
  using core::put_raw;
  std::string out(kMagic, 4);
  put_raw<uint32_t>(out, kVersion);
  put_raw<uint64_t>(out, step);
  put_raw<int64_t>(out, last_round);
  put_raw<uint32_t>(out, static_cast<uint32_t>(tensors.size()));
  for (const auto& [name, t] : tensors) {
    SPARROW_CHECK(static_cast<int64_t>(t.data.size()) == checked_numel(t.shape, "compressor state"),
                  "compressor state '" << name << "' has " << t.data.size() << " values for its shape");
    put_raw<uint32_t>(out, static_cast<uint32_t>(name.size()));
    out += name;
    put_raw<uint32_t>(out, static_cast<uint32_t>(t.shape.size()));
    for (int64_t d : t.shape) put_raw<int64_t>(out, d);
    out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size() * 4);
  }
  return out;
}

State State::deserialize(const std::string& bytes) {
  core::ByteReader r(bytes, "compressor state");
  SPARROW_CHECK_T(FormatError, bytes.size() >= 4 && std::memcmp(r.take(4), kMagic, 4) == 0,
                  "compressor state: bad magic");
  const uint32_t version = r.get<uint32_t>();
  SPARROW_CHECK_T(FormatError, version == 1 || version == kVersion,
                  "compressor state: unsupported version " << version);
  State s;
  s.step = r.get<uint64_t>();
  if (version >= 2) {
    s.last_round = r.get<int64_t>();
    SPARROW_CHECK_T(FormatError, s.last_round >= -1, "compressor state: bad last round " << s.last_round);
  }
  const uint32_t count = r.get<uint32_t>();
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t name_len = r.get<uint32_t>();
    std::string name(r.take(name_len), name_len);
    const uint32_t dims = r.get<uint32_t>();
    SPARROW_CHECK_T(FormatError, dims <= 8, "compressor state: '" << name << "' has " << dims << " dims");
    Tensor t;
    t.shape.resize(dims);
    uint64_t numel = 1;
    for (auto& d : t.shape) {
      d = r.get<int64_t>();
      SPARROW_CHECK_T(FormatError, d >= 0 && d < (int64_t{1} << 40), "compressor state: bad dimension " << d);
      numel *= static_cast<uint64_t>(d);
      SPARROW_CHECK_T(FormatError, numel < (uint64_t{1} << 40), "compressor state: tensor too large");
    }
    const char* data = r.take(numel * 4);
    t.data.resize(numel);
    if (numel) std::memcpy(t.data.data(), data, numel * 4);
    SPARROW_CHECK_T(FormatError, s.tensors.emplace(std::move(name), std::move(t)).second,
                    "compressor state: duplicate slot");
  }
  SPARROW_CHECK_T(FormatError, r.done(), "compressor state: trailing bytes");
  return s;
}

std::unique_ptr<Codec> make_codec(const std::string& text) {
  Spec spec = Spec::parse(text);
  if (needs_libtorch(spec.method()))
    throw ConfigError(spec.method() + " needs the LibTorch client: sparrow-client-lite encodes with " +
                      "none, fp16, bf16, topk, stc, randomk, threshold, tcs, dgc, qsgd, terngrad, sign or powersgd");
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
      break;
  }
  throw FormatError(std::string("decode_add: a ") + format_name(e.format) +
                    " update needs the LibTorch client (it is decoded against the round's shared factor)");
}

}  // namespace

void decode_add(const Encoded& e, float* out, int64_t n, float weight, const Context& ctx) {
  validate(e);
  SPARROW_CHECK_T(FormatError, n == e.numel(), "decode_add: output has " << n << " elements, update has " << e.numel());
  const detail::CodecView view = view_of(ctx);
  if (e.format == Format::kLowRankFactor) decode_into(e, nullptr, weight, view);  // throws
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

}  // namespace flat
}  // namespace sparrow::compression
