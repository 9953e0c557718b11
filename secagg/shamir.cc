// Shamir secret sharing over GF(2^8), byte-wise (secagg/secagg.h, "building
// blocks"): splitting, combining from t shares, and the robust combination
// that outvotes wrong shares (unique decoding over t-subsets).
#include <sodium.h>

#include <algorithm>
#include <set>

#include "core/error.h"
#include "secagg/secagg.h"
#include "secagg/sodium_init.h"

namespace sparrow::secagg {
namespace {

// ---- GF(2^8), AES polynomial ------------------------------------------------

struct Gf {
  uint8_t exp[512];
  uint8_t log[256];
  Gf() {
    unsigned x = 1;
    for (int i = 0; i < 255; ++i) {
      exp[i] = static_cast<uint8_t>(x);
      log[x] = static_cast<uint8_t>(i);
      x ^= x << 1;  // multiply by the generator 3
      if (x & 0x100) x ^= 0x11b;
    }
    for (int i = 255; i < 512; ++i) exp[i] = exp[i - 255];
    log[0] = 0;
  }
  uint8_t mul(uint8_t a, uint8_t b) const { return a && b ? exp[log[a] + log[b]] : 0; }
  uint8_t div(uint8_t a, uint8_t b) const { return a ? exp[log[a] + 255 - log[b]] : 0; }
};
const Gf& gf() {
  static const Gf g;
  return g;
}

}  // namespace

std::vector<std::string> shamir_split(const Secret& secret, uint32_t t, const std::vector<uint8_t>& xs) {
  init_sodium();
  SPARROW_CHECK(t >= 1 && t <= xs.size(), "secagg: threshold " << t << " for " << xs.size() << " shares");
  const Gf& g = gf();
  // coef[j][byte]: the polynomial of each byte; coef[0] = the secret.
  std::vector<Secret> coef(t);
  coef[0] = secret;
  for (uint32_t j = 1; j < t; ++j) randombytes_buf(coef[j].data(), coef[j].size());
  std::vector<std::string> out;
  for (uint8_t x : xs) {
    SPARROW_CHECK(x != 0, "secagg: share x must be non-zero");
    std::string s(kShareBytes, '\0');
    s[0] = static_cast<char>(x);
    for (size_t b = 0; b < 32; ++b) {
      uint8_t y = 0;  // Horner
      for (uint32_t j = t; j-- > 0;) y = static_cast<uint8_t>(g.mul(y, x) ^ coef[j][b]);
      s[1 + b] = static_cast<char>(y);
    }
    out.push_back(std::move(s));
  }
  for (auto& c : coef) sodium_memzero(c.data(), c.size());
  return out;
}

Secret shamir_combine(const std::vector<std::string>& shares, uint32_t t) {
  SPARROW_CHECK(t >= 1 && shares.size() >= t, "secagg: " << shares.size() << " shares, " << t << " needed");
  const Gf& g = gf();
  std::vector<uint8_t> xs(t);
  for (uint32_t i = 0; i < t; ++i) {
    SPARROW_CHECK(shares[i].size() == kShareBytes, "secagg: a share must be " << kShareBytes << " bytes");
    xs[i] = static_cast<uint8_t>(shares[i][0]);
    SPARROW_CHECK(xs[i] != 0, "secagg: share with x = 0");
    for (uint32_t j = 0; j < i; ++j) SPARROW_CHECK(xs[j] != xs[i], "secagg: two shares with x = " << int(xs[i]));
  }
  Secret out{};
  for (uint32_t i = 0; i < t; ++i) {
    uint8_t l = 1;  // Lagrange basis at 0: prod x_j / (x_j - x_i)
    for (uint32_t j = 0; j < t; ++j)
      if (j != i) l = g.mul(l, g.div(xs[j], static_cast<uint8_t>(xs[j] ^ xs[i])));
    for (size_t b = 0; b < 32; ++b) out[b] ^= g.mul(l, static_cast<uint8_t>(shares[i][1 + b]));
  }
  return out;
}

namespace {
// The value at x of the polynomial through the shares `idx` (their x distinct),
// byte b of the secret.
uint8_t interpolate_at(const std::vector<std::string>& shares, const std::vector<size_t>& idx, uint8_t x, size_t b) {
  const Gf& g = gf();
  uint8_t y = 0;
  for (size_t i : idx) {
    const uint8_t xi = static_cast<uint8_t>(shares[i][0]);
    if (xi == x) return static_cast<uint8_t>(shares[i][1 + b]);
    uint8_t l = 1;  // Lagrange basis: prod (x - x_j) / (x_i - x_j); minus is xor
    for (size_t j : idx)
      if (j != i) {
        const uint8_t xj = static_cast<uint8_t>(shares[j][0]);
        l = g.mul(l, g.div(static_cast<uint8_t>(x ^ xj), static_cast<uint8_t>(xi ^ xj)));
      }
    y ^= g.mul(l, static_cast<uint8_t>(shares[i][1 + b]));
  }
  return y;
}

// Whether share k lies on the polynomial through `idx`: all 32 bytes, or only the
// first when `first_byte_only`.
bool on_polynomial(const std::vector<std::string>& shares, const std::vector<size_t>& idx, size_t k,
                   bool first_byte_only) {
  const uint8_t x = static_cast<uint8_t>(shares[k][0]);
  const size_t bytes = first_byte_only ? 1 : 32;
  for (size_t b = 0; b < bytes; ++b)
    if (interpolate_at(shares, idx, x, b) != static_cast<uint8_t>(shares[k][1 + b])) return false;
  return true;
}
}  // namespace

std::optional<Secret> shamir_combine_robust(const std::vector<std::string>& shares, uint32_t t,
                                            std::vector<size_t>* wrong) {
  const size_t m = shares.size();
  SPARROW_CHECK(t >= 1 && m >= t, "secagg: " << m << " shares, " << t << " needed");
  std::set<uint8_t> xs;
  for (const auto& sh : shares) {
    SPARROW_CHECK(sh.size() == kShareBytes, "secagg: a share must be " << kShareBytes << " bytes");
    SPARROW_CHECK(sh[0] != 0, "secagg: share with x = 0");
    SPARROW_CHECK(xs.insert(static_cast<uint8_t>(sh[0])).second, "secagg: two shares with x = " << int(sh[0]));
  }
  const size_t need = (m + t + 1) / 2;  // ceil((m + t) / 2)
  // Tries the polynomial through `idx`: the shares off it, or nullopt when fewer than `need` lie on it.
  auto attempt = [&](const std::vector<size_t>& idx) -> std::optional<std::vector<size_t>> {
    size_t agree = 0;
    for (size_t k = 0; k < m; ++k) agree += on_polynomial(shares, idx, k, /*first_byte_only=*/true) ? 1 : 0;
    if (agree < need) return std::nullopt;
    std::vector<size_t> off;
    for (size_t k = 0; k < m; ++k)
      if (!on_polynomial(shares, idx, k, false)) off.push_back(k);
    if (m - off.size() < need) return std::nullopt;
    return off;
  };
  std::vector<size_t> idx(t);
  for (uint32_t i = 0; i < t; ++i) idx[i] = i;
  uint64_t tried = 0;
  for (;;) {
    if (auto off = attempt(idx)) {
      std::vector<std::string> good;
      for (size_t i : idx) good.push_back(shares[i]);
      if (wrong) *wrong = *off;
      return shamir_combine(good, t);
    }
    if (++tried >= kMaxSubsets) return std::nullopt;
    // The next t-subset of 0..m-1 in lexicographic order.
    size_t i = t;
    while (i > 0 && idx[i - 1] == m - t + i - 1) --i;
    if (i == 0) return std::nullopt;
    ++idx[i - 1];
    for (size_t j = i; j < t; ++j) idx[j] = idx[j - 1] + 1;
  }
}

}  // namespace sparrow::secagg
