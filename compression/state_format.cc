#include "compression/state_format.h"

#include <cstring>
#include <set>

#include "core/bytes.h"
#include "core/error.h"

namespace sparrow::compression::state_format {
namespace {

constexpr char kMagic[4] = {'S', 'P', 'S', 'T'};
constexpr uint32_t kVersion = 2;  // 2 adds last_round; 1 is still read

template <typename T>
void put(const Sink& sink, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian hosts only (x86-64, arm64)
  sink(b, sizeof(T));
}

}  // namespace

uint64_t size(const std::vector<SlotView>& slots) {
  uint64_t n = 4 + 4 + 8 + 8 + 4;
  for (const SlotView& s : slots) {
    uint64_t numel = 1;
    for (size_t i = 0; i < s.dims; ++i) {
      SPARROW_CHECK(s.shape[i] >= 0, "compressor state '" << *s.name << "': negative dimension " << s.shape[i]);
      numel *= static_cast<uint64_t>(s.shape[i]);
    }
    SPARROW_CHECK(numel == s.count, "compressor state '" << *s.name << "' has " << s.count << " values for its shape");
    n += 4 + s.name->size() + 4 + 8 * s.dims + 4 * numel;
  }
  return n;
}

void write(const Header& h, const std::vector<SlotView>& slots, const Sink& sink) {
  size(slots);  // checks every slot before any byte leaves
  sink(kMagic, 4);
  put<uint32_t>(sink, kVersion);
  put<uint64_t>(sink, h.step);
  put<int64_t>(sink, h.last_round);
  put<uint32_t>(sink, static_cast<uint32_t>(slots.size()));
  for (const SlotView& s : slots) {
    put<uint32_t>(sink, static_cast<uint32_t>(s.name->size()));
    sink(s.name->data(), s.name->size());
    put<uint32_t>(sink, static_cast<uint32_t>(s.dims));
    for (size_t i = 0; i < s.dims; ++i) put<int64_t>(sink, s.shape[i]);
    if (s.count) sink(reinterpret_cast<const char*>(s.data), s.count * sizeof(float));
  }
}

std::string write(const Header& h, const std::vector<SlotView>& slots) {
  std::string out;
  out.reserve(static_cast<size_t>(size(slots)));
  write(h, slots, [&out](const char* p, size_t n) { out.append(p, n); });
  return out;
}

Header read(const char* p, size_t n, const SlotAlloc& alloc) {
  core::ByteReader r(p, n, "compressor state");
  SPARROW_CHECK_T(FormatError, n >= 4 && std::memcmp(r.take(4), kMagic, 4) == 0, "compressor state: bad magic");
  const uint32_t version = r.get<uint32_t>();
  SPARROW_CHECK_T(FormatError, version == 1 || version == kVersion,
                  "compressor state: unsupported version " << version);
  Header h;
  h.step = r.get<uint64_t>();
  if (version >= 2) {
    h.last_round = r.get<int64_t>();
    SPARROW_CHECK_T(FormatError, h.last_round >= -1, "compressor state: bad last round " << h.last_round);
  }
  const uint32_t count = r.get<uint32_t>();
  std::set<std::string> seen;
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
    const char* data = r.take(numel * 4);  // bounds-checked before anything is allocated
    SPARROW_CHECK_T(FormatError, seen.insert(name).second, "compressor state: duplicate slot");
    float* dst = alloc(std::move(name), shape);
    if (numel) std::memcpy(dst, data, numel * 4);
  }
  SPARROW_CHECK_T(FormatError, r.done(), "compressor state: trailing bytes");
  return h;
}

}  // namespace sparrow::compression::state_format
