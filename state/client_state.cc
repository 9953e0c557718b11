#include "state/client_state.h"

#include <ATen/ATen.h>

#include <cstring>
#include <utility>
#include <vector>

#include "core/bytes.h"
#include "core/error.h"

namespace sparrow::state {
namespace {

constexpr char kMagic[4] = {'S', 'P', 'C', 'L'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kMaxDims = 8;
// Per-entry bookkeeping counted on top of tensor bytes (map node, TensorImpl,
// name): keeps a cache of many tiny states from under-counting.
constexpr size_t kEntryOverhead = 128;

// Dtype codes on disk are ours, not at::ScalarType's numbering (which may move).
struct DtypeCode {
  uint8_t code;
  at::ScalarType type;
};
constexpr DtypeCode kDtypes[] = {
    {1, at::kFloat}, {2, at::kDouble}, {3, at::kHalf}, {4, at::kBFloat16}, {5, at::kLong},
    {6, at::kInt},   {7, at::kChar},   {8, at::kByte}, {9, at::kBool},
};

uint8_t code_of(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.code;
  return 0;
}

void check_storable(const std::string& name, const at::Tensor& t) {
  SPARROW_CHECK(t.defined(), "client state: control tensor '" << name << "' is undefined");
  SPARROW_CHECK(t.layout() == at::kStrided, "client state: control tensor '" << name << "' is not dense");
  SPARROW_CHECK(code_of(t.scalar_type()) != 0,
                "client state: control tensor '" << name << "' has unsupported dtype " << t.scalar_type());
  SPARROW_CHECK(t.dim() <= static_cast<int64_t>(kMaxDims),
                "client state: control tensor '" << name << "' has " << t.dim() << " dims");
}

void check_compressor_tensor(const std::string& entry, const std::string& slot, const at::Tensor& t) {
  SPARROW_CHECK(t.defined() && t.layout() == at::kStrided && t.scalar_type() == at::kFloat,
                "client state: compressor '" << entry << "' slot '" << slot << "' is not a dense float32 tensor");
}

// Independent CPU contiguous copy (never aliases the source's storage).
at::Tensor owned_copy(const at::Tensor& t) { return t.detach().to(at::kCPU).clone(at::MemoryFormat::Contiguous); }

using core::put_raw;

void put_name(std::string& out, const std::string& name) {
  put_raw<uint32_t>(out, static_cast<uint32_t>(name.size()));
  out += name;
}

// A client state blob, read with its name in errors, plus its names.
struct Reader : core::ByteReader {
  explicit Reader(const std::string& b) : core::ByteReader(b, "client state") {}
  std::string name() {
    const uint32_t len = get<uint32_t>();
    return std::string(take(len), len);
  }
};

}  // namespace

std::string ClientState::serialize() const {
  for (const auto& [name, t] : control) check_storable(name, t);
  std::string out;
  out.reserve(approx_bytes() + 4096);  // tensor bytes plus headers: one allocation, no regrowth
  out.append(kMagic, 4);
  put_raw<uint32_t>(out, kVersion);
  put_raw<uint64_t>(out, rng);
  put_raw<uint64_t>(out, rounds);
  put_raw<uint32_t>(out, static_cast<uint32_t>(compressor.size()));
  for (const auto& [name, s] : compressor) {
    put_name(out, name);
    const std::string blob = s.serialize();
    put_raw<uint64_t>(out, blob.size());
    out += blob;
  }
  put_raw<uint32_t>(out, static_cast<uint32_t>(control.size()));
  for (const auto& [name, t] : control) {
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    put_name(out, name);
    put_raw<uint8_t>(out, code_of(c.scalar_type()));
    put_raw<uint32_t>(out, static_cast<uint32_t>(c.dim()));
    for (int64_t d : c.sizes()) put_raw<int64_t>(out, d);
    out.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
  }
  return out;
}

ClientState ClientState::deserialize(const std::string& bytes) {
  Reader r(bytes);
  SPARROW_CHECK_T(FormatError, bytes.size() >= 4 && std::memcmp(r.take(4), kMagic, 4) == 0,
                  "client state: bad magic (not a client state)");
  const uint32_t version = r.get<uint32_t>();
  SPARROW_CHECK_T(FormatError, version == kVersion,
                  "client state: unsupported version " << version << " (this build reads " << kVersion << ")");
  ClientState s;
  s.rng = r.get<uint64_t>();
  s.rounds = r.get<uint64_t>();
  const uint32_t n_compressor = r.get<uint32_t>();
  for (uint32_t i = 0; i < n_compressor; ++i) {
    std::string name = r.name();
    const uint64_t len = r.get<uint64_t>();
    std::string blob(r.take(len), len);
    compression::State cs;
    try {
      cs = compression::State::deserialize(blob);
    } catch (const FormatError& e) {
      throw FormatError("client state: compressor '" + name + "': " + e.what());
    }
    SPARROW_CHECK_T(FormatError, s.compressor.emplace(name, std::move(cs)).second,
                    "client state: duplicate compressor entry '" << name << "'");
  }
  const uint32_t n_control = r.get<uint32_t>();
  for (uint32_t i = 0; i < n_control; ++i) {
    std::string name = r.name();
    const uint8_t code = r.get<uint8_t>();
    at::ScalarType type = at::kFloat;
    bool known = false;
    for (const auto& d : kDtypes)
      if (d.code == code) type = d.type, known = true;
    SPARROW_CHECK_T(FormatError, known, "client state: control '" << name << "' has unknown dtype code " << int(code));
    const uint32_t dims = r.get<uint32_t>();
    SPARROW_CHECK_T(FormatError, dims <= kMaxDims, "client state: control '" << name << "' has " << dims << " dims");
    std::vector<int64_t> shape(dims);
    uint64_t numel = 1;
    for (auto& d : shape) {
      d = r.get<int64_t>();
      SPARROW_CHECK_T(FormatError, d >= 0 && d < (int64_t{1} << 40),
                      "client state: control '" << name << "' has bad dimension " << d);
      numel *= static_cast<uint64_t>(d);
      SPARROW_CHECK_T(FormatError, numel < (uint64_t{1} << 40), "client state: control '" << name << "' too large");
    }
    const uint64_t nbytes = numel * at::elementSize(type);
    const char* data = r.take(nbytes);
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type));
    if (nbytes) std::memcpy(t.data_ptr(), data, nbytes);
    SPARROW_CHECK_T(FormatError, s.control.emplace(std::move(name), t).second, "client state: duplicate control entry");
  }
  SPARROW_CHECK_T(FormatError, r.done(), "client state: trailing bytes");
  return s;
}

ClientState ClientState::deep_copy() const {
  ClientState c;
  c.rng = rng;
  c.rounds = rounds;
  for (const auto& [name, s] : compressor) {
    compression::State cs;
    cs.step = s.step;
    cs.last_round = s.last_round;
    for (const auto& [slot, t] : s.tensors) {
      check_compressor_tensor(name, slot, t);
      cs.tensors.emplace(slot, owned_copy(t));
    }
    c.compressor.emplace(name, std::move(cs));
  }
  for (const auto& [name, t] : control) {
    check_storable(name, t);
    c.control.emplace(name, owned_copy(t));
  }
  return c;
}

namespace {
// True when nothing else can reach t's memory: the tensor object and its
// storage have one owner each, and it is a contiguous CPU view of the whole
// storage.
bool sole_owner(const at::Tensor& t) {
  return t.device().is_cpu() && !t.requires_grad() && t.is_contiguous() && t.storage_offset() == 0 &&
         t.use_count() == 1 && t.storage().use_count() == 1 &&
         t.storage().nbytes() == static_cast<size_t>(t.numel()) * t.element_size();
}
}  // namespace

ClientState ClientState::into_owned(ClientState&& s) {
  // Check everything first, so an error leaves `s` as it was.
  for (const auto& [name, cs] : s.compressor)
    for (const auto& [slot, t] : cs.tensors) check_compressor_tensor(name, slot, t);
  for (const auto& [name, t] : s.control) check_storable(name, t);
  ClientState c = std::move(s);
  for (auto& [name, cs] : c.compressor)
    for (auto& [slot, t] : cs.tensors)
      if (!sole_owner(t)) t = owned_copy(t);
  for (auto& [name, t] : c.control)
    if (!sole_owner(t)) t = owned_copy(t);
  return c;
}

size_t ClientState::approx_bytes() const {
  size_t n = sizeof(ClientState);
  for (const auto& [name, s] : compressor) {
    n += kEntryOverhead + name.size();
    for (const auto& [slot, t] : s.tensors) n += kEntryOverhead + slot.size() + (t.defined() ? t.nbytes() : 0);
  }
  for (const auto& [name, t] : control) n += kEntryOverhead + name.size() + (t.defined() ? t.nbytes() : 0);
  return n;
}

}  // namespace sparrow::state
