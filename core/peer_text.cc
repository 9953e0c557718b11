#include "core/peer_text.h"

namespace sparrow::core {

std::string printable(std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size());
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\\' || c == '"') {
      out += '\\';
      out += ch;
    } else if (c >= 0x20 && c < 0x7f) {
      out += ch;
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

namespace {

bool id_char(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == ':' || c == '@' || c == '-';
}

}  // namespace

bool valid_client_id(std::string_view id) {
  if (id.empty() || id.size() > kMaxClientIdChars) return false;
  for (const char c : id)
    if (!id_char(c)) return false;
  return true;
}

std::string client_id_problem(std::string_view id) {
  if (valid_client_id(id)) return {};
  std::string shown = printable(id.substr(0, kMaxClientIdChars + 16));
  if (id.size() > kMaxClientIdChars + 16) shown += "...";
  const std::string what = id.empty()                      ? "is empty"
                           : id.size() > kMaxClientIdChars ? "has " + std::to_string(id.size()) + " characters"
                                                           : "has a character outside that set";
  return std::string("client id must be ") + kClientIdRule + "; \"" + shown + "\" " + what;
}

}  // namespace sparrow::core
