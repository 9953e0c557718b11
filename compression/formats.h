#pragma once
// Per-format decoders, dispatched by decode()/decode_add() in compressor.cc.
// Each adds weight · decoded into out (float32, contiguous, numel == e.numel())
// and may assume validate(e) passed; it still throws FormatError on bad payload
// bits that validate() cannot see (e.g. a truncated Elias-gamma stream).
// Each register_* adds the methods of one file to the registry.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

#include "compression/compressor.h"

namespace sparrow::compression::detail {

void decode_dense_add(const Encoded& e, float* out, float weight);
// out = weight · values of a dense fp32 e. Values not yet known finite are
// scanned block by block before each block is written; on a non-finite one,
// out[0, written) is zeroed again and NonFiniteError is thrown, else they are
// marked finite. (decode_fill's dense path; size already validated.)
void fill_dense_f32(const Encoded& e, float* out, float weight);
// out = wa · a + wb · b for dense fp32 a (known finite) and b, b scanned as
// fill_dense_f32 scans (on a non-finite value out[0, written) is zeroed again).
void fill_dense_f32_pair(const Encoded& a, float wa, const Encoded& b, float wb, float* out);
// validate()'s finiteness scan of n fp32 values (encoded.cc), a block of 1,024
// at a time, calling done(begin, end) after each block found finite; throws
// NonFiniteError naming the first non-finite value.
void scan_finite_f32(const uint8_t* bytes, uint64_t n, const char* what,
                     const std::function<void(uint64_t, uint64_t)>& done);
void decode_sparse_add(const Encoded& e, float* out, float weight, const Context& ctx);
void decode_quantized_add(const Encoded& e, float* out, float weight);     // qsgd.cc
void decode_ternary_add(const Encoded& e, float* out, float weight);       // terngrad.cc
void decode_sign_add(const Encoded& e, float* out, float weight);          // sign.cc
void decode_lowrank_add(const Encoded& e, at::Tensor& out, float weight);  // kLowRank(Sparse), powersgd.cc
void decode_factor_add(const Encoded& e, at::Tensor& out, float weight, const Context& ctx);  // acp.cc

void register_dense();        // none, fp16, bf16             (dense.cc)
void register_sparsifiers();  // topk, stc, randomk, threshold (sparse.cc)
void register_dgc();          // dgc                          (dgc.cc)
void register_quantizers();   // qsgd, terngrad, sign         (qsgd.cc, terngrad.cc, sign.cc via quantizers)
void register_lowrank();      // powersgd, acp                (powersgd.cc, acp.cc)

}  // namespace sparrow::compression::detail
