#pragma once
// The client's half of a round, written once for sparrow-client (client/
// session.cc), the simulator's clients (simulator/clients.cc) and gateways:
// train -> client-side DP (local_dp_update) -> encode (make_update) or, under
// SecAgg+, quantise into the ring (quantise_update) -> the message. Also the
// task's seed and the codec context each client encodes with.
// docs/architecture.md, "One round engine".
//
// Keys: the functions take their random key from the caller. sparrow-client
// draws it from the device's own entropy (the server must not know the noise
// or the rounding); the simulator, which is server and clients at once,
// derives it from the run's seed (sim_local_dp_key, sim_secagg_key) so that a
// run is reproducible. Given the same inputs and key, both produce the same
// bytes.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "compression/compressor.h"
#include "compression/state.h"
#include "wire/wire.h"

namespace sparrow::federation {

// Seed of client `client_id`'s task in round r (1-based): its training's
// randomness (shuffling, dropout) and its codec's random streams.
uint64_t task_seed(uint64_t seed, uint64_t r, const std::string& client_id);

// The partition seed of a simulated run with this `seed`: a deployed client
// configured with `partition_seed` = this, the simulator's `partition`,
// `clients` and `index = c` holds the simulator's shard of client c.
uint64_t partition_seed(uint64_t seed);

// The id the simulator gives client c (what a deployed client of the same
// partition index is called in the parity tests): its decimal index.
std::string sim_client_id(int64_t c);

// What a client encodes tensor `name` with: the round's context (round,
// shared factor, mask, share_mean) with the task's seed and the number of
// clients selected (Task.clients; 0 = not said, taken as 1).
compression::Context client_context(compression::Context round_ctx, uint64_t task_seed, uint32_t clients);

// The update of one client: `delta` (after any local DP) encoded tensor by
// tensor in `names` order with `codec` and the client's codec states
// (advanced; created when missing), SCAFFOLD's control delta dense when
// given, and `metrics`. contexts: per tensor, from client_context().
wire::ModelUpdate make_update(uint64_t round, const std::string& client_id, int64_t num_samples,
                              const std::vector<std::string>& names, const std::map<std::string, at::Tensor>& delta,
                              const compression::Compressor& codec, std::map<std::string, compression::State>& states,
                              const std::map<std::string, compression::Context>& contexts,
                              const std::map<std::string, at::Tensor>& control_delta,
                              std::vector<std::pair<std::string, double>> metrics);

// Client-side (local) DP of an update, before it is encoded or quantised:
// every tensor of `delta` becomes CPU float32, the whole update (all tensors
// together) is clipped to L2 norm `clip`, and N(0, (noise * clip)^2) is added
// to every coordinate, coordinate i of the update (tensors in name order, as
// the map holds them) drawn from (key, i) (aggregation::local_dp). Same delta
// and key: the same bytes. Returns the update's norm before clipping.
double local_dp_update(std::map<std::string, at::Tensor>& delta, double clip, double noise, uint64_t key);

// A weighted update quantised into SecAgg+'s ring, ready to be masked
// (secagg::Client::masked).
struct RingUpdate {
  std::vector<uint32_t> x;  // the tensors of `names`, concatenated in that order
  size_t clipped = 0;       // coordinates clamped to +-clip
};

// SecAgg+ quantisation of `delta`: the tensors in `names` order, concatenated;
// tensor k's coordinates, at offset o_k in the concatenation, go through
// secagg::quantise(weight, clip, scale) with their stochastic rounding drawn
// from rng::derive(key, o_k). `weight` is this client's share of the round's
// samples (SecAggSetup.weight), `scale` secagg::ring_scale(clients, clip).
// sparrow::Error (secagg::quantise) for a non-finite coordinate.
RingUpdate quantise_update(const std::vector<std::string>& names, const std::map<std::string, at::Tensor>& delta,
                           double weight, double clip, double scale, uint64_t key);

// The simulator's keys for client c in round t (0-based), derived from the
// run's seed, each from a stream of its own: local DP's noise ("ldp ") and
// SecAgg's rounding ("seca", the stream the simulator's SecAgg+ round seeds
// also come from). Fixed since 1.0: a run's results depend on them.
uint64_t sim_local_dp_key(uint64_t seed, uint64_t t, int64_t c);
uint64_t sim_secagg_key(uint64_t seed, uint64_t t, int64_t c);

}  // namespace sparrow::federation
