#include "liteclient/layout.h"

#include <sstream>

#include "core/error.h"

namespace sparrow::liteclient {
namespace {
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull, kFnvPrime = 0x100000001b3ull;
}  // namespace

Layout Layout::make(std::vector<std::string> names, std::vector<std::vector<int64_t>> shapes) {
  SPARROW_CHECK(names.size() == shapes.size(),
                "layout: " << names.size() << " names for " << shapes.size() << " shapes");
  Layout l;
  l.names = std::move(names);
  l.shapes = std::move(shapes);
  for (size_t k = 0; k < l.names.size(); ++k) {
    SPARROW_CHECK(!l.names[k].empty(), "layout: parameter " << k << " has no name");
    SPARROW_CHECK(l.index_.emplace(l.names[k], static_cast<int64_t>(k)).second,
                  "layout: parameter '" << l.names[k] << "' appears twice");
    int64_t n = 1;
    for (int64_t d : l.shapes[k]) {
      SPARROW_CHECK(d >= 0, "layout: parameter '" << l.names[k] << "' has a negative dimension");
      n *= d;
    }
    l.offsets.push_back(l.total);
    l.sizes.push_back(n);
    l.total += n;
  }
  return l;
}

int64_t Layout::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? -1 : it->second;
}

uint64_t model_digest(const Layout& layout) {
  std::map<std::string, std::vector<int64_t>> by_name;  // name order, as core::model_digest
  for (size_t k = 0; k < layout.names.size(); ++k) by_name[layout.names[k]] = layout.shapes[k];
  uint64_t h = kFnvOffset;
  for (const auto& [name, shape] : by_name) {
    std::string s = name + ":";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? "x" : "") + std::to_string(shape[i]);
    s += ";";
    for (unsigned char c : s) {
      h ^= c;
      h *= kFnvPrime;
    }
  }
  return h;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  return os.str() + ']';
}

}  // namespace sparrow::liteclient
