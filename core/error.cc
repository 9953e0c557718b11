#include "core/error.h"

#include <atomic>

namespace sparrow {
namespace {
std::atomic<bool> g_check_locations{true};
}  // namespace

void set_check_locations(bool on) { g_check_locations.store(on, std::memory_order_relaxed); }
bool check_locations() { return g_check_locations.load(std::memory_order_relaxed); }

namespace detail {

void throw_check(const char* file, int line, const char* cond, const std::string& msg) {
  if (!check_locations()) {
    // A check without a message still tells the user something, and how to
    // learn more.
    throw Error(msg.empty() ? std::string("internal check failed (--log-level debug names it)") : msg);
  }
  std::ostringstream os;
  os << msg << " [" << cond << " failed at " << file << ":" << line << "]";
  throw Error(os.str());
}

}  // namespace detail
}  // namespace sparrow
