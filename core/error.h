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

// Whether SPARROW_CHECK's message names the failed condition and the source
// file and line: "MSG [COND failed at FILE:LINE]", or MSG alone. Programs turn
// it on only for --log-level debug or trace (core/cli.h): a message a user
// sees names the key or the file, never a source path. On by default, so
// library code and tests that configure nothing keep the location. Read at
// each throw; set it once at start-up, before threads throw.
void set_check_locations(bool on);
bool check_locations();

namespace detail {
[[noreturn]] void throw_check(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

}  // namespace sparrow

// SPARROW_CHECK(cond, stream-expr) throws sparrow::Error with the message, and
// the condition with file:line when check_locations() is on.
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
