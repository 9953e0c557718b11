#include "lite/model_file.h"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "kernels/cpu.h"

namespace sparrow::lite {
namespace {

static_assert(sizeof(float) == 4, "float must be IEEE-754 binary32");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the lite model file reader and writer assume a little-endian host"
#endif

constexpr char kMagic[8] = {'S', 'P', 'R', 'W', 'L', 'I', 'T', 'E'};
constexpr uint32_t kMaxRank = 8;
constexpr uint32_t kMaxLayers = 4096;
constexpr uint32_t kMaxParams = 16;
constexpr uint32_t kMaxName = 1024;
constexpr int64_t kMaxDim = int64_t{1} << 31;

uint64_t fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

class Writer {
 public:
  template <typename T>
  void put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  void shape(const Shape& s) {
    put<uint32_t>(static_cast<uint32_t>(s.size()));
    for (int64_t d : s) put<int64_t>(d);
  }
  std::vector<uint8_t> out;
};

class Reader {
 public:
  Reader(const uint8_t* p, size_t n, const std::string& what) : p_(p), n_(n), what_(what) {}
  template <typename T>
  T get(const char* field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, p_ + off_, sizeof(T));
    off_ += sizeof(T);
    return v;
  }
  uint32_t count(const char* field, uint32_t max) {
    const auto v = get<uint32_t>(field);
    fail_if(v > max, std::string(field) + " " + std::to_string(v) + " is over the limit " + std::to_string(max));
    return v;
  }
  Shape shape(const char* field, bool allow_empty) {
    const uint32_t rank = count(field, kMaxRank);
    fail_if(rank == 0 && !allow_empty, std::string(field) + " has rank 0");
    Shape s(rank);
    for (auto& d : s) {
      d = get<int64_t>(field);
      fail_if(d < 1 || d > kMaxDim, std::string(field) + " has dimension " + std::to_string(d));
    }
    return s;
  }
  const uint8_t* take(size_t n, const char* field) {
    need(n, field);
    const uint8_t* at = p_ + off_;
    off_ += n;
    return at;
  }
  size_t offset() const { return off_; }
  void fail_if(bool bad, const std::string& why) const {
    if (bad) throw FormatError("lite model file '" + what_ + "': " + why);
  }

 private:
  void need(size_t n, const char* field) const {
    fail_if(n > n_ - off_, std::string("truncated (") + std::to_string(n_) + " bytes; ends inside " + field + ")");
  }
  const uint8_t* p_;
  size_t n_, off_ = 0;
  const std::string& what_;
};

}  // namespace

std::vector<uint8_t> encode_model_file(const ModelSpec& spec, const std::vector<float>& values) {
  Model check(spec);  // refuses a spec no reader could build
  SPARROW_LITE_CHECK(static_cast<int64_t>(values.size()) == check.num_values(),
                     "lite model file: " << values.size() << " values for a model of " << check.num_values());
  Writer w;
  w.bytes(kMagic, sizeof kMagic);
  w.put<uint32_t>(kModelFileVersion);
  w.put<uint32_t>(0);
  w.shape(spec.input_shape);
  w.put<uint32_t>(static_cast<uint32_t>(spec.layers.size()));
  for (const LayerSpec& l : spec.layers) {
    w.put<uint32_t>(static_cast<uint32_t>(l.kind));
    for (int64_t v : {l.in, l.out, l.kh, l.kw, l.sh, l.sw, l.ph, l.pw, l.bias, l.flag}) w.put<int64_t>(v);
    w.put<float>(l.p);
    w.put<float>(l.eps);
    // Frozen tensors first (a LoRA layer's weight and bias), then the parameters.
    w.put<uint32_t>(static_cast<uint32_t>(l.frozen.size() + l.param_names.size()));
    for (const FrozenTensor& f : l.frozen) {
      w.put<uint32_t>(static_cast<uint32_t>(f.name.size()));
      w.bytes(f.name.data(), f.name.size());
      w.shape(f.shape);
    }
    for (size_t i = 0; i < l.param_names.size(); ++i) {
      w.put<uint32_t>(static_cast<uint32_t>(l.param_names[i].size()));
      w.bytes(l.param_names[i].data(), l.param_names[i].size());
      w.shape(l.param_shapes[i]);
    }
  }
  // Every tensor listed above, in that order: the flat vector's values with
  // each layer's frozen values before its parameters'.
  uint64_t total = values.size();
  for (const LayerSpec& l : spec.layers)
    for (const FrozenTensor& f : l.frozen) total += f.value->size();
  w.put<uint64_t>(total);
  size_t at = 0;
  for (const LayerSpec& l : spec.layers) {
    for (const FrozenTensor& f : l.frozen) w.bytes(f.value->data(), f.value->size() * sizeof(float));
    size_t n = 0;
    for (const Shape& s : l.param_shapes) n += static_cast<size_t>(numel(s));
    w.bytes(values.data() + at, n * sizeof(float));
    at += n;
  }
  w.put<uint64_t>(fnv1a(w.out.data(), w.out.size()));
  return std::move(w.out);
}

ModelFile decode_model_file(const uint8_t* data, size_t size, const std::string& what) {
  Reader r(data, size, what);
  r.fail_if(size < sizeof kMagic || std::memcmp(data, kMagic, sizeof kMagic) != 0,
            "not a lite model file (no SPRWLITE magic)");
  r.take(sizeof kMagic, "magic");
  const auto version = r.get<uint32_t>("version");
  r.fail_if(version != kModelFileVersion,
            "version " + std::to_string(version) + ", this runtime reads version " + std::to_string(kModelFileVersion));
  // The checksum first: a damaged file gets one clear message, not whatever
  // field the damage happened to hit.
  r.fail_if(size < sizeof kMagic + 8 + 8, "truncated (" + std::to_string(size) + " bytes)");
  uint64_t stored;
  std::memcpy(&stored, data + size - 8, 8);
  r.fail_if(fnv1a(data, size - 8) != stored, "checksum mismatch (the file is damaged or truncated)");
  r.fail_if(r.get<uint32_t>("flags") != 0, "unknown flags");

  ModelFile f;
  f.spec.input_shape = r.shape("input shape", false);
  const uint32_t layers = r.count("layer count", kMaxLayers);
  int64_t expected = 0;
  for (uint32_t i = 0; i < layers; ++i) {
    LayerSpec l;
    l.kind = static_cast<LayerKind>(r.get<uint32_t>("layer kind"));
    for (int64_t* v : {&l.in, &l.out, &l.kh, &l.kw, &l.sh, &l.sw, &l.ph, &l.pw, &l.bias, &l.flag}) {
      *v = r.get<int64_t>("layer field");
      r.fail_if(*v < 0 || *v > kMaxDim, "layer " + std::to_string(i) + " has a field out of range");
    }
    l.p = r.get<float>("layer p");
    l.eps = r.get<float>("layer eps");
    // The kind says how many of the leading tensors are frozen (LoRA's weight
    // and bias); a file that lists fewer fails the model check below.
    const size_t frozen = frozen_count(l.kind, l.bias);
    const uint32_t params = r.count("parameter count", kMaxParams);
    for (uint32_t j = 0; j < params; ++j) {
      const uint32_t len = r.count("parameter name length", kMaxName);
      const uint8_t* name = r.take(len, "parameter name");
      std::string text(reinterpret_cast<const char*>(name), len);
      Shape shape = r.shape("parameter shape", true);
      expected += numel(shape);
      r.fail_if(expected > kMaxDim, "more than 2^31 parameter values");
      if (j < frozen) {
        l.frozen.push_back(FrozenTensor{std::move(text), std::move(shape), nullptr});
      } else {
        l.param_names.push_back(std::move(text));
        l.param_shapes.push_back(std::move(shape));
      }
    }
    f.spec.layers.push_back(std::move(l));
  }
  const auto count = r.get<uint64_t>("value count");
  r.fail_if(count != static_cast<uint64_t>(expected),
            "holds " + std::to_string(count) + " values, its layers need " + std::to_string(expected));
  const uint8_t* vals = r.take(count * sizeof(float), "values");  // not aligned for float: memcpy only
  // Frozen values go to their layer's spec; the parameters' make the flat vector.
  f.values.reserve(static_cast<size_t>(count));
  for (LayerSpec& l : f.spec.layers) {
    for (FrozenTensor& t : l.frozen) {
      auto v = std::make_shared<std::vector<float>>(static_cast<size_t>(numel(t.shape)));
      std::memcpy(v->data(), vals, v->size() * sizeof(float));
      vals += v->size() * sizeof(float);
      t.value = std::move(v);
    }
    for (const Shape& s : l.param_shapes) {
      const auto n = static_cast<size_t>(numel(s));
      f.values.resize(f.values.size() + n);
      std::memcpy(f.values.data() + f.values.size() - n, vals, n * sizeof(float));
      vals += n * sizeof(float);
    }
  }
  r.fail_if(r.offset() + 8 != size, std::to_string(size - r.offset() - 8) + " unexpected bytes after the values");
  try {
    Model check(f.spec);
  } catch (const Error& e) {
    throw FormatError("lite model file '" + what + "': " + e.what());
  }
  return f;
}

void save_model_file(const std::string& path, const ModelSpec& spec, const std::vector<float>& values) {
  const std::vector<uint8_t> bytes = encode_model_file(spec, values);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    SPARROW_LITE_CHECK(out.good(), "cannot write lite model file '" << tmp << "'");
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    out.close();
    SPARROW_LITE_CHECK(out.good(), "cannot write lite model file '" << tmp << "'");
  }
  SPARROW_LITE_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0,
                     "cannot rename '" << tmp << "' to lite model file '" << path << "'");
}

ModelFile load_model_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_LITE_CHECK(in.good(), "cannot open lite model file '" << path << "'");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  SPARROW_LITE_CHECK(!in.bad(), "cannot read lite model file '" << path << "'");
  return decode_model_file(bytes.data(), bytes.size(), path);
}

std::unique_ptr<Model> load_model(const std::string& path) {
  // This file is compiled with SPARROW_LITE_ARCH_FLAGS, as the layers are.
  SPARROW_KERNELS_REQUIRE_BUILD_ISA("this sparrow-lite build (SPARROW_LITE_ARCH_FLAGS)",
                                    "rebuild with -DSPARROW_LITE_ARCH_FLAGS= for a portable build");
  ModelFile f = load_model_file(path);
  auto m = std::make_unique<Model>(std::move(f.spec));
  m->set_values(f.values);
  return m;
}

}  // namespace sparrow::lite
