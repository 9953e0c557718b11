#pragma once
// Errors are exceptions; expected outcomes (timeouts, dropped clients) are values.
// Every Sparrow error derives from sparrow::Error so callers can catch at thread
// tops and message boundaries without catching unrelated std::exceptions.

#include <sstream>
#include <stdexcept>
#include <string>

namespace sparrow {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A user-facing configuration problem: unknown compressor, unknown key, bad value.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// Bytes from outside (a file, a peer) that do not describe a valid object.
class FormatError : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] void throw_check(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

}  // namespace sparrow

// SPARROW_CHECK(cond, stream-expr) throws sparrow::Error with file:line.
#define SPARROW_CHECK(cond, ...)                                                          \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::ostringstream sparrow_check_os_;                                               \
      sparrow_check_os_ << __VA_ARGS__;                                                   \
      ::sparrow::detail::throw_check(__FILE__, __LINE__, #cond, sparrow_check_os_.str()); \
    }                                                                                     \
  } while (0)

// Same, but throws the given Error subclass (for FormatError / ConfigError).
#define SPARROW_CHECK_T(ErrorType, cond, ...)   \
  do {                                          \
    if (!(cond)) {                              \
      std::ostringstream sparrow_check_os_;     \
      sparrow_check_os_ << __VA_ARGS__;         \
      throw ErrorType(sparrow_check_os_.str()); \
    }                                           \
  } while (0)
