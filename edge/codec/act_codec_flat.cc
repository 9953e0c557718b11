// The torch-free activation codecs (act_codec_flat.h): spec parsing, encode,
// the decoders of both sides and the gradient's encode on the cloud.
#include "edge/codec/act_codec_flat.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <utility>

#include "core/error.h"
#include "core/rng.h"
#include "core/spec.h"
#include "edge/codec/act_math.h"

namespace sparrow::edge::flat {
namespace {

constexpr int64_t kMaxNumel = (int64_t{1} << 31) - 1;

// Rows and columns of the matrix view of a (validated) shape.
std::pair<int64_t, int64_t> matrix_dims(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return {shape[0], n / shape[0]};
}

std::vector<float> read_floats(const ActPacket& p, size_t byte_offset, int64_t count) {
  // Copy: the packet's buffer need not be aligned for float.
  std::vector<float> out(static_cast<size_t>(count));
  if (count > 0) std::memcpy(out.data(), p.data.data() + byte_offset, static_cast<size_t>(count) * 4);
  return out;
}

void append_floats(std::vector<uint8_t>& out, const float* v, size_t n) {
  const size_t at = out.size();
  out.resize(at + 4 * n);
  if (n) std::memcpy(out.data() + at, v, 4 * n);
}

bool lowrank_q(ActFormat f) { return f == ActFormat::kLowRankQ || f == ActFormat::kLowRankCachedQ; }
bool lowrank_any(ActFormat f) { return f == ActFormat::kLowRank || f == ActFormat::kLowRankCached || lowrank_q(f); }

// P (N x R) of a validated kLowRank(Cached)(Q) packet.
std::vector<float> factor_p(const ActPacket& p) {
  const int64_t rows = p.params[0], r = p.params[2];
  if (!lowrank_q(p.format)) return read_floats(p, 0, rows * r);
  std::vector<float> out(static_cast<size_t>(rows * r));
  detail::dequantize_cols(p.scales.data(), p.data.data(), rows, r, p.params[4], out.data());
  return out;
}

// Q (M x R) of a validated kLowRank(Q) packet.
Matrix factor_q(const ActPacket& p) {
  const int64_t rows = p.params[0], cols = p.params[1], r = p.params[2];
  Matrix q;
  q.rows = cols;
  q.cols = r;
  if (p.format == ActFormat::kLowRank) {
    q.data = read_floats(p, static_cast<size_t>(4 * rows * r), cols * r);
    return q;
  }
  q.data.resize(static_cast<size_t>(cols * r));
  const size_t offset = static_cast<size_t>(detail::code_bytes(static_cast<uint64_t>(r * rows), p.params[4]));
  detail::dequantize_cols(p.scales.data() + 2 * r, p.data.data() + offset, cols, r, p.params[6], q.data.data());
  return q;
}

// a (n x m) times its projection: out (n x r) = A Q.
std::vector<float> project(const float* a, int64_t n, int64_t m, const Matrix& q) {
  std::vector<float> out(static_cast<size_t>(n * q.cols));
  detail::matmul(a, q.data.data(), n, m, q.cols, out.data());
  return out;
}

// out (n x m) = Y Qᵀ, Y n x r.
std::vector<float> expand(const std::vector<float>& y, int64_t n, const Matrix& q) {
  std::vector<float> out(static_cast<size_t>(n * q.rows));
  detail::matmul_nt(y.data(), q.data.data(), n, q.cols, q.rows, out.data());
  return out;
}

// A seeded orthonormal start [cols, r] (warm=0 or no basis yet).
Matrix random_basis(int64_t cols, int64_t r, uint64_t key) {
  Matrix q{cols, r, detail::gaussian(cols, r, key)};
  detail::orthonormalize(q.data.data(), cols, r);
  return q;
}

// One power iteration on the batch: Q <- orth(Aᵀ (A Q)).
void power_step(const float* a, int64_t rows, int64_t cols, Matrix& q) {
  const std::vector<float> y = project(a, rows, cols, q);
  std::vector<float> z(static_cast<size_t>(cols * q.cols));
  detail::matmul_tn(a, y.data(), rows, cols, q.cols, z.data());
  detail::orthonormalize(z.data(), cols, q.cols);
  q.data = std::move(z);
}

void encode_quant(const float* a, int64_t rows, int64_t cols, int bits, int64_t block_spec, ActPacket& p) {
  const int64_t block = block_spec == 0 ? cols : std::min(block_spec, cols);
  const int64_t nb = (cols + block - 1) / block;
  const float levels = static_cast<float>((1 << bits) - 1);
  p.format = ActFormat::kQuant;
  p.params = {static_cast<uint32_t>(bits), static_cast<uint32_t>(block)};
  p.scales.reserve(static_cast<size_t>(2 * rows * nb));
  const uint64_t n = static_cast<uint64_t>(rows * cols);
  p.data.assign(detail::code_bytes(n, static_cast<uint32_t>(bits)), 0);
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = a + i * cols;
    for (int64_t b = 0; b < nb; ++b) {
      // A block's range is its own values' (the last block may be short).
      const int64_t lo_col = b * block, hi_col = std::min(cols, lo_col + block);
      float lo = row[lo_col], hi = row[lo_col];
      for (int64_t j = lo_col + 1; j < hi_col; ++j) {
        lo = std::min(lo, row[j]);
        hi = std::max(hi, row[j]);
      }
      const float step = (hi - lo) / levels;
      const float safe = step > 0 ? step : 1.0f;
      p.scales.push_back(lo);
      p.scales.push_back(step);
      for (int64_t j = lo_col; j < hi_col; ++j) {
        float c = std::nearbyint((row[j] - lo) / safe);
        if (!(c >= 0)) c = 0;  // also NaN
        if (c > levels) c = levels;
        const uint64_t k = static_cast<uint64_t>(i * cols + j);
        const auto code = static_cast<uint8_t>(c);
        if (bits == 8)
          p.data[k] = code;
        else
          p.data[k / 2] |= static_cast<uint8_t>(code << (4 * (k & 1)));
      }
    }
  }
}

void encode_topk(const float* a, int64_t numel, double ratio, ActPacket& p) {
  const int64_t k = std::min<int64_t>(numel, static_cast<int64_t>(std::ceil(ratio * static_cast<double>(numel))));
  // Largest |value| first, ties (and NaN, ranked as +inf) by the lower index:
  // a strict weak order whatever the values.
  auto key = [&](int64_t i) {
    const float v = std::fabs(a[i]);
    return std::isnan(v) ? INFINITY : v;
  };
  std::vector<uint32_t> idx(static_cast<size_t>(numel));
  std::iota(idx.begin(), idx.end(), 0u);
  auto before = [&](uint32_t x, uint32_t y) {
    const float kx = key(x), ky = key(y);
    return kx > ky || (kx == ky && x < y);
  };
  if (k < numel) std::nth_element(idx.begin(), idx.begin() + k, idx.end(), before);
  idx.resize(static_cast<size_t>(k));
  std::sort(idx.begin(), idx.end());
  p.format = ActFormat::kTopK;
  p.params = {static_cast<uint32_t>(k)};
  p.data.resize(static_cast<size_t>(8 * k));
  for (int64_t i = 0; i < k; ++i) {
    std::memcpy(p.data.data() + 4 * i, &idx[static_cast<size_t>(i)], 4);
    std::memcpy(p.data.data() + 4 * (k + i), a + idx[static_cast<size_t>(i)], 4);
  }
}

}  // namespace

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

ActPacket ActCodec::encode(const float* x, const std::vector<int64_t>& shape, CodecState& state, bool infer) const {
  SPARROW_CHECK(!shape.empty(), "encode: empty activation");
  int64_t numel = 1;
  for (int64_t d : shape) {
    SPARROW_CHECK(d > 0, "encode: empty activation");
    SPARROW_CHECK(d <= kMaxNumel && numel * d <= kMaxNumel, "encode: activation too large");
    numel *= d;
  }
  ActPacket p;
  p.shape = shape;
  const auto [rows, cols] = matrix_dims(shape);
  const float* a = x;
  const uint64_t step = state.steps++;
  switch (kind_) {
    case Kind::kNone:
      p.format = ActFormat::kDense;
      append_floats(p.data, a, static_cast<size_t>(numel));
      break;
    case Kind::kLowRank: {
      // A streaming basis describes the data, so it may have more directions than
      // the batch has rows; a per-batch basis cannot.
      const int64_t r = beta_ > 0 ? std::min(rank_, cols) : std::min({rank_, rows, cols});
      const bool fits = state.basis.is(cols, r);
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
        const bool tracked = state.tracker.is(cols, r) && state.sketch.is(cols, r);
        Matrix t = tracked ? state.tracker : random_basis(cols, r, rng::derive(seed_, step));
        const std::vector<float> at = project(a, rows, cols, t);
        std::vector<float> y(static_cast<size_t>(cols * r));
        detail::matmul_tn(a, at.data(), rows, cols, r, y.data());
        const float inv_rows = 1.0f / static_cast<float>(rows);
        const float b = static_cast<float>(beta_), one_minus_b = static_cast<float>(1 - beta_);
        if (tracked) {
          for (size_t i = 0; i < y.size(); ++i) y[i] = b * state.sketch.data[i] + one_minus_b * (y[i] * inv_rows);
        } else {
          for (float& v : y) v *= inv_rows;
        }
        state.sketch = Matrix{cols, r, y};
        detail::orthonormalize(y.data(), cols, r);
        state.tracker = Matrix{cols, r, std::move(y)};
      }
      Matrix q = fits ? state.basis : Matrix{};
      std::vector<float> q_scales;  // the basis' quantisation (factor bits < 32, refresh steps)
      std::vector<uint8_t> q_codes;
      if (refresh) {
        if (beta_ > 0 && state.tracker.is(cols, r)) {
          q = state.tracker;
        } else {
          // Per-batch basis: I power iterations on this batch, warm-started.
          const bool reuse = warm_ && fits;
          if (!reuse) q = random_basis(cols, r, rng::derive(seed_, step));
          const int64_t iters = reuse ? iters_ : std::max<int64_t>(iters_, 1);
          for (int64_t i = 0; i < iters; ++i) power_step(a, rows, cols, q);
        }
        if (factor_bits_ < 32) {
          // Both sides must hold the same basis: the device switches to the
          // dequantised Q it sends.
          detail::quantize_cols(q.data.data(), cols, r, basis_bits_, q_scales, q_codes);
          detail::dequantize_cols(q_scales.data(), q_codes.data(), cols, r, static_cast<uint32_t>(basis_bits_),
                                  q.data.data());
        }
        if (!infer) {
          state.basis = q;
          state.basis_id = state.basis_id + 1 == 0 ? 1 : state.basis_id + 1;
          state.refresh_next = false;
        }
      }
      const std::vector<float> pf = project(a, rows, cols, q);
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
        detail::quantize_cols(pf.data(), rows, r, factor_bits_, p.scales, p.data);
        if (refresh) {
          p.scales.insert(p.scales.end(), q_scales.begin(), q_scales.end());
          p.data.insert(p.data.end(), q_codes.begin(), q_codes.end());
        }
        break;
      }
      p.format = refresh ? ActFormat::kLowRank : ActFormat::kLowRankCached;
      p.params = {static_cast<uint32_t>(rows), static_cast<uint32_t>(cols), static_cast<uint32_t>(r), id};
      append_floats(p.data, pf.data(), pf.size());
      if (refresh) append_floats(p.data, q.data.data(), q.data.size());
      break;
    }
    case Kind::kQuant:
      encode_quant(a, rows, cols, bits_, block_, p);
      break;
    case Kind::kTopK:
      encode_topk(a, numel, ratio_, p);
      break;
  }
  return p;
}

std::vector<float> decode(const ActPacket& p) {
  validate(p);
  const auto [rows, cols] = matrix_dims(p.shape);
  switch (p.format) {
    case ActFormat::kDense:
      return read_floats(p, 0, rows * cols);
    case ActFormat::kLowRank:
    case ActFormat::kLowRankQ:
      return expand(factor_p(p), rows, factor_q(p));
    case ActFormat::kQuant: {
      const uint32_t bits = p.params[0];
      const int64_t block = p.params[1], nb = (cols + block - 1) / block;
      std::vector<float> out(static_cast<size_t>(rows * cols));
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          const size_t k = static_cast<size_t>(i * cols + j), b = static_cast<size_t>(i * nb + j / block);
          const uint32_t c = bits == 8 ? p.data[k] : (p.data[k / 2] >> (4 * (k & 1))) & 0xF;
          out[k] = p.scales[2 * b] + static_cast<float>(c) * p.scales[2 * b + 1];
        }
      }
      return out;
    }
    case ActFormat::kTopK: {
      const int64_t k = p.params[0];
      std::vector<float> out(static_cast<size_t>(rows * cols), 0.0f);
      for (int64_t i = 0; i < k; ++i) {
        uint32_t idx;
        std::memcpy(&idx, p.data.data() + 4 * i, 4);
        std::memcpy(&out[idx], p.data.data() + 4 * (k + i), 4);
      }
      return out;
    }
    case ActFormat::kProjected:
    case ActFormat::kProjectedQ:
      throw FormatError("a projected gradient packet needs the device's basis: use decode_gradient");
    case ActFormat::kLowRankCached:
    case ActFormat::kLowRankCachedQ:
      throw FormatError("a cached-basis lowrank packet needs the cloud's basis: use decode_activation");
  }
  throw FormatError("activation packet: unknown format");
}

std::vector<float> decode_activation(const ActPacket& p, CodecState& peer) {
  validate(p);
  const auto [rows, cols] = matrix_dims(p.shape);
  if (p.format == ActFormat::kLowRank || p.format == ActFormat::kLowRankQ) {
    Matrix q = factor_q(p);
    std::vector<float> out = expand(factor_p(p), rows, q);
    peer.basis = std::move(q);
    peer.basis_id = p.params[3];
    return out;
  }
  if (p.format != ActFormat::kLowRankCached && p.format != ActFormat::kLowRankCachedQ) return decode(p);
  const int64_t r = p.params[2];
  SPARROW_CHECK_T(FormatError, peer.basis.is(cols, r) && peer.basis_id == p.params[3],
                  "lowrank packet refers to basis " << p.params[3] << ", which this side does not hold (it holds "
                                                    << peer.basis_id << "): resend the basis");
  return expand(factor_p(p), rows, peer.basis);
}

ActPacket encode_gradient(const float* grad, const ActPacket& act, const ActCodec& codec, const CodecState& peer) {
  if (!lowrank_any(act.format)) {
    CodecState scratch;
    return codec.encode(grad, act.shape, scratch);
  }
  const auto [rows, cols] = matrix_dims(act.shape);
  const int64_t r = act.params[2];
  SPARROW_CHECK(peer.basis.is(cols, r) && peer.basis_id == act.params[3],
                "encode_gradient: the activation's basis is not the one held (decode_activation first)");
  const std::vector<float> y = project(grad, rows, cols, peer.basis);
  ActPacket p;
  p.shape = act.shape;
  const uint32_t gbits = lowrank_q(act.format) ? act.params[5] : 32;
  if (gbits < 32) {
    p.format = ActFormat::kProjectedQ;
    p.params = {static_cast<uint32_t>(rows), static_cast<uint32_t>(r), gbits};
    detail::quantize_cols(y.data(), rows, r, static_cast<int>(gbits), p.scales, p.data);
    return p;
  }
  p.format = ActFormat::kProjected;
  p.params = {static_cast<uint32_t>(rows), static_cast<uint32_t>(r)};
  append_floats(p.data, y.data(), y.size());
  return p;
}

std::vector<float> decode_gradient(const ActPacket& p, const CodecState& state,
                                   const std::vector<int64_t>& expected_shape) {
  validate(p);
  SPARROW_CHECK_T(FormatError, p.shape == expected_shape, "gradient packet: shape does not match the activation sent");
  if (p.format != ActFormat::kProjected && p.format != ActFormat::kProjectedQ) return decode(p);
  const auto [rows, cols] = matrix_dims(p.shape);
  const int64_t r = p.params[1];
  SPARROW_CHECK_T(FormatError, state.basis.is(cols, r),
                  "projected gradient: rank " << r << " does not match the device's basis");
  std::vector<float> y;
  if (p.format == ActFormat::kProjectedQ) {
    y.resize(static_cast<size_t>(rows * r));
    detail::dequantize_cols(p.scales.data(), p.data.data(), rows, r, p.params[2], y.data());
  } else {
    y = read_floats(p, 0, rows * r);
  }
  return expand(y, rows, state.basis);
}

}  // namespace sparrow::edge::flat
