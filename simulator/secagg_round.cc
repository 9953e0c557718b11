// SecAgg+ in one process (docs/security.md): the server and every client of
// the round are secagg::Server and secagg::Client, the code sparrow-server and
// sparrow-client run; their messages are serialised and parsed as on the wire
// (their bytes counted) but handed over in memory. The clients' masked
// updates come from finish_client (clients.cc).
#include <spdlog/spdlog.h>

#include <cstring>

#include "core/rng.h"
#include "federation/client_pipeline.h"
#include "simulator/impl.h"

namespace sparrow::simulator {
namespace {
// The round seeds' stream; client c's rounding comes from the same stream
// (federation::sim_secagg_key).
constexpr uint64_t kSecAggTag = 0x73656361;  // "seca"
}  // namespace

wire::SecAgg Simulator::Impl::over_wire(const wire::SecAgg& m, uint64_t& bytes) {
  const std::string b = wire::serialize(wire::Message{wire::kProtocolMajor, wire::kProtocolMinor, m});
  bytes += b.size();
  return std::get<wire::SecAgg>(wire::parse(b).body);
}

void Simulator::Impl::begin_secagg(int t, const std::vector<int64_t>& ids) {
  sa = std::make_unique<SecAggRound>();
  SecAggRound& r = *sa;
  const uint32_t n = static_cast<uint32_t>(ids.size());
  const uint64_t seed = rng::derive(rng::derive(cfg.seed, kSecAggTag), static_cast<uint64_t>(t));
  r.length = static_cast<size_t>(model_bytes / sizeof(float));
  r.server = std::make_unique<secagg::Server>(sa_params, static_cast<uint64_t>(t + 1), n, seed, r.length);
  r.scale = secagg::ring_scale(n, sa_params.clip);
  double total = 0;
  for (int64_t c : ids) total += static_cast<double>(client_idx[c].numel());
  for (uint32_t i = 0; i < n; ++i) {
    const int64_t c = ids[i];
    wire::SecAggSetup a{i + 1,
                        n,
                        r.server->degree(),
                        r.server->threshold(),
                        seed,
                        sa_params.clip,
                        static_cast<double>(client_idx[c].numel()) / total};
    r.index[c] = i + 1;
    r.weight[c] = a.weight;
    r.party[c] = std::make_unique<secagg::Client>(a, static_cast<uint64_t>(t + 1), federation::sim_client_id(c));
    r.server->add_keys(i + 1, over_wire(r.party[c]->keys(), r.up[c]));
  }
  const auto client_of = [&](uint32_t index) { return ids[index - 1]; };
  std::vector<std::pair<uint32_t, wire::SecAgg>> shares;
  for (auto& [i, m] : r.server->neighbour_messages()) {
    const int64_t c = client_of(i);
    shares.emplace_back(i, over_wire(r.party[c]->shares(over_wire(m, r.down[c])), r.up[c]));
  }
  for (auto& [i, m] : shares) r.server->add_shares(i, m);
  for (auto& [i, m] : r.server->shares_in_messages()) {
    const int64_t c = client_of(i);
    r.party[c]->receive_shares(over_wire(m, r.down[c]));
  }
}

bool Simulator::Impl::end_secagg(int t, const std::vector<int64_t>& ids) {
  SecAggRound& r = *sa;
  for (auto& [i, m] : r.server->unmask_messages()) {
    const int64_t c = ids[i - 1];
    r.server->add_reveal(i, over_wire(r.party[c]->reveal(over_wire(m, r.down[c])), r.up[c]));
  }
  if (!r.server->can_unmask()) {
    spdlog::warn("round {}: secure aggregation cannot unmask ({}): the model stays as it was", t + 1,
                 r.server->missing());
    return false;
  }
  const std::vector<uint32_t> sum = r.server->unmask();
  double wsum = 0, samples = 0;
  for (uint32_t i : r.server->survivors()) {
    wsum += r.weight.at(ids[i - 1]);
    samples += static_cast<double>(client_idx[ids[i - 1]].numel());
  }
  engine->add_secagg_sum(sum, r.scale, wsum, samples);  // as sparrow-server folds it
  return true;
}
}  // namespace sparrow::simulator
