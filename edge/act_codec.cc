#include "edge/act_codec.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "compression/state.h"
#include "core/bytes.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/spec.h"

namespace sparrow::edge {
namespace {

constexpr int64_t kMaxNumel = (int64_t{1} << 31) - 1;
constexpr size_t kMaxDims = 8;

// Rows and columns of the matrix view of a packet's shape.
std::pair<int64_t, int64_t> matrix_dims(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return {shape[0], n / shape[0]};
}

bool all_finite(const float* v, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i])) return false;
  return true;
}

at::Tensor float_view(const ActPacket& p, size_t byte_offset, int64_t count) {
  // Copy: the packet's buffer need not be aligned for float and must not be aliased.
  at::Tensor t = at::empty({count}, at::kFloat);
  // count 0 (a k = 0 top-k packet): an empty tensor's and vector's pointers may be null.
  if (count > 0) std::memcpy(t.data_ptr<float>(), p.data.data() + byte_offset, static_cast<size_t>(count) * 4);
  return t;
}

void append_floats(std::vector<uint8_t>& out, const at::Tensor& t) {
  at::Tensor c = t.to(at::kFloat).contiguous();
  const size_t at = out.size();
  out.resize(at + static_cast<size_t>(c.numel()) * 4);
  if (c.numel()) std::memcpy(out.data() + at, c.data_ptr<float>(), static_cast<size_t>(c.numel()) * 4);
}

// Fresh Gaussian start for power iteration, a pure function of (seed, step).
at::Tensor gaussian(int64_t rows, int64_t cols, uint64_t key) {
  at::Tensor t = at::empty({rows, cols}, at::kFloat);
  float* d = t.data_ptr<float>();
  for (int64_t i = 0; i < rows * cols; ++i) d[i] = rng::normal(key, static_cast<uint64_t>(i));
  return t;
}

at::Tensor orthonormal(const at::Tensor& x) { return std::get<0>(at::linalg_qr(x, "reduced")); }

uint64_t code_bytes(uint64_t n, uint32_t bits) { return bits == 8 ? n : (n + 1) / 2; }

// Affine quantisation of each row of t [rows, cols] to `bits` (8 or 4), round to
// nearest: appends (min, step) per row to `scales` and the codes (4-bit: two per
// byte, low nibble first, padded to a byte) to `data`.
void quantize_rows(const at::Tensor& t, int bits, std::vector<float>& scales, std::vector<uint8_t>& data) {
  const at::Tensor a = t.to(at::kFloat).contiguous();
  const at::Tensor lo = std::get<0>(a.min(1, true)), hi = std::get<0>(a.max(1, true));
  const double levels = (1 << bits) - 1;
  const at::Tensor step = (hi - lo) / levels;
  const at::Tensor safe = at::where(step > 0, step, at::ones_like(step));
  const at::Tensor codes = ((a - lo) / safe).round().clamp(0, levels).to(at::kByte).contiguous();
  const at::Tensor sc = at::cat({lo, step}, 1).contiguous();
  scales.insert(scales.end(), sc.data_ptr<float>(), sc.data_ptr<float>() + sc.numel());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const int64_t n = codes.numel();
  if (bits == 8) {
    data.insert(data.end(), c, c + n);
  } else {
    const size_t at = data.size();
    data.resize(at + static_cast<size_t>((n + 1) / 2), 0);
    for (int64_t i = 0; i < n; ++i)
      data[at + static_cast<size_t>(i / 2)] |= static_cast<uint8_t>(c[i] << (4 * (i & 1)));
  }
}

// The inverse of quantize_rows: min + code * step, [rows, cols]. Device and
// cloud both call it on the same bytes, so they get bit-identical values.
at::Tensor dequantize_rows(const float* scales, const uint8_t* codes, int64_t rows, int64_t cols, uint32_t bits) {
  at::Tensor out = at::empty({rows, cols}, at::kFloat);
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float lo = scales[2 * r], step = scales[2 * r + 1];
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t i = r * cols + j;
      const uint32_t c = bits == 8 ? codes[i] : (codes[i / 2] >> (4 * (i & 1))) & 0xF;
      o[i] = lo + static_cast<float>(c) * step;
    }
  }
  return out;
}

bool lowrank_q(ActFormat f) { return f == ActFormat::kLowRankQ || f == ActFormat::kLowRankCachedQ; }

// P (N x R) of a kLowRank(Cached)Q packet, dequantised.
at::Tensor quantized_p(const ActPacket& p) {
  const int64_t rows = p.params[0], r = p.params[2];
  return dequantize_rows(p.scales.data(), p.data.data(), r, rows, p.params[4]).t();
}

// Q (M x R) of a kLowRankQ packet, dequantised.
at::Tensor quantized_q(const ActPacket& p) {
  const int64_t rows = p.params[0], cols = p.params[1], r = p.params[2];
  const size_t offset = static_cast<size_t>(code_bytes(static_cast<uint64_t>(r * rows), p.params[4]));
  return dequantize_rows(p.scales.data() + 2 * r, p.data.data() + offset, r, cols, p.params[6]).t().contiguous();
}

}  // namespace

const char* act_format_name(ActFormat f) {
  switch (f) {
    case ActFormat::kDense:
      return "dense";
    case ActFormat::kLowRank:
      return "lowrank";
    case ActFormat::kProjected:
      return "projected";
    case ActFormat::kQuant:
      return "quant";
    case ActFormat::kTopK:
      return "topk";
    case ActFormat::kLowRankCached:
      return "lowrank_cached";
    case ActFormat::kLowRankQ:
      return "lowrank_q";
    case ActFormat::kLowRankCachedQ:
      return "lowrank_cached_q";
    case ActFormat::kProjectedQ:
      return "projected_q";
  }
  return "unknown";
}

int64_t ActPacket::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t ActPacket::wire_bytes() const {
  return kHeaderBytes + 8 * shape.size() + 4 * params.size() + 4 * scales.size() + data.size();
}

std::vector<uint8_t> ActPacket::serialize() const {
  std::vector<uint8_t> out;
  out.reserve(wire_bytes());
  core::VecByteWriter w(out);
  w.put<uint8_t>(static_cast<uint8_t>(format))
      .put<uint8_t>(static_cast<uint8_t>(shape.size()))
      .put<uint16_t>(want_gradient ? 1 : 0)
      .put<uint32_t>(static_cast<uint32_t>(params.size()))
      .put<uint32_t>(static_cast<uint32_t>(scales.size()))
      .put<uint64_t>(static_cast<uint64_t>(data.size()));
  for (int64_t d : shape) w.put<int64_t>(d);
  w.put_span(params.data(), 4 * params.size()).put_span(scales.data(), 4 * scales.size());
  w.put_span(data.data(), data.size());
  return out;
}

ActPacket ActPacket::deserialize(const uint8_t* bytes, size_t size) {
  core::ByteReader r(bytes, size, "activation packet");
  ActPacket p;
  const uint8_t format = r.get<uint8_t>();
  SPARROW_CHECK_T(FormatError, format <= static_cast<uint8_t>(ActFormat::kProjectedQ),
                  "activation packet: unknown format " << int{format});
  p.format = static_cast<ActFormat>(format);
  const uint8_t ndim = r.get<uint8_t>();
  const uint16_t flags = r.get<uint16_t>();
  SPARROW_CHECK_T(FormatError, (flags & ~uint16_t{1}) == 0, "activation packet: unknown flags " << flags);
  p.want_gradient = (flags & 1) != 0;
  const uint32_t nparams = r.get<uint32_t>(), nscales = r.get<uint32_t>();
  const uint64_t ndata = r.get<uint64_t>();
  // Size the vectors only after checking the bytes are there (no huge allocations
  // from a lying header).
  const uint64_t need = uint64_t{8} * ndim + uint64_t{4} * nparams + uint64_t{4} * nscales + ndata;
  SPARROW_CHECK_T(FormatError, need == r.left(),
                  "activation packet: header announces " << need << " bytes, " << r.left() << " follow");
  p.shape.resize(ndim);
  for (auto& d : p.shape) d = r.get<int64_t>();
  p.params.resize(nparams);
  r.read(p.params.data(), 4 * size_t{nparams});
  p.scales.resize(nscales);
  r.read(p.scales.data(), 4 * size_t{nscales});
  p.data.resize(ndata);
  r.read(p.data.data(), ndata);
  validate(p);
  return p;
}

void validate(const ActPacket& p) {
  const char* f = act_format_name(p.format);
  SPARROW_CHECK_T(FormatError, !p.shape.empty() && p.shape.size() <= kMaxDims,
                  f << " packet: " << p.shape.size() << " dimensions (1.." << kMaxDims << " allowed)");
  int64_t numel = 1;
  for (int64_t d : p.shape) {
    SPARROW_CHECK_T(FormatError, d > 0 && d <= kMaxNumel, f << " packet: bad dimension " << d);
    numel *= d;
    SPARROW_CHECK_T(FormatError, numel <= kMaxNumel, f << " packet: too many elements");
  }
  const auto [rows, cols] = matrix_dims(p.shape);
  auto need_params = [&](size_t n) {
    SPARROW_CHECK_T(FormatError, p.params.size() == n, f << " packet: " << p.params.size() << " params, need " << n);
  };
  auto need_data = [&](uint64_t n) {
    SPARROW_CHECK_T(FormatError, p.data.size() == n, f << " packet: " << p.data.size() << " data bytes, need " << n);
  };
  auto need_scales = [&](uint64_t n) {
    SPARROW_CHECK_T(FormatError, p.scales.size() == n, f << " packet: " << p.scales.size() << " scales, need " << n);
  };
  auto floats_finite = [&](size_t offset, uint64_t count) {
    for (uint64_t i = 0; i < count; ++i) {
      float v;
      std::memcpy(&v, p.data.data() + offset + 4 * i, 4);
      SPARROW_CHECK_T(FormatError, std::isfinite(v), f << " packet: non-finite value");
    }
  };
  switch (p.format) {
    case ActFormat::kDense:
      need_params(0);
      need_scales(0);
      need_data(uint64_t{4} * static_cast<uint64_t>(numel));
      floats_finite(0, static_cast<uint64_t>(numel));
      break;
    case ActFormat::kLowRank:
    case ActFormat::kLowRankCached: {
      need_params(4);
      need_scales(0);
      SPARROW_CHECK_T(FormatError, p.params[0] == rows && p.params[1] == cols,
                      f << " packet: factors " << p.params[0] << "x" << p.params[1] << " do not match the shape");
      const uint64_t r = p.params[2];
      // A data basis (streaming) may have more directions than one batch has rows.
      SPARROW_CHECK_T(FormatError, r >= 1 && r <= static_cast<uint64_t>(cols), f << " packet: bad rank " << r);
      SPARROW_CHECK_T(FormatError, p.params[3] >= 1, f << " packet: basis id 0");
      const uint64_t n = r * static_cast<uint64_t>(p.format == ActFormat::kLowRank ? rows + cols : rows);
      need_data(4 * n);
      floats_finite(0, n);
      break;
    }
    case ActFormat::kProjected: {
      need_params(2);
      need_scales(0);
      const uint64_t r = p.params[1];
      SPARROW_CHECK_T(FormatError, p.params[0] == rows,
                      "projected packet: " << p.params[0] << " rows, shape has " << rows);
      SPARROW_CHECK_T(FormatError, r >= 1 && r <= static_cast<uint64_t>(cols), "projected packet: bad rank " << r);
      need_data(4 * r * static_cast<uint64_t>(rows));
      floats_finite(0, r * static_cast<uint64_t>(rows));
      break;
    }
    case ActFormat::kLowRankQ:
    case ActFormat::kLowRankCachedQ:
    case ActFormat::kProjectedQ: {
      const bool projected = p.format == ActFormat::kProjectedQ;
      need_params(projected ? 3 : 7);
      const uint64_t r = projected ? p.params[1] : p.params[2];
      const uint32_t bits = projected ? p.params[2] : p.params[4];
      SPARROW_CHECK_T(FormatError, p.params[0] == rows && (projected || p.params[1] == cols),
                      f << " packet: factor dimensions do not match the shape");
      SPARROW_CHECK_T(FormatError, r >= 1 && r <= static_cast<uint64_t>(cols), f << " packet: bad rank " << r);
      SPARROW_CHECK_T(FormatError, bits == 8 || bits == 4, f << " packet: bits must be 8 or 4, not " << bits);
      if (!projected) {
        SPARROW_CHECK_T(FormatError, p.params[3] >= 1, f << " packet: basis id 0");
        const uint32_t gbits = p.params[5];
        SPARROW_CHECK_T(FormatError, gbits == 32 || gbits == 8 || gbits == 4,
                        f << " packet: gradient bits must be 32, 8 or 4, not " << gbits);
        SPARROW_CHECK_T(FormatError, p.params[6] == 8 || p.params[6] == 4,
                        f << " packet: basis bits must be 8 or 4, not " << p.params[6]);
      }
      const bool with_q = p.format == ActFormat::kLowRankQ;
      need_scales(2 * r * (with_q ? 2 : 1));
      SPARROW_CHECK_T(FormatError, all_finite(p.scales.data(), p.scales.size()), f << " packet: non-finite scale");
      for (uint64_t b = 0; b < p.scales.size() / 2; ++b) {
        // The largest code must decode to a finite value too (finite but huge
        // scales would otherwise decode to inf).
        const float levels = b < r ? static_cast<float>((1u << bits) - 1) : static_cast<float>((1u << p.params[6]) - 1);
        SPARROW_CHECK_T(FormatError, p.scales[2 * b + 1] >= 0, f << " packet: negative step");
        SPARROW_CHECK_T(FormatError, std::isfinite(p.scales[2 * b] + levels * p.scales[2 * b + 1]),
                        f << " packet: scale range overflows");
      }
      need_data(code_bytes(r * static_cast<uint64_t>(rows), bits) +
                (with_q ? code_bytes(r * static_cast<uint64_t>(cols), p.params[6]) : uint64_t{0}));
      break;
    }
    case ActFormat::kQuant: {
      need_params(2);
      const uint32_t bits = p.params[0], block = p.params[1];
      SPARROW_CHECK_T(FormatError, bits == 8 || bits == 4, "quant packet: bits must be 8 or 4, not " << bits);
      SPARROW_CHECK_T(FormatError, block >= 1 && block <= cols, "quant packet: bad block " << block);
      const uint64_t blocks = static_cast<uint64_t>(rows) * ((static_cast<uint64_t>(cols) + block - 1) / block);
      need_scales(2 * blocks);
      SPARROW_CHECK_T(FormatError, all_finite(p.scales.data(), p.scales.size()), "quant packet: non-finite scale");
      for (uint64_t b = 0; b < blocks; ++b)
        SPARROW_CHECK_T(FormatError, p.scales[2 * b + 1] >= 0, "quant packet: negative step");
      need_data(bits == 8 ? static_cast<uint64_t>(numel) : (static_cast<uint64_t>(numel) + 1) / 2);
      break;
    }
    case ActFormat::kTopK: {
      need_params(1);
      need_scales(0);
      const uint64_t k = p.params[0];
      SPARROW_CHECK_T(FormatError, k <= static_cast<uint64_t>(numel), "topk packet: k " << k << " > numel");
      need_data(8 * k);
      int64_t prev = -1;
      for (uint64_t i = 0; i < k; ++i) {
        uint32_t idx;
        std::memcpy(&idx, p.data.data() + 4 * i, 4);
        SPARROW_CHECK_T(FormatError, static_cast<int64_t>(idx) > prev && static_cast<int64_t>(idx) < numel,
                        "topk packet: indices must ascend within [0, " << numel << ")");
        prev = idx;
      }
      floats_finite(4 * k, k);
      break;
    }
    default:
      throw FormatError("activation packet: unknown format");
  }
}

ActCodec::ActCodec(const std::string& spec) : spec_(spec) {
  Spec s = Spec::parse(spec);
  const std::string& m = s.method();
  if (m == "none") {
    kind_ = Kind::kNone;
  } else if (m == "lowrank") {
    kind_ = Kind::kLowRank;
    rank_ = s.get_int("rank", 4);
    iters_ = s.get_int("iters", 1);
    warm_ = s.get_bool("warm", true);
    seed_ = static_cast<uint64_t>(s.get_int("seed", 0));
    beta_ = s.get_double("beta", 0.0);
    refresh_ = s.get_int("refresh", 1);
    ramp_ = s.get_bool("ramp", false);
    SPARROW_CHECK_T(ConfigError, beta_ >= 0 && beta_ < 1, "codec '" << spec << "': beta must be in [0, 1)");
    SPARROW_CHECK_T(ConfigError, refresh_ >= 1, "codec '" << spec << "': refresh must be >= 1");
    SPARROW_CHECK_T(ConfigError, rank_ >= 1 && rank_ <= 4096, "codec '" << spec << "': rank must be in [1, 4096]");
    SPARROW_CHECK_T(ConfigError, iters_ >= 0 && iters_ <= 100, "codec '" << spec << "': iters must be in [0, 100]");
    SPARROW_CHECK_T(ConfigError, iters_ >= 1 || warm_, "codec '" << spec << "': warm=0 needs iters >= 1");
    factor_bits_ = static_cast<int>(s.get_int("bits", 32));
    gradient_bits_ = static_cast<int>(s.get_int("gbits", factor_bits_));
    SPARROW_CHECK_T(ConfigError, factor_bits_ == 32 || factor_bits_ == 8 || factor_bits_ == 4,
                    "codec '" << spec << "': bits must be 32, 8 or 4");
    SPARROW_CHECK_T(ConfigError, gradient_bits_ == 32 || gradient_bits_ == 8 || gradient_bits_ == 4,
                    "codec '" << spec << "': gbits must be 32, 8 or 4");
    basis_bits_ = static_cast<int>(s.get_int("qbits", 8));
    SPARROW_CHECK_T(ConfigError, basis_bits_ == 8 || basis_bits_ == 4, "codec '" << spec << "': qbits must be 8 or 4");
    SPARROW_CHECK_T(ConfigError, factor_bits_ < 32 || (gradient_bits_ == 32 && basis_bits_ == 8),
                    "codec '" << spec << "': gbits and qbits need quantised factors (bits=8 or 4)");
  } else if (m == "q8" || m == "q4") {
    kind_ = Kind::kQuant;
    bits_ = m == "q8" ? 8 : 4;
    block_ = s.get_int("block", 0);
    SPARROW_CHECK_T(ConfigError, block_ >= 0, "codec '" << spec << "': block must be >= 0 (0 = one block per row)");
  } else if (m == "topk") {
    kind_ = Kind::kTopK;
    ratio_ = s.get_double("ratio", 0.01);
    SPARROW_CHECK_T(ConfigError, ratio_ > 0 && ratio_ <= 1, "codec '" << spec << "': ratio must be in (0, 1]");
  } else {
    throw ConfigError("unknown activation codec '" + spec + "' (known: none, lowrank, q8, q4, topk)");
  }
  s.check_all_consumed();
}

ActPacket ActCodec::encode(const at::Tensor& x, CodecState& state, bool infer) const {
  SPARROW_CHECK(x.defined() && x.dim() >= 1 && x.numel() > 0, "encode: empty activation");
  SPARROW_CHECK(x.numel() <= kMaxNumel, "encode: activation too large");
  at::NoGradGuard no_grad;
  ActPacket p;
  p.shape = x.sizes().vec();
  const int64_t rows = x.size(0), cols = x.numel() / rows;
  const at::Tensor a = x.detach().to(at::kFloat).contiguous().view({rows, cols});
  const uint64_t step = state.steps++;
  switch (kind_) {
    case Kind::kNone:
      p.format = ActFormat::kDense;
      append_floats(p.data, a);
      break;
    case Kind::kLowRank: {
      // A streaming basis describes the data, so it may have more directions than
      // the batch has rows; a per-batch basis cannot.
      const int64_t r = beta_ > 0 ? std::min(rank_, cols) : std::min({rank_, rows, cols});
      at::Tensor q = state.basis;
      std::vector<float> q_scales;  // the basis' quantisation (factor bits < 32, refresh steps)
      std::vector<uint8_t> q_codes;
      const bool fits = q.defined() && q.size(0) == cols && q.size(1) == r;
      // ramp=1: a young tracker has seen few batches (at step 0 it spans at most
      // N directions), so two early refreshes (steps K/4 and K/2) publish it
      // sooner than the regular K-step schedule would.
      const uint64_t k = static_cast<uint64_t>(refresh_);
      const bool scheduled = step % k == 0 || (ramp_ && step < k && k >= 4 && (step == k / 4 || step == k / 2));
      const bool refresh = !fits || state.refresh_next || (!infer && scheduled);
      // Streaming basis (beta > 0): every training step does one power iteration
      // on the averaged covariance, S <- B S + (1 - B) A^T A T / N, T = orth(S)
      // (the tracker T is the device's; only refreshes publish it as the basis).
      if (beta_ > 0 && !infer) {
        at::Tensor t = state.tracker;
        const bool tracked = t.defined() && t.size(0) == cols && t.size(1) == r && state.sketch.defined() &&
                             state.sketch.sizes() == t.sizes();
        if (!tracked) t = orthonormal(gaussian(cols, r, rng::derive(seed_, step)));
        at::Tensor y = a.t().mm(a.mm(t)) / static_cast<double>(rows);
        state.sketch = tracked ? beta_ * state.sketch + (1 - beta_) * y : y;
        state.tracker = orthonormal(state.sketch).contiguous();
      }
      if (refresh) {
        if (beta_ > 0 && state.tracker.defined() && state.tracker.size(0) == cols && state.tracker.size(1) == r) {
          q = state.tracker;
        } else {
          // Per-batch basis: I power iterations on this batch, warm-started.
          const bool reuse = warm_ && fits;
          if (!reuse) q = orthonormal(gaussian(cols, r, rng::derive(seed_, step)));
          const int64_t iters = reuse ? iters_ : std::max<int64_t>(iters_, 1);
          for (int64_t i = 0; i < iters; ++i) q = orthonormal(a.t().mm(a.mm(q)));
          q = q.contiguous();
        }
        if (factor_bits_ < 32) {
          // Both sides must hold the same basis: the device switches to the
          // dequantised Q it sends.
          quantize_rows(q.t(), basis_bits_, q_scales, q_codes);
          q = dequantize_rows(q_scales.data(), q_codes.data(), r, cols, static_cast<uint32_t>(basis_bits_))
                  .t()
                  .contiguous();
        }
        if (!infer) {
          state.basis = q;
          state.basis_id = state.basis_id + 1 == 0 ? 1 : state.basis_id + 1;
          state.refresh_next = false;
        }
      }
      const at::Tensor pf = a.mm(q);
      const uint32_t id = refresh && infer ? 1u : state.basis_id;
      if (factor_bits_ < 32) {
        p.format = refresh ? ActFormat::kLowRankQ : ActFormat::kLowRankCachedQ;
        p.params = {static_cast<uint32_t>(rows),
                    static_cast<uint32_t>(cols),
                    static_cast<uint32_t>(r),
                    id,
                    static_cast<uint32_t>(factor_bits_),
                    static_cast<uint32_t>(gradient_bits_),
                    static_cast<uint32_t>(basis_bits_)};
        quantize_rows(pf.t(), factor_bits_, p.scales, p.data);
        if (refresh) {
          p.scales.insert(p.scales.end(), q_scales.begin(), q_scales.end());
          p.data.insert(p.data.end(), q_codes.begin(), q_codes.end());
        }
        break;
      }
      p.format = refresh ? ActFormat::kLowRank : ActFormat::kLowRankCached;
      p.params = {static_cast<uint32_t>(rows), static_cast<uint32_t>(cols), static_cast<uint32_t>(r), id};
      append_floats(p.data, pf);
      if (refresh) append_floats(p.data, q);
      break;
    }
    case Kind::kQuant: {
      const int64_t block = block_ == 0 ? cols : std::min(block_, cols);
      const int64_t nb = (cols + block - 1) / block, pad = nb * block - cols;
      // Pad by repeating the row's last value so padding never widens a block's range.
      at::Tensor padded = pad ? at::cat({a, a.narrow(1, cols - 1, 1).expand({rows, pad})}, 1) : a;
      at::Tensor blocks = padded.reshape({rows, nb, block});
      at::Tensor lo = std::get<0>(blocks.min(2, true)), hi = std::get<0>(blocks.max(2, true));
      const double levels = (1 << bits_) - 1;
      at::Tensor step_t = (hi - lo) / levels;
      at::Tensor safe = at::where(step_t > 0, step_t, at::ones_like(step_t));
      at::Tensor codes = ((blocks - lo) / safe).round().clamp(0, levels);
      codes = codes.reshape({rows, nb * block}).narrow(1, 0, cols).to(at::kByte).contiguous();
      at::Tensor sc = at::cat({lo, step_t}, 2).reshape({-1}).contiguous();
      p.format = ActFormat::kQuant;
      p.params = {static_cast<uint32_t>(bits_), static_cast<uint32_t>(block)};
      p.scales.assign(sc.data_ptr<float>(), sc.data_ptr<float>() + sc.numel());
      const uint8_t* c = codes.data_ptr<uint8_t>();
      const int64_t n = codes.numel();
      if (bits_ == 8) {
        p.data.assign(c, c + n);
      } else {
        p.data.assign(static_cast<size_t>((n + 1) / 2), 0);
        for (int64_t i = 0; i < n; ++i) p.data[i / 2] |= static_cast<uint8_t>(c[i] << (4 * (i & 1)));
      }
      break;
    }
    case Kind::kTopK: {
      const at::Tensor flat = a.reshape({-1});
      const int64_t k = std::min<int64_t>(flat.numel(), static_cast<int64_t>(std::ceil(ratio_ * flat.numel())));
      at::Tensor idx = std::get<1>(flat.abs().topk(k, 0, true, false));
      idx = std::get<0>(idx.sort());
      at::Tensor vals = flat.index_select(0, idx).contiguous();
      at::Tensor idx32 = idx.to(at::kInt).contiguous();
      p.format = ActFormat::kTopK;
      p.params = {static_cast<uint32_t>(k)};
      p.data.resize(static_cast<size_t>(8 * k));
      if (k > 0) {
        std::memcpy(p.data.data(), idx32.data_ptr<int32_t>(), static_cast<size_t>(4 * k));
        std::memcpy(p.data.data() + 4 * k, vals.data_ptr<float>(), static_cast<size_t>(4 * k));
      }
      break;
    }
  }
  return p;
}

at::Tensor decode(const ActPacket& p) {
  validate(p);
  const auto [rows, cols] = matrix_dims(p.shape);
  at::Tensor out;
  switch (p.format) {
    case ActFormat::kDense:
      out = float_view(p, 0, rows * cols);
      break;
    case ActFormat::kLowRank: {
      const int64_t r = p.params[2];
      at::Tensor pf = float_view(p, 0, rows * r).view({rows, r});
      at::Tensor q = float_view(p, static_cast<size_t>(4 * rows * r), cols * r).view({cols, r});
      out = pf.mm(q.t());
      break;
    }
    case ActFormat::kQuant: {
      const int64_t bits = p.params[0], block = p.params[1];
      const int64_t nb = (cols + block - 1) / block, n = rows * cols;
      at::Tensor codes = at::empty({n}, at::kFloat);
      float* c = codes.data_ptr<float>();
      if (bits == 8) {
        for (int64_t i = 0; i < n; ++i) c[i] = p.data[static_cast<size_t>(i)];
      } else {
        for (int64_t i = 0; i < n; ++i) c[i] = (p.data[static_cast<size_t>(i / 2)] >> (4 * (i & 1))) & 0xF;
      }
      at::Tensor sc = at::from_blob(const_cast<float*>(p.scales.data()), {rows, nb, 2}, at::kFloat).clone();
      // Expand per-block (min, step) to per-column, then drop the padding.
      at::Tensor lo = sc.select(2, 0).repeat_interleave(block, 1).narrow(1, 0, cols);
      at::Tensor st = sc.select(2, 1).repeat_interleave(block, 1).narrow(1, 0, cols);
      out = lo + codes.view({rows, cols}) * st;
      break;
    }
    case ActFormat::kTopK: {
      const int64_t k = p.params[0];
      at::Tensor idx32 = at::empty({k}, at::kInt);
      if (k) std::memcpy(idx32.data_ptr<int32_t>(), p.data.data(), static_cast<size_t>(4 * k));
      at::Tensor vals = float_view(p, static_cast<size_t>(4 * k), k);
      out = at::zeros({rows * cols}, at::kFloat);
      out.index_put_({idx32.to(at::kLong)}, vals);
      break;
    }
    case ActFormat::kLowRankQ:
      out = quantized_p(p).mm(quantized_q(p).t());
      break;
    case ActFormat::kProjected:
    case ActFormat::kProjectedQ:
      throw FormatError("a projected gradient packet needs the device's basis: use decode_gradient");
    case ActFormat::kLowRankCached:
    case ActFormat::kLowRankCachedQ:
      throw FormatError("a cached-basis lowrank packet needs the cloud's basis: use decode_activation");
  }
  return out.view(p.shape);
}

at::Tensor decode_activation(const ActPacket& p, CodecState& peer) {
  validate(p);
  const auto [rows, cols] = matrix_dims(p.shape);
  if (p.format == ActFormat::kLowRank) {
    at::Tensor out = decode(p);
    const int64_t r = p.params[2];
    peer.basis = float_view(p, static_cast<size_t>(4 * rows * r), cols * r).view({cols, r});
    peer.basis_id = p.params[3];
    return out;
  }
  if (p.format == ActFormat::kLowRankQ) {
    at::Tensor q = quantized_q(p);
    at::Tensor out = quantized_p(p).mm(q.t()).view(p.shape);
    peer.basis = q;
    peer.basis_id = p.params[3];
    return out;
  }
  if (p.format != ActFormat::kLowRankCached && p.format != ActFormat::kLowRankCachedQ) return decode(p);
  const int64_t r = p.params[2];
  SPARROW_CHECK_T(
      FormatError,
      peer.basis.defined() && peer.basis_id == p.params[3] && peer.basis.size(0) == cols && peer.basis.size(1) == r,
      "lowrank packet refers to basis " << p.params[3] << ", which this side does not hold (it holds " << peer.basis_id
                                        << "): resend the basis");
  const at::Tensor pf =
      p.format == ActFormat::kLowRankCachedQ ? quantized_p(p) : float_view(p, 0, rows * r).view({rows, r});
  return pf.mm(peer.basis.t()).view(p.shape);
}

ActPacket encode_gradient(const at::Tensor& grad, const ActPacket& act, const ActCodec& codec, const CodecState& peer) {
  SPARROW_CHECK(grad.defined() && grad.sizes().vec() == act.shape,
                "encode_gradient: gradient shape does not match the activation");
  if (act.format != ActFormat::kLowRank && act.format != ActFormat::kLowRankCached && !lowrank_q(act.format)) {
    CodecState scratch;
    return codec.encode(grad, scratch);
  }
  at::NoGradGuard no_grad;
  const auto [rows, cols] = matrix_dims(act.shape);
  const int64_t r = act.params[2];
  const at::Tensor& q = peer.basis;
  SPARROW_CHECK(q.defined() && q.size(0) == cols && q.size(1) == r && peer.basis_id == act.params[3],
                "encode_gradient: the activation's basis is not the one held (decode_activation first)");
  at::Tensor y = grad.detach().to(at::kFloat).reshape({rows, cols}).mm(q);
  ActPacket p;
  p.shape = act.shape;
  const uint32_t gbits = lowrank_q(act.format) ? act.params[5] : 32;
  if (gbits < 32) {
    p.format = ActFormat::kProjectedQ;
    p.params = {static_cast<uint32_t>(rows), static_cast<uint32_t>(r), gbits};
    quantize_rows(y.t(), static_cast<int>(gbits), p.scales, p.data);
    return p;
  }
  p.format = ActFormat::kProjected;
  p.params = {static_cast<uint32_t>(rows), static_cast<uint32_t>(r)};
  append_floats(p.data, y);
  return p;
}

at::Tensor decode_gradient(const ActPacket& p, const CodecState& state, const std::vector<int64_t>& expected_shape) {
  validate(p);
  SPARROW_CHECK_T(FormatError, p.shape == expected_shape, "gradient packet: shape does not match the activation sent");
  if (p.format != ActFormat::kProjected && p.format != ActFormat::kProjectedQ) return decode(p);
  const auto [rows, cols] = matrix_dims(p.shape);
  const int64_t r = p.params[1];
  SPARROW_CHECK_T(FormatError, state.basis.defined() && state.basis.size(0) == cols && state.basis.size(1) == r,
                  "projected gradient: rank " << r << " does not match the device's basis");
  at::Tensor y = p.format == ActFormat::kProjectedQ
                     ? dequantize_rows(p.scales.data(), p.data.data(), r, rows, p.params[2]).t()
                     : float_view(p, 0, rows * r).view({rows, r});
  return y.mm(state.basis.t()).view(p.shape);
}

std::map<std::string, at::Tensor> codec_state_tensors(const CodecState& s, const std::string& prefix) {
  std::map<std::string, at::Tensor> t;
  const std::pair<const char*, const at::Tensor*> slots[] = {
      {"basis", &s.basis}, {"sketch", &s.sketch}, {"tracker", &s.tracker}};
  for (const auto& [name, v] : slots)
    if (v->defined()) t[prefix + name] = v->detach().to(at::kCPU, at::kFloat).contiguous();
  std::vector<float> meta{static_cast<float>(s.basis_id & 0xffffu), static_cast<float>(s.basis_id >> 16),
                          s.refresh_next ? 1.0f : 0.0f};
  for (int i = 0; i < 4; ++i) meta.push_back(static_cast<float>((s.steps >> (16 * i)) & 0xffffu));
  t[prefix + "meta"] = torch::tensor(meta);
  return t;
}

CodecState codec_state_from_tensors(const std::map<std::string, at::Tensor>& t, const std::string& prefix) {
  auto meta = t.find(prefix + "meta");
  SPARROW_CHECK_T(FormatError, meta != t.end() && meta->second.numel() == 7, "codec state: no '" << prefix << "meta'");
  const at::Tensor m = meta->second.to(at::kFloat).contiguous();
  const float* v = m.data_ptr<float>();
  auto piece = [&](int i) {
    SPARROW_CHECK_T(FormatError, v[i] >= 0 && v[i] < 65536 && v[i] == std::floor(v[i]),
                    "codec state: bad '" << prefix << "meta'");
    return static_cast<uint64_t>(v[i]);
  };
  CodecState s;
  s.basis_id = static_cast<uint32_t>(piece(0) | (piece(1) << 16));
  s.refresh_next = piece(2) != 0;
  for (int i = 0; i < 4; ++i) s.steps |= piece(3 + i) << (16 * i);
  for (auto [name, slot] :
       {std::pair<const char*, at::Tensor*>{"basis", &s.basis}, {"sketch", &s.sketch}, {"tracker", &s.tracker}}) {
    auto it = t.find(prefix + name);
    if (it == t.end()) continue;
    SPARROW_CHECK_T(FormatError, it->second.dim() == 2, "codec state: '" << prefix << name << "' is not a matrix");
    *slot = it->second.clone();
  }
  SPARROW_CHECK_T(FormatError, !s.basis.defined() || s.basis_id != 0, "codec state: a basis without an id");
  return s;
}

std::string serialize_codec_state(const CodecState& s) {
  compression::State st;
  st.tensors = codec_state_tensors(s);
  return st.serialize();
}

CodecState deserialize_codec_state(const std::string& bytes) {
  return codec_state_from_tensors(compression::State::deserialize(bytes).tensors);
}

}  // namespace sparrow::edge
