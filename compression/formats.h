#pragma once
// The LibTorch-side decoders (low-rank formats) and the registration of the
// built-in methods; the other formats' decoders are torch-free (decoders.h).
// Each register_* adds the methods of one file to the registry.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

#include "compression/compressor.h"
#include "compression/decoders.h"

namespace sparrow::compression::detail {

void decode_lowrank_add(const Encoded& e, at::Tensor& out, float weight);  // kLowRank(Sparse), powersgd.cc
void decode_factor_add(const Encoded& e, at::Tensor& out, float weight, const Context& ctx);  // acp.cc

void register_kernel_codecs();  // every codec of the torch-free core but dgc and sign (torch_codec.cc)
void register_dgc();            // dgc, with its CUDA path (dgc.cc)
void register_sign();           // sign, with its CUDA path (sign.cc)
void register_lowrank();        // powersgd, acp (powersgd.cc, acp.cc)

}  // namespace sparrow::compression::detail
