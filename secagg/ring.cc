// The parts of SecAgg+ that are not a party: the `secagg` setting, what it
// composes with, the neighbour graph and the ring Z_{2^32} (secagg/secagg.h).
#include <sodium.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "core/spec.h"
#include "secagg/secagg.h"
#include "secagg/sodium_init.h"

namespace sparrow::secagg {

// ---- Params ------------------------------------------------------------------------

Params Params::parse(const std::string& text) {
  Params p;
  if (text == "none" || text.empty()) return p;
  Spec s = Spec::parse(text);
  SPARROW_CHECK_T(ConfigError, s.method() == "secagg+",
                  "secagg: unknown method '" << s.method() << "' (none, or secagg+:degree=,threshold=,clip=,timeout=)");
  p.enabled = true;
  const int64_t k = s.get_int("degree", p.degree);
  const int64_t t = s.get_int("threshold", 0);
  p.clip = s.get_double("clip", p.clip);
  p.timeout_s = s.get_double("timeout", p.timeout_s);
  s.check_all_consumed();
  SPARROW_CHECK_T(ConfigError, k >= 2 && k <= 254 && k % 2 == 0,
                  "secagg: degree must be even and in [2, 254] (got " << k << ")");
  p.degree = static_cast<uint32_t>(k);
  SPARROW_CHECK_T(ConfigError, t == 0 || (t >= 2 && t <= k),
                  "secagg: threshold must be in [2, degree = " << k << "] (got " << t << ")");
  p.threshold = static_cast<uint32_t>(t);
  SPARROW_CHECK_T(ConfigError, std::isfinite(p.clip) && p.clip > 0 && p.clip <= 1e6,
                  "secagg: clip must be in (0, 1e6] (got " << p.clip << ")");
  SPARROW_CHECK_T(ConfigError, std::isfinite(p.timeout_s) && p.timeout_s > 0 && p.timeout_s <= 3600,
                  "secagg: timeout must be in (0, 3600] seconds (got " << p.timeout_s << ")");
  return p;
}

std::string Params::text() const {
  if (!enabled) return "none";
  std::ostringstream os;
  os << "secagg+:degree=" << degree << ",threshold=" << effective_threshold() << ",clip=" << clip
     << ",timeout=" << timeout_s;
  return os.str();
}

void check_compatible(const std::string& compression, const std::string& aggregator, const std::string& dp,
                      const std::string& algorithm) {
  SPARROW_CHECK_T(ConfigError, compression == "none",
                  "secure aggregation needs compression = \"none\" (got '"
                      << compression
                      << "'): a masked update is dense 32-bit ring elements whatever the codec, and a sparse "
                         "update's positions would be masked into a dense vector");
  SPARROW_CHECK_T(ConfigError, aggregator == "mean",
                  "secure aggregation needs aggregator = \"mean\" (got '"
                      << aggregator << "'): robust aggregators look at each update, which the server never sees");
  SPARROW_CHECK_T(ConfigError, dp == "none" || dp.rfind("local", 0) == 0,
                  "secure aggregation takes dp = \"none\" or client-side local DP (got '"
                      << dp << "'): central DP clips each update at the server, which never sees one");
  SPARROW_CHECK_T(ConfigError, algorithm == "fedavg" || algorithm == "fedprox",
                  "secure aggregation works with fedavg and fedprox (got '"
                      << algorithm << "'): SCAFFOLD's per-client control deltas would travel in the clear");
}

// ---- Graph ---------------------------------------------------------------------------

Graph::Graph(uint32_t n, uint32_t degree, uint64_t seed) : n_(n), adj_(n) {
  SPARROW_CHECK(n >= 2, "secagg: a round needs at least 2 clients");
  std::vector<uint32_t> ring(n);
  for (uint32_t i = 0; i < n; ++i) ring[i] = i + 1;
  rng::Stream st(seed);
  for (uint32_t i = n - 1; i > 0; --i) std::swap(ring[i], ring[st.below(i + 1)]);  // Fisher-Yates
  if (degree >= n - 1) {
    for (uint32_t i = 1; i <= n; ++i)
      for (uint32_t j = 1; j <= n; ++j)
        if (i != j) adj_[i - 1].push_back(j);
    return;
  }
  SPARROW_CHECK(degree % 2 == 0, "secagg: the degree of an incomplete graph must be even");
  for (uint32_t p = 0; p < n; ++p) {
    auto& a = adj_[ring[p] - 1];
    for (uint32_t j = 1; j <= degree / 2; ++j) {
      a.push_back(ring[(p + j) % n]);
      a.push_back(ring[(p + n - j) % n]);
    }
    std::sort(a.begin(), a.end());
  }
}

const std::vector<uint32_t>& Graph::neighbours(uint32_t index) const {
  SPARROW_CHECK(index >= 1 && index <= n_, "secagg: client index " << index << " outside 1.." << n_);
  return adj_[index - 1];
}

bool Graph::linked(uint32_t a, uint32_t b) const {
  if (a < 1 || a > n_ || b < 1 || b > n_ || a == b) return false;
  const auto& v = adj_[a - 1];
  return std::binary_search(v.begin(), v.end(), b);
}

// ---- the ring ------------------------------------------------------------------------

double ring_scale(uint32_t n, double clip) {
  // |sum| <= clip * scale + n (each rounding adds < 1) must stay below 2^31.
  return (2147483647.0 - static_cast<double>(n) - 1.0) / clip;
}

size_t quantise(const float* x, size_t n, double weight, double clip, double scale, uint64_t key, uint32_t* out) {
  size_t clipped = 0;
  const double f = weight * scale;
  for (size_t i = 0; i < n; ++i) {
    double v = x[i];
    SPARROW_CHECK(std::isfinite(v), "secagg: update coordinate " << i << " is not finite");
    if (v > clip) {
      v = clip;
      ++clipped;
    } else if (v < -clip) {
      v = -clip;
      ++clipped;
    }
    const double s = v * f;
    const double fl = std::floor(s);
    const double q = fl + (static_cast<double>(rng::uniform01(key, i)) < s - fl ? 1.0 : 0.0);
    out[i] = static_cast<uint32_t>(static_cast<int64_t>(q));
  }
  return clipped;
}

void dequantise(const uint32_t* sum, size_t n, double scale, float* out) {
  const double inv = 1.0 / scale;
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<int32_t>(sum[i]) * inv);
}

void add_prg(uint32_t* v, size_t n, const Secret& seed, bool subtract) {
  init_sodium();
  static const uint8_t nonce[crypto_stream_chacha20_ietf_NONCEBYTES] = {};
  constexpr size_t kChunk = 4096;  // words per keystream call (16 KiB = 256 ChaCha20 blocks)
  uint32_t buf[kChunk];
  for (size_t off = 0; off < n; off += kChunk) {
    const size_t m = std::min(kChunk, n - off);
    std::memset(buf, 0, m * 4);
    // Block counter = words / 16: each 64-byte block is 16 words.
    crypto_stream_chacha20_ietf_xor_ic(reinterpret_cast<uint8_t*>(buf), reinterpret_cast<uint8_t*>(buf), m * 4, nonce,
                                       static_cast<uint32_t>(off / 16), seed.data());
    if (subtract)
      for (size_t i = 0; i < m; ++i) v[off + i] -= buf[i];
    else
      for (size_t i = 0; i < m; ++i) v[off + i] += buf[i];
  }
  sodium_memzero(buf, sizeof buf);
}

}  // namespace sparrow::secagg
