#include "core/error_text.h"

#include <c10/util/Exception.h>

namespace sparrow::core {

std::string error_text(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) {
    std::string text = c10->what_without_backtrace();
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    return text;
  }
  return e.what();
}

}  // namespace sparrow::core
