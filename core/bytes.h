#pragma once
// Little helpers for the project's own binary blobs (compressor state, client
// state, the simulator's rank messages): fixed-size fields in host byte order
// appended to a string, and a bounds-checked reader over a buffer it does not
// own. Peers' wire messages are FlatBuffers (wire/), not this.

#include <cstdint>
#include <cstring>
#include <string>

#include "core/error.h"

namespace sparrow::core {

template <typename T>
void put_raw(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

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
