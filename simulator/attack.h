#pragma once
// Attacks in the simulator, so that robust aggregation and DP can be measured
// (docs/aggregation.md). A fixed set of round(adversaries × clients) clients,
// drawn with the run's seed, attacks whenever it is selected; what it sends is
// encoded with its own compressor state like any update, and it reports its
// true sample count.
//
// attack =
//   sign_flip[:scale=10]   sends −scale·Δ (its honest update Δ, negated and scaled; with 20% adversaries
//                          a scale above 4 outweighs the honest 80% in a plain mean)
//   scale[:factor=10]      sends factor·Δ (model-replacement-style boosting)
//   gaussian[:std=1]       sends N(0, std²) noise of the model's shape
//   label_flip             trains honestly on labels flipped to (classes − 1 − y)
//   alie[:z=0]             "A little is enough" (Baruch et al., NeurIPS 2019): the round's adversaries
//                          pool their honest updates and each sends μ − z·σ (coordinate-wise mean and
//                          standard deviation of the pool); z = 0 picks the paper's z_max from the number
//                          n of updates in the round and f of adversaries in it:
//                          s = floor(n/2 + 1) − f, z_max = Φ⁻¹((n − s) / n)

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace sparrow::simulator {

struct AttackSpec {
  enum class Kind { kSignFlip, kScale, kGaussian, kLabelFlip, kAlie };
  Kind kind = Kind::kSignFlip;
  double scale = 10;                                 // sign_flip
  double factor = 10;                                // scale
  double stddev = 1;                                 // gaussian
  double z = 0;                                      // alie (0 = z_max)
  static AttackSpec parse(const std::string& spec);  // ConfigError on unknown kinds or keys
};

// Which clients attack: round(fraction × clients) of them, a seeded choice.
std::vector<char> choose_adversaries(int clients, double fraction, uint64_t seed);

// The update an adversary sends instead of its honest `delta` (sign_flip,
// scale, gaussian; label_flip and alie are handled where they act). `key`
// seeds the Gaussian noise.
std::map<std::string, at::Tensor> attack_update(const AttackSpec& a, const std::map<std::string, at::Tensor>& delta,
                                                uint64_t key);

// ALIE's z_max for n updates of which f are the attackers'.
double alie_z(int64_t n, int64_t f);
// ALIE: μ − z·σ over the pooled honest updates (σ: population standard
// deviation; a single update gives σ = 0).
std::map<std::string, at::Tensor> alie_update(const std::vector<std::map<std::string, at::Tensor>>& honest, double z);

}  // namespace sparrow::simulator
