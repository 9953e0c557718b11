#include "core/idx.h"

#include <ATen/ATen.h>
#include <zlib.h>

#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "core/error.h"

namespace sparrow::core {
namespace {

// A gzip or plain file (zlib reads plain files transparently), closed on
// scope exit; read() throws FormatError on a read error or a corrupt stream.
class GzFile {
 public:
  explicit GzFile(const std::string& path) : path_(path), f_(gzopen(path.c_str(), "rb")) {
    SPARROW_CHECK_T(FormatError, f_ != nullptr, "cannot open '" << path << "'");
    gzbuffer(f_, 1 << 17);
  }
  ~GzFile() { gzclose(f_); }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;
  // Up to n bytes into p; returns how many (fewer only at the end of the data).
  size_t read(void* p, size_t n) {
    size_t done = 0;
    while (done < n) {
      const unsigned ask = static_cast<unsigned>(std::min<size_t>(n - done, size_t{1} << 30));
      const int got = gzread(f_, static_cast<char*>(p) + done, ask);
      if (got < 0 || (got == 0 && !gzeof(f_))) {
        int errnum = 0;
        const char* msg = gzerror(f_, &errnum);
        throw FormatError("'" + path_ + "': " + (msg ? msg : "read error") + " (truncated or corrupt gzip?)");
      }
      if (got == 0) break;
      done += static_cast<size_t>(got);
    }
    return done;
  }
  // Everything left, counted (for the error message of a file longer than its header says).
  size_t skip_rest() {
    char buf[1 << 16];
    size_t n = 0;
    for (size_t got; (got = read(buf, sizeof buf)) > 0;) n += got;
    return n;
  }

 private:
  std::string path_;
  gzFile f_;
};

// An uninitialised tensor. A large one (a data set) is 2 MiB aligned
// and advised to transparent huge pages: Fashion-MNIST's 188 MB of training
// floats are then a hundred page faults instead of 46,000, which cost 0.5-1 s
// of start-up on a VM where a fault costs ~20 us. Advice only: without THP
// they are 4 KiB pages as before.
at::Tensor empty_large(const std::vector<int64_t>& shape, at::ScalarType type) {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = static_cast<size_t>(n) * at::elementSize(type);
  if (bytes < 4 * kHuge) return at::empty(shape, at::TensorOptions().dtype(type));
  const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, size);
  if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  (void)::madvise(p, size, MADV_HUGEPAGE);
#endif
  return at::from_blob(
      p, shape, [](void* q) { std::free(q); }, at::TensorOptions().dtype(type));
}

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

}  // namespace

at::Tensor read_idx(const std::string& path) {
  // Header first, then the data straight into the tensor: no 47 MB staging
  // string and copy for Fashion-MNIST's training images.
  GzFile f(path);
  unsigned char head[4 + 4 * 4] = {};
  const size_t got = f.read(head, 4);
  SPARROW_CHECK_T(FormatError, got == 4 && head[0] == 0 && head[1] == 0, "'" << path << "' is not an IDX file");
  SPARROW_CHECK_T(FormatError, head[2] == 0x08, "'" << path << "': IDX data type " << int(head[2]) << " is not uint8");
  const int dims = head[3];
  SPARROW_CHECK_T(FormatError, dims >= 1 && dims <= 4 && f.read(head + 4, 4u * dims) == 4u * dims,
                  "'" << path << "': bad IDX header");
  std::vector<int64_t> shape(dims);
  uint64_t numel = 1;
  for (int d = 0; d < dims; ++d) {
    const unsigned char* p = head + 4 + 4 * d;
    shape[d] = (int64_t{p[0]} << 24) | (p[1] << 16) | (p[2] << 8) | p[3];
    numel *= static_cast<uint64_t>(shape[d]);
  }
  SPARROW_CHECK_T(FormatError, numel <= (uint64_t{1} << 34),
                  "'" << path << "': header says " << numel << " data bytes (more than 16 GiB)");
  at::Tensor t = empty_large(shape, at::kByte);
  const size_t have = f.read(t.data_ptr<uint8_t>(), numel);
  const size_t extra = have == numel ? f.skip_rest() : 0;
  SPARROW_CHECK_T(FormatError, have == numel && extra == 0,
                  "'" << path << "': " << (have + extra) << " data bytes, header says " << numel);
  return t;
}

at::Tensor normalize_bytes(const at::Tensor& bytes, float mean, float std, const at::Tensor& rows) {
  SPARROW_CHECK_T(FormatError, bytes.scalar_type() == at::kByte, "normalize_bytes: uint8 tensor expected");
  // The 256 possible values go through ATen's expression once; the images are
  // then one table lookup per pixel into one allocation. The expression on the
  // whole split made four 188 MB float tensors for Fashion-MNIST's training
  // images: 2.6 s of a client's start-up, most of it page faults.
  const at::Tensor levels = at::arange(256, at::TensorOptions().dtype(at::kByte));
  const at::Tensor table = ((levels.to(at::kFloat).div_(255.0f) - mean) / std).contiguous();
  const float* lut = table.data_ptr<float>();
  const at::Tensor in = bytes.contiguous();
  const uint8_t* src = in.data_ptr<uint8_t>();
  if (!rows.defined()) {
    at::Tensor out = empty_large(in.sizes().vec(), at::kFloat);
    float* dst = out.data_ptr<float>();
    const int64_t n = in.numel();
    for (int64_t i = 0; i < n; ++i) dst[i] = lut[src[i]];
    return out;
  }
  SPARROW_CHECK(in.dim() >= 1 && rows.dim() == 1 && rows.scalar_type() == at::kLong,
                "normalize_bytes: rows must be int64 indices into dim 0");
  const at::Tensor r = rows.contiguous();
  const int64_t* idx = r.data_ptr<int64_t>();
  const int64_t count = r.numel(), total = in.size(0), row = total > 0 ? in.numel() / total : 0;
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = count;
  at::Tensor out = empty_large(shape, at::kFloat);
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < count; ++i) {
    SPARROW_CHECK(idx[i] >= 0 && idx[i] < total, "normalize_bytes: row " << idx[i] << " of " << total);
    const uint8_t* s = src + idx[i] * row;
    float* d = dst + i * row;
    for (int64_t j = 0; j < row; ++j) d[j] = lut[s[j]];
  }
  return out;
}

ImageSplit load_mnist_format(const std::string& dir, const std::string& split, float mean, float std) {
  ImageSplit s = load_mnist_bytes(dir, split);
  s.images = normalize_bytes(s.images, mean, std);
  return s;
}

ImageSplit load_mnist_bytes(const std::string& dir, const std::string& split) {
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
  s.images = images.unsqueeze(1);
  s.labels = labels.to(at::kLong);
  return s;
}

}  // namespace sparrow::core
