#include "compression/state.h"

#include <ATen/ATen.h>

#include <cstring>

#include "core/bytes.h"
#include "core/error.h"

namespace sparrow::compression {
namespace {

constexpr char kMagic[4] = {'S', 'P', 'S', 'T'};
constexpr uint32_t kVersion = 2;  // 2 adds last_round; 1 is still read

using core::put_raw;

// A compressor state blob, read with its name in errors.
struct Reader : core::ByteReader {
  explicit Reader(const std::string& b) : core::ByteReader(b, "compressor state") {}
};

}  // namespace

at::Tensor& State::slot(const std::string& key, const at::Tensor& like) {
  auto it = tensors.find(key);
  if (it == tensors.end() || !it->second.sizes().equals(like.sizes())) {
    at::Tensor z = at::zeros(like.sizes(), at::TensorOptions().dtype(at::kFloat));
    it = tensors.insert_or_assign(key, z).first;
  }
  return it->second;
}

std::string State::serialize() const {
  std::string out(kMagic, 4);
  put_raw<uint32_t>(out, kVersion);
  put_raw<uint64_t>(out, step);
  put_raw<int64_t>(out, last_round);
  put_raw<uint32_t>(out, static_cast<uint32_t>(tensors.size()));
  for (const auto& [name, t] : tensors) {
    SPARROW_CHECK(t.scalar_type() == at::kFloat, "compressor state '" << name << "' is not float32");
    at::Tensor c = t.contiguous().cpu();
    put_raw<uint32_t>(out, static_cast<uint32_t>(name.size()));
    out += name;
    put_raw<uint32_t>(out, static_cast<uint32_t>(c.dim()));
    for (int64_t d : c.sizes()) put_raw<int64_t>(out, d);
    out.append(reinterpret_cast<const char*>(c.data_ptr<float>()), static_cast<size_t>(c.numel()) * 4);
  }
  return out;
}

State State::deserialize(const std::string& bytes) {
  Reader r(bytes);
  SPARROW_CHECK_T(FormatError, bytes.size() >= 4 && std::memcmp(r.take(4), kMagic, 4) == 0,
                  "compressor state: bad magic");
  const uint32_t version = r.get<uint32_t>();
  SPARROW_CHECK_T(FormatError, version == 1 || version == kVersion,
                  "compressor state: unsupported version " << version);
  State s;
  s.step = r.get<uint64_t>();
  if (version >= 2) {
    s.last_round = r.get<int64_t>();
    SPARROW_CHECK_T(FormatError, s.last_round >= -1, "compressor state: bad last round " << s.last_round);
  }
  const uint32_t count = r.get<uint32_t>();
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t name_len = r.get<uint32_t>();
    std::string name(r.take(name_len), name_len);
    const uint32_t dims = r.get<uint32_t>();
    SPARROW_CHECK_T(FormatError, dims <= 8, "compressor state: '" << name << "' has " << dims << " dims");
    std::vector<int64_t> shape(dims);
    uint64_t numel = 1;
    for (auto& d : shape) {
      d = r.get<int64_t>();
      SPARROW_CHECK_T(FormatError, d >= 0 && d < (int64_t{1} << 40), "compressor state: bad dimension " << d);
      numel *= static_cast<uint64_t>(d);
      SPARROW_CHECK_T(FormatError, numel < (uint64_t{1} << 40), "compressor state: tensor too large");
    }
    const char* data = r.take(numel * 4);
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
    if (numel) std::memcpy(t.data_ptr<float>(), data, numel * 4);
    SPARROW_CHECK_T(FormatError, s.tensors.emplace(std::move(name), t).second, "compressor state: duplicate slot");
  }
  SPARROW_CHECK_T(FormatError, r.done(), "compressor state: trailing bytes");
  return s;
}

std::string serialize_weights(const std::map<std::string, at::Tensor>& weights) {
  State s;
  for (const auto& [k, v] : weights) s.tensors[k] = v.to(at::kCPU, at::kFloat).contiguous();
  return s.serialize();
}

std::map<std::string, at::Tensor> deserialize_weights(const std::string& bytes) {
  if (bytes.empty()) return {};
  return State::deserialize(bytes).tensors;
}

}  // namespace sparrow::compression
