#pragma once
// The text of an exception for a user-facing message. LibTorch's c10::Error
// carries a C++ backtrace ("Exception raised from ... frame #0 ...") in
// what(); users get its first part only.

#include <exception>
#include <string>
#include <string_view>

namespace sparrow::core {

std::string error_text(const std::exception& e);

// What a remote peer may read of an error (the message of an Error reply;
// docs/security.md, "Internal text on the wire"). SPARROW_CHECK appends
// " [COND failed at FILE:LINE]" to its message: the condition and the build
// path are for the local log only. peer_text removes every such part of
// `text` (also from a message that quotes another's what() in its middle) and
// anything from LibTorch's "\nException raised from" on; the rest is kept as
// it is. peer_message is peer_text(error_text(e)). Callers log the full text
// locally where the two differ.
std::string peer_text(std::string_view text);
std::string peer_message(const std::exception& e);

}  // namespace sparrow::core
