#pragma once
// Hand-written JSON (benchmarks, sparrow-codec, the monitor's API): a number
// with 6 (or `digits`) significant digits and null for NaN or infinity, which
// JSON cannot hold; a string quoted and escaped.

#include <cmath>
#include <cstdio>
#include <string>

namespace sparrow {

inline std::string json_number(double v, int digits = 6) {
  if (!std::isfinite(v)) return "null";
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
  return buf;
}

// "..." with \" \\ and control characters escaped (UTF-8 passes through).
inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

}  // namespace sparrow
