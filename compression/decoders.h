#pragma once
// Per-format decoders without LibTorch, dispatched by decode()/decode_add()
// (compressor.cc) and flat::decode_add (flat_codec.cc). Each adds weight ·
// decoded into out (numel == e.numel() floats) and may assume validate(e)
// passed; it still throws FormatError on bad payload bits that validate()
// cannot see (e.g. a truncated Elias-gamma stream). Internal to compression/.

#include <cstdint>
#include <functional>

#include "compression/codec_bits.h"
#include "compression/encoded.h"

namespace sparrow::compression::detail {

void decode_dense_add(const Encoded& e, float* out, float weight);  // dense.cc
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
void decode_sparse_add(const Encoded& e, float* out, float weight, const CodecView& ctx);  // codec_bits.cc
void decode_quantized_add(const Encoded& e, float* out, float weight);                     // qsgd.cc
void decode_ternary_add(const Encoded& e, float* out, float weight);                       // terngrad.cc
void decode_sign_add(const Encoded& e, float* out, float weight);                          // sign_cpu.cc

// True for formats whose malformation can surface only while decoding (a
// truncated Elias-gamma stream, a TernGrad code 3, nonzero padding), which
// validate() cannot see: decode_add decodes these into scratch first.
inline bool format_decodes_late(Format f) {
  return f == Format::kQuantized || f == Format::kTernary || f == Format::kSign;
}

}  // namespace sparrow::compression::detail
