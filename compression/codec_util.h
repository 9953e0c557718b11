#pragma once
// Building blocks shared by the codecs: input checks, per-tensor random keys,
// value packing (fp32/fp16/bf16/sign bits), index coding (delta varint or bitmap,
// whichever is smaller; seeded for random-k), bit streams, error feedback.
// Internal to compression/: not part of the public interface.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "compression/compressor.h"
#include "core/error.h"

namespace sparrow::compression::detail {

// Checks x is defined, float32, on the CPU and finite (sparrow::Error otherwise,
// before any state is touched); returns a contiguous view or copy.
at::Tensor as_input(const at::Tensor& x, const char* method);
std::vector<int64_t> shape_of(const at::Tensor& x);
int64_t numel_of(const std::vector<int64_t>& shape);

// Key of the tensor's random stream: same on every party for the same
// (seed, name); `step` separates successive encodes.
uint64_t tensor_key(const Context& ctx);
uint64_t step_key(const Context& ctx, uint64_t step);

// ---- values -----------------------------------------------------------------
size_t value_bytes(ValueType vt, uint64_t n);
// Appends n packed values of src to out (kSign: bit i set when src[i] < 0).
void pack_values(const float* src, uint64_t n, ValueType vt, std::vector<uint8_t>& out);
// Unpacks n values; kSign gives ±magnitude. bytes must hold value_bytes(vt, n).
void unpack_values(const uint8_t* bytes, uint64_t n, ValueType vt, float magnitude, float* dst);
ValueType parse_value_type(const std::string& text);  // "fp32" | "fp16" | "bf16"

// ---- indices ----------------------------------------------------------------
// Sets e.index_coding / e.indices / e.count for k strictly ascending indices in
// [0, numel), choosing the smaller of delta-varint and bitmap.
void encode_indices(const int64_t* idx, uint64_t k, int64_t numel, Encoded& e);
size_t delta_varint_bytes(const int64_t* idx, uint64_t k);
// Decodes e's indices (any coding but kNone), checking ranges, order and count;
// throws FormatError when they are invalid.
std::vector<int64_t> decode_indices(const Encoded& e);
// k distinct indices in [0, n), ascending, a pure function of (key, k, n).
std::vector<int64_t> seeded_indices(uint64_t key, uint64_t k, int64_t n);

// Builds a kSparse Encoded from ascending indices and their values.
Encoded make_sparse(const std::vector<int64_t>& shape, const int64_t* idx, const float* vals, uint64_t k, ValueType vt,
                    float sign_magnitude = 0.0f);

// ---- bit streams (LSB first, 64-bit little-endian words) ---------------------
class BitWriter {
 public:
  void put(uint64_t bits, int width) {  // width in [0, 64]; bits above width must be 0
    if (width == 0) return;
    acc_ |= bits << fill_;
    const int room = 64 - fill_;
    if (width >= room) {
      words_.push_back(acc_);
      acc_ = room == 64 ? 0 : (width == room ? 0 : bits >> room);
      fill_ = width - room;
    } else {
      fill_ += width;
    }
  }
  uint64_t bit_count() const { return words_.size() * 64 + static_cast<uint64_t>(fill_); }
  // Appends ceil(bit_count / 8) bytes to out.
  void finish(std::vector<uint8_t>& out);

 private:
  std::vector<uint64_t> words_;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

class BitReader {
 public:
  BitReader(const uint8_t* data, size_t bytes) : data_(data), bits_(bytes * 8) {}
  // Throws FormatError when fewer than `width` bits remain.
  uint64_t get(int width);
  uint64_t remaining() const { return bits_ - pos_; }
  uint64_t position() const { return pos_; }

 private:
  const uint8_t* data_;
  uint64_t bits_;
  uint64_t pos_ = 0;
};

// ---- error feedback -----------------------------------------------------------
// Returns x + residual (a new tensor) when ef is on, otherwise x itself.
at::Tensor ef_compensate(const at::Tensor& x, State& state, bool ef, const char* slot = "residual");
// residual = compensated - decode(e).
void ef_update(State& state, const at::Tensor& compensated, const Encoded& e, const Context& ctx,
               const char* slot = "residual");

}  // namespace sparrow::compression::detail
