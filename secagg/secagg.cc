#include "secagg/secagg.h"

#include <sodium.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <sstream>

#include "core/error.h"
#include "secagg/sodium_init.h"
#include "secagg/verify.h"

namespace sparrow::secagg {
namespace {

Secret random_secret() {
  Secret s;
  randombytes_buf(s.data(), s.size());
  return s;
}

std::string bytes(const uint8_t* p, size_t n) { return std::string(reinterpret_cast<const char*>(p), n); }
const uint8_t* u8(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

// The pairwise mask seed: kdf() of the X25519 agreement of two mask keys.
Secret derive_key(const std::string& secret_key, const std::string& public_key, const char* label, uint64_t round,
                  uint32_t a, uint32_t b) {
  uint8_t q[crypto_scalarmult_BYTES];
  SPARROW_CHECK(crypto_scalarmult(q, u8(secret_key), u8(public_key)) == 0, "secagg: key agreement with client "
                                                                               << (a == b ? a : std::max(a, b))
                                                                               << " failed (a low-order public key)");
  const Secret k = kdf(q, label, round, a, b);
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

std::string Offence::text(const std::function<std::string(uint32_t)>& name) const {
  std::string out;
  for (const Finding& f : findings) {
    out += (out.empty() ? "" : "; ") + f.what;
    for (size_t i = 0; i < f.clients.size(); ++i) out += (i ? "," : " ") + name(f.clients[i]);
    out += f.why;
  }
  return out;
}

// ---- Client ------------------------------------------------------------------------

struct Client::Impl {
  wire::SecAggSetup setup;
  uint64_t round;
  std::string client_id;
  Graph graph;
  EncKeyPair enc;  // share encryption (ristretto255: a rejection can be proven)
  KeyPair mask;
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
  uint8_t x_of(uint32_t owner, uint32_t holder) const { return share_x(graph, owner, holder); }
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
  c.enc = EncKeyPair::fresh();
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
  // The commitment and the digests let the server check every share it is
  // later revealed, and the seed it reconstructs (docs/security.md).
  out.commitment = seed_commitment(c.b, c.round, c.setup.index);
  size_t i = 0;
  for (const auto& [v, p] : peers) {
    out.shares.push_back(
        {v, 0, seal_pair(c.enc.sk, p.enc_key, c.round, c.setup.index, v, bs[i], ss[i]),
         share_digest(bs[i], 1, c.round, c.setup.index, v) + share_digest(ss[i], 2, c.round, c.setup.index, v)});
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
  // A bad pair is its sender's fault: the sender is rejected, not this
  // client's round (masked() attaches the evidence the server checks).
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
    if (sh.kind != 0) {
      reject(sh.peer, "the pair from client " + std::to_string(sh.peer) + " is malformed");
      continue;
    }
    // An empty digest is an older server's (it checks no reveal either).
    OpenedPair o = open_pair(c.enc.sk, c.peers.at(sh.peer).enc_key, c.round, sh.peer, c.setup.index,
                             c.x_of(sh.peer, c.setup.index), sh.data, sh.digest);
    if (!o.error.empty())
      reject(sh.peer, o.error);
    else
      held.emplace(sh.peer, std::make_pair(std::move(o.b_share), std::move(o.s_share)));
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
  // Evidence for each rejection: the server opens that pair and sees who lied.
  for (uint32_t v : c.rejected) {
    try {
      m.evidence.push_back(
          {v, 0, make_evidence(c.enc.sk, c.enc.pk, c.peers.at(v).enc_key, c.round, v, c.setup.index), {}});
    } catch (const Error&) {
      // An unusable key: the server refuses those at the keys stage.
    }
  }
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
  std::map<uint32_t, wire::SecAggPeer> keys;                         // U1
  std::map<uint32_t, std::vector<wire::SecAggShare>> outgoing;       // U2: sender -> its pairs (until routed)
  std::map<std::pair<uint32_t, uint32_t>, wire::SecAggShare> pairs;  // (owner, holder) -> pair and digests
  std::map<uint32_t, std::string> commitment;                        // U2: owner -> its seed commitment
  std::map<uint32_t, Offence> offenders;                             // found by the server's own checks
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
  void blame(uint32_t u, const char* stage, std::string what, std::vector<uint32_t> whom, std::string why = "") {
    Offence& o = offenders[u];
    if (o.findings.empty()) o.stage = stage;
    o.findings.push_back({std::move(what), std::move(whom), std::move(why)});
  }
  // The dealer's digest of the share of `kind` it dealt holder (empty when none).
  std::string digest_of(uint32_t owner, uint32_t holder, uint8_t kind) const {
    auto it = pairs.find({owner, holder});
    if (it == pairs.end() || it->second.digest.size() != 2 * kDigestBytes) return {};
    return it->second.digest.substr(kind == 1 ? 0 : kDigestBytes, kDigestBytes);
  }
  std::string failure;  // why reconstruct() failed

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
  SPARROW_CHECK(usable_enc_key(m.peers[0].enc_key) && usable_key(m.peers[0].mask_key) &&
                    m.peers[0].enc_key != m.peers[0].mask_key,
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
  // Without the commitments no reveal could be checked: a client older than
  // protocol 1.8 cannot take part (docs/security.md).
  SPARROW_CHECK(m.commitment.size() == kDigestBytes,
                "secagg: Shares without the seed commitment (a client before protocol 1.8 cannot take part)");
  for (const auto& sh : m.shares) {
    SPARROW_CHECK(sh.kind == 0, "secagg: Shares carries encrypted pairs only");
    SPARROW_CHECK(sh.digest.size() == 2 * kDigestBytes,
                  "secagg: the pair to client " << sh.peer << " comes without the digests of its shares");
    got.push_back(sh.peer);
  }
  std::sort(got.begin(), got.end());
  SPARROW_CHECK(got == want, "secagg: client " << from << " must send one pair to each of its neighbours {"
                                               << join(want) << "}, sent to {" << join(got) << "}");
  s.outgoing[from] = m.shares;
  for (const auto& sh : m.shares) s.pairs[{from, sh.peer}] = sh;
  s.commitment[from] = m.commitment;
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
      if (it != out.end()) it->second.shares.push_back({u, 0, sh.data, sh.digest});
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
  // Each rejection comes with the key agreement of that one pair, proven: the
  // server opens the pair and decides who lied (nothing else is opened).
  std::map<uint32_t, std::string> evidence;
  for (const auto& e : m.evidence) {
    SPARROW_CHECK(
        std::find(m.rejected.begin(), m.rejected.end(), e.peer) != m.rejected.end(),
        "secagg: client " << from << " sent evidence against client " << e.peer << ", which it did not reject");
    SPARROW_CHECK(evidence.emplace(e.peer, e.data).second,
                  "secagg: client " << from << " sent evidence against client " << e.peer << " twice");
  }
  std::vector<uint32_t> bad_pair, good_pair;
  for (uint32_t v : m.rejected) {
    auto it = evidence.find(v);
    SPARROW_CHECK(it != evidence.end(), "secagg: client " << from << " rejects client " << v
                                                          << " without the evidence (a client before protocol 1.8?)");
    const std::optional<std::string> point =
        check_evidence(it->second, s.keys.at(from).enc_key, s.keys.at(v).enc_key, s.round, v, from);
    SPARROW_CHECK(point, "secagg: client " << from << " rejects client " << v << " with evidence that does not verify");
    const wire::SecAggShare& pair = s.pairs.at({v, from});
    const OpenedPair o =
        open_pair_with_point(*point, s.round, v, from, share_x(s.graph, v, from), pair.data, pair.digest);
    (o.error.empty() ? good_pair : bad_pair).push_back(v);
  }
  if (!good_pair.empty()) {
    // A false report: the accuser is the offender and leaves the round (a
    // dropout: its mask key is revealed, its update never summed); the
    // accused stay in. Its true reports, if any, still count.
    s.blame(from, "masked", "it falsely rejected the pair of client", good_pair,
            " (the pair opens and is well formed: checked with its own proof)");
    s.out.insert(from);
    for (uint32_t v : bad_pair) {
      s.reported[v].insert(from);
      s.blame(v, "shares", "its encrypted pair to client", {from}, " is bad (checked with that client's proof)");
    }
    s.settle(false);
    return;
  }
  s.u3.insert(from);
  if (!m.rejected.empty()) s.rejected_by[from].insert(m.rejected.begin(), m.rejected.end());
  for (uint32_t v : m.rejected) {
    s.reported[v].insert(from);
    s.blame(v, "shares", "its encrypted pair to client", {from}, " is bad (checked with that client's proof)");
  }
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
  // The secret of `owner` from the revealed shares that match the digests its
  // dealer published: a holder whose share does not is named, whatever the
  // number of holders. The secret is then checked against the dealer's own
  // commitment (`check`); with fewer than t matching shares, or a secret that
  // fails its check (a dealer whose shares are not on one polynomial), the
  // round is not unmasked.
  auto solve = [&](uint32_t owner, uint8_t kind, const std::map<uint32_t, std::string>& by_holder,
                   const std::function<bool(const Secret&)>& check) -> std::optional<Secret> {
    const char* what = kind == 1 ? "self-mask" : "mask-key";
    std::vector<std::string> good;
    for (const auto& [holder, sh] : by_holder) {
      const std::string want = s.digest_of(owner, holder, kind);
      if (!want.empty() && share_digest(sh, kind, s.round, owner, holder) == want)
        good.push_back(sh);
      else
        s.wrong[holder].insert(owner);
    }
    if (good.size() < s.t) {
      fail << (fail.tellp() ? "; " : "") << "client " << owner << ": " << good.size() << " of the " << by_holder.size()
           << " " << what << " shares revealed are the ones dealt, " << s.t << " needed";
      return std::nullopt;
    }
    Secret secret = shamir_combine(good, s.t);
    if (!check(secret)) {
      s.blame(owner, "reveal",
              std::string("the shares it dealt do not reconstruct the ") +
                  (kind == 1 ? "self-mask seed it committed to" : "mask key it sent"),
              {});
      fail << (fail.tellp() ? "; " : "") << "the " << what << " shares client " << owner
           << " dealt do not reconstruct its " << (kind == 1 ? "committed seed" : "public key");
      sodium_memzero(secret.data(), secret.size());
      return std::nullopt;
    }
    return secret;
  };
  for (uint32_t u : s.summed) {
    const std::string& c = s.commitment.at(u);
    auto b = solve(u, 1, s.b_shares.at(u), [&](const Secret& x) { return seed_commitment(x, s.round, u) == c; });
    if (b) s.b_secret[u] = *b;
  }
  for (uint32_t u : s.dropped_needed()) {
    const std::string& pk = s.keys.at(u).mask_key;
    auto sk = solve(u, 2, s.s_shares.at(u), [&](const Secret& x) {
      uint8_t got[crypto_scalarmult_BYTES];
      crypto_scalarmult_base(got, x.data());
      return sodium_memcmp(got, u8(pk), sizeof got) == 0;
    });
    if (sk) s.s_secret[u] = *sk;
  }
  for (const auto& [holder, owners] : s.wrong) {
    s.blame(holder, "reveal", "it revealed a wrong share of client", {owners.begin(), owners.end()});
  }
  s.reconstructed = true;
  s.failure = fail.str();
  return s.failure.empty();
}

const std::map<uint32_t, std::set<uint32_t>>& Server::wrong_shares() const { return impl_->wrong; }
std::string Server::failure() const { return impl_->failure; }
const std::map<uint32_t, Offence>& Server::offenders() const { return impl_->offenders; }

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
