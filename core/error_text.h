#pragma once
// The text of an exception for a user-facing message. LibTorch's c10::Error
// carries a C++ backtrace ("Exception raised from ... frame #0 ...") in
// what(); users get its first part only.

#include <exception>
#include <string>

namespace sparrow::core {

std::string error_text(const std::exception& e);

}  // namespace sparrow::core
