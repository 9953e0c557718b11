#pragma once
// The client's half of a round, written once for sparrow-client (client/
// session.cc), the simulator's clients (simulator/simulator.cc) and gateways:
// the task's seed, the codec context each client encodes with, and the
// ModelUpdate it sends (encode tensor by tensor, SCAFFOLD's control delta,
// metrics). docs/architecture.md, "One round engine".

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

}  // namespace sparrow::federation
