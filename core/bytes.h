#pragma once
// Little helpers for the project's own binary blobs (compressor state, client
// state, the simulator's rank messages, the split activation packet):
// fixed-size fields in host byte order appended to a string or a byte vector
// (put_raw, ByteWriter, VecByteWriter), and a bounds-checked reader over a
// buffer it does not own (ByteReader). Hosts are little-endian (x86, ARM). Byte strings are a u64 length, then
// the bytes (put_bytes/get_bytes). Peers' wire messages are FlatBuffers
// (wire/), not this.

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.h"

namespace sparrow::core {

template <typename T>
void put_raw(std::string& out, T v) {
  static_assert(std::is_trivially_copyable_v<T>, "put_raw: fixed-size fields only");
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
template <typename T>
void put_raw(std::vector<uint8_t>& out, T v) {
  static_assert(std::is_trivially_copyable_v<T>, "put_raw: fixed-size fields only");
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

// Appends to a buffer it does not own (a std::string or a byte vector): a
// caller that keeps the buffer across messages (clear() keeps its capacity)
// writes without new allocations.
template <typename Buf>
class BasicByteWriter {
 public:
  explicit BasicByteWriter(Buf& out) : out_(out) {}
  template <typename T>
  BasicByteWriter& put(T v) {
    put_raw(out_, v);
    return *this;
  }
  // n raw bytes (no length).
  BasicByteWriter& put_span(const void* p, size_t n) {
    const auto* b = static_cast<const typename Buf::value_type*>(p);
    out_.insert(out_.end(), b, b + n);
    return *this;
  }
  // A u64 length, then the bytes: ByteReader::get_bytes() reads it back.
  BasicByteWriter& put_bytes(const std::string& s) {
    put_raw<uint64_t>(out_, s.size());
    return put_span(s.data(), s.size());
  }

 private:
  Buf& out_;
};
using ByteWriter = BasicByteWriter<std::string>;
using VecByteWriter = BasicByteWriter<std::vector<uint8_t>>;

class ByteReader {
 public:
  // `what` names the blob in errors: "<what>: truncated at byte N".
  ByteReader(const std::string& b, const char* what) : p_(b.data()), n_(b.size()), what_(what) {}
  ByteReader(const void* p, size_t n, const char* what) : p_(static_cast<const char*>(p)), n_(n), what_(what) {}
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
  // The next n bytes copied to dst; FormatError past the buffer's end.
  void read(void* dst, uint64_t n) {
    const char* p = take(n);
    if (n) std::memcpy(dst, p, n);
  }
  // The next n bytes (a view into the buffer); FormatError past its end.
  const char* take(uint64_t n) {
    SPARROW_CHECK_T(FormatError, n <= n_ - pos_, what_ << ": truncated at byte " << pos_ << " of " << n_);
    const char* p = p_ + pos_;
    pos_ += n;
    return p;
  }
  size_t pos() const { return pos_; }
  size_t left() const { return n_ - pos_; }
  bool done() const { return pos_ == n_; }

 private:
  const char* p_;
  size_t n_;
  const char* what_;
  size_t pos_ = 0;
};

}  // namespace sparrow::core
