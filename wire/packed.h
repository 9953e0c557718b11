#pragma once
// Packed tensor lists (protocol 1.10; docs/protocol.md, "Packed tensor
// lists"): a catch-up Task's `weights` and `chain` in one byte string,
// Task.packed, instead of one FlatBuffers EncodedTensor table per tensor and
// step. Each name and shape is written once per message (a name table); each
// tensor record is then its name's index, its kinds, and its fields as
// varints: about 10-20 bytes of framing against ~100-170 for a table. A
// sparse model step of a few hundred positions is mostly framing otherwise.
// Internal to sparrow_wire: serialize() and parse() call it for Task.packed.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "wire/wire.h"

namespace sparrow::wire::detail {

// Task.packed for `weights` (list 0) and `chain` (lists 1..); also
// ModelUpdate.packed for `tensors` (list 0) and `control_delta` (list 1).
std::string pack(const std::vector<NamedTensor>& weights, const std::vector<std::vector<NamedTensor>>& chain);

struct Unpacked {
  std::vector<NamedTensor> weights;
  std::vector<std::vector<NamedTensor>> chain;
};

// Parses and checks Task.packed or ModelUpdate.packed as parse() checks
// tables (ProtocolError: kMalformed, kUnsupported, kOversize). `budget`: the
// message's remaining element allowance, which list 0 draws on; with
// `list_budget` > 0 each further list has an allowance of its own (a Chain's
// steps, as in tables), with 0 they draw on `budget` too. `check`: list 0's
// value check (a ModelUpdate's tensors: ParseLimits::update_values).
// `max_lists`: at most so many lists (ModelUpdate: 2).
Unpacked unpack(const uint8_t* data, size_t size, uint64_t& budget, uint64_t list_budget,
                compression::ValueCheck check = compression::ValueCheck::kScan, size_t max_lists = SIZE_MAX);

}  // namespace sparrow::wire::detail
