#pragma once
// Partitioners split a labelled dataset across simulated clients. The result is
// a partition: every sample index in [0, N) appears in exactly one client's
// list (each list sorted ascending; order within a client means nothing, the
// trainer shuffles), and it is a pure function of (labels, clients, spec, seed).
//
// Specs (core/spec.h, strict keys):
//   iid                    uniform random split into sizes differing by at most 1
//   dirichlet:alpha=A[,min_size=1]
//                          label skew (Hsu et al. 2019, FedML's
//                          non_iid_partition_with_dirichlet_distribution): for each
//                          class, proportions ~ Dir(A) over clients, with FedML's
//                          balancing (a client already holding >= N/clients samples
//                          gets no more). Resampled until every client has at least
//                          min_size samples (FedML uses 10), at most kDirichletTries
//                          times, then ConfigError. Small A with many clients may
//                          never succeed: e.g. A = 0.1 over 1000 clients of
//                          Fashion-MNIST leaves ~3% of clients empty on every try.
//   shards[:per_client=2]  pathological non-IID (McMahan et al. 2017): sort by label,
//                          cut into clients*per_client shards of near-equal size,
//                          give each client per_client random shards.
//   quantity:alpha=A       quantity skew (Li et al., NIID-Bench 2022): IID labels,
//                          client sizes proportional to Dir(A). One sample per client
//                          is reserved first and the other N - clients are split by
//                          the Dirichlet proportions, so no resampling is needed
//                          (NIID-Bench's resampling almost never succeeds for small A
//                          and many clients).
// Errors are ConfigError: unknown method or key, bad values, clients < 1 or
// clients > N, labels that are not a 1-D tensor of non-negative integers, or a
// Dirichlet split that cannot give every client a sample.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace sparrow::core {

constexpr int kDirichletTries = 1000;

std::vector<std::vector<int64_t>> partition(const at::Tensor& labels, int clients, const std::string& spec,
                                            uint64_t seed);

// Gamma(shape, 1) by Marsaglia & Tsang, "A simple method for generating gamma
// variables" (ACM TOMS 2000): squeeze + log acceptance on a transformed normal,
// for shape >= 1; for shape < 1 the boost Gamma(a) = Gamma(a + 1) * U^(1/a).
// Draws normals and uniforms from the counter-based stream `key` starting at
// `counter`, which is advanced past every value used (a variable number).
double sample_gamma(double shape, uint64_t key, uint64_t& counter);

// Dir(alpha, ..., alpha) of dimension n from n gamma draws, normalised. If every
// draw underflows to 0 (tiny alpha), returns a one-hot on a uniformly chosen
// coordinate, which is the limit of Dir(alpha) as alpha -> 0.
std::vector<double> sample_dirichlet(double alpha, int n, uint64_t key);

}  // namespace sparrow::core
