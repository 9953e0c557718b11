#pragma once
// The L2 norm of what an update decodes to, for admission (aggregation/
// aggregator.h, StreamingAggregator::set_max_update_norm): computed from the
// encoded form where the format allows, without the dense tensor. A low-rank
// product's norm comes from the factors' Gram matrices, in double, so a pair of
// finite factors whose product overflows float32 shows as a norm above 3.4e38
// instead of as infinities found later, in the sum.

#include <ATen/core/Tensor.h>

#include "compression/compressor.h"
#include "compression/encoded.h"

namespace sparrow::compression {

// ||A · Bᵀ||_F for A {n, r} and B {m, r} (any float dtype), computed in double
// as sqrt(Σ (AᵀA) ⊙ (BᵀB)): O((n + m) r²), never the n × m product. +inf when a
// factor entry is not finite.
double lowrank_norm(const at::Tensor& a, const at::Tensor& b);

// ||decode(e, ctx)||_2 in double for a validated `e`: exact for dense, sparse
// and low-rank formats (from the values and factors), decoded first for the bit
// streams (QSGD, TernGrad, sign) and kLowRankSparse. kLowRankFactor needs the
// shared factor: use lowrank_norm with it (throws sparrow::Error here). +inf when
// a value is not finite.
double decoded_norm(const Encoded& e, const Context& ctx = {});

}  // namespace sparrow::compression
