#include "liteedge/data.h"

#include <spdlog/spdlog.h>
#if SPARROW_LITE_EDGE_ZLIB
#include <zlib.h>
#endif

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "liteclient/data.h"

namespace sparrow::liteedge {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kClasses = 10;  // the built-in models' (lite/model.h)
// core/idx.h's Fashion-MNIST normalisation: (byte / 255 - mean) / std in float.
constexpr float kMean = 0.2860f, kStd = 0.3530f;

// A whole gzip (or plain) file; FormatError naming it when it cannot be read.
std::string read_gz(const std::string& path) {
#if !SPARROW_LITE_EDGE_ZLIB
  throw ConfigError("data: this build of sparrow-edge-lite has no zlib to read '" + path +
                    "'; use data = \"folder:PATH\" (x.npy + y.npy)");
#else
  gzFile f = gzopen(path.c_str(), "rb");
  SPARROW_CHECK_T(ConfigError, f != nullptr, "data_dir: cannot open '" << path << "'");
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const int got = gzread(f, buf, sizeof buf);
    if (got < 0) {
      gzclose(f);
      throw FormatError("'" + path + "': read error (truncated or corrupt gzip?)");
    }
    if (got == 0) break;
    out.append(buf, static_cast<size_t>(got));
  }
  gzclose(f);
  return out;
#endif
}

std::string read_idx(const std::string& dir, const std::string& stem) {
  const fs::path plain = fs::path(dir) / stem;
  return read_gz(fs::exists(plain) ? plain.string() : plain.string() + ".gz");
}

uint32_t be32(const std::string& b, size_t at) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(b[at + i]);
  return v;
}

Samples keep_first(Samples s, int64_t n, int64_t per) {
  n = std::min(n, s.size());
  s.y.resize(static_cast<size_t>(n));
  s.x.resize(static_cast<size_t>(n * per));
  return s;
}

}  // namespace

Samples load_mnist_idx(const std::string& dir, const std::string& split) {
  const std::string images = read_idx(dir, split + "-images-idx3-ubyte");
  const std::string labels = read_idx(dir, split + "-labels-idx1-ubyte");
  const std::string what = dir + "/" + split;
  SPARROW_CHECK_T(FormatError, images.size() >= 16 && be32(images, 0) == 2051,
                  what << "-images-idx3-ubyte: not an IDX image file");
  SPARROW_CHECK_T(FormatError, labels.size() >= 8 && be32(labels, 0) == 2049,
                  what << "-labels-idx1-ubyte: not an IDX label file");
  const uint64_t n = be32(images, 4), rows = be32(images, 8), cols = be32(images, 12);
  SPARROW_CHECK_T(FormatError, be32(labels, 4) == n && labels.size() == 8 + n,
                  what << ": the label file does not hold one label per image");
  SPARROW_CHECK_T(FormatError, rows == 28 && cols == 28 && images.size() == 16 + n * rows * cols,
                  what << "-images-idx3-ubyte: expected " << n << " images of 28x28 bytes");
  float lut[256];
  for (int v = 0; v < 256; ++v) lut[v] = (static_cast<float>(v) / 255.0f - kMean) / kStd;
  Samples s;
  s.x.resize(static_cast<size_t>(n * rows * cols));
  for (size_t i = 0; i < s.x.size(); ++i) s.x[i] = lut[static_cast<unsigned char>(images[16 + i])];
  s.y.resize(static_cast<size_t>(n));
  for (size_t i = 0; i < n; ++i) {
    s.y[i] = static_cast<unsigned char>(labels[8 + i]);
    SPARROW_CHECK_T(FormatError, s.y[i] < kClasses, what << ": label " << s.y[i] << " of sample " << i);
  }
  return s;
}

DeviceData load_device_data(const DeviceConfig& cfg, int64_t input_size) {
  DeviceData d;
  const int64_t eval = static_cast<int64_t>(cfg.eval_samples);
  if (cfg.data.rfind("folder:", 0) == 0) {
    const std::string path = cfg.data.substr(7);
    liteclient::LocalData train = liteclient::load_local_data(path, input_size, kClasses);
    d.train.x = std::move(train.x);
    d.train.y = std::move(train.y);
    const fs::path test = fs::path(path) / "test";
    if (eval == 0) return d;
    if (!fs::exists(test / "x.npy")) {
      spdlog::info("event=no_eval msg=\"{} has no test split (test/x.npy + test/y.npy): no evaluation\"", path);
      return d;
    }
    liteclient::LocalData t = liteclient::load_local_data(test.string(), input_size, kClasses);
    d.test.x = std::move(t.x);
    d.test.y = std::move(t.y);
  } else {  // fashion-mnist (config.cc refuses every other source)
    SPARROW_CHECK_T(ConfigError, input_size == 784,
                    "data: fashion-mnist has 784 values per sample, the model takes " << input_size);
    d.train = load_mnist_idx(cfg.data_dir, "train");
    if (eval > 0) d.test = load_mnist_idx(cfg.data_dir, "t10k");
  }
  d.test = keep_first(std::move(d.test), eval, input_size);
  return d;
}

}  // namespace sparrow::liteedge
