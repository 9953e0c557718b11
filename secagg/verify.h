#pragma once
// What makes a SecAgg+ round checkable by the server (docs/security.md, "One
// bad participant" and "Wrong shares in a Reveal"): the share pairs sealed
// between two clients, the dealer's commitments to its self-mask seed and to
// each share it deals, and the evidence a client attaches when it rejects a
// neighbour's pair. Client and Server (secagg/secagg.cc) use these, the
// server to decide every dispute from what it holds instead of weighing
// words: a wrong revealed share does not match its digest, a false report
// opens to a good pair. Internal to secagg/ (and its tests).
//
// Share encryption keys are ristretto255 (libsodium), not X25519: a client
// that rejects a pair proves its key agreement with the sender (a
// Chaum-Pedersen proof of equal discrete logarithms) without giving out its
// secret key, so the server opens that one pair and nothing else.

#include <cstdint>
#include <optional>
#include <string>

#include "secagg/secagg.h"

namespace sparrow::secagg {

constexpr size_t kDigestBytes = 32;
constexpr size_t kEvidenceBytes = 96;  // the shared point, then the proof's challenge and response

// A share-encryption key pair (ristretto255; 32-byte scalar and point).
struct EncKeyPair {
  std::string pk, sk;
  static EncKeyPair fresh();
};
// A point that is a valid ristretto255 encoding other than the identity.
bool usable_enc_key(const std::string& pk);

// The x coordinate of holder's share of owner's secrets: its position among
// owner's neighbours + 1 (both ends and the server compute it).
uint8_t share_x(const Graph& graph, uint32_t owner, uint32_t holder);

// BLAKE2b-256 commitment to a self-mask seed, bound to the round and owner.
std::string seed_commitment(const Secret& seed, uint64_t round, uint32_t owner);
// BLAKE2b-256 of one share (kind 1 seed, 2 mask key) dealt by owner to holder.
std::string share_digest(const std::string& share, uint8_t kind, uint64_t round, uint32_t owner, uint32_t holder);

// The pair owner deals holder: both shares encrypted (ChaCha20-Poly1305)
// under the key of their ristretto255 agreement, bound to the round and both
// indices. `b_share` and `s_share` are kShareBytes each.
std::string seal_pair(const std::string& owner_sk, const std::string& holder_pk, uint64_t round, uint32_t owner,
                      uint32_t holder, const std::string& b_share, const std::string& s_share);

// A pair opened, or why it is bad (`error` non-empty): does not decrypt,
// malformed, names other parties, shares at the wrong x, or shares that do
// not match the dealer's digests (checked when `digest` is not empty).
struct OpenedPair {
  std::string b_share, s_share;
  std::string error;
};
// The holder's view: its secret key and the owner's public key.
OpenedPair open_pair(const std::string& holder_sk, const std::string& owner_pk, uint64_t round, uint32_t owner,
                     uint32_t holder, uint8_t x, const std::string& ciphertext, const std::string& digest);
// The server's view: the shared point from verified evidence.
OpenedPair open_pair_with_point(const std::string& point, uint64_t round, uint32_t owner, uint32_t holder, uint8_t x,
                                const std::string& ciphertext, const std::string& digest);

// Evidence that holder's key agreement with owner is `point` (kEvidenceBytes):
// the point and a proof that log_G(holder_pk) = log_{owner_pk}(point), bound
// to the round and both indices. Reveals nothing of holder_sk and opens no
// other pair.
std::string make_evidence(const std::string& holder_sk, const std::string& holder_pk, const std::string& owner_pk,
                          uint64_t round, uint32_t owner, uint32_t holder);
// The shared point when the evidence proves it, nullopt otherwise.
std::optional<std::string> check_evidence(const std::string& evidence, const std::string& holder_pk,
                                          const std::string& owner_pk, uint64_t round, uint32_t owner, uint32_t holder);

// BLAKE2b-256 of a key-agreement point, a domain label, the round and the two
// indices (smaller first): the symmetric key both ends derive.
Secret kdf(const uint8_t* point, const char* label, uint64_t round, uint32_t a, uint32_t b);

}  // namespace sparrow::secagg
