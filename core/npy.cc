#include "core/npy.h"

#include <cstdio>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "core/error.h"

namespace sparrow::npy {
namespace {

constexpr char kMagic[] = "\x93NUMPY";

// Finds the value text after 'key': in a Python dict literal header.
std::string dict_value(const std::string& header, const std::string& key) {
  const std::string needle = "'" + key + "'";
  size_t p = header.find(needle);
  SPARROW_CHECK_T(FormatError, p != std::string::npos, "npy: header has no '" << key << "' entry");
  p = header.find(':', p + needle.size());
  SPARROW_CHECK_T(FormatError, p != std::string::npos, "npy: malformed header near '" << key << "'");
  ++p;
  while (p < header.size() && header[p] == ' ') ++p;
  SPARROW_CHECK_T(FormatError, p < header.size(), "npy: malformed header near '" << key << "'");
  size_t end;
  if (header[p] == '(') {
    end = header.find(')', p);
    SPARROW_CHECK_T(FormatError, end != std::string::npos, "npy: unterminated shape tuple");
    return header.substr(p, end - p + 1);
  }
  if (header[p] == '\'' || header[p] == '"') {
    end = header.find(header[p], p + 1);
    SPARROW_CHECK_T(FormatError, end != std::string::npos, "npy: unterminated string for '" << key << "'");
    return header.substr(p + 1, end - p - 1);
  }
  end = header.find_first_of(",}", p);
  SPARROW_CHECK_T(FormatError, end != std::string::npos, "npy: malformed header near '" << key << "'");
  std::string v = header.substr(p, end - p);
  while (!v.empty() && v.back() == ' ') v.pop_back();
  return v;
}

std::vector<int64_t> parse_shape(const std::string& tuple) {
  std::vector<int64_t> shape;
  std::string inner = tuple.substr(1, tuple.size() - 2);
  std::stringstream ss(inner);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t b = item.find_first_not_of(' ');
    if (b == std::string::npos) continue;  // trailing comma of a 1-tuple
    size_t e = item.find_last_not_of(' ');
    item = item.substr(b, e - b + 1);
    SPARROW_CHECK_T(FormatError,
                    !item.empty() && item.find_first_not_of("0123456789") == std::string::npos && item.size() <= 15,
                    "npy: bad dimension '" << item << "' in shape " << tuple);
    shape.push_back(std::stoll(item));
  }
  return shape;
}

}  // namespace

Array parse(const std::string& bytes, bool convert_float64) {
  SPARROW_CHECK_T(FormatError, bytes.size() >= 10 && std::memcmp(bytes.data(), kMagic, 6) == 0,
                  "npy: not a .npy file (bad magic)");
  const int major = static_cast<unsigned char>(bytes[6]);
  SPARROW_CHECK_T(FormatError, major >= 1 && major <= 3, "npy: unsupported format version " << major);
  size_t header_len, header_start;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
    header_start = 10;
  } else {
    SPARROW_CHECK_T(FormatError, bytes.size() >= 12, "npy: truncated header");
    header_len = 0;
    for (int i = 0; i < 4; ++i) header_len |= static_cast<size_t>(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    header_start = 12;
  }
  SPARROW_CHECK_T(FormatError, header_start + header_len <= bytes.size(), "npy: truncated header");
  const std::string header = bytes.substr(header_start, header_len);
  const std::string descr = dict_value(header, "descr");
  const bool f64 = convert_float64 && (descr == "<f8" || descr == "=f8" || descr == "f8");
  SPARROW_CHECK_T(FormatError, f64 || descr == "<f4" || descr == "=f4" || descr == "f4",
                  "npy: dtype '" << descr << "' is not supported; expected float32 ('<f4')"
                                 << (convert_float64 ? " or float64 ('<f8')" : ""));
  const uint64_t width = f64 ? 8 : 4;
  const std::string fortran = dict_value(header, "fortran_order");
  SPARROW_CHECK_T(FormatError, fortran == "False", "npy: Fortran-order arrays are not supported");
  const std::string shape_text = dict_value(header, "shape");
  SPARROW_CHECK_T(FormatError, shape_text.size() >= 2 && shape_text.front() == '(',
                  "npy: malformed shape " << shape_text);
  Array a;
  a.shape = parse_shape(shape_text);
  uint64_t numel = 1;
  for (int64_t d : a.shape) {
    SPARROW_CHECK_T(FormatError, d == 0 || numel <= std::numeric_limits<uint64_t>::max() / 8 / static_cast<uint64_t>(d),
                    "npy: shape too large");
    numel *= static_cast<uint64_t>(d);
  }
  const size_t data_start = header_start + header_len;
  const uint64_t want = numel * width;
  SPARROW_CHECK_T(FormatError, bytes.size() - data_start == want,
                  "npy: data section has " << (bytes.size() - data_start) << " bytes, shape needs " << want
                                           << (bytes.size() - data_start < want ? " (truncated file)" : ""));
  a.data.resize(numel);
  if (!f64) {
    if (numel) std::memcpy(a.data.data(), bytes.data() + data_start, want);
    return a;
  }
  a.from_float64 = true;
  const char* src = bytes.data() + data_start;
  for (uint64_t i = 0; i < numel; ++i) {
    double v;
    std::memcpy(&v, src + i * 8, 8);
    const float f = static_cast<float>(v);
    SPARROW_CHECK_T(FormatError, std::isfinite(f) || !std::isfinite(v),
                    "npy: float64 value " << v << " at index " << i << " does not fit float32");
    a.data[i] = f;
  }
  return a;
}

Array read(const std::string& path, bool convert_float64) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK_T(FormatError, in.good(), "npy: cannot open '" << path << "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  try {
    return parse(ss.str(), convert_float64);
  } catch (const FormatError& e) {
    throw FormatError(std::string(e.what()) + " (file '" + path + "')");
  }
}

std::string serialize(const std::vector<int64_t>& shape, const float* data) {
  std::string shape_text = "(";
  uint64_t numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    shape_text += std::to_string(shape[i]);
    shape_text += (shape.size() == 1 || i + 1 < shape.size()) ? "," : "";
    if (i + 1 < shape.size()) shape_text += " ";
    numel *= static_cast<uint64_t>(shape[i]);
  }
  shape_text += ")";
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape_text + ", }";
  // Pad so that magic + len + header + '\n' is a multiple of 64.
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::string out(kMagic, 6);
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>((header.size() >> 8) & 0xff);
  out += header;
  out.append(reinterpret_cast<const char*>(data), numel * 4);
  return out;
}

void write(const std::string& path, const std::vector<int64_t>& shape, const float* data) {
  const std::string bytes = serialize(shape, data);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    SPARROW_CHECK_T(Error, out.good(), "npy: cannot write '" << tmp << "'");
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    SPARROW_CHECK_T(Error, out.good(), "npy: write to '" << tmp << "' failed");
  }
  SPARROW_CHECK_T(Error, std::rename(tmp.c_str(), path.c_str()) == 0, "npy: cannot rename to '" << path << "'");
}

}  // namespace sparrow::npy
