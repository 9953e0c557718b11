#pragma once
// Little helpers for the project's own binary blobs (compressor state, client
// state, the simulator's rank messages): fixed-size fields in host byte order
// appended to a string (put_raw, ByteWriter), and a bounds-checked reader over
// a buffer it does not own (ByteReader). Byte strings are a u64 length, then
// the bytes (put_bytes/get_bytes). Peers' wire messages are FlatBuffers
// (wire/), not this.

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/error.h"

namespace sparrow::core {

template <typename T>
void put_raw(std::string& out, T v) {
  static_assert(std::is_trivially_copyable_v<T>, "put_raw: fixed-size fields only");
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// Appends to a buffer it does not own: a caller that keeps the buffer across
// messages (clear() keeps its capacity) writes without new allocations.
class ByteWriter {
 public:
  explicit ByteWriter(std::string& out) : out_(out) {}
  template <typename T>
  ByteWriter& put(T v) {
    put_raw(out_, v);
    return *this;
  }
  // A u64 length, then the bytes: ByteReader::get_bytes() reads it back.
  ByteWriter& put_bytes(const std::string& s) {
    put_raw<uint64_t>(out_, s.size());
    out_ += s;
    return *this;
  }

 private:
  std::string& out_;
};

class ByteReader {
 public:
  // `what` names the blob in errors: "<what>: truncated at byte N".
  ByteReader(const std::string& b, const char* what) : b_(b), what_(what) {}
  template <typename T>
  T get() {
    T v;
    std::memcpy(&v, take(sizeof(T)), sizeof(T));
    return v;
  }
  // A u64 length and that many bytes (ByteWriter::put_bytes); FormatError
  // when the length runs past the buffer's end.
  std::string get_bytes() {
    const auto n = get<uint64_t>();
    return std::string(take(n), n);
  }
  // The next n bytes (a view into the buffer); FormatError past its end.
  const char* take(uint64_t n) {
    SPARROW_CHECK_T(FormatError, n <= b_.size() - pos_, what_ << ": truncated at byte " << pos_);
    const char* p = b_.data() + pos_;
    pos_ += n;
    return p;
  }
  size_t pos() const { return pos_; }
  size_t left() const { return b_.size() - pos_; }
  bool done() const { return pos_ == b_.size(); }

 private:
  const std::string& b_;
  const char* what_;
  size_t pos_ = 0;
};

}  // namespace sparrow::core
