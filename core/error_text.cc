#include "core/error_text.h"

namespace sparrow::core {

// LibTorch's c10::Error::what() is its message (and context) followed by
// "\nException raised from ... (most recent call first):" and the frames: the
// first part is what_without_backtrace(). Cut textually, so that this file
// (sparrow_base, linked by the lite client) needs no LibTorch header.
std::string error_text(const std::exception& e) {
  std::string text = e.what();
  const size_t cut = text.find("\nException raised from ");
  if (cut == std::string::npos) return text;
  text.erase(cut);
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

namespace {

// True when text[from, close) is "FILE:LINE" (a non-empty file, then digits).
bool file_and_line(const std::string& text, size_t from, size_t close) {
  const size_t colon = text.rfind(':', close);
  if (colon == std::string::npos || colon <= from || colon + 1 >= close) return false;
  for (size_t i = colon + 1; i < close; ++i)
    if (text[i] < '0' || text[i] > '9') return false;
  return true;
}

}  // namespace

std::string peer_text(std::string_view text) {
  std::string out(text.substr(0, text.find("\nException raised from ")));
  static constexpr std::string_view kFailedAt = " failed at ";
  size_t search = 0;
  for (;;) {
    const size_t at = out.find(kFailedAt, search);
    if (at == std::string::npos) return out;
    search = at + 1;
    const size_t close = out.find(']', at);
    if (close == std::string::npos || !file_and_line(out, at + kFailedAt.size(), close)) continue;
    // The opening " [" before the condition, whose own brackets are balanced.
    size_t open = std::string::npos;
    int depth = 0;
    for (size_t i = at; i-- > 0;) {
      if (out[i] == ']') {
        ++depth;
      } else if (out[i] == '[') {
        if (depth == 0) {
          open = i;
          break;
        }
        --depth;
      }
    }
    if (open == std::string::npos) continue;
    if (open > 0 && out[open - 1] == ' ') --open;
    out.erase(open, close + 1 - open);
    search = open;
  }
}

std::string peer_message(const std::exception& e) { return peer_text(error_text(e)); }

}  // namespace sparrow::core
