// Checks shared by the wire format's parsers (checks.h).
#include "wire/checks.h"

namespace sparrow::wire::detail {

namespace c = compression;

[[noreturn]] void fail(ErrorCode code, const std::string& what) { throw ProtocolError(code, what); }

bool valid_text(const char* s, size_t n) {
  const auto* p = reinterpret_cast<const unsigned char*>(s);
  size_t i = 0;
  while (i < n) {
    const unsigned b = p[i];
    if (b == 0) return false;
    if (b < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp, min;
    if ((b & 0xe0) == 0xc0) {
      len = 2, cp = b & 0x1f, min = 0x80;
    } else if ((b & 0xf0) == 0xe0) {
      len = 3, cp = b & 0x0f, min = 0x800;
    } else if ((b & 0xf8) == 0xf0) {
      len = 4, cp = b & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += len;
  }
  return true;
}

uint64_t checked_numel(const std::vector<int64_t>& shape, uint64_t budget, const std::string& name) {
  for (int64_t d : shape)
    if (d < 0) fail(ErrorCode::kMalformed, "tensor '" + name + "': negative dimension " + std::to_string(d));
  for (int64_t d : shape)
    if (d == 0) return 0;
  uint64_t n = 1;
  for (int64_t d : shape) {
    const auto ud = static_cast<uint64_t>(d);
    if (n > budget / ud)
      fail(ErrorCode::kOversize, "tensor '" + name + "' takes the message over the receiver's element limit");
    n *= ud;
  }
  if (n > budget)
    fail(ErrorCode::kOversize, "tensor '" + name + "' takes the message over the receiver's element limit");
  return n;
}

void set_kinds(c::Encoded& e, uint8_t format, uint8_t value_type, uint8_t index_coding, const std::string& name) {
  if (format > static_cast<uint8_t>(c::Format::kLowRankSparse))
    fail(ErrorCode::kUnsupported, "tensor '" + name + "': unknown format " + std::to_string(format));
  if (value_type > static_cast<uint8_t>(c::ValueType::kInt8))
    fail(ErrorCode::kUnsupported, "tensor '" + name + "': unknown value type " + std::to_string(value_type));
  if (index_coding > static_cast<uint8_t>(c::IndexCoding::kMask))
    fail(ErrorCode::kUnsupported, "tensor '" + name + "': unknown index coding " + std::to_string(index_coding));
  e.format = static_cast<c::Format>(format);
  e.value_type = static_cast<c::ValueType>(value_type);
  e.index_coding = static_cast<c::IndexCoding>(index_coding);
}

void check_payload(const c::Encoded& e, c::ValueCheck check, const std::string& name) {
  try {
    c::validate(e, check);
  } catch (const sparrow::Error& err) {
    fail(ErrorCode::kMalformed, "tensor '" + name + "': " + err.what());
  }
}

}  // namespace sparrow::wire::detail
