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
constexpr uint32_t kVersion = 1;         // fp32: what every build reads
constexpr uint32_t kVersionEncoded = 2;  // says its encoding; a stored form per tensor
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

namespace {

constexpr uint8_t kFloatCode = 1;  // kDtypes' float32
constexpr uint8_t kBf16Code = 4;   // kDtypes' bfloat16

// Whether `encoding` stores this float32 tensor as bf16 (a compressor slot
// narrowable_slot() names, or a float32 control).
bool stored_narrow(Encoding encoding, const at::Tensor& t) {
  return encoding == Encoding::kBf16 && t.scalar_type() == at::kFloat;
}

// Throws, naming the tensor, when a float32 tensor bf16 would store holds a
// value bf16 cannot (c: the CPU contiguous tensor).
void check_fits_bf16(const std::string& what, const at::Tensor& c) {
  size_t bad = 0;
  SPARROW_CHECK(
      fits_bf16(c.data_ptr<float>(), static_cast<size_t>(c.numel()), &bad),
      "client state: " << what << " holds " << c.data_ptr<float>()[bad] << " at element " << bad
                       << ", which state_encoding = \"bf16\" cannot store (not finite or beyond bf16's range)");
}

// Version 2's tensor record: name, u8 dtype (in memory), u8 stored (on disk:
// the dtype, or bf16 for a float32 stored narrow), u32 dims, i64 shape, data.
void put_tensor(std::string& out, const std::string& name, const std::string& what, const at::Tensor& t, bool narrow) {
  const at::Tensor c = t.detach().to(at::kCPU).contiguous();
  put_name(out, name);
  put_raw<uint8_t>(out, code_of(c.scalar_type()));
  put_raw<uint8_t>(out, narrow ? kBf16Code : code_of(c.scalar_type()));
  put_raw<uint32_t>(out, static_cast<uint32_t>(c.dim()));
  for (int64_t d : c.sizes()) put_raw<int64_t>(out, d);
  if (!narrow) {
    out.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
    return;
  }
  const size_t n = static_cast<size_t>(c.numel());
  const size_t at = out.size();
  out.resize(at + 2 * n);
  size_t bad = 0;
  if (!to_bf16(c.data_ptr<float>(), reinterpret_cast<uint16_t*>(&out[at]), n, &bad)) check_fits_bf16(what, c);
}

at::ScalarType type_of(uint8_t code, const std::string& name) {
  for (const auto& d : kDtypes)
    if (d.code == code) return d.type;
  throw FormatError("client state: '" + name + "' has unknown dtype code " + std::to_string(code));
}

// Shape of a tensor record (v1 control or v2), checked against absurd sizes.
std::vector<int64_t> read_shape(core::ByteReader& r, const std::string& name, uint64_t* numel) {
  const uint32_t dims = r.get<uint32_t>();
  SPARROW_CHECK_T(FormatError, dims <= kMaxDims, "client state: '" << name << "' has " << dims << " dims");
  std::vector<int64_t> shape(dims);
  *numel = 1;
  for (auto& d : shape) {
    d = r.get<int64_t>();
    SPARROW_CHECK_T(FormatError, d >= 0 && d < (int64_t{1} << 40),
                    "client state: '" << name << "' has bad dimension " << d);
    *numel *= static_cast<uint64_t>(d);
    SPARROW_CHECK_T(FormatError, *numel < (uint64_t{1} << 40), "client state: '" << name << "' too large");
  }
  return shape;
}

// Data of `numel` elements stored as `stored`, returned as `type`.
at::Tensor read_data(core::ByteReader& r, const std::vector<int64_t>& shape, uint64_t numel, at::ScalarType type,
                     at::ScalarType stored) {
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type));
  const char* data = r.take(numel * at::elementSize(stored));
  if (numel == 0) return t;
  if (stored == type)
    std::memcpy(t.data_ptr(), data, numel * at::elementSize(type));
  else  // bf16 widened to float32 (the only narrowing read_v2 accepts)
    from_bf16(reinterpret_cast<const uint16_t*>(data), t.data_ptr<float>(), numel);
  return t;
}

// A version 2 tensor record; float32_only: a compressor slot.
std::pair<std::string, at::Tensor> read_tensor(Reader& r, bool float32_only) {
  std::string name = r.name();
  const uint8_t code = r.get<uint8_t>(), stored_code = r.get<uint8_t>();
  const at::ScalarType type = type_of(code, name), stored = type_of(stored_code, name);
  SPARROW_CHECK_T(FormatError, stored_code == code || (code == kFloatCode && stored_code == kBf16Code),
                  "client state: '" << name << "' is " << type << " stored as " << stored);
  SPARROW_CHECK_T(FormatError, !float32_only || code == kFloatCode,
                  "client state: compressor slot '" << name << "' is " << type << ", not float32");
  uint64_t numel = 0;
  const std::vector<int64_t> shape = read_shape(r, name, &numel);
  return {std::move(name), read_data(r, shape, numel, type, stored)};
}

}  // namespace

std::string ClientState::serialize(Encoding encoding) const {
  for (const auto& [name, t] : control) check_storable(name, t);
  std::string out;
  out.reserve(approx_bytes() + 4096);  // tensor bytes plus headers: one allocation, no regrowth
  out.append(kMagic, 4);
  if (encoding == Encoding::kFp32) {
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
  put_raw<uint32_t>(out, kVersionEncoded);
  put_raw<uint8_t>(out, static_cast<uint8_t>(encoding));
  put_raw<uint64_t>(out, rng);
  put_raw<uint64_t>(out, rounds);
  put_raw<uint32_t>(out, static_cast<uint32_t>(compressor.size()));
  for (const auto& [name, s] : compressor) {
    put_name(out, name);
    put_raw<uint64_t>(out, s.step);
    put_raw<int64_t>(out, s.last_round);
    put_raw<uint32_t>(out, static_cast<uint32_t>(s.tensors.size()));
    for (const auto& [slot, t] : s.tensors) {
      check_compressor_tensor(name, slot, t);
      put_tensor(out, slot, "compressor '" + name + "' slot '" + slot + "'", t,
                 narrowable_slot(slot) && stored_narrow(encoding, t));
    }
  }
  put_raw<uint32_t>(out, static_cast<uint32_t>(control.size()));
  for (const auto& [name, t] : control) put_tensor(out, name, "control '" + name + "'", t, stored_narrow(encoding, t));
  return out;
}

ClientState ClientState::deserialize(const std::string& bytes) {
  Reader r(bytes);
  SPARROW_CHECK_T(FormatError, bytes.size() >= 4 && std::memcmp(r.take(4), kMagic, 4) == 0,
                  "client state: bad magic (not a client state)");
  const uint32_t version = r.get<uint32_t>();
  SPARROW_CHECK_T(FormatError, version == kVersion || version == kVersionEncoded,
                  "client state: unsupported version " << version << " (this build reads " << kVersion << " and "
                                                       << kVersionEncoded << ")");
  ClientState s;
  if (version == kVersionEncoded) {
    const uint8_t encoding = r.get<uint8_t>();
    SPARROW_CHECK_T(FormatError, encoding <= static_cast<uint8_t>(Encoding::kBf16),
                    "client state: unknown encoding " << int(encoding));
  }
  s.rng = r.get<uint64_t>();
  s.rounds = r.get<uint64_t>();
  const uint32_t n_compressor = r.get<uint32_t>();
  for (uint32_t i = 0; i < n_compressor; ++i) {
    std::string name = r.name();
    compression::State cs;
    if (version == kVersionEncoded) {
      cs.step = r.get<uint64_t>();
      cs.last_round = r.get<int64_t>();
      SPARROW_CHECK_T(FormatError, cs.last_round >= -1,
                      "client state: compressor '" << name << "' has bad last round " << cs.last_round);
      const uint32_t n_slots = r.get<uint32_t>();
      for (uint32_t j = 0; j < n_slots; ++j) {
        auto [slot, t] = read_tensor(r, /*float32_only=*/true);
        SPARROW_CHECK_T(FormatError, cs.tensors.emplace(std::move(slot), std::move(t)).second,
                        "client state: compressor '" << name << "' has a duplicate slot");
      }
    } else {
      const uint64_t len = r.get<uint64_t>();
      std::string blob(r.take(len), len);
      try {
        cs = compression::State::deserialize(blob);
      } catch (const FormatError& e) {
        throw FormatError("client state: compressor '" + name + "': " + e.what());
      }
    }
    SPARROW_CHECK_T(FormatError, s.compressor.emplace(name, std::move(cs)).second,
                    "client state: duplicate compressor entry '" << name << "'");
  }
  const uint32_t n_control = r.get<uint32_t>();
  for (uint32_t i = 0; i < n_control; ++i) {
    if (version == kVersionEncoded) {
      auto [name, t] = read_tensor(r, /*float32_only=*/false);
      SPARROW_CHECK_T(FormatError, s.control.emplace(std::move(name), std::move(t)).second,
                      "client state: duplicate control entry");
      continue;
    }
    std::string name = r.name();
    const at::ScalarType type = type_of(r.get<uint8_t>(), "control " + name);
    uint64_t numel = 0;
    const std::vector<int64_t> shape = read_shape(r, "control " + name, &numel);
    at::Tensor t = read_data(r, shape, numel, type, type);
    SPARROW_CHECK_T(FormatError, s.control.emplace(std::move(name), t).second, "client state: duplicate control entry");
  }
  SPARROW_CHECK_T(FormatError, r.done(), "client state: trailing bytes");
  return s;
}

void ClientState::round_to(Encoding encoding) {
  if (encoding == Encoding::kFp32) return;
  // The tensors to round and their CPU contiguous float32 views, all checked
  // before the first one changes.
  std::vector<std::pair<at::Tensor*, at::Tensor>> narrow;
  for (auto& [name, cs] : compressor)
    for (auto& [slot, t] : cs.tensors) {
      check_compressor_tensor(name, slot, t);
      if (!narrowable_slot(slot)) continue;
      narrow.emplace_back(&t, t.detach().to(at::kCPU).contiguous());
      check_fits_bf16("compressor '" + name + "' slot '" + slot + "'", narrow.back().second);
    }
  for (auto& [name, t] : control) {
    check_storable(name, t);
    if (!stored_narrow(encoding, t)) continue;
    narrow.emplace_back(&t, t.detach().to(at::kCPU).contiguous());
    check_fits_bf16("control '" + name + "'", narrow.back().second);
  }
  for (auto& [t, c] : narrow) {
    round_to_bf16(c.data_ptr<float>(), static_cast<size_t>(c.numel()), nullptr);
    if (c.data_ptr() != t->data_ptr()) t->copy_(c);  // a GPU or strided tensor: rounded in a copy
  }
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
