#pragma once
// SecAgg+ (Bell et al., CCS 2020; after Bonawitz et al., CCS 2017): the
// aggregator learns the sum of the round's updates, never one client's.
// docs/security.md has the protocol, the threat model and the parameters.
//
// A round of n selected clients (indices 1..n) runs four exchanges, each a
// wire::SecAgg message of the stage named:
//   1. Keys:     every client sends two fresh X25519 public keys; the server
//                answers each with its neighbours' keys (Neighbours). The
//                neighbours are a random k-regular graph: the clients on a
//                ring in a seeded random order, k/2 on each side.
//   2. Shares:   every client draws a self-mask seed b_u, Shamir-shares b_u
//                and its mask secret key t-of-k among its neighbours, and
//                sends each neighbour its pair encrypted (ChaCha20-Poly1305
//                under a ristretto255 key agreement) with digests of the two
//                shares, and a commitment to b_u; the server keeps those and
//                routes the pairs (SharesIn). secagg/verify.h.
//   3. Masked:   every client sends y_u = x_u + PRG(b_u) + sum over neighbours
//                v whose pair it holds of +-PRG(s_uv) mod 2^32, x_u its update
//                quantised into the ring (PRG = ChaCha20), and names the
//                neighbours whose pair was bad (rejected), each with evidence
//                that lets the server open that pair and see who lied
//                (docs/security.md, "One bad participant").
//   4. Unmask:   the server tells each survivor which neighbours sent y and
//                which did not; the survivor reveals its share of b_u for the
//                former and of the mask key for the latter (Reveal), never
//                both for one client. With t shares per secret that match
//                their digests (and a secret that matches its commitment)
//                the server removes the self-masks of survivors and the
//                pairwise masks of dropped clients: what is left is sum x_u.
//
// Client and Server are the protocol without transport: sparrow-client and
// sparrow-server carry their messages over ZeroMQ, the simulator hands them
// over in memory. Neither is thread-safe; every failure is a sparrow::Error
// whose message names the check (a peer's bad message changes nothing).

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "wire/wire.h"

namespace sparrow::secagg {

// The `secagg` setting: "none", or
// "secagg+:degree=K,threshold=T,clip=C,timeout=S" (every key optional).
struct Params {
  bool enabled = false;
  uint32_t degree = 16;    // k: neighbours per client (even, 2..254); a round of n <= k clients is complete
  uint32_t threshold = 0;  // t: shares that reconstruct a secret, 2..k; 0 = k/2 + 1
  double clip = 4;         // update coordinates are clipped to [-clip, clip]
  double timeout_s = 10;   // how long the server waits in each short exchange (keys, shares, unmask)
  // ConfigError naming the key for a bad value or an unknown key.
  static Params parse(const std::string& spec);
  uint32_t effective_threshold() const { return threshold ? threshold : degree / 2 + 1; }
  // The round's graph degree: k, or n - 1 when the ring has no more clients.
  uint32_t degree_for(uint32_t n) const { return n - 1 < degree ? n - 1 : degree; }
  // The fewest selected clients a round may have: t + 1.
  uint32_t min_clients() const { return effective_threshold() + 1; }
  std::string text() const;
};

// What secure aggregation composes with (ConfigError saying why otherwise):
// the uplink compressor "none" (a masked update is a dense vector of 32-bit
// ring elements whatever the compressor, and a sparse update's positions
// would be masked into a dense one), the "mean" aggregator (robust
// aggregators need each update, which the server never sees), dp "none" or
// client-side ("local:...": clients add their noise before masking), and the
// fedavg / fedprox algorithms (SCAFFOLD's per-client control deltas would go
// in the clear).
void check_compatible(const std::string& compression, const std::string& aggregator, const std::string& dp,
                      const std::string& algorithm);

// The neighbour graph of a round: clients 1..n on a ring in the order drawn
// from `seed`, each linked to the degree/2 nearest on both sides (everyone
// when degree >= n - 1).
class Graph {
 public:
  Graph(uint32_t n, uint32_t degree, uint64_t seed);
  // Sorted, without `index`.
  const std::vector<uint32_t>& neighbours(uint32_t index) const;
  bool linked(uint32_t a, uint32_t b) const;
  uint32_t size() const { return n_; }

 private:
  uint32_t n_;
  std::vector<std::vector<uint32_t>> adj_;  // adj_[i - 1]
};

// ---- the ring Z_{2^32} --------------------------------------------------------

// Fixed-point scale for n clients and a clip: the sum of n weighted,
// clipped, stochastically rounded coordinates (weights summing to <= 1)
// stays inside the int32 range, so the sum mod 2^32 is exact.
double ring_scale(uint32_t n, double clip);
// out[i] = round_stochastic(weight * clamp(x[i], -clip, clip) * scale) mod 2^32,
// the rounding drawn from `key`. Returns how many coordinates were clipped.
// x must be finite (sparrow::Error naming the first coordinate otherwise).
size_t quantise(const float* x, size_t n, double weight, double clip, double scale, uint64_t key, uint32_t* out);
// out[i] = int32(sum[i]) / scale.
void dequantise(const uint32_t* sum, size_t n, double scale, float* out);

// ---- building blocks (exposed for tests) -----------------------------------------

using Secret = std::array<uint8_t, 32>;
// v[i] += sign * the i-th 32-bit word of ChaCha20(key = seed, nonce = 0).
void add_prg(uint32_t* v, size_t n, const Secret& seed, bool subtract);
// Shamir t-of-m over GF(2^8), byte-wise (secagg/shamir.cc): one share per x
// in xs (distinct, non-zero); a share is kShareBytes, x then y.
constexpr size_t kShareBytes = 33;
std::vector<std::string> shamir_split(const Secret& secret, uint32_t t, const std::vector<uint8_t>& xs);
// The secret from t or more shares of distinct x (uses the first t).
Secret shamir_combine(const std::vector<std::string>& shares, uint32_t t);
// The secret from m >= t shares of distinct x of which some may be wrong
// (well-formed but off the dealer's polynomial: a lying holder). Unique
// decoding: a polynomial of degree < t that agrees with at least
// ceil((m + t) / 2) of the shares is the only one that can, so it is the
// dealer's whenever at most (m - t) / 2 shares are wrong. `wrong` (if given)
// gets the indices of the shares off it. nullopt when no polynomial agrees
// with that many: more wrong shares than the redundancy corrects. So m = t
// detects nothing, m = t + 1 detects one wrong share, m = t + 2 corrects one.
// Cost: one interpolation when all shares agree; otherwise a search over
// t-subsets (filtered on one byte), at most kMaxSubsets of them.
constexpr uint64_t kMaxSubsets = 200000;
std::optional<Secret> shamir_combine_robust(const std::vector<std::string>& shares, uint32_t t,
                                            std::vector<size_t>* wrong = nullptr);

// ---- the parties --------------------------------------------------------------------

class Client {
 public:
  // `setup` from the Task (parse() checked its ranges).
  Client(const wire::SecAggSetup& setup, uint64_t round, std::string client_id);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Stage 1: fresh key pairs; the Keys message.
  wire::SecAgg keys();
  // Stage 2: Neighbours in, Shares out. Refuses keys of clients that are not
  // its neighbours in the round's graph, repeated or reflected keys, and fewer
  // than t neighbours (its own update could not be unmasked).
  wire::SecAgg shares(const wire::SecAgg& neighbours);
  // Stage 2 -> 3: the encrypted pairs addressed to it. A pair that is
  // malformed, does not decrypt, names other parties or comes twice is not
  // an error of this client: its sender is rejected (no shares held, no mask
  // with it, named in the Masked message). Returns the rejected neighbours,
  // each with why. Throws only for a message the server got wrong (stage,
  // order, a pair from a client that sent no keys).
  std::map<uint32_t, std::string> receive_shares(const wire::SecAgg& shares_in);
  // Stage 3: its quantised update (quantise()), masked. The ring vector is
  // the caller's; metrics travel in the clear.
  wire::SecAgg masked(std::vector<uint32_t> x, std::vector<std::pair<std::string, double>> metrics = {});
  // Stage 4: Unmask in, Reveal out. Refuses (sparrow::Error) a second request
  // of the round, a request that names a client as survivor and dropped, one
  // without itself among the survivors, and clients it holds no shares of:
  // no server can obtain both shares of one client from it.
  wire::SecAgg reveal(const wire::SecAgg& unmask);

  uint32_t index() const;
  uint64_t round() const;
  const wire::SecAggSetup& setup() const;

 private:
  struct Impl;
  Impl* impl_;
};

// A client the server's own checks found cheating, and at which stage: each
// finding reads `what` + the clients + `why` ("it revealed a wrong share of
// client" 1,3 ""). text() names the clients as the caller does (ids, keys).
struct Offence {
  struct Finding {
    std::string what;
    std::vector<uint32_t> clients;
    std::string why;
  };
  const char* stage = "";  // "shares", "masked" or "reveal": the first finding's
  std::vector<Finding> findings;
  std::string text(const std::function<std::string(uint32_t)>& name) const;
};

class Server {
 public:
  // `length`: ring elements of a masked update (the model's parameters).
  Server(const Params& params, uint64_t round, uint32_t n, uint64_t graph_seed, size_t length);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  uint32_t threshold() const;
  uint32_t degree() const;
  const Graph& graph() const;

  // Each add_* checks the message against the stage and the graph, and
  // changes nothing when it throws (sparrow::Error).
  void add_keys(uint32_t from, const wire::SecAgg& m);
  // Closes stage 1: U1 = the senders of keys. One Neighbours per member.
  std::map<uint32_t, wire::SecAgg> neighbour_messages();
  // A share pair for every neighbour in U1, nothing else.
  void add_shares(uint32_t from, const wire::SecAgg& m);
  // Closes stage 2: U2 = the senders of shares. One SharesIn per member.
  std::map<uint32_t, wire::SecAgg> shares_in_messages();
  // Takes y_u; it joins the running sum once every neighbour in U2 has sent
  // its own masked update without rejecting u (or at the close of the stage),
  // so memory is O(length) plus the updates whose neighbours are still
  // training. `m.rejected` must name neighbours in U2 only, each with
  // evidence (m.evidence) that lets the server open that pair: a bad pair
  // takes its sender out of the sum, a good one makes the sender of `m` an
  // offender taken out of the round instead (offenders()).
  void add_masked(uint32_t from, const wire::SecAgg& m);
  // Closes stage 3: the survivors S = the senders of masked updates that no
  // neighbour rejected and that were not excluded; only their y_u are in the
  // sum. One Unmask per member of S: its neighbours in S, and the dropped
  // ones (U2 \ S) whose pair it holds.
  std::map<uint32_t, wire::SecAgg> unmask_messages();
  void add_reveal(uint32_t from, const wire::SecAgg& m);
  // Every self-mask of U3 and every mask key of U2 \ U3 needed has t shares.
  bool can_unmask() const;
  // Reconstructs every secret unmask() needs from the revealed shares that
  // match the digests their dealer published with its pairs (Shares), so a
  // survivor that revealed a wrong share (well formed, not the one it was
  // dealt) is named however many holders there are, and never folded; each
  // secret is then checked against its dealer's seed commitment or mask
  // public key. False when some secret has fewer than t shares that match,
  // or fails its check: failure() says which. Needs can_unmask().
  bool reconstruct();
  // Holder -> the clients whose share it revealed wrong (after reconstruct()).
  const std::map<uint32_t, std::set<uint32_t>>& wrong_shares() const;
  std::string failure() const;
  // Clients proven to cheat, each once with every reason: a sender of a bad
  // pair (shown by its receiver's evidence, add_masked), a receiver that
  // rejected a good pair (it leaves the round, a dropout; its rejection of
  // the good pair counts for nothing), a holder of wrong revealed shares and
  // a dealer of shares that do not reconstruct its commitment (reconstruct()).
  const std::map<uint32_t, Offence>& offenders() const;
  // The unmasked sum of U3's quantised updates (calls reconstruct() if not
  // done); sparrow::Error when a secret lacks shares or cannot be reconstructed.
  std::vector<uint32_t> unmask();

  // Takes `from` out of the round after it broke the protocol (a refused
  // message in its open stage): later messages from it are refused, it no
  // longer holds up stage_complete(), and a masked update of its that is not
  // yet in the sum never will be. One already summed stays (it is a survivor).
  void exclude(uint32_t from);
  bool excluded(uint32_t from) const;
  // Whether `stage` is the exchange open now: a message of another stage is
  // late or early (a straggler, not a protocol breach).
  bool open_for(wire::SecAggStage stage) const;
  // Every client the open exchange waits for has answered or is excluded.
  bool stage_complete() const;

  const std::set<uint32_t>& keyed() const;      // U1
  const std::set<uint32_t>& shared() const;     // U2
  const std::set<uint32_t>& masked() const;     // U3: masked updates accepted (summed or not)
  const std::set<uint32_t>& survivors() const;  // S, after unmask_messages()
  const std::set<uint32_t>& revealed() const;   // members of S whose reveal arrived
  // Clients rejected by neighbours in their Masked messages: client -> who.
  const std::map<uint32_t, std::set<uint32_t>>& reported() const;
  // Reveals missing, for a log line: "client 4: 1 of 3 self-mask shares".
  std::string missing() const;

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace sparrow::secagg
