#include "core/error.h"

namespace sparrow::detail {

void throw_check(const char* file, int line, const char* cond, const std::string& msg) {
  std::ostringstream os;
  os << msg << " [" << cond << " failed at " << file << ":" << line << "]";
  throw Error(os.str());
}

}  // namespace sparrow::detail
