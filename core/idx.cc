#include "core/idx.h"

#include <ATen/ATen.h>
#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sys/stat.h>

#include "core/error.h"

namespace sparrow::core {
namespace {

// The size `path` will have once read: a gzip file's trailer holds it mod
// 2^32, a plain file is its own size; 0 when unknown. Only a hint for reserve().
size_t size_hint(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return 0;
  const std::streamoff size = in.tellg();
  unsigned char magic[2] = {0, 0}, b[4] = {0, 0, 0, 0};
  in.seekg(0);
  in.read(reinterpret_cast<char*>(magic), 2);
  if (!(magic[0] == 0x1f && magic[1] == 0x8b && size >= 18)) return size > 0 ? static_cast<size_t>(size) : 0;
  in.seekg(size - 4);
  in.read(reinterpret_cast<char*>(b), 4);
  if (!in) return 0;
  const uint32_t isize = b[0] | (b[1] << 8) | (b[2] << 16) | (uint32_t{b[3]} << 24);
  return std::min<size_t>(isize, size_t{1} << 31);
}

std::string read_all(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");  // reads plain files transparently
  SPARROW_CHECK_T(FormatError, f != nullptr, "cannot open '" << path << "'");
  std::string out;
  out.reserve(size_hint(path));  // saves the growing string's copies of 47 MB
  char buf[1 << 16];
  int got;
  while ((got = gzread(f, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(got));
  int errnum = 0;
  const char* msg = gzerror(f, &errnum);
  const bool bad = got < 0 || (errnum != Z_OK && errnum != Z_STREAM_END);
  const std::string err = bad ? std::string(msg) : "";
  gzclose(f);
  SPARROW_CHECK_T(FormatError, !bad, "'" << path << "': " << err << " (truncated or corrupt gzip?)");
  return out;
}

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

}  // namespace

at::Tensor read_idx(const std::string& path) {
  const std::string b = read_all(path);
  SPARROW_CHECK_T(FormatError, b.size() >= 4 && b[0] == 0 && b[1] == 0, "'" << path << "' is not an IDX file");
  SPARROW_CHECK_T(FormatError, static_cast<unsigned char>(b[2]) == 0x08,
                  "'" << path << "': IDX data type " << int(static_cast<unsigned char>(b[2])) << " is not uint8");
  const int dims = static_cast<unsigned char>(b[3]);
  SPARROW_CHECK_T(FormatError, dims >= 1 && dims <= 4 && b.size() >= 4u + 4u * dims,
                  "'" << path << "': bad IDX header");
  std::vector<int64_t> shape(dims);
  uint64_t numel = 1;
  for (int d = 0; d < dims; ++d) {
    const auto* p = reinterpret_cast<const unsigned char*>(b.data()) + 4 + 4 * d;
    shape[d] = (int64_t{p[0]} << 24) | (p[1] << 16) | (p[2] << 8) | p[3];
    numel *= static_cast<uint64_t>(shape[d]);
  }
  const size_t off = 4 + 4 * static_cast<size_t>(dims);
  SPARROW_CHECK_T(FormatError, b.size() - off == numel,
                  "'" << path << "': " << (b.size() - off) << " data bytes, header says " << numel);
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(at::kByte));
  std::memcpy(t.data_ptr<uint8_t>(), b.data() + off, numel);
  return t;
}

at::Tensor normalize_bytes(const at::Tensor& bytes, float mean, float std) {
  SPARROW_CHECK_T(FormatError, bytes.scalar_type() == at::kByte, "normalize_bytes: uint8 tensor expected");
  // The 256 possible values go through ATen's expression once; the images are
  // then one table lookup per pixel into one allocation. The expression on the
  // whole split made four 188 MB float tensors for Fashion-MNIST's training
  // images: 2.6 s of a client's start-up, most of it page faults.
  const at::Tensor levels = at::arange(256, at::TensorOptions().dtype(at::kByte));
  const at::Tensor table = ((levels.to(at::kFloat).div_(255.0f) - mean) / std).contiguous();
  const float* lut = table.data_ptr<float>();
  const at::Tensor in = bytes.contiguous();
  at::Tensor out = at::empty(in.sizes(), at::TensorOptions().dtype(at::kFloat));
  const uint8_t* src = in.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const int64_t n = in.numel();
  for (int64_t i = 0; i < n; ++i) dst[i] = lut[src[i]];
  return out;
}

ImageSplit load_mnist_format(const std::string& dir, const std::string& split, float mean, float std) {
  SPARROW_CHECK_T(ConfigError, split == "train" || split == "test",
                  "split must be 'train' or 'test', got '" << split << "'");
  const std::string prefix = dir + "/" + (split == "train" ? "train" : "t10k");
  auto pick = [](const std::string& base) {
    if (exists(base + ".gz")) return base + ".gz";
    if (exists(base)) return base;
    throw ConfigError("dataset file '" + base +
                      "[.gz]' not found (install the Debian package "
                      "dataset-fashion-mnist, or point the data path at an MNIST-format folder)");
  };
  at::Tensor images = read_idx(pick(prefix + "-images-idx3-ubyte"));
  at::Tensor labels = read_idx(pick(prefix + "-labels-idx1-ubyte"));
  SPARROW_CHECK_T(FormatError, images.dim() == 3 && labels.dim() == 1 && images.size(0) == labels.size(0),
                  "'" << dir << "': images " << images.sizes() << " and labels " << labels.sizes() << " do not match");
  ImageSplit s;
  s.images = normalize_bytes(images, mean, std).unsqueeze(1);
  s.labels = labels.to(at::kLong);
  return s;
}

}  // namespace sparrow::core
