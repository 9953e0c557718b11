#pragma once
// Checks every parser of the wire format shares (wire.cc for FlatBuffers
// tables, packed.cc for packed tensor lists): the error they throw, text,
// shapes against the receiver's element budget, and a tensor's kinds and
// payload. Internal to sparrow_wire.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "compression/encoded.h"
#include "wire/wire.h"

namespace sparrow::wire::detail {

[[noreturn]] void fail(ErrorCode code, const std::string& what);

// Strict UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF) and
// no NUL, so names are safe as keys, in logs and in C strings.
bool valid_text(const char* s, size_t n);

// numel of `shape` (dimensions >= 0), kOversize when above `budget`;
// `name` is the tensor's, for the message.
uint64_t checked_numel(const std::vector<int64_t>& shape, uint64_t budget, const std::string& name);

// Sets e's format, value type and index coding from their wire numbers:
// kUnsupported for a number this build does not know (a newer peer, or noise).
void set_kinds(compression::Encoded& e, uint8_t format, uint8_t value_type, uint8_t index_coding,
               const std::string& name);

// compression::validate, as kMalformed naming the tensor.
void check_payload(const compression::Encoded& e, compression::ValueCheck check, const std::string& name);

}  // namespace sparrow::wire::detail
