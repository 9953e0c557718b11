// flat::CodecState's bytes (act_codec_flat.h): what a torch-free split device
// keeps of its codec in its progress file.
#include <cmath>
#include <cstring>

#include "core/bytes.h"
#include "core/error.h"
#include "edge/codec/act_codec_flat.h"

namespace sparrow::edge::flat {
namespace {

constexpr char kMagic[4] = {'S', 'P', 'A', 'C'};
constexpr uint32_t kVersion = 1;
// A state matrix is [M, R] with M the activation's features per sample
// (< 2^31) and R <= 4096 (the codec's rank limit).
constexpr int64_t kMaxElements = (int64_t{1} << 31) - 1;

void put_matrix(core::ByteWriter& w, const Matrix& m) {
  w.put<int64_t>(m.empty() ? 0 : m.rows).put<int64_t>(m.empty() ? 0 : m.cols);
  w.put_span(m.data.data(), 4 * m.data.size());
}

Matrix get_matrix(core::ByteReader& r, const char* name) {
  Matrix m;
  m.rows = r.get<int64_t>();
  m.cols = r.get<int64_t>();
  if (m.rows == 0 && m.cols == 0) return m;
  SPARROW_CHECK_T(FormatError, m.rows > 0 && m.cols > 0 && m.rows <= kMaxElements && m.cols <= 4096,
                  "codec state: bad " << name << " shape " << m.rows << "x" << m.cols);
  const uint64_t n = static_cast<uint64_t>(m.rows) * static_cast<uint64_t>(m.cols);
  // Check the bytes are there before sizing the vector (no huge allocation
  // from a lying header).
  SPARROW_CHECK_T(FormatError, n <= r.left() / 4, "codec state: " << name << " truncated");
  m.data.resize(n);
  r.read(m.data.data(), 4 * n);
  for (float v : m.data) SPARROW_CHECK_T(FormatError, std::isfinite(v), "codec state: non-finite " << name);
  return m;
}

}  // namespace

std::string CodecState::serialize() const {
  std::string out;
  core::ByteWriter w(out);
  w.put_span(kMagic, 4).put<uint32_t>(kVersion).put<uint32_t>(basis_id).put<uint32_t>(refresh_next ? 1 : 0);
  w.put<uint64_t>(steps);
  put_matrix(w, basis);
  put_matrix(w, sketch);
  put_matrix(w, tracker);
  return out;
}

CodecState CodecState::deserialize(const std::string& bytes) {
  core::ByteReader r(bytes, "codec state");
  SPARROW_CHECK_T(FormatError, std::memcmp(r.take(4), kMagic, 4) == 0, "codec state: not a codec state (magic)");
  const uint32_t version = r.get<uint32_t>();
  SPARROW_CHECK_T(FormatError, version == kVersion,
                  "codec state: version " << version << " (this build reads " << kVersion << ")");
  CodecState s;
  s.basis_id = r.get<uint32_t>();
  const uint32_t flags = r.get<uint32_t>();
  SPARROW_CHECK_T(FormatError, (flags & ~uint32_t{1}) == 0, "codec state: unknown flags " << flags);
  s.refresh_next = (flags & 1) != 0;
  s.steps = r.get<uint64_t>();
  s.basis = get_matrix(r, "basis");
  s.sketch = get_matrix(r, "sketch");
  s.tracker = get_matrix(r, "tracker");
  SPARROW_CHECK_T(FormatError, r.done(), "codec state: " << r.left() << " trailing bytes");
  SPARROW_CHECK_T(FormatError, s.basis.empty() || s.basis_id != 0, "codec state: a basis without an id");
  return s;
}

}  // namespace sparrow::edge::flat
