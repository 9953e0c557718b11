#include "federation/client_pipeline.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "aggregation/robust.h"
#include "core/error.h"
#include "core/rng.h"
#include "secagg/secagg.h"

namespace sparrow::federation {

namespace {
constexpr uint64_t kTaskTag = 0x7461736b;       // "task": sparrow-server's task seeds since 1.0
constexpr uint64_t kPartitionTag = 0x70617274;  // "part": the simulator's partition since 1.0
constexpr uint64_t kLocalDpTag = 0x6c647020;    // "ldp ": the simulator's local DP noise since 1.0
constexpr uint64_t kSecAggTag = 0x73656361;     // "seca": the simulator's SecAgg+ seeds and rounding since 1.0

// Client c's key in round t (0-based) of the stream `tag` of the run's seed.
uint64_t sim_client_key(uint64_t seed, uint64_t tag, uint64_t t, int64_t c) {
  return rng::derive(rng::derive(seed, tag), rng::derive(t, static_cast<uint64_t>(c)));
}
}  // namespace

uint64_t task_seed(uint64_t seed, uint64_t r, const std::string& client_id) {
  return rng::derive(rng::derive(rng::derive(seed, kTaskTag), r), rng::hash_name(client_id));
}

uint64_t partition_seed(uint64_t seed) { return rng::derive(seed, kPartitionTag); }

std::string sim_client_id(int64_t c) { return std::to_string(c); }

compression::Context client_context(compression::Context round_ctx, uint64_t seed, uint32_t clients) {
  round_ctx.seed = seed;
  round_ctx.num_workers = static_cast<int>(std::max<uint32_t>(clients, 1));
  return round_ctx;
}

wire::ModelUpdate make_update(uint64_t round, const std::string& client_id, int64_t num_samples,
                              const std::vector<std::string>& names, const std::map<std::string, at::Tensor>& delta,
                              const compression::Compressor& codec, std::map<std::string, compression::State>& states,
                              const std::map<std::string, compression::Context>& contexts,
                              const std::map<std::string, at::Tensor>& control_delta,
                              std::vector<std::pair<std::string, double>> metrics) {
  SPARROW_CHECK(num_samples > 0, "make_update: num_samples must be > 0");
  wire::ModelUpdate u;
  u.round = round;
  u.client_id = client_id;
  u.num_samples = static_cast<uint64_t>(num_samples);
  u.metrics = std::move(metrics);
  u.tensors.reserve(names.size());
  for (const auto& name : names) {
    const at::Tensor d = delta.at(name).to(at::kCPU, at::kFloat).contiguous();
    u.tensors.push_back({name, codec.encode(d, states[name], contexts.at(name))});
  }
  if (!control_delta.empty()) {
    const auto dense = compression::make_compressor("none");
    for (const auto& name : names) {
      auto it = control_delta.find(name);
      if (it == control_delta.end()) continue;
      compression::State scratch;
      u.control_delta.push_back({name, dense->encode(it->second.to(at::kCPU, at::kFloat).contiguous(), scratch, {})});
    }
  }
  return u;
}

double local_dp_update(std::map<std::string, at::Tensor>& delta, double clip, double noise, uint64_t key) {
  for (auto& [name, v] : delta) v = v.to(at::kCPU, at::kFloat);
  return aggregation::local_dp(delta, clip, noise, key);
}

RingUpdate quantise_update(const std::vector<std::string>& names, const std::map<std::string, at::Tensor>& delta,
                           double weight, double clip, double scale, uint64_t key) {
  size_t length = 0;
  for (const auto& name : names) {
    auto it = delta.find(name);
    SPARROW_CHECK(it != delta.end(), "quantise_update: the update lacks '" << name << "'");
    length += static_cast<size_t>(it->second.numel());
  }
  RingUpdate q;
  q.x.resize(length);
  size_t off = 0;
  for (const auto& name : names) {  // one tensor on the host at a time
    const at::Tensor d = delta.at(name).to(at::kCPU, at::kFloat).contiguous();
    const size_t len = static_cast<size_t>(d.numel());
    q.clipped +=
        secagg::quantise(d.data_ptr<float>(), len, weight, clip, scale, rng::derive(key, off), q.x.data() + off);
    off += len;
  }
  return q;
}

uint64_t sim_local_dp_key(uint64_t seed, uint64_t t, int64_t c) { return sim_client_key(seed, kLocalDpTag, t, c); }

uint64_t sim_secagg_key(uint64_t seed, uint64_t t, int64_t c) { return sim_client_key(seed, kSecAggTag, t, c); }

}  // namespace sparrow::federation
