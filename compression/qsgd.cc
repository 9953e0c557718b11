// qsgd: QSGD (Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
// Quantization and Encoding", NeurIPS 2017) with per-bucket L2 norms and
// Elias-gamma coded levels.
//
// Spec: qsgd:levels=S[,bucket=B]. S (required) in [1, 2^24]; B >= 1, default 512
// as in the paper's experiments.
//
// Per bucket of B consecutive elements (the last one may be shorter):
// norm = ||v||_2, sent as fp32; r_i = S·|v_i|/norm, l = floor(r_i), and the level
// is l+1 with probability r_i − l, else l (stochastic rounding with
// rng::uniform01(step_key(ctx, step), i), i the flat element index). Decoding
// gives norm·sign·level/S, so E[decode] = v (unbiased; the norm used is the fp32
// one on the wire). A zero norm gives all-zero levels.
//
// Wire (Format::kQuantized): params = {S, B}; scales = one norm per bucket;
// values = one bit stream, LSB first in 64-bit little-endian words, holding per
// element the Elias-gamma code of x = level + 1 followed, when level > 0, by a
// sign bit (1 = negative). With N = floor(log2 x), the gamma code is N zero
// bits, a one bit (x's leading bit), then x's N low-order bits, least
// significant first (the LSB-first form of gamma: same length, 2N+1 bits, and
// decodable with one count-trailing-zeros). The stream ends with < 8 zero
// padding bits. Level 0 costs one bit, level 1 four bits; on Gaussian data with
// S = 16, B = 512 this averages about 2.55 bits per element (12.3x below fp32).
#include <cmath>
#include <cstring>
#include <vector>

#include "compression/codec_bits.h"
#include "compression/codec_kernel.h"
#include "compression/decoders.h"
#include "compression/quantizers.h"
#include "core/rng.h"
#include "core/spec.h"

namespace sparrow::compression::detail {
namespace {

constexpr int64_t kMaxLevels = int64_t{1} << 24;  // validate()'s bound; a code then fits in 50 bits
constexpr int64_t kMaxBucket = 0xffffffffll;      // params are uint32
constexpr int64_t kDefaultBucket = 512;

// Appends codes of width < 64 to a vector of 64-bit words, LSB first.
class WordWriter {
 public:
  void reserve_bits(uint64_t bits) { words_.reserve(bits / 64 + 2); }
  // bits above `width` must be zero; 1 <= width <= 63.
  void put(uint64_t bits, int width) {
    acc_ |= bits << fill_;
    fill_ += width;
    if (fill_ >= 64) {
      words_.push_back(acc_);
      fill_ -= 64;
      acc_ = fill_ ? bits >> (width - fill_) : 0;
    }
  }
  // `count` one bits (level-0 codes), written 63 at a time.
  void put_ones(uint64_t count) {
    while (count) {
      const int w = static_cast<int>(std::min<uint64_t>(count, 63));
      put((uint64_t{1} << w) - 1, w);
      count -= static_cast<uint64_t>(w);
    }
  }
  uint64_t bit_count() const { return words_.size() * 64 + static_cast<uint64_t>(fill_); }
  // Moves out the words, the partial last one included (its unused high bits are zero).
  std::vector<uint64_t> take() {
    if (fill_) words_.push_back(acc_);
    fill_ = 0;
    acc_ = 0;
    return std::move(words_);
  }

 private:
  std::vector<uint64_t> words_;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

class QsgdKernel final : public Kernel {
 public:
  QsgdKernel(uint32_t levels, uint32_t bucket) : levels_(levels), bucket_(bucket) {}
  std::string method() const override { return "qsgd"; }

  Encoded encode(const float* x, const std::vector<int64_t>& shape, Slots& slots, const CodecView& ctx) const override {
    const int64_t n_all = numel_of(shape);
    const int64_t bucket_all = bucket_;
    const int64_t buckets_all = (n_all + bucket_all - 1) / bucket_all;
    const uint64_t key_all = step_key(ctx, slots.step());
    const double levels_all = static_cast<double>(levels_);
    const uint64_t max_level_all = levels_;

    Encoded e;
    e.format = Format::kQuantized;
    e.shape = shape;
    e.params = {levels_, bucket_};
    e.scales.assign(static_cast<size_t>(buckets_all), 0.0f);

    // Each chunk of whole buckets gets its own bit stream, built in parallel;
    // the streams are then spliced with shifts. The chunking only changes where
    // the work is split, never the bits produced.
    const int64_t chunk_all = std::max<int64_t>(1, kBlock / bucket_all);
    const int64_t chunks = (buckets_all + chunk_all - 1) / chunk_all;
    std::vector<WordWriter> writers(static_cast<size_t>(chunks));
    float* const norms_out = e.scales.data();
    parallel_for(0, chunks, [&](int64_t c0, int64_t c1) {
      // Locals: the writers' 64-bit stores could otherwise alias the captures.
      const float* const v = x;
      float* const norms = norms_out;
      const int64_t n = n_all, bucket = bucket_all, buckets = buckets_all, chunk_buckets = chunk_all;
      const uint64_t key = key_all, max_level = max_level_all;
      const double levels = levels_all;
      for (int64_t c = c0; c < c1; ++c) {
        WordWriter& w = writers[static_cast<size_t>(c)];
        const int64_t b_end = std::min(buckets, (c + 1) * chunk_buckets);
        w.reserve_bits(static_cast<uint64_t>(std::min(n, b_end * bucket) - c * chunk_buckets * bucket) * 3);
        for (int64_t b = c * chunk_buckets; b < b_end; ++b) {
          const int64_t lo = b * bucket, hi = std::min(n, lo + bucket);
          double ss = 0.0;
          for (int64_t i = lo; i < hi; ++i) ss += static_cast<double>(v[i]) * v[i];
          const float norm = static_cast<float>(std::sqrt(ss));
          SPARROW_CHECK(std::isfinite(norm), "qsgd: bucket " << b << " has a non-finite L2 norm "
                                                             << "(input contains inf/nan or overflows float32)");
          norms[b] = norm;
          if (norm == 0.0f) {
            w.put_ones(static_cast<uint64_t>(hi - lo));
            continue;
          }
          const double inv = levels / static_cast<double>(norm);
          for (int64_t i = lo; i < hi; ++i) {
            // r >= 0, so truncation is floor (and avoids a libm call without SSE4.1).
            const double r = std::fabs(static_cast<double>(v[i])) * inv;
            uint64_t level = static_cast<uint64_t>(r);
            if (level >= max_level) {
              level = max_level;  // |v_i| == norm up to rounding
            } else {
              const double frac = r - static_cast<double>(level);
              level += static_cast<double>(rng::uniform01(key, static_cast<uint64_t>(i))) < frac;
            }
            // Branch-free code: level 0 gives nb = 0, code "1", width 1, no sign bit.
            const uint64_t xg = level + 1;
            const int nb = 63 - __builtin_clzll(xg);
            const uint64_t top = uint64_t{1} << nb;
            const uint64_t has_sign = level != 0;
            const uint64_t neg = static_cast<uint64_t>(v[i] < 0.0f) & has_sign;
            w.put(top | ((xg ^ top) << (nb + 1)) | (neg << (2 * nb + 1)), 2 * nb + 1 + static_cast<int>(has_sign));
          }
        }
      }
    });

    // Splice the chunk streams.
    std::vector<uint64_t> offsets(static_cast<size_t>(chunks) + 1, 0);
    for (int64_t c = 0; c < chunks; ++c) offsets[c + 1] = offsets[c] + writers[c].bit_count();
    const uint64_t total = offsets.back();
    std::vector<uint64_t> out(total / 64 + 2, 0);
    for (int64_t c = 0; c < chunks; ++c) {
      const std::vector<uint64_t> words = writers[c].take();
      const uint64_t k0 = offsets[c] >> 6;
      const int s = static_cast<int>(offsets[c] & 63);
      if (s == 0) {
        for (size_t j = 0; j < words.size(); ++j) out[k0 + j] |= words[j];
      } else {
        for (size_t j = 0; j < words.size(); ++j) {
          out[k0 + j] |= words[j] << s;
          out[k0 + j + 1] |= words[j] >> (64 - s);
        }
      }
    }
    e.values.resize((total + 7) / 8);
    if (!e.values.empty()) std::memcpy(e.values.data(), out.data(), e.values.size());  // little-endian hosts
    ++slots.step();
    return e;
  }

 private:
  uint32_t levels_;
  uint32_t bucket_;
};

}  // namespace

void decode_quantized_add(const Encoded& e, float* out, float weight) {
  SPARROW_CHECK_T(FormatError, e.params.size() == 2 && e.params[0] >= 1 && e.params[1] >= 1, "qsgd: bad params");
  const uint64_t levels = e.params[0];
  const uint64_t bucket = e.params[1];
  const uint64_t n = static_cast<uint64_t>(e.numel());
  SPARROW_CHECK_T(FormatError, e.scales.size() == (n + bucket - 1) / bucket, "qsgd: wrong number of bucket norms");
  // The longest valid gamma prefix: that of levels + 1.
  const int max_prefix = 63 - __builtin_clzll(levels + 1);

  // Copy into words with two zero words of padding, so that a 64-bit peek at
  // any position <= nbits stays in bounds and every bit past the stream is 0.
  const uint64_t nbits = static_cast<uint64_t>(e.values.size()) * 8;
  std::vector<uint64_t> padded((e.values.size() + 7) / 8 + 2, 0);
  if (!e.values.empty()) std::memcpy(padded.data(), e.values.data(), e.values.size());
  const uint64_t* words = padded.data();
  auto peek = [words](uint64_t pos) {
    const uint64_t k = pos >> 6;
    const unsigned s = static_cast<unsigned>(pos & 63);
    return (words[k] >> s) | ((words[k + 1] << 1) << (63 - s));
  };

  // buf holds the `avail` stream bits from pos on (higher bits zero); it is
  // refilled before it could run short of the longest code (2·24+2 = 50 bits),
  // which keeps the per-element dependency chain to ctz + shift.
  uint64_t pos = 0, buf = 0;
  int avail = 0;
  // A sentinel bit caps count-trailing-zeros at max_prefix + 1 (an error) without a branch.
  const uint64_t sentinel = uint64_t{1} << (max_prefix + 1);
  for (uint64_t b = 0, lo = 0; lo < n; ++b, lo += bucket) {
    const uint64_t hi = std::min(n, lo + bucket);
    // In double, so that a top-level element (level == S) decodes to exactly the norm.
    const double f = static_cast<double>(weight) * e.scales[b] / static_cast<double>(levels);
    for (uint64_t i = lo; i < hi; ++i) {
      if (avail < 50) {
        buf |= peek(pos + static_cast<uint64_t>(avail)) << avail;
        avail = 64;
      }
      const int nb = __builtin_ctzll(buf | sentinel);
      const uint64_t top = uint64_t{1} << nb;
      const uint64_t level = (top | ((buf >> (nb + 1)) & (top - 1))) - 1;
      const uint64_t has_sign = nb != 0;
      const uint32_t neg = static_cast<uint32_t>((buf >> (2 * nb + 1)) & has_sign);
      const int width = 2 * nb + 1 + static_cast<int>(has_sign);
      buf >>= width;  // width <= 2·25+1 < 64
      avail -= width;
      pos += static_cast<uint64_t>(width);
      // One rarely-taken branch for all three ways a stream can be bad. Bits past
      // the stream read as zero, so a truncated stream ends in a too-long prefix
      // or overruns nbits; pos <= nbits keeps every peek within the buffer.
      if (nb > max_prefix || level > levels || pos > nbits) {
        SPARROW_CHECK_T(FormatError, nb <= max_prefix,
                        "qsgd: Elias-gamma prefix too long (or stream truncated) at element " << i);
        SPARROW_CHECK_T(FormatError, level <= levels,
                        "qsgd: level " << level << " exceeds " << levels << " at element " << i);
        throw FormatError("qsgd: bit stream truncated at element " + std::to_string(i));
      }
      uint32_t bits;
      const float val = static_cast<float>(f * static_cast<double>(level));
      std::memcpy(&bits, &val, 4);
      bits ^= neg << 31;
      float sv;
      std::memcpy(&sv, &bits, 4);
      out[i] += sv;
    }
  }
  SPARROW_CHECK_T(FormatError, nbits - pos < 8,
                  "qsgd: " << (nbits - pos) << " bits left after the last element (at most 7 bits of padding)");
  SPARROW_CHECK_T(FormatError, nbits == pos || (peek(pos) & ((uint64_t{1} << (nbits - pos)) - 1)) == 0,
                  "qsgd: nonzero padding bits");
}

std::unique_ptr<Kernel> make_qsgd_kernel(Spec& spec) {
  SPARROW_CHECK_T(sparrow::ConfigError, spec.has("levels"),
                  "spec '" << spec.text() << "': qsgd needs levels=S (an integer >= 1), e.g. qsgd:levels=16");
  const int64_t levels = spec.get_int("levels", 0);
  const int64_t bucket = spec.get_int("bucket", kDefaultBucket);
  SPARROW_CHECK_T(sparrow::ConfigError, levels >= 1 && levels <= kMaxLevels,
                  "spec '" << spec.text() << "': qsgd levels must be in [1, " << kMaxLevels << "], got " << levels);
  SPARROW_CHECK_T(sparrow::ConfigError, bucket >= 1 && bucket <= kMaxBucket,
                  "spec '" << spec.text() << "': qsgd bucket must be in [1, " << kMaxBucket << "], got " << bucket);
  return std::make_unique<QsgdKernel>(static_cast<uint32_t>(levels), static_cast<uint32_t>(bucket));
}

}  // namespace sparrow::compression::detail
