#include "core/data_folder.h"

#include <spdlog/spdlog.h>

#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "core/error.h"
#include "core/error_text.h"
#include "core/models.h"
#include "core/npy.h"
#include "core/partition.h"
#include "core/spec.h"

namespace sparrow::core {
namespace fs = std::filesystem;

namespace {

constexpr int64_t kBuiltinClasses = 10;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK_T(ConfigError, in, "data: cannot read '" << path << "'");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The text of `key`'s value in a .npy header dict ('descr': '<i8', 'shape': (3,)).
std::string header_value(const std::string& header, const std::string& key, const std::string& path) {
  const std::string needle = "'" + key + "'";
  size_t p = header.find(needle);
  SPARROW_CHECK_T(FormatError, p != std::string::npos, "npy '" << path << "': header has no '" << key << "'");
  p = header.find(':', p + needle.size());
  SPARROW_CHECK_T(FormatError, p != std::string::npos, "npy '" << path << "': malformed header");
  ++p;
  while (p < header.size() && header[p] == ' ') ++p;
  SPARROW_CHECK_T(FormatError, p < header.size(), "npy '" << path << "': malformed header");
  const char open = header[p];
  const char close = open == '(' ? ')' : open;
  if (open == '(' || open == '\'' || open == '"') {
    const size_t end = header.find(close, p + 1);
    SPARROW_CHECK_T(FormatError, end != std::string::npos, "npy '" << path << "': malformed header");
    return header.substr(p + 1, end - p - 1);
  }
  const size_t end = header.find_first_of(",}", p);
  SPARROW_CHECK_T(FormatError, end != std::string::npos, "npy '" << path << "': malformed header");
  return header.substr(p, end - p);
}

std::string shape_text(at::IntArrayRef s) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  return os.str() + ']';
}

}  // namespace

at::Tensor read_npy_labels(const std::string& path) {
  const std::string bytes = read_file(path);
  SPARROW_CHECK_T(FormatError, bytes.size() >= 10 && std::memcmp(bytes.data(), "\x93NUMPY", 6) == 0,
                  "npy '" << path << "': not a .npy file (bad magic)");
  const int major = static_cast<unsigned char>(bytes[6]);
  SPARROW_CHECK_T(FormatError, major >= 1 && major <= 3, "npy '" << path << "': unsupported version " << major);
  size_t len = 0, start = 10;
  if (major == 1) {
    len = static_cast<unsigned char>(bytes[8]) | (static_cast<size_t>(static_cast<unsigned char>(bytes[9])) << 8);
  } else {
    SPARROW_CHECK_T(FormatError, bytes.size() >= 12, "npy '" << path << "': truncated header");
    for (int i = 0; i < 4; ++i) len |= static_cast<size_t>(static_cast<unsigned char>(bytes[8 + i])) << (8 * i);
    start = 12;
  }
  SPARROW_CHECK_T(FormatError, len <= bytes.size() - start, "npy '" << path << "': truncated header");
  const std::string header = bytes.substr(start, len);
  const std::string descr = header_value(header, "descr", path);
  const std::string fortran = header_value(header, "fortran_order", path);
  std::string shape = header_value(header, "shape", path);
  SPARROW_CHECK_T(FormatError, fortran.find("False") != std::string::npos,
                  "npy '" << path << "': Fortran order is not supported");
  // Shape must be (N,): one dimension.
  shape.erase(std::remove(shape.begin(), shape.end(), ' '), shape.end());
  if (!shape.empty() && shape.back() == ',') shape.pop_back();
  SPARROW_CHECK_T(FormatError,
                  !shape.empty() && shape.find(',') == std::string::npos &&
                      shape.find_first_not_of("0123456789") == std::string::npos && shape.size() < 16,
                  "npy '" << path << "': labels must be a 1-D array, got shape (" << shape << ")");
  const int64_t n = std::stoll(shape);
  struct Type {
    const char* descr;
    at::ScalarType type;
    size_t bytes;
  };
  // Little-endian or byte-order-free types only ('|' or '<'; '=' on this little-endian host).
  static const Type kTypes[] = {
      {"i1", at::kChar, 1}, {"u1", at::kByte, 1}, {"i2", at::kShort, 2}, {"u2", at::kInt, 2},   {"i4", at::kInt, 4},
      {"u4", at::kLong, 4}, {"i8", at::kLong, 8}, {"u8", at::kLong, 8},  {"f4", at::kFloat, 4}, {"f8", at::kDouble, 8}};
  SPARROW_CHECK_T(FormatError, descr.size() == 3 && (descr[0] == '<' || descr[0] == '|' || descr[0] == '='),
                  "npy '" << path << "': unsupported dtype '" << descr << "' (little-endian integers or floats)");
  const Type* type = nullptr;
  for (const Type& t : kTypes)
    if (descr.substr(1) == t.descr) type = &t;
  SPARROW_CHECK_T(FormatError, type != nullptr, "npy '" << path << "': unsupported dtype '" << descr << "'");
  const size_t data_start = start + len;
  SPARROW_CHECK_T(FormatError, bytes.size() - data_start == static_cast<size_t>(n) * type->bytes,
                  "npy '" << path << "': " << bytes.size() - data_start << " data bytes for " << n << " labels of '"
                          << descr << "'");
  const char* src = bytes.data() + data_start;
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const char* p = src + static_cast<size_t>(i) * type->bytes;
    const std::string d = type->descr;
    double v = 0;
    if (d == "i1") {
      int8_t x;
      std::memcpy(&x, p, 1);
      v = x;
    } else if (d == "u1") {
      uint8_t x;
      std::memcpy(&x, p, 1);
      v = x;
    } else if (d == "i2") {
      int16_t x;
      std::memcpy(&x, p, 2);
      v = x;
    } else if (d == "u2") {
      uint16_t x;
      std::memcpy(&x, p, 2);
      v = x;
    } else if (d == "i4") {
      int32_t x;
      std::memcpy(&x, p, 4);
      v = x;
    } else if (d == "u4") {
      uint32_t x;
      std::memcpy(&x, p, 4);
      v = x;
    } else if (d == "i8") {
      int64_t x;
      std::memcpy(&x, p, 8);
      v = static_cast<double>(x);
    } else if (d == "u8") {
      uint64_t x;
      std::memcpy(&x, p, 8);
      v = static_cast<double>(x);
    } else if (d == "f4") {
      float x;
      std::memcpy(&x, p, 4);
      v = x;
    } else {
      std::memcpy(&v, p, 8);
    }
    SPARROW_CHECK_T(FormatError, std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9e15,
                    "npy '" << path << "': label " << i << " is not a whole number (" << v << ")");
    out[static_cast<size_t>(i)] = static_cast<int64_t>(v);
  }
  return at::tensor(out, at::kLong);
}

Dataset load_data_folder(const std::string& dir) {
  SPARROW_CHECK_T(ConfigError, fs::is_directory(dir), "data: folder '" << dir << "' does not exist");
  const fs::path d(dir);
  Dataset out;
  if (fs::exists(d / "x.npy") || fs::exists(d / "y.npy")) {
    SPARROW_CHECK_T(ConfigError, fs::exists(d / "x.npy") && fs::exists(d / "y.npy"),
                    "data: folder '" << dir << "' needs both x.npy and y.npy");
    npy::Array x;
    try {
      x = npy::read((d / "x.npy").string(), /*convert_float64=*/true);
    } catch (const FormatError& e) {
      throw FormatError("data: " + (d / "x.npy").string() + ": " + e.what());
    }
    if (x.from_float64)
      spdlog::info(
          "event=data_converted file={} from=float64 to=float32 msg=\"numpy's default dtype; save x.astype('float32') "
          "to skip this\"",
          (d / "x.npy").string());
    SPARROW_CHECK_T(FormatError, x.shape.size() >= 2,
                    "data: " << (d / "x.npy").string() << " must be [N, ...] with at least 2 dimensions");
    out.x = at::from_blob(x.data.data(), x.shape, at::kFloat).clone();
    out.y = read_npy_labels((d / "y.npy").string());
  } else if (fs::exists(d / "train-images-idx3-ubyte") || fs::exists(d / "train-images-idx3-ubyte.gz")) {
    out = load_fashion_mnist(dir, "train");  // any MNIST-format folder
  } else {
    throw ConfigError("data: folder '" + dir +
                      "' holds neither x.npy + y.npy nor train-images-idx3-ubyte[.gz] + "
                      "train-labels-idx1-ubyte[.gz]");
  }
  SPARROW_CHECK_T(FormatError, out.x.size(0) == out.y.size(0),
                  "data: folder '" << dir << "': " << out.x.size(0) << " samples but " << out.y.size(0) << " labels");
  return out;
}

bool has_data_folder_test(const std::string& dir) {
  const fs::path d(dir);
  return fs::is_directory(d / "test") || fs::exists(d / "t10k-images-idx3-ubyte") ||
         fs::exists(d / "t10k-images-idx3-ubyte.gz");
}

bool has_client_ids(const std::string& dir) { return fs::is_regular_file(fs::path(dir) / kClientIdFile); }

std::optional<at::Tensor> load_client_ids(const std::string& dir, int64_t n) {
  if (!has_client_ids(dir)) return std::nullopt;
  const std::string path = (fs::path(dir) / kClientIdFile).string();
  at::Tensor ids;
  try {
    ids = read_npy_labels(path);  // integers (or whole floats), one dimension
  } catch (const FormatError& e) {
    throw FormatError("data: " + std::string(e.what()) + " (client ids: one integer per sample)");
  }
  SPARROW_CHECK_T(FormatError, ids.size(0) == n,
                  "data: " << path << " holds " << ids.size(0) << " client ids for " << n << " samples");
  return ids;
}

std::vector<std::vector<int64_t>> natural_partition(const at::Tensor& client_ids) {
  const at::Tensor ids = client_ids.to(at::kCPU, at::kLong).contiguous();
  const int64_t* v = ids.data_ptr<int64_t>();
  std::map<int64_t, std::vector<int64_t>> by_id;  // ascending ids; indices pushed in order, so sorted
  for (int64_t i = 0; i < ids.numel(); ++i) by_id[v[i]].push_back(i);
  std::vector<std::vector<int64_t>> parts;
  parts.reserve(by_id.size());
  for (auto& kv : by_id) parts.push_back(std::move(kv.second));
  return parts;
}

std::vector<std::vector<int64_t>> partition_folder(const at::Tensor& labels,
                                                   const std::optional<at::Tensor>& client_ids, int clients,
                                                   const std::string& partition, uint64_t seed) {
  if (partition == "natural") {
    SPARROW_CHECK_T(
        ConfigError, client_ids.has_value(),
        "partition: \"natural\" needs the folder's own client ids (" << kClientIdFile << ", one per sample)");
    return natural_partition(*client_ids);
  }
  return core::partition(labels, clients, partition, seed);
}

std::optional<Dataset> load_data_folder_test(const std::string& dir) {
  const fs::path d(dir);
  if (fs::is_directory(d / "test")) return load_data_folder((d / "test").string());
  if (fs::exists(d / "t10k-images-idx3-ubyte") || fs::exists(d / "t10k-images-idx3-ubyte.gz")) {
    return load_fashion_mnist(dir, "test");
  }
  return std::nullopt;
}

Dataset hold_out(Dataset& d, int64_t k, uint64_t seed, at::Tensor* ids) {
  at::Generator g = at::detail::createCPUGenerator(seed);
  const at::Tensor perm = at::randperm(d.size(), g, at::TensorOptions().dtype(at::kLong));
  Dataset held;
  held.x = d.x.index_select(0, perm.slice(0, 0, k));
  held.y = d.y.index_select(0, perm.slice(0, 0, k));
  d.x = d.x.index_select(0, perm.slice(0, k));
  d.y = d.y.index_select(0, perm.slice(0, k));
  if (ids != nullptr && ids->defined()) *ids = ids->index_select(0, perm.slice(0, k));
  return held;
}

void check_model_on_data(Model& model, const Dataset& d, const std::string& name, int64_t max_label) {
  const int64_t b = std::min<int64_t>(4, d.x.size(0));
  SPARROW_CHECK_T(ConfigError, b >= 1, "data: no samples to check model '" << name << "' with");
  if (max_label < 0) max_label = d.y.max().item<int64_t>();
  const at::Tensor x = d.x.slice(0, 0, b).to(at::kCPU).contiguous();
  at::Tensor out;
  try {
    c10::NoGradGuard ng;
    const bool was_training = model.is_training();
    model.eval();
    out = model.forward(x);
    model.train(was_training);
  } catch (const std::exception& e) {
    // One line: a TorchScript failure's reason is its last "RuntimeError: ..."
    // line (the first says only that the interpreter failed).
    const std::string text = error_text(e);
    std::string why = text.substr(0, text.find('\n'));
    for (size_t at = text.find("Error: "); at != std::string::npos; at = text.find("Error: ", at + 1)) {
      const size_t begin = at + 7, end = text.find('\n', begin);
      why = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    }
    throw ConfigError("model '" + name + "' cannot take the data: a forward pass on " + std::to_string(b) +
                      " samples of shape " + shape_text(x.sizes().slice(1)) + " failed: " + why);
  }
  SPARROW_CHECK_T(
      ConfigError, out.defined() && out.dim() == 2 && out.size(0) == b && at::isFloatingType(out.scalar_type()),
      "model '" << name << "' returned " << (out.defined() ? shape_text(out.sizes()) : std::string("nothing"))
                << " for " << b << " samples: it must return logits [" << b << ", classes] (docs/data-and-models.md)");
  SPARROW_CHECK_T(ConfigError, out.size(1) > max_label,
                  "model '" << name << "' has " << out.size(1) << " outputs (classes) but the data has label "
                            << max_label << ": it needs at least " << max_label + 1);
}

Dataset check_data_for_model(Dataset d, const std::string& model) {
  SPARROW_CHECK_T(ConfigError, d.x.defined() && d.y.defined() && d.x.dim() >= 1 && d.y.dim() == 1,
                  "data: x must be [N, ...] and y [N]");
  SPARROW_CHECK_T(ConfigError, d.x.size(0) == d.y.size(0) && d.y.size(0) >= 1,
                  "data: " << d.x.size(0) << " samples and " << d.y.size(0) << " labels (need the same, >= 1)");
  SPARROW_CHECK_T(ConfigError, at::isFloatingType(d.x.scalar_type()), "data: x must be floating point");
  if (d.x.scalar_type() != at::kFloat) d.x = d.x.to(at::kFloat);
  d.y = d.y.to(at::kLong);
  const bool scripted = model.rfind("torchscript:", 0) == 0;
  const int64_t lo = d.y.min().item<int64_t>(), hi = d.y.max().item<int64_t>();
  SPARROW_CHECK_T(ConfigError, lo >= 0, "data: labels must be >= 0 (found " << lo << ")");
  if (!scripted) {
    SPARROW_CHECK_T(ConfigError, hi < kBuiltinClasses,
                    "data: model '" << model << "' has " << kBuiltinClasses << " classes but a label is " << hi);
    const std::vector<int64_t> in = model_input_shape(model);
    int64_t want = 1;
    for (int64_t s : in) want *= s;
    const int64_t got = d.x.numel() / d.x.size(0);
    SPARROW_CHECK_T(ConfigError, got == want,
                    "data: samples of shape " << shape_text(d.x.sizes().slice(1)) << " do not fit model '" << model
                                              << "' (input " << shape_text(in) << ")");
    std::vector<int64_t> shape{d.x.size(0)};
    shape.insert(shape.end(), in.begin(), in.end());
    d.x = d.x.reshape(shape).contiguous();
  }
  return d;
}

}  // namespace sparrow::core
