#include "secagg/verify.h"

#include <sodium.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "secagg/sodium_init.h"

namespace sparrow::secagg {
namespace {

constexpr size_t kNonceBytes = crypto_aead_chacha20poly1305_IETF_NPUBBYTES;
constexpr size_t kPlainBytes = 8 + 2 * kShareBytes;  // owner, holder, seed share, mask key share
constexpr size_t kPairBytes = kNonceBytes + kPlainBytes + crypto_aead_chacha20poly1305_IETF_ABYTES;
constexpr size_t kPoint = crypto_core_ristretto255_BYTES;
constexpr size_t kScalar = crypto_core_ristretto255_SCALARBYTES;

const uint8_t* u8(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{p[i]} << (8 * i);
  return v;
}
void put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// Associated data of a pair: the round, then owner and holder (in that order:
// a pair cannot be replayed the other way).
void pair_ad(uint8_t ad[16], uint64_t round, uint32_t owner, uint32_t holder) {
  put64(ad, round);
  put32(ad + 8, owner);
  put32(ad + 12, holder);
}

void hash_update(crypto_generichash_state& st, const std::string& s) {
  crypto_generichash_update(&st, u8(s), s.size());
}

// The Fiat-Shamir challenge of the proof: every public value, so it cannot be
// moved to another round, pair or point.
void challenge(uint8_t e[kScalar], uint64_t round, uint32_t owner, uint32_t holder, const std::string& holder_pk,
               const std::string& owner_pk, const uint8_t* q, const uint8_t* a1, const uint8_t* a2) {
  static const char kLabel[] = "sparrow-secagg-evidence";
  uint8_t info[16];
  pair_ad(info, round, owner, holder);
  uint8_t h[64];
  crypto_generichash_state st;
  crypto_generichash_init(&st, nullptr, 0, sizeof h);
  crypto_generichash_update(&st, reinterpret_cast<const uint8_t*>(kLabel), sizeof kLabel - 1);
  crypto_generichash_update(&st, info, sizeof info);
  hash_update(st, holder_pk);
  hash_update(st, owner_pk);
  crypto_generichash_update(&st, q, kPoint);
  crypto_generichash_update(&st, a1, kPoint);
  crypto_generichash_update(&st, a2, kPoint);
  crypto_generichash_final(&st, h, sizeof h);
  crypto_core_ristretto255_scalar_reduce(e, h);
}

}  // namespace

EncKeyPair EncKeyPair::fresh() {
  init_sodium();
  EncKeyPair k;
  k.sk.resize(kScalar);
  k.pk.resize(kPoint);
  auto* sk = reinterpret_cast<uint8_t*>(k.sk.data());
  do crypto_core_ristretto255_scalar_random(sk);
  while (crypto_scalarmult_ristretto255_base(reinterpret_cast<uint8_t*>(k.pk.data()), sk) != 0);
  return k;
}

bool usable_enc_key(const std::string& pk) {
  init_sodium();
  static const uint8_t probe[kScalar] = {9, 1, 2, 3, 4, 5, 6, 7, 8};
  uint8_t q[kPoint];
  return pk.size() == kPoint && crypto_scalarmult_ristretto255(q, probe, u8(pk)) == 0;
}

uint8_t share_x(const Graph& graph, uint32_t owner, uint32_t holder) {
  const auto& nb = graph.neighbours(owner);
  return static_cast<uint8_t>(std::lower_bound(nb.begin(), nb.end(), holder) - nb.begin() + 1);
}

Secret kdf(const uint8_t* point, const char* label, uint64_t round, uint32_t a, uint32_t b) {
  uint8_t info[16];
  put64(info, round);
  put32(info + 8, std::min(a, b));
  put32(info + 12, std::max(a, b));
  crypto_generichash_state st;
  crypto_generichash_init(&st, nullptr, 0, 32);
  crypto_generichash_update(&st, point, 32);
  crypto_generichash_update(&st, reinterpret_cast<const uint8_t*>(label), std::strlen(label));
  crypto_generichash_update(&st, info, sizeof info);
  Secret k;
  crypto_generichash_final(&st, k.data(), k.size());
  return k;
}

std::string seed_commitment(const Secret& seed, uint64_t round, uint32_t owner) {
  init_sodium();
  static const char kLabel[] = "sparrow-secagg-seed";
  uint8_t info[12];
  put64(info, round);
  put32(info + 8, owner);
  std::string out(kDigestBytes, '\0');
  crypto_generichash_state st;
  crypto_generichash_init(&st, nullptr, 0, kDigestBytes);
  crypto_generichash_update(&st, reinterpret_cast<const uint8_t*>(kLabel), sizeof kLabel - 1);
  crypto_generichash_update(&st, info, sizeof info);
  crypto_generichash_update(&st, seed.data(), seed.size());
  crypto_generichash_final(&st, reinterpret_cast<uint8_t*>(out.data()), out.size());
  return out;
}

std::string share_digest(const std::string& share, uint8_t kind, uint64_t round, uint32_t owner, uint32_t holder) {
  init_sodium();
  static const char kLabel[] = "sparrow-secagg-share-digest";
  uint8_t info[17];
  pair_ad(info, round, owner, holder);
  info[16] = kind;
  std::string out(kDigestBytes, '\0');
  crypto_generichash_state st;
  crypto_generichash_init(&st, nullptr, 0, kDigestBytes);
  crypto_generichash_update(&st, reinterpret_cast<const uint8_t*>(kLabel), sizeof kLabel - 1);
  crypto_generichash_update(&st, info, sizeof info);
  hash_update(st, share);
  crypto_generichash_final(&st, reinterpret_cast<uint8_t*>(out.data()), out.size());
  return out;
}

std::string seal_pair(const std::string& owner_sk, const std::string& holder_pk, uint64_t round, uint32_t owner,
                      uint32_t holder, const std::string& b_share, const std::string& s_share) {
  SPARROW_CHECK(b_share.size() == kShareBytes && s_share.size() == kShareBytes,
                "secagg: a share must be " << kShareBytes << " bytes");
  uint8_t q[kPoint];
  SPARROW_CHECK(crypto_scalarmult_ristretto255(q, u8(owner_sk), u8(holder_pk)) == 0,
                "secagg: key agreement with client " << holder << " failed (an unusable public key)");
  const Secret key = kdf(q, "sparrow-secagg-share", round, owner, holder);
  sodium_memzero(q, sizeof q);
  uint8_t plain[kPlainBytes];
  put32(plain, owner);
  put32(plain + 4, holder);
  std::memcpy(plain + 8, b_share.data(), kShareBytes);
  std::memcpy(plain + 8 + kShareBytes, s_share.data(), kShareBytes);
  uint8_t ad[16];
  pair_ad(ad, round, owner, holder);
  std::string ct(kPairBytes, '\0');
  auto* ctp = reinterpret_cast<uint8_t*>(ct.data());
  randombytes_buf(ctp, kNonceBytes);
  unsigned long long clen = 0;
  crypto_aead_chacha20poly1305_ietf_encrypt(ctp + kNonceBytes, &clen, plain, sizeof plain, ad, sizeof ad, nullptr, ctp,
                                            key.data());
  sodium_memzero(plain, sizeof plain);
  return ct;
}

OpenedPair open_pair_with_point(const std::string& point, uint64_t round, uint32_t owner, uint32_t holder, uint8_t x,
                                const std::string& ciphertext, const std::string& digest) {
  OpenedPair out;
  const std::string from = "the pair from client " + std::to_string(owner);
  if (ciphertext.size() != kPairBytes || point.size() != kPoint) {
    out.error = from + " is malformed";
    return out;
  }
  const Secret key = kdf(u8(point), "sparrow-secagg-share", round, owner, holder);
  uint8_t ad[16];
  pair_ad(ad, round, owner, holder);
  uint8_t plain[kPlainBytes];
  unsigned long long plen = 0;
  const auto* ctp = u8(ciphertext);
  if (crypto_aead_chacha20poly1305_ietf_decrypt(plain, &plen, nullptr, ctp + kNonceBytes,
                                                ciphertext.size() - kNonceBytes, ad, sizeof ad, ctp, key.data()) != 0 ||
      plen != kPlainBytes) {
    out.error = from + " does not decrypt";
    return out;
  }
  if (get32(plain) != owner || get32(plain + 4) != holder || plain[8] != x || plain[8 + kShareBytes] != x) {
    out.error = from + " names other parties";
  } else {
    out.b_share.assign(reinterpret_cast<const char*>(plain + 8), kShareBytes);
    out.s_share.assign(reinterpret_cast<const char*>(plain + 8 + kShareBytes), kShareBytes);
    // A dealer that publishes digests of other shares than it deals would
    // make an honest holder's reveal look wrong: the holder refuses the pair.
    if (!digest.empty() &&
        (digest.size() != 2 * kDigestBytes ||
         digest.compare(0, kDigestBytes, share_digest(out.b_share, 1, round, owner, holder)) != 0 ||
         digest.compare(kDigestBytes, kDigestBytes, share_digest(out.s_share, 2, round, owner, holder)) != 0)) {
      out = OpenedPair{};
      out.error = from + " does not match the digests its sender published";
    }
  }
  sodium_memzero(plain, sizeof plain);
  return out;
}

OpenedPair open_pair(const std::string& holder_sk, const std::string& owner_pk, uint64_t round, uint32_t owner,
                     uint32_t holder, uint8_t x, const std::string& ciphertext, const std::string& digest) {
  std::string q(kPoint, '\0');
  if (owner_pk.size() != kPoint ||
      crypto_scalarmult_ristretto255(reinterpret_cast<uint8_t*>(q.data()), u8(holder_sk), u8(owner_pk)) != 0) {
    OpenedPair out;
    out.error = "key agreement with client " + std::to_string(owner) + " failed";
    return out;
  }
  OpenedPair out = open_pair_with_point(q, round, owner, holder, x, ciphertext, digest);
  sodium_memzero(q.data(), q.size());
  return out;
}

std::string make_evidence(const std::string& holder_sk, const std::string& holder_pk, const std::string& owner_pk,
                          uint64_t round, uint32_t owner, uint32_t holder) {
  init_sodium();
  uint8_t q[kPoint], r[kScalar], a1[kPoint], a2[kPoint], e[kScalar], ec[kScalar], z[kScalar];
  SPARROW_CHECK(crypto_scalarmult_ristretto255(q, u8(holder_sk), u8(owner_pk)) == 0,
                "secagg: key agreement with client " << owner << " failed (an unusable public key)");
  do crypto_core_ristretto255_scalar_random(r);
  while (crypto_scalarmult_ristretto255_base(a1, r) != 0);
  SPARROW_CHECK(crypto_scalarmult_ristretto255(a2, r, u8(owner_pk)) == 0, "secagg: proof for client " << owner);
  challenge(e, round, owner, holder, holder_pk, owner_pk, q, a1, a2);
  crypto_core_ristretto255_scalar_mul(ec, e, u8(holder_sk));
  crypto_core_ristretto255_scalar_add(z, r, ec);  // z = r + e * sk
  std::string out(kEvidenceBytes, '\0');
  std::memcpy(&out[0], q, kPoint);
  std::memcpy(&out[kPoint], e, kScalar);
  std::memcpy(&out[kPoint + kScalar], z, kScalar);
  sodium_memzero(r, sizeof r);
  sodium_memzero(ec, sizeof ec);
  return out;
}

std::optional<std::string> check_evidence(const std::string& evidence, const std::string& holder_pk,
                                          const std::string& owner_pk, uint64_t round, uint32_t owner,
                                          uint32_t holder) {
  init_sodium();
  if (evidence.size() != kEvidenceBytes || holder_pk.size() != kPoint || owner_pk.size() != kPoint) return std::nullopt;
  const uint8_t* q = u8(evidence);
  const uint8_t* e = q + kPoint;
  const uint8_t* z = e + kScalar;
  if (!crypto_core_ristretto255_is_valid_point(q)) return std::nullopt;
  // A1 = z*G - e*holder_pk and A2 = z*owner_pk - e*Q: what the prover
  // committed to when both logarithms are its secret key.
  uint8_t zg[kPoint], epk[kPoint], zo[kPoint], eq[kPoint], a1[kPoint], a2[kPoint], e2[kScalar];
  if (crypto_scalarmult_ristretto255_base(zg, z) != 0 || crypto_scalarmult_ristretto255(epk, e, u8(holder_pk)) != 0 ||
      crypto_scalarmult_ristretto255(zo, z, u8(owner_pk)) != 0 || crypto_scalarmult_ristretto255(eq, e, q) != 0)
    return std::nullopt;
  if (crypto_core_ristretto255_sub(a1, zg, epk) != 0 || crypto_core_ristretto255_sub(a2, zo, eq) != 0)
    return std::nullopt;
  challenge(e2, round, owner, holder, holder_pk, owner_pk, q, a1, a2);
  if (sodium_memcmp(e2, e, kScalar) != 0) return std::nullopt;
  return std::string(reinterpret_cast<const char*>(q), kPoint);
}

}  // namespace sparrow::secagg
