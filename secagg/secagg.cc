#include "secagg/secagg.h"

#include <sodium.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "core/spec.h"
#include "secagg/sodium_init.h"

namespace sparrow::secagg {
namespace {

constexpr size_t kNonceBytes = crypto_aead_chacha20poly1305_IETF_NPUBBYTES;
constexpr size_t kPlainBytes = 8 + 2 * kShareBytes;  // from, to, b share, s share

Secret random_secret() {
  Secret s;
  randombytes_buf(s.data(), s.size());
  return s;
}

std::string bytes(const uint8_t* p, size_t n) { return std::string(reinterpret_cast<const char*>(p), n); }
const uint8_t* u8(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{p[i]} << (8 * i);
  return v;
}

// BLAKE2b-256 of an X25519 shared point, a domain label, the round and the
// two indices (smaller first): the key both ends derive.
Secret derive_key(const std::string& secret_key, const std::string& public_key, const char* label, uint64_t round,
                  uint32_t a, uint32_t b) {
  uint8_t q[crypto_scalarmult_BYTES];
  SPARROW_CHECK(crypto_scalarmult(q, u8(secret_key), u8(public_key)) == 0, "secagg: key agreement with client "
                                                                               << (a == b ? a : std::max(a, b))
                                                                               << " failed (a low-order public key)");
  uint8_t info[8 + 4 + 4];
  for (int i = 0; i < 8; ++i) info[i] = static_cast<uint8_t>(round >> (8 * i));
  put32(info + 8, std::min(a, b));
  put32(info + 12, std::max(a, b));
  crypto_generichash_state st;
  crypto_generichash_init(&st, nullptr, 0, 32);
  crypto_generichash_update(&st, q, sizeof q);
  crypto_generichash_update(&st, reinterpret_cast<const uint8_t*>(label), std::strlen(label));
  crypto_generichash_update(&st, info, sizeof info);
  Secret k;
  crypto_generichash_final(&st, k.data(), k.size());
  sodium_memzero(q, sizeof q);
  return k;
}

struct KeyPair {
  std::string pk, sk;
  static KeyPair fresh() {
    KeyPair k;
    k.pk.resize(crypto_box_PUBLICKEYBYTES);
    k.sk.resize(crypto_box_SECRETKEYBYTES);
    crypto_box_keypair(reinterpret_cast<uint8_t*>(k.pk.data()), reinterpret_cast<uint8_t*>(k.sk.data()));
    return k;
  }
};

std::string join(const std::vector<uint32_t>& v) {
  std::string s;
  for (uint32_t x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

// An X25519 public key that agrees to a non-zero secret (libsodium refuses
// the low-order points that would give every party the same key).
bool usable_key(const std::string& pk) {
  static const uint8_t probe[crypto_scalarmult_SCALARBYTES] = {9, 1, 2, 3, 4, 5, 6, 7, 8};
  uint8_t q[crypto_scalarmult_BYTES];
  return pk.size() == crypto_scalarmult_BYTES && crypto_scalarmult(q, probe, u8(pk)) == 0;
}

void check_stage(const wire::SecAgg& m, wire::SecAggStage want, uint64_t round) {
  SPARROW_CHECK(m.stage == want, "secagg: expected a " << wire::secagg_stage_name(want) << " message, got "
                                                       << wire::secagg_stage_name(m.stage));
  SPARROW_CHECK(m.round == round, "secagg: message for round " << m.round << ", this is round " << round);
}

}  // namespace

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

// ---- Client ------------------------------------------------------------------------

struct Client::Impl {
  wire::SecAggSetup setup;
  uint64_t round;
  std::string client_id;
  Graph graph;
  KeyPair enc, mask;
  bool keys_sent = false, shares_sent = false, masked_sent = false, revealed = false;
  std::map<uint32_t, wire::SecAggPeer> peers;  // neighbours that sent keys
  Secret b{};                                  // self-mask seed
  // Shares held for each neighbour that sent its pair: b share, s share.
  std::map<uint32_t, std::pair<std::string, std::string>> held;
  std::vector<uint32_t> rejected;  // neighbours whose pair was bad (sorted)

  Impl(const wire::SecAggSetup& s, uint64_t r, std::string id)
      : setup(s), round(r), client_id(std::move(id)), graph(s.clients, s.degree, s.graph_seed) {}
  ~Impl() {
    sodium_memzero(b.data(), b.size());
    sodium_memzero(enc.sk.data(), enc.sk.size());
    sodium_memzero(mask.sk.data(), mask.sk.size());
  }

  wire::SecAgg msg(wire::SecAggStage st) const {
    wire::SecAgg m;
    m.round = round;
    m.client_id = client_id;
    m.stage = st;
    m.index = setup.index;
    return m;
  }
  // x coordinate of a neighbour's share: its position among this client's
  // graph neighbours, + 1 (at most 254).
  uint8_t x_of(uint32_t owner, uint32_t holder) const {
    const auto& nb = graph.neighbours(owner);
    return static_cast<uint8_t>(std::lower_bound(nb.begin(), nb.end(), holder) - nb.begin() + 1);
  }
};

Client::Client(const wire::SecAggSetup& setup, uint64_t round, std::string client_id)
    : impl_(new Impl(setup, round, std::move(client_id))) {
  init_sodium();
  SPARROW_CHECK(setup.degree <= 254, "secagg: degree " << setup.degree << " above 254");
}
Client::~Client() { delete impl_; }
uint32_t Client::index() const { return impl_->setup.index; }
uint64_t Client::round() const { return impl_->round; }
const wire::SecAggSetup& Client::setup() const { return impl_->setup; }

wire::SecAgg Client::keys() {
  Impl& c = *impl_;
  SPARROW_CHECK(!c.keys_sent, "secagg: keys already sent for round " << c.round);
  c.enc = KeyPair::fresh();
  c.mask = KeyPair::fresh();
  c.keys_sent = true;
  wire::SecAgg m = c.msg(wire::SecAggStage::kKeys);
  m.peers.push_back({c.setup.index, c.enc.pk, c.mask.pk});
  return m;
}

wire::SecAgg Client::shares(const wire::SecAgg& in) {
  Impl& c = *impl_;
  check_stage(in, wire::SecAggStage::kNeighbours, c.round);
  SPARROW_CHECK(c.keys_sent && !c.shares_sent, "secagg: unexpected Neighbours message");
  std::map<uint32_t, wire::SecAggPeer> peers;
  std::set<std::string> seen{c.enc.pk, c.mask.pk};
  for (const auto& p : in.peers) {
    SPARROW_CHECK(c.graph.linked(c.setup.index, p.index),
                  "secagg: client " << p.index << " is not a neighbour of client " << c.setup.index);
    SPARROW_CHECK(peers.emplace(p.index, p).second, "secagg: neighbour " << p.index << " listed twice");
    SPARROW_CHECK(seen.insert(p.enc_key).second && seen.insert(p.mask_key).second,
                  "secagg: neighbour " << p.index << " repeats a key already seen");
  }
  SPARROW_CHECK(peers.size() >= c.setup.threshold, "secagg: " << peers.size() << " neighbours sent keys, threshold "
                                                              << c.setup.threshold
                                                              << ": this client's update could not be unmasked");
  c.b = random_secret();
  std::vector<uint8_t> xs;
  for (const auto& [v, p] : peers) xs.push_back(c.x_of(c.setup.index, v));
  Secret sk;
  std::memcpy(sk.data(), c.mask.sk.data(), sk.size());
  const std::vector<std::string> bs = shamir_split(c.b, c.setup.threshold, xs);
  const std::vector<std::string> ss = shamir_split(sk, c.setup.threshold, xs);
  sodium_memzero(sk.data(), sk.size());
  wire::SecAgg out = c.msg(wire::SecAggStage::kShares);
  size_t i = 0;
  for (const auto& [v, p] : peers) {
    const Secret key = derive_key(c.enc.sk, p.enc_key, "sparrow-secagg-share", c.round, c.setup.index, v);
    uint8_t plain[kPlainBytes];
    put32(plain, c.setup.index);
    put32(plain + 4, v);
    std::memcpy(plain + 8, bs[i].data(), kShareBytes);
    std::memcpy(plain + 8 + kShareBytes, ss[i].data(), kShareBytes);
    uint8_t ad[16];
    for (int k = 0; k < 8; ++k) ad[k] = static_cast<uint8_t>(c.round >> (8 * k));
    put32(ad + 8, c.setup.index);
    put32(ad + 12, v);
    std::string ct(kNonceBytes + kPlainBytes + crypto_aead_chacha20poly1305_IETF_ABYTES, '\0');
    auto* ctp = reinterpret_cast<uint8_t*>(ct.data());
    randombytes_buf(ctp, kNonceBytes);
    unsigned long long clen = 0;
    crypto_aead_chacha20poly1305_ietf_encrypt(ctp + kNonceBytes, &clen, plain, sizeof plain, ad, sizeof ad, nullptr,
                                              ctp, key.data());
    sodium_memzero(plain, sizeof plain);
    out.shares.push_back({v, 0, std::move(ct)});
    ++i;
  }
  c.peers = std::move(peers);
  c.shares_sent = true;
  return out;
}

std::map<uint32_t, std::string> Client::receive_shares(const wire::SecAgg& in) {
  Impl& c = *impl_;
  check_stage(in, wire::SecAggStage::kSharesIn, c.round);
  SPARROW_CHECK(c.shares_sent && !c.masked_sent && c.held.empty() && c.rejected.empty(),
                "secagg: unexpected SharesIn message");
  for (const auto& sh : in.shares)
    SPARROW_CHECK(c.peers.count(sh.peer),
                  "secagg: shares from client " << sh.peer << ", not a neighbour that sent keys");
  // A bad pair is its sender's fault (the server cannot read it): the sender
  // is rejected, not this client's round.
  std::map<uint32_t, std::pair<std::string, std::string>> held;
  std::map<uint32_t, std::string> bad;
  auto reject = [&](uint32_t v, std::string why) {
    held.erase(v);
    bad.emplace(v, std::move(why));
  };
  for (const auto& sh : in.shares) {
    if (bad.count(sh.peer)) continue;
    if (held.count(sh.peer)) {
      reject(sh.peer, "two pairs from client " + std::to_string(sh.peer));
      continue;
    }
    if (sh.kind != 0 || sh.data.size() != kNonceBytes + kPlainBytes + crypto_aead_chacha20poly1305_IETF_ABYTES) {
      reject(sh.peer, "the pair from client " + std::to_string(sh.peer) + " is malformed");
      continue;
    }
    Secret key;
    try {
      key = derive_key(c.enc.sk, c.peers.at(sh.peer).enc_key, "sparrow-secagg-share", c.round, sh.peer, c.setup.index);
    } catch (const Error&) {
      reject(sh.peer, "key agreement with client " + std::to_string(sh.peer) + " failed");
      continue;
    }
    uint8_t ad[16];
    for (int k = 0; k < 8; ++k) ad[k] = static_cast<uint8_t>(c.round >> (8 * k));
    put32(ad + 8, sh.peer);
    put32(ad + 12, c.setup.index);
    uint8_t plain[kPlainBytes];
    unsigned long long plen = 0;
    const auto* ctp = u8(sh.data);
    if (crypto_aead_chacha20poly1305_ietf_decrypt(plain, &plen, nullptr, ctp + kNonceBytes,
                                                  sh.data.size() - kNonceBytes, ad, sizeof ad, ctp, key.data()) != 0 ||
        plen != kPlainBytes) {
      reject(sh.peer, "the pair from client " + std::to_string(sh.peer) + " does not decrypt");
    } else if (get32(plain) != sh.peer || get32(plain + 4) != c.setup.index ||
               plain[8] != c.x_of(sh.peer, c.setup.index) || plain[8 + kShareBytes] != c.x_of(sh.peer, c.setup.index)) {
      reject(sh.peer, "the pair from client " + std::to_string(sh.peer) + " names other parties");
    } else {
      held.emplace(sh.peer, std::make_pair(bytes(plain + 8, kShareBytes), bytes(plain + 8 + kShareBytes, kShareBytes)));
    }
    sodium_memzero(plain, sizeof plain);
  }
  c.held = std::move(held);
  for (const auto& [v, why] : bad) c.rejected.push_back(v);
  return bad;
}

wire::SecAgg Client::masked(std::vector<uint32_t> x, std::vector<std::pair<std::string, double>> metrics) {
  Impl& c = *impl_;
  SPARROW_CHECK(c.shares_sent && !c.masked_sent, "secagg: masked update out of order");
  add_prg(x.data(), x.size(), c.b, false);
  // Pairwise masks with every neighbour whose pair it holds: the server
  // forwards the pairs of exactly the clients that sent theirs, and sums y_v
  // only of clients no neighbour rejected, so among the survivors the
  // relation is symmetric. + when this client's index is the smaller.
  for (const auto& [v, pair] : c.held) {
    const Secret s = derive_key(c.mask.sk, c.peers.at(v).mask_key, "sparrow-secagg-mask", c.round, c.setup.index, v);
    add_prg(x.data(), x.size(), s, /*subtract=*/c.setup.index > v);
  }
  c.masked_sent = true;
  wire::SecAgg m = c.msg(wire::SecAggStage::kMasked);
  m.masked = std::move(x);
  m.metrics = std::move(metrics);
  m.rejected = c.rejected;
  return m;
}

wire::SecAgg Client::reveal(const wire::SecAgg& in) {
  Impl& c = *impl_;
  check_stage(in, wire::SecAggStage::kUnmask, c.round);
  SPARROW_CHECK(!c.revealed,
                "secagg: refused a second unmask request for round " << c.round << " (each client reveals once)");
  SPARROW_CHECK(c.masked_sent, "secagg: unmask request before this client sent its masked update");
  const std::set<uint32_t> surv(in.survivors.begin(), in.survivors.end());
  const std::set<uint32_t> drop(in.dropped.begin(), in.dropped.end());
  for (uint32_t u : drop)
    SPARROW_CHECK(!surv.count(u), "secagg: refused: client " << u
                                                             << " is listed as survivor and as dropped (revealing "
                                                                "both its shares would expose its update)");
  SPARROW_CHECK(drop.count(c.setup.index) == 0 && surv.count(c.setup.index) == 1,
                "secagg: refused: this client sent its masked update but is not listed among the survivors");
  for (uint32_t u : surv)
    SPARROW_CHECK(u == c.setup.index || c.held.count(u), "secagg: refused: no shares held for client " << u);
  for (uint32_t u : drop) SPARROW_CHECK(c.held.count(u), "secagg: refused: no shares held for client " << u);
  c.revealed = true;
  wire::SecAgg out = c.msg(wire::SecAggStage::kReveal);
  for (uint32_t u : surv)
    if (u != c.setup.index) out.shares.push_back({u, 1, c.held.at(u).first});
  for (uint32_t u : drop) out.shares.push_back({u, 2, c.held.at(u).second});
  return out;
}

// ---- Server ------------------------------------------------------------------------

struct Server::Impl {
  Params params;
  uint64_t round;
  uint32_t n, t;
  Graph graph;
  size_t length;
  enum Stage { kKeys, kShares, kMasked, kReveal, kDone } stage = kKeys;
  std::map<uint32_t, wire::SecAggPeer> keys;                    // U1
  std::map<uint32_t, std::vector<wire::SecAggShare>> outgoing;  // U2: sender -> its pairs
  std::set<uint32_t> u1, u2, u3;
  std::vector<uint32_t> sum;
  std::map<uint32_t, std::map<uint32_t, std::string>> b_shares, s_shares;  // owner -> holder -> share
  std::set<uint32_t> revealed;
  std::set<uint32_t> out;                              // excluded (exclude())
  std::map<uint32_t, std::vector<uint32_t>> pending;   // masked updates not yet in the sum
  std::map<uint32_t, std::set<uint32_t>> rejected_by;  // sender of Masked -> neighbours it rejected
  std::map<uint32_t, std::set<uint32_t>> reported;     // rejected client -> who rejected it
  std::set<uint32_t> summed;                           // S: y_u in the sum
  bool reconstructed = false;                          // reconstruct() ran
  std::map<uint32_t, Secret> b_secret, s_secret;       // reconstruct(): self-mask seeds of S, mask keys of U2 \ S
  std::map<uint32_t, std::set<uint32_t>> wrong;        // holder -> clients whose share it revealed wrong
  std::string failure;                                 // why reconstruct() failed

  Impl(const Params& p, uint64_t r, uint32_t clients, uint64_t seed, size_t len)
      : params(p),
        round(r),
        n(clients),
        t(p.effective_threshold()),
        graph(clients, p.degree_for(clients), seed),
        length(len) {}
  ~Impl() {
    for (auto* m : {&b_secret, &s_secret})
      for (auto& kv : *m) sodium_memzero(kv.second.data(), kv.second.size());
  }

  // The neighbours of u in `set`.
  std::vector<uint32_t> among(uint32_t u, const std::set<uint32_t>& set) const {
    std::vector<uint32_t> out;
    for (uint32_t v : graph.neighbours(u))
      if (set.count(v)) out.push_back(v);
    return out;
  }
  // Whether survivor w masked with (and holds the pair of) neighbour d.
  bool holds(uint32_t w, uint32_t d) const {
    auto it = rejected_by.find(w);
    return it == rejected_by.end() || !it->second.count(d);
  }
  // The survivors that masked with dropped client d.
  std::vector<uint32_t> maskers(uint32_t d) const {
    std::vector<uint32_t> v;
    for (uint32_t w : among(d, summed))
      if (holds(w, d)) v.push_back(w);
    return v;
  }
  // Dropped clients (U2 \ S) whose pairwise masks are in the sum.
  std::vector<uint32_t> dropped_needed() const {
    std::vector<uint32_t> v;
    for (uint32_t u : u2)
      if (!summed.count(u) && !maskers(u).empty()) v.push_back(u);
    return v;
  }
  void add_to_sum(uint32_t u, const std::vector<uint32_t>& y) {
    uint32_t* d = sum.data();
    for (size_t i = 0; i < length; ++i) d[i] += y[i];  // mod 2^32
    summed.insert(u);
  }
  // Sums or discards the pending updates whose fate is known: discarded when
  // a neighbour rejected the sender or it was excluded, summed once every
  // neighbour in U2 has answered (or at the close, `closing`).
  void settle(bool closing) {
    for (auto it = pending.begin(); it != pending.end();) {
      const uint32_t u = it->first;
      bool known = closing;
      if (!known) {
        known = true;
        for (uint32_t v : among(u, u2)) known = known && (u3.count(v) || out.count(v));
      }
      if (reported.count(u) || out.count(u)) {
        it = pending.erase(it);
      } else if (known) {
        add_to_sum(u, it->second);
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
  }
  void check_from(uint32_t from, const wire::SecAgg& m) const {
    SPARROW_CHECK(from >= 1 && from <= n, "secagg: client index " << from << " outside 1.." << n);
    SPARROW_CHECK(m.index == from, "secagg: message says index " << m.index << ", the sender is " << from);
    SPARROW_CHECK(!out.count(from), "secagg: client " << from << " is excluded from round " << round);
  }
};

Server::Server(const Params& params, uint64_t round, uint32_t n, uint64_t graph_seed, size_t length) : impl_(nullptr) {
  init_sodium();
  SPARROW_CHECK(params.enabled, "secagg: not enabled");
  SPARROW_CHECK(n >= params.min_clients(), "secagg: " << n << " clients in the round, threshold "
                                                      << params.effective_threshold() << " needs "
                                                      << params.min_clients());
  impl_ = new Impl(params, round, n, graph_seed, length);
}
Server::~Server() { delete impl_; }
uint32_t Server::threshold() const { return impl_->t; }
uint32_t Server::degree() const { return impl_->params.degree_for(impl_->n); }
const Graph& Server::graph() const { return impl_->graph; }
const std::set<uint32_t>& Server::keyed() const { return impl_->u1; }
const std::set<uint32_t>& Server::shared() const { return impl_->u2; }
const std::set<uint32_t>& Server::masked() const { return impl_->u3; }
const std::set<uint32_t>& Server::revealed() const { return impl_->revealed; }
const std::set<uint32_t>& Server::survivors() const { return impl_->summed; }
const std::map<uint32_t, std::set<uint32_t>>& Server::reported() const { return impl_->reported; }

void Server::exclude(uint32_t from) {
  Impl& s = *impl_;
  if (from < 1 || from > s.n) return;
  s.out.insert(from);
  if (s.stage == Impl::kMasked) s.settle(false);
}
bool Server::excluded(uint32_t from) const { return impl_->out.count(from) > 0; }

bool Server::open_for(wire::SecAggStage stage) const {
  switch (impl_->stage) {
    case Impl::kKeys:
      return stage == wire::SecAggStage::kKeys;
    case Impl::kShares:
      return stage == wire::SecAggStage::kShares;
    case Impl::kMasked:
      return stage == wire::SecAggStage::kMasked;
    case Impl::kReveal:
      return stage == wire::SecAggStage::kReveal;
    default:
      return false;
  }
}

bool Server::stage_complete() const {
  const Impl& s = *impl_;
  auto all = [&](const std::set<uint32_t>& from, const std::set<uint32_t>& answered) {
    for (uint32_t u : from)
      if (!answered.count(u) && !s.out.count(u)) return false;
    return true;
  };
  switch (s.stage) {
    case Impl::kKeys: {
      for (uint32_t u = 1; u <= s.n; ++u)
        if (!s.u1.count(u) && !s.out.count(u)) return false;
      return true;
    }
    case Impl::kShares:
      return all(s.u1, s.u2);
    case Impl::kMasked:
      return all(s.u2, s.u3);
    case Impl::kReveal:
      return all(s.summed, s.revealed);
    default:
      return true;
  }
}

void Server::add_keys(uint32_t from, const wire::SecAgg& m) {
  Impl& s = *impl_;
  check_stage(m, wire::SecAggStage::kKeys, s.round);
  s.check_from(from, m);
  SPARROW_CHECK(s.stage == Impl::kKeys, "secagg: the keys exchange of round " << s.round << " is closed");
  SPARROW_CHECK(!s.u1.count(from), "secagg: client " << from << " already sent its keys");
  SPARROW_CHECK(m.peers.size() == 1 && m.peers[0].index == from, "secagg: Keys must carry the sender's own keys");
  SPARROW_CHECK(
      usable_key(m.peers[0].enc_key) && usable_key(m.peers[0].mask_key) && m.peers[0].enc_key != m.peers[0].mask_key,
      "secagg: client " << from << " sent an unusable public key (low-order point, or both keys equal)");
  for (const auto& [v, p] : s.keys)
    SPARROW_CHECK(p.enc_key != m.peers[0].enc_key && p.mask_key != m.peers[0].mask_key &&
                      p.enc_key != m.peers[0].mask_key && p.mask_key != m.peers[0].enc_key,
                  "secagg: client " << from << " sent a public key client " << v << " already sent");
  s.keys[from] = m.peers[0];
  s.u1.insert(from);
}

std::map<uint32_t, wire::SecAgg> Server::neighbour_messages() {
  Impl& s = *impl_;
  SPARROW_CHECK(s.stage == Impl::kKeys, "secagg: the keys exchange is already closed");
  s.stage = Impl::kShares;
  std::map<uint32_t, wire::SecAgg> out;
  for (uint32_t u : s.u1) {
    wire::SecAgg m;
    m.round = s.round;
    m.stage = wire::SecAggStage::kNeighbours;
    m.index = u;
    for (uint32_t v : s.among(u, s.u1)) m.peers.push_back(s.keys.at(v));
    out.emplace(u, std::move(m));
  }
  return out;
}

void Server::add_shares(uint32_t from, const wire::SecAgg& m) {
  Impl& s = *impl_;
  check_stage(m, wire::SecAggStage::kShares, s.round);
  s.check_from(from, m);
  SPARROW_CHECK(s.stage == Impl::kShares, "secagg: the shares exchange of round " << s.round << " is not open");
  SPARROW_CHECK(s.u1.count(from), "secagg: client " << from << " sent no keys");
  SPARROW_CHECK(!s.u2.count(from), "secagg: client " << from << " already sent its shares");
  const std::vector<uint32_t> want = s.among(from, s.u1);
  std::vector<uint32_t> got;
  for (const auto& sh : m.shares) {
    SPARROW_CHECK(sh.kind == 0, "secagg: Shares carries encrypted pairs only");
    got.push_back(sh.peer);
  }
  std::sort(got.begin(), got.end());
  SPARROW_CHECK(got == want, "secagg: client " << from << " must send one pair to each of its neighbours {"
                                               << join(want) << "}, sent to {" << join(got) << "}");
  s.outgoing[from] = m.shares;
  s.u2.insert(from);
}

std::map<uint32_t, wire::SecAgg> Server::shares_in_messages() {
  Impl& s = *impl_;
  SPARROW_CHECK(s.stage == Impl::kShares, "secagg: the shares exchange is not open");
  s.stage = Impl::kMasked;
  std::map<uint32_t, wire::SecAgg> out;
  for (uint32_t v : s.u2) {
    wire::SecAgg m;
    m.round = s.round;
    m.stage = wire::SecAggStage::kSharesIn;
    m.index = v;
    out.emplace(v, std::move(m));
  }
  for (const auto& [u, pairs] : s.outgoing)
    for (const auto& sh : pairs) {
      auto it = out.find(sh.peer);
      if (it != out.end()) it->second.shares.push_back({u, 0, sh.data});
    }
  s.outgoing.clear();
  s.sum.assign(s.length, 0);
  return out;
}

void Server::add_masked(uint32_t from, const wire::SecAgg& m) {
  Impl& s = *impl_;
  check_stage(m, wire::SecAggStage::kMasked, s.round);
  s.check_from(from, m);
  SPARROW_CHECK(s.stage == Impl::kMasked, "secagg: masked updates of round " << s.round << " are not accepted now");
  SPARROW_CHECK(s.u2.count(from), "secagg: client " << from << " sent no shares");
  SPARROW_CHECK(!s.u3.count(from), "secagg: client " << from << " already sent its masked update");
  SPARROW_CHECK(m.masked.size() == s.length,
                "secagg: masked update of " << m.masked.size() << " elements, the model has " << s.length);
  for (uint32_t v : m.rejected)
    SPARROW_CHECK(s.graph.linked(from, v) && s.u2.count(v),
                  "secagg: client " << from << " rejects client " << v << ", which sent it no pair");
  s.u3.insert(from);
  if (!m.rejected.empty()) s.rejected_by[from].insert(m.rejected.begin(), m.rejected.end());
  for (uint32_t v : m.rejected) s.reported[v].insert(from);
  s.pending[from] = m.masked;
  s.settle(false);
}

std::map<uint32_t, wire::SecAgg> Server::unmask_messages() {
  Impl& s = *impl_;
  SPARROW_CHECK(s.stage == Impl::kMasked, "secagg: the masked exchange is not open");
  s.settle(true);
  s.stage = Impl::kReveal;
  std::map<uint32_t, wire::SecAgg> out;
  for (uint32_t v : s.summed) {
    wire::SecAgg m;
    m.round = s.round;
    m.stage = wire::SecAggStage::kUnmask;
    m.index = v;
    m.survivors.push_back(v);
    for (uint32_t u : s.among(v, s.u2)) {
      if (s.summed.count(u))
        m.survivors.push_back(u);  // holds u's pair: else u would be reported, not summed
      else if (s.holds(v, u))
        m.dropped.push_back(u);
    }
    out.emplace(v, std::move(m));
  }
  return out;
}

void Server::add_reveal(uint32_t from, const wire::SecAgg& m) {
  Impl& s = *impl_;
  check_stage(m, wire::SecAggStage::kReveal, s.round);
  s.check_from(from, m);
  SPARROW_CHECK(s.stage == Impl::kReveal, "secagg: reveals of round " << s.round << " are not accepted now");
  SPARROW_CHECK(s.summed.count(from), "secagg: client " << from << " is not a survivor");
  SPARROW_CHECK(!s.revealed.count(from), "secagg: client " << from << " already revealed");
  std::set<std::pair<uint32_t, uint8_t>> seen;
  for (const auto& sh : m.shares) {
    SPARROW_CHECK(s.graph.linked(from, sh.peer) && s.u2.count(sh.peer) && s.holds(from, sh.peer),
                  "secagg: client " << from << " revealed a share of client " << sh.peer << ", not asked for");
    SPARROW_CHECK(sh.kind == (s.summed.count(sh.peer) ? 1 : 2),
                  "secagg: client " << from << " revealed the wrong kind of share of client " << sh.peer);
    SPARROW_CHECK(sh.data.size() == kShareBytes, "secagg: a revealed share must be " << kShareBytes << " bytes");
    SPARROW_CHECK(seen.insert({sh.peer, sh.kind}).second, "secagg: share of client " << sh.peer << " repeated");
  }
  for (const auto& sh : m.shares) (sh.kind == 1 ? s.b_shares : s.s_shares)[sh.peer][from] = sh.data;
  s.revealed.insert(from);
}

bool Server::can_unmask() const {
  const Impl& s = *impl_;
  if (s.stage != Impl::kReveal || s.summed.empty()) return false;
  for (uint32_t u : s.summed) {
    auto it = s.b_shares.find(u);
    if (it == s.b_shares.end() || it->second.size() < s.t) return false;
  }
  for (uint32_t u : s.dropped_needed()) {
    auto it = s.s_shares.find(u);
    if (it == s.s_shares.end() || it->second.size() < s.t) return false;
  }
  return true;
}

std::string Server::missing() const {
  const Impl& s = *impl_;
  std::ostringstream os;
  if (s.summed.empty()) return "no masked update arrived";
  auto count = [&](const std::map<uint32_t, std::map<uint32_t, std::string>>& m, uint32_t u) -> size_t {
    auto it = m.find(u);
    return it == m.end() ? 0 : it->second.size();
  };
  for (uint32_t u : s.summed)
    if (count(s.b_shares, u) < s.t)
      os << (os.tellp() ? "; " : "") << "client " << u << ": " << count(s.b_shares, u) << " of " << s.t
         << " self-mask shares";
  for (uint32_t u : s.dropped_needed())
    if (count(s.s_shares, u) < s.t)
      os << (os.tellp() ? "; " : "") << "dropped client " << u << ": " << count(s.s_shares, u) << " of " << s.t
         << " mask-key shares";
  return os.str();
}

bool Server::reconstruct() {
  Impl& s = *impl_;
  SPARROW_CHECK(can_unmask(), "secagg: cannot unmask round " << s.round << ": " << missing());
  if (s.reconstructed) return s.failure.empty();
  std::ostringstream fail;
  // The secret of `owner` from its holders' shares; records wrong holders.
  auto solve = [&](uint32_t owner, const std::map<uint32_t, std::string>& by_holder,
                   const char* what) -> std::optional<Secret> {
    std::vector<uint32_t> holders;
    std::vector<std::string> shares;
    for (const auto& [holder, sh] : by_holder) {
      holders.push_back(holder);
      shares.push_back(sh);
    }
    std::vector<size_t> off;
    std::optional<Secret> secret = shamir_combine_robust(shares, s.t, &off);
    for (size_t k : off) s.wrong[holders[k]].insert(owner);
    if (!secret)
      fail << (fail.tellp() ? "; " : "") << "the " << shares.size() << " " << what << " shares of client " << owner
           << " disagree beyond correction (" << s.t << " needed; a wrong one is outvoted only with at least "
           << s.t + 2 << ")";
    return secret;
  };
  for (uint32_t u : s.summed)
    if (auto b = solve(u, s.b_shares.at(u), "self-mask")) s.b_secret[u] = *b;
  for (uint32_t u : s.dropped_needed()) {
    std::optional<Secret> sk = solve(u, s.s_shares.at(u), "mask-key");
    if (!sk) continue;
    uint8_t pk[crypto_scalarmult_BYTES];
    crypto_scalarmult_base(pk, sk->data());
    if (sodium_memcmp(pk, u8(s.keys.at(u).mask_key), sizeof pk) != 0) {
      // The shares agree with each other but not with the public key: too
      // many of them are wrong to tell which (or exactly t were revealed).
      fail << (fail.tellp() ? "; " : "") << "the mask key of dropped client " << u
           << " reconstructs wrong (a wrong share among " << s.s_shares.at(u).size() << ")";
      continue;
    }
    s.s_secret[u] = *sk;
  }
  s.reconstructed = true;
  s.failure = fail.str();
  return s.failure.empty();
}

const std::map<uint32_t, std::set<uint32_t>>& Server::wrong_shares() const { return impl_->wrong; }
std::string Server::failure() const { return impl_->failure; }

std::vector<uint32_t> Server::unmask() {
  Impl& s = *impl_;
  SPARROW_CHECK(can_unmask(), "secagg: cannot unmask round " << s.round << ": " << missing());
  SPARROW_CHECK(reconstruct(), "secagg: cannot unmask round " << s.round << ": " << s.failure);
  std::vector<uint32_t> sum = s.sum;
  for (uint32_t u : s.summed) {
    Secret& b = s.b_secret.at(u);
    add_prg(sum.data(), sum.size(), b, /*subtract=*/true);
    sodium_memzero(b.data(), b.size());
  }
  for (uint32_t u : s.dropped_needed()) {
    Secret& sk = s.s_secret.at(u);
    const std::string sks = bytes(sk.data(), sk.size());
    for (uint32_t v : s.maskers(u)) {
      // v added +PRG(s_uv) when v < u, -PRG(s_uv) otherwise: take it out.
      const Secret m = derive_key(sks, s.keys.at(v).mask_key, "sparrow-secagg-mask", s.round, u, v);
      add_prg(sum.data(), sum.size(), m, /*subtract=*/v < u);
    }
    sodium_memzero(sk.data(), sk.size());
  }
  s.stage = Impl::kDone;
  s.sum.clear();
  s.sum.shrink_to_fit();
  return sum;
}

}  // namespace sparrow::secagg
