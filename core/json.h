#pragma once
// A number for a hand-written JSON line (benchmarks, sparrow-codec): 6
// significant digits, and null for NaN or infinity, which JSON cannot hold.

#include <cmath>
#include <cstdio>
#include <string>

namespace sparrow {

inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

}  // namespace sparrow
