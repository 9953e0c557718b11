// Packed tensor lists (packed.h). Layout, all varints unsigned LEB128:
//   names    varint n, then n x (varint bytes, UTF-8 name, varint ndims, ndims x varint dim)
//   lists    varint L >= 1: list 0 = Task.weights, lists 1 .. L-1 = Task.chain
//   list     varint count, then count records
//   record   varint name index, byte format, byte value type, byte index coding,
//            varint count, varint seed, varint #params, params (varints),
//            varint #scales, scales (fp32 little-endian), varint #index bytes,
//            index bytes, varint #value bytes, value bytes
// Fields mean what they mean in an EncodedTensor (sparrow.fbs).
#include "wire/packed.h"

#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "compression/codec_bits.h"
#include "wire/checks.h"

namespace sparrow::wire {
namespace {

namespace c = compression;
using detail::fail;

constexpr size_t kMaxDims = 8;
// What a packed field adds to its message besides its bytes, at most.
constexpr size_t kFieldBytes = 16;

using c::detail::varint_len;

void put_varint(std::string& out, uint64_t v) {
  uint8_t buf[10];
  out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(c::detail::put_varint(buf, v) - buf));
}

void put_bytes(std::string& out, const uint8_t* p, size_t n) {
  put_varint(out, n);
  out.append(reinterpret_cast<const char*>(p), n);
}

void put_f32(std::string& out, float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}

// A bounds-checked reader: every overrun or malformed varint is kMalformed.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), end_(p + n) {}
  bool done() const { return p_ == end_; }
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  uint64_t varint(const char* what) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ == end_) truncated(what);
      const uint8_t b = *p_++;
      if (shift == 63 && b > 1) break;
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    fail(ErrorCode::kMalformed, std::string("packed tensors: ") + what + " is not a valid varint");
  }
  // A count of items of at least `item_bytes` each: never more than the bytes left.
  size_t count(const char* what, size_t item_bytes = 1) {
    const uint64_t n = varint(what);
    if (n > left() / item_bytes) truncated(what);
    return static_cast<size_t>(n);
  }
  uint8_t byte(const char* what) {
    if (p_ == end_) truncated(what);
    return *p_++;
  }
  const uint8_t* take(size_t n, const char* what) {
    if (n > left()) truncated(what);
    const uint8_t* at = p_;
    p_ += n;
    return at;
  }
  float f32(const char* what) {
    const uint8_t* b = take(4, what);
    const uint32_t u = uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }

 private:
  [[noreturn]] static void truncated(const char* what) {
    fail(ErrorCode::kMalformed, std::string("packed tensors: truncated at ") + what);
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

struct Entry {
  std::string name;
  std::vector<int64_t> shape;
};

NamedTensor read_record(Reader& r, const std::vector<Entry>& names, uint64_t& budget, c::ValueCheck check) {
  const uint64_t idx = r.varint("a tensor's name index");
  if (idx >= names.size())
    fail(ErrorCode::kMalformed,
         "packed tensors: name index " + std::to_string(idx) + " outside the table of " + std::to_string(names.size()));
  NamedTensor out;
  out.name = names[idx].name;
  const std::string& name = out.name;
  c::Encoded& e = out.tensor;
  const uint8_t format = r.byte("a format"), value_type = r.byte("a value type"), coding = r.byte("an index coding");
  detail::set_kinds(e, format, value_type, coding, name);
  e.shape = names[idx].shape;
  budget -= detail::checked_numel(e.shape, budget, name);
  e.count = r.varint("a count");
  e.seed = r.varint("a seed");
  e.params.resize(r.count("params"));
  for (auto& p : e.params) {
    const uint64_t v = r.varint("a param");
    if (v > UINT32_MAX)
      fail(ErrorCode::kMalformed, "tensor '" + name + "': param " + std::to_string(v) + " > 2^32 - 1");
    p = static_cast<uint32_t>(v);
  }
  e.scales.resize(r.count("scales", 4));
  for (auto& s : e.scales) s = r.f32("a scale");
  const size_t ni = r.count("index bytes");
  const uint8_t* ip = r.take(ni, "index bytes");
  e.indices.assign(ip, ip + ni);
  const size_t nv = r.count("value bytes");
  const uint8_t* vp = r.take(nv, "value bytes");
  e.values.assign(vp, vp + nv);
  detail::check_payload(e, check, name);
  return out;
}

std::vector<NamedTensor> read_list(Reader& r, const std::vector<Entry>& names, uint64_t& budget,
                                   c::ValueCheck check = c::ValueCheck::kScan) {
  // A record takes at least 9 bytes (index, three kinds, five counts).
  const size_t n = r.count("a list's tensor count", 9);
  std::vector<NamedTensor> out;
  out.reserve(n);
  std::unordered_set<std::string> seen;
  for (size_t i = 0; i < n; ++i) {
    out.push_back(read_record(r, names, budget, check));
    if (!seen.insert(out.back().name).second)
      fail(ErrorCode::kMalformed, "duplicate tensor name '" + out.back().name + "'");
  }
  return out;
}

}  // namespace

size_t packed_tensor_size(const c::Encoded& e, size_t name_index) {
  size_t n = varint_len(name_index) + 3 + varint_len(e.count) + varint_len(e.seed) + varint_len(e.params.size());
  for (uint32_t p : e.params) n += varint_len(p);
  n += varint_len(e.scales.size()) + 4 * e.scales.size();
  n += varint_len(e.indices.size()) + e.indices.size() + varint_len(e.values.size()) + e.values.size();
  return n;
}

size_t packed_list_size(const std::vector<NamedTensor>& ts, const std::vector<size_t>& name_index) {
  size_t n = varint_len(ts.size());
  for (size_t i = 0; i < ts.size(); ++i)
    n += packed_tensor_size(ts[i].tensor, i < name_index.size() ? name_index[i] : i);
  return n;
}

size_t packed_frame_size(const std::vector<std::string>& names, const std::vector<std::vector<int64_t>>& shapes,
                         size_t lists) {
  // The field (an upper bound): its offset (4), the vector's length (4), up
  // to 3 bytes of padding, its vtable slot (2) and the vtable's own padding.
  size_t n = kFieldBytes + varint_len(names.size()) + varint_len(lists);
  for (size_t i = 0; i < names.size(); ++i) {
    n += varint_len(names[i].size()) + names[i].size();
    const auto& s = i < shapes.size() ? shapes[i] : std::vector<int64_t>{};
    n += varint_len(s.size());
    for (int64_t d : s) n += varint_len(static_cast<uint64_t>(d));
  }
  return n;
}

bool packs_well(const ModelUpdate& u, uint16_t server_minor) {
  if (server_minor < kPackedMinor) return false;
  for (const auto& nt : u.tensors)
    if (nt.tensor.format == c::Format::kDense) return false;
  return true;
}

size_t packed_size(const std::vector<NamedTensor>& weights, const std::vector<std::vector<NamedTensor>>& chain) {
  return kFieldBytes + detail::pack(weights, chain).size();
}

namespace detail {

std::string pack(const std::vector<NamedTensor>& weights, const std::vector<std::vector<NamedTensor>>& chain) {
  // The name table, in order of first appearance; a name's shape is its
  // first tensor's (every later one must agree).
  std::vector<const NamedTensor*> table;
  std::unordered_map<std::string, size_t> index;
  auto note = [&](const std::vector<NamedTensor>& list) {
    for (const NamedTensor& nt : list) {
      auto [it, fresh] = index.emplace(nt.name, table.size());
      if (fresh)
        table.push_back(&nt);
      else
        SPARROW_CHECK(table[it->second]->tensor.shape == nt.tensor.shape,
                      "packed tensors: '" << nt.name << "' with two shapes in one message");
    }
  };
  note(weights);
  for (const auto& step : chain) note(step);
  std::string out;
  put_varint(out, table.size());
  for (const NamedTensor* nt : table) {
    put_bytes(out, reinterpret_cast<const uint8_t*>(nt->name.data()), nt->name.size());
    put_varint(out, nt->tensor.shape.size());
    for (int64_t d : nt->tensor.shape) put_varint(out, static_cast<uint64_t>(d));
  }
  put_varint(out, 1 + chain.size());
  auto write = [&](const std::vector<NamedTensor>& list) {
    put_varint(out, list.size());
    for (const NamedTensor& nt : list) {
      const c::Encoded& e = nt.tensor;
      put_varint(out, index.at(nt.name));
      out.push_back(static_cast<char>(e.format));
      out.push_back(static_cast<char>(e.value_type));
      out.push_back(static_cast<char>(e.index_coding));
      put_varint(out, e.count);
      put_varint(out, e.seed);
      put_varint(out, e.params.size());
      for (uint32_t p : e.params) put_varint(out, p);
      put_varint(out, e.scales.size());
      for (float s : e.scales) put_f32(out, s);
      put_bytes(out, e.indices.data(), e.indices.size());
      put_bytes(out, e.values.data(), e.values.size());
    }
  };
  write(weights);
  for (const auto& step : chain) write(step);
  return out;
}

Unpacked unpack(const uint8_t* data, size_t size, uint64_t& budget, uint64_t list_budget, c::ValueCheck check,
                size_t max_lists) {
  Reader r(data, size);
  // A table entry takes at least 3 bytes (length, a name byte, ndims).
  const size_t n = r.count("the name table's size", 3);
  std::vector<Entry> names(n);
  std::unordered_set<std::string> seen;
  for (size_t i = 0; i < n; ++i) {
    const size_t len = r.count("a name's length");
    const uint8_t* p = r.take(len, "a name");
    if (len == 0) fail(ErrorCode::kMalformed, "packed tensors: name " + std::to_string(i) + " is empty");
    if (len > kMaxTextBytes || !detail::valid_text(reinterpret_cast<const char*>(p), len))
      fail(ErrorCode::kMalformed, "packed tensors: name " + std::to_string(i) + " is not valid UTF-8 of at most " +
                                      std::to_string(kMaxTextBytes) + " bytes");
    names[i].name.assign(reinterpret_cast<const char*>(p), len);
    if (!seen.insert(names[i].name).second)
      fail(ErrorCode::kMalformed, "packed tensors: name '" + names[i].name + "' twice in the table");
    const size_t dims = r.count("a shape's size");
    if (dims > kMaxDims)
      fail(ErrorCode::kMalformed, "tensor '" + names[i].name + "' has " + std::to_string(dims) + " dimensions (max 8)");
    for (size_t d = 0; d < dims; ++d) {
      const uint64_t v = r.varint("a dimension");
      if (v > static_cast<uint64_t>(INT64_MAX))
        fail(ErrorCode::kMalformed, "tensor '" + names[i].name + "': dimension out of range");
      names[i].shape.push_back(static_cast<int64_t>(v));
    }
  }
  const size_t lists = r.count("the list count");
  if (lists == 0 || lists > max_lists)
    fail(ErrorCode::kMalformed, "packed tensors: " + std::to_string(lists) + " lists (1 to " +
                                    (max_lists == SIZE_MAX ? std::string("any") : std::to_string(max_lists)) + ")");
  Unpacked out;
  out.weights = read_list(r, names, budget, check);
  out.chain.reserve(lists - 1);
  for (size_t l = 1; l < lists; ++l) {
    uint64_t own = list_budget;
    out.chain.push_back(read_list(r, names, list_budget > 0 ? own : budget));
  }
  if (!r.done())
    fail(ErrorCode::kMalformed, "packed tensors: " + std::to_string(r.left()) + " bytes after the last list");
  return out;
}

}  // namespace detail
}  // namespace sparrow::wire
