#pragma once
// What crosses the cut in split fine-tuning, as bytes: one encoded activation
// or gradient (ActPacket), its exact byte serialisation and its structural
// checks. No LibTorch: the LibTorch codecs (edge/act_codec.h), the torch-free
// codec (edge/codec/act_codec_flat.h) and the cloud all use this one struct,
// so a packet from either device decodes the same on the cloud.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sparrow::edge {

enum class ActFormat : uint8_t {
  // data: numel fp32.
  kDense = 0,
  // params {rows N, cols M, rank R, basis id}; data: P (N x R) then Q (M x R),
  // fp32 row-major.
  kLowRank = 1,
  // params {rows N, rank R}; data: G Q (N x R) fp32. Decoding needs the device's Q.
  kProjected = 2,
  // params {rows N, cols M, rank R, basis id}; data: P (N x R) fp32. Decoding
  // needs the Q of the last kLowRank packet with that basis id.
  kLowRankCached = 5,
  // Quantised factors (lowrank bits=8|4). params {rows N, cols M, rank R, basis
  // id, bits 8|4, gradient bits 32|8|4, basis bits 8|4}; scales: (min, step) per
  // column of P (R pairs), then per column of Q (R pairs); data: P's codes column
  // by column (i.e. P^T row-major) at `bits` per code, then Q's codes column by
  // column at basis bits. 4-bit codes two per byte, low nibble first, each matrix
  // padded to a byte.
  kLowRankQ = 6,
  // As kLowRankQ without Q: params the same; scales: R pairs for P; data: P's codes.
  kLowRankCachedQ = 7,
  // Quantised projected gradient: params {rows N, rank R, bits 8|4}; scales: R
  // (min, step) pairs, one per column of G Q; data: (G Q)^T codes row-major.
  kProjectedQ = 8,
  // params {bits 8|4, block}; scales: (min, step) per block, row by row; data:
  // one code per element, row-major; 4-bit codes two per byte, low nibble first.
  kQuant = 3,
  // params {k}; data: k ascending uint32 flat indices, then k fp32 values.
  kTopK = 4,
};

const char* act_format_name(ActFormat f);

struct ActPacket {
  ActFormat format = ActFormat::kDense;
  // Set on activations whose sender needs the gradient back (the bottom trains);
  // unset when the bottom is frozen: then nothing needs to come back.
  bool want_gradient = true;
  std::vector<int64_t> shape;  // the tensor's shape; shape[0] is the batch
  std::vector<uint32_t> params;
  std::vector<float> scales;
  std::vector<uint8_t> data;

  // Byte layout (little-endian): u8 format, u8 ndim, u16 flags (bit 0:
  // want_gradient), u32 #params, u32 #scales, u64 #data bytes, then shape (i64
  // each), params (u32), scales (f32), data. wire_bytes() == serialize().size().
  static constexpr size_t kHeaderBytes = 20;
  size_t wire_bytes() const;
  std::vector<uint8_t> serialize() const;
  // FormatError for truncated or trailing bytes or an unknown format; then
  // validate()s the result.
  static ActPacket deserialize(const uint8_t* bytes, size_t size);

  int64_t numel() const;
};

// Structural checks on a packet from outside: shape sane (1..8 dims, positive,
// < 2^31 elements), params/scales/data sizes exactly what the format needs,
// floats finite, steps >= 0, top-k indices ascending and in range. FormatError.
void validate(const ActPacket& p);

}  // namespace sparrow::edge
