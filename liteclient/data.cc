#include "liteclient/data.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <type_traits>

#include "core/error.h"
#include "core/npy.h"

namespace sparrow::liteclient {
namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK_T(ConfigError, in, "data: cannot read " << path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The value of 'key' in the header's dict literal (a quoted string, a tuple or a word).
std::string header_value(const std::string& h, const std::string& key, const std::string& what) {
  size_t p = h.find("'" + key + "'");
  SPARROW_CHECK_T(FormatError, p != std::string::npos, what << ": npy header has no '" << key << "'");
  p = h.find(':', p);
  SPARROW_CHECK_T(FormatError, p != std::string::npos, what << ": malformed npy header");
  p = h.find_first_not_of(' ', p + 1);
  SPARROW_CHECK_T(FormatError, p != std::string::npos, what << ": malformed npy header");
  size_t e;
  if (h[p] == '\'' || h[p] == '"') {
    e = h.find(h[p], p + 1);
    SPARROW_CHECK_T(FormatError, e != std::string::npos, what << ": malformed npy header");
    return h.substr(p + 1, e - p - 1);
  }
  e = h[p] == '(' ? h.find(')', p) + 1 : h.find_first_of(",}", p);
  SPARROW_CHECK_T(FormatError, e != std::string::npos && e > p, what << ": malformed npy header");
  return h.substr(p, e - p);
}

template <typename T>
int64_t label_at(const char* p, size_t i, const std::string& what) {
  T v;
  std::memcpy(&v, p + i * sizeof(T), sizeof(T));
  if constexpr (std::is_floating_point_v<T>) {
    SPARROW_CHECK_T(FormatError, std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9e15,
                    what << ": label " << i << " (" << v << ") is not a whole number");
  } else if constexpr (std::is_unsigned_v<T>) {
    SPARROW_CHECK_T(FormatError, static_cast<uint64_t>(v) <= static_cast<uint64_t>(INT64_MAX),
                    what << ": label " << i << " is out of range");
  }
  return static_cast<int64_t>(v);
}

}  // namespace

std::vector<int64_t> parse_npy_labels(const std::string& b, const std::string& what) {
  SPARROW_CHECK_T(FormatError, b.size() >= 10 && b.compare(0, 6, "\x93NUMPY") == 0, what << ": not a .npy file");
  const auto major = static_cast<unsigned char>(b[6]);
  SPARROW_CHECK_T(FormatError, major >= 1 && major <= 3, what << ": npy format version " << int(major));
  size_t hlen = 0, start = 0;
  if (major == 1) {
    hlen = static_cast<unsigned char>(b[8]) | (static_cast<size_t>(static_cast<unsigned char>(b[9])) << 8);
    start = 10;
  } else {
    SPARROW_CHECK_T(FormatError, b.size() >= 12, what << ": truncated .npy file");
    for (int i = 0; i < 4; ++i) hlen |= static_cast<size_t>(static_cast<unsigned char>(b[8 + i])) << (8 * i);
    start = 12;
  }
  SPARROW_CHECK_T(FormatError, hlen <= b.size() - start, what << ": truncated .npy header");
  const std::string h = b.substr(start, hlen);
  const std::string descr = header_value(h, "descr", what);
  SPARROW_CHECK_T(FormatError, header_value(h, "fortran_order", what) == "False",
                  what << ": Fortran-order arrays are not supported");
  const std::string shape = header_value(h, "shape", what);
  // [N] only: "(N,)".
  std::string inner = shape.substr(1, shape.size() - 2);
  while (!inner.empty() && (inner.back() == ',' || inner.back() == ' ')) inner.pop_back();
  SPARROW_CHECK_T(FormatError,
                  !inner.empty() && inner.find_first_not_of("0123456789") == std::string::npos && inner.size() <= 15,
                  what << ": labels must be a 1-D array [N], got shape " << shape);
  const auto n = static_cast<size_t>(std::stoll(inner));
  const std::string d = descr.size() == 3 && descr[0] == '=' ? "<" + descr.substr(1) : descr;
  size_t width = 0;
  if (d == "|i1" || d == "|u1" || d == "<i1" || d == "<u1")
    width = 1;
  else if (d == "<i2" || d == "<u2")
    width = 2;
  else if (d == "<i4" || d == "<u4" || d == "<f4")
    width = 4;
  else if (d == "<i8" || d == "<u8" || d == "<f8")
    width = 8;
  SPARROW_CHECK_T(FormatError, width > 0,
                  what << ": label dtype '" << descr << "' is not supported (integers or floats)");
  const size_t off = start + hlen;
  SPARROW_CHECK_T(FormatError, b.size() - off == n * width,
                  what << ": " << b.size() - off << " data bytes for " << n << " labels of " << width << " bytes");
  const char* p = b.data() + off;
  const char kind = d[1];
  std::vector<int64_t> y(n);
  for (size_t i = 0; i < n; ++i) {
    switch (width) {
      case 1:
        y[i] = kind == 'u' ? label_at<uint8_t>(p, i, what) : label_at<int8_t>(p, i, what);
        break;
      case 2:
        y[i] = kind == 'u' ? label_at<uint16_t>(p, i, what) : label_at<int16_t>(p, i, what);
        break;
      case 4:
        y[i] = kind == 'u'   ? label_at<uint32_t>(p, i, what)
               : kind == 'f' ? label_at<float>(p, i, what)
                             : label_at<int32_t>(p, i, what);
        break;
      default:
        y[i] = kind == 'u'   ? label_at<uint64_t>(p, i, what)
               : kind == 'f' ? label_at<double>(p, i, what)
                             : label_at<int64_t>(p, i, what);
    }
  }
  return y;
}

LocalData load_local_data(const std::string& path, int64_t input_size, int64_t classes) {
  namespace fs = std::filesystem;
  const std::string xp = (fs::path(path) / "x.npy").string(), yp = (fs::path(path) / "y.npy").string();
  SPARROW_CHECK_T(ConfigError, fs::is_regular_file(xp) && fs::is_regular_file(yp),
                  "data: folder '" << path << "' has no x.npy + y.npy (sparrow-client-lite reads that form only)");
  npy::Array x = npy::read(xp, /*convert_float64=*/true);
  LocalData d;
  d.y = parse_npy_labels(read_all(yp), yp);
  const auto n = static_cast<int64_t>(d.y.size());
  SPARROW_CHECK_T(ConfigError, n >= 1, "data: " << yp << " holds no labels");
  SPARROW_CHECK_T(ConfigError, !x.shape.empty() && x.shape[0] == n,
                  "data: " << xp << " and " << yp << " hold different numbers of samples");
  const int64_t per = n > 0 ? static_cast<int64_t>(x.data.size()) / n : 0;
  SPARROW_CHECK_T(ConfigError, per == input_size,
                  "data: each sample of " << xp << " has " << per << " values, the model takes " << input_size);
  for (size_t i = 0; i < d.y.size(); ++i)
    SPARROW_CHECK_T(ConfigError, d.y[i] >= 0 && d.y[i] < classes,
                    "data: label " << d.y[i] << " of sample " << i << " in " << yp << " is outside [0, " << classes
                                   << ") (the model's classes)");
  d.x = std::move(x.data);
  return d;
}

}  // namespace sparrow::liteclient
