#pragma once
// The bytes of a codec's per-tensor state: the one writer and reader behind
// compression::State (at::Tensor), flat::State and the lite client's state
// file. Torch-free (the device build links it). Little-endian:
//
//   magic "SPST" | u32 version (2) | u64 step | i64 last_round | u32 count |
//   per slot: u32 name length, name, u32 dims, i64 x dims, f32 x numel
//
// Version 1 (no last_round) is still read, as last_round = -1. The writer
// reads values where they lie; the reader copies each slot once, into storage
// the caller allocates: no second copy of every state (a simulator holds
// thousands).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace sparrow::compression::state_format {

// A float32 row-major slot to write, alive until write() returns.
struct SlotView {
  const std::string* name;
  const int64_t* shape;
  size_t dims;
  const float* data;
  size_t count;  // values at data: the product of shape, or write() throws
};

struct Header {
  uint64_t step = 0;
  int64_t last_round = -1;
};

// Receives the bytes in order, in pieces (a slot's values in one).
using Sink = std::function<void(const char* p, size_t n)>;

// The size of write()'s bytes. sparrow::Error (a caller's bug) on a slot whose
// count is not its shape's product, before write() sends any byte.
uint64_t size(const std::vector<SlotView>& slots);
void write(const Header& h, const std::vector<SlotView>& slots, const Sink& sink);
std::string write(const Header& h, const std::vector<SlotView>& slots);

// Once per slot, in order, with a name not seen before: the storage for the
// product of shape's floats (null when 0), which the reader fills.
using SlotAlloc = std::function<float*(std::string name, const std::vector<int64_t>& shape)>;

// Reads version 1 or 2. FormatError ("compressor state: ...") on a bad magic
// or version, a truncated or oversized slot, a duplicate name or trailing
// bytes; a slot is allocated only once its bytes are known to be there.
Header read(const char* p, size_t n, const SlotAlloc& alloc);

}  // namespace sparrow::compression::state_format
