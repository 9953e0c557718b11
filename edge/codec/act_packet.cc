// ActPacket: names, the byte serialisation and the structural checks
// (act_packet.h). Torch-free.
#include "edge/codec/act_packet.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "core/bytes.h"
#include "core/error.h"

namespace sparrow::edge {
namespace {

constexpr int64_t kMaxNumel = (int64_t{1} << 31) - 1;
constexpr size_t kMaxDims = 8;

// Rows and columns of the matrix view of a packet's shape.
std::pair<int64_t, int64_t> matrix_dims(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return {shape[0], n / shape[0]};
}

bool all_finite(const float* v, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i])) return false;
  return true;
}

uint64_t code_bytes(uint64_t n, uint32_t bits) { return bits == 8 ? n : (n + 1) / 2; }

}  // namespace

const char* act_format_name(ActFormat f) {
  switch (f) {
    case ActFormat::kDense:
      return "dense";
    case ActFormat::kLowRank:
      return "lowrank";
    case ActFormat::kProjected:
      return "projected";
    case ActFormat::kQuant:
      return "quant";
    case ActFormat::kTopK:
      return "topk";
    case ActFormat::kLowRankCached:
      return "lowrank_cached";
    case ActFormat::kLowRankQ:
      return "lowrank_q";
    case ActFormat::kLowRankCachedQ:
      return "lowrank_cached_q";
    case ActFormat::kProjectedQ:
      return "projected_q";
  }
  return "unknown";
}

int64_t ActPacket::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t ActPacket::wire_bytes() const {
  return kHeaderBytes + 8 * shape.size() + 4 * params.size() + 4 * scales.size() + data.size();
}

std::vector<uint8_t> ActPacket::serialize() const {
  std::vector<uint8_t> out;
  out.reserve(wire_bytes());
  core::VecByteWriter w(out);
  w.put<uint8_t>(static_cast<uint8_t>(format))
      .put<uint8_t>(static_cast<uint8_t>(shape.size()))
      .put<uint16_t>(want_gradient ? 1 : 0)
      .put<uint32_t>(static_cast<uint32_t>(params.size()))
      .put<uint32_t>(static_cast<uint32_t>(scales.size()))
      .put<uint64_t>(static_cast<uint64_t>(data.size()));
  for (int64_t d : shape) w.put<int64_t>(d);
  w.put_span(params.data(), 4 * params.size()).put_span(scales.data(), 4 * scales.size());
  w.put_span(data.data(), data.size());
  return out;
}

ActPacket ActPacket::deserialize(const uint8_t* bytes, size_t size) {
  core::ByteReader r(bytes, size, "activation packet");
  ActPacket p;
  const uint8_t format = r.get<uint8_t>();
  SPARROW_CHECK_T(FormatError, format <= static_cast<uint8_t>(ActFormat::kProjectedQ),
                  "activation packet: unknown format " << int{format});
  p.format = static_cast<ActFormat>(format);
  const uint8_t ndim = r.get<uint8_t>();
  const uint16_t flags = r.get<uint16_t>();
  SPARROW_CHECK_T(FormatError, (flags & ~uint16_t{1}) == 0, "activation packet: unknown flags " << flags);
  p.want_gradient = (flags & 1) != 0;
  const uint32_t nparams = r.get<uint32_t>(), nscales = r.get<uint32_t>();
  const uint64_t ndata = r.get<uint64_t>();
  // Size the vectors only after checking the bytes are there (no huge allocations
  // from a lying header).
  const uint64_t need = uint64_t{8} * ndim + uint64_t{4} * nparams + uint64_t{4} * nscales + ndata;
  SPARROW_CHECK_T(FormatError, need == r.left(),
                  "activation packet: header announces " << need << " bytes, " << r.left() << " follow");
  p.shape.resize(ndim);
  for (auto& d : p.shape) d = r.get<int64_t>();
  p.params.resize(nparams);
  r.read(p.params.data(), 4 * size_t{nparams});
  p.scales.resize(nscales);
  r.read(p.scales.data(), 4 * size_t{nscales});
  p.data.resize(ndata);
  r.read(p.data.data(), ndata);
  validate(p);
  return p;
}

void validate(const ActPacket& p) {
  const char* f = act_format_name(p.format);
  SPARROW_CHECK_T(FormatError, !p.shape.empty() && p.shape.size() <= kMaxDims,
                  f << " packet: " << p.shape.size() << " dimensions (1.." << kMaxDims << " allowed)");
  int64_t numel = 1;
  for (int64_t d : p.shape) {
    SPARROW_CHECK_T(FormatError, d > 0 && d <= kMaxNumel, f << " packet: bad dimension " << d);
    numel *= d;
    SPARROW_CHECK_T(FormatError, numel <= kMaxNumel, f << " packet: too many elements");
  }
  const auto [rows, cols] = matrix_dims(p.shape);
  auto need_params = [&](size_t n) {
    SPARROW_CHECK_T(FormatError, p.params.size() == n, f << " packet: " << p.params.size() << " params, need " << n);
  };
  auto need_data = [&](uint64_t n) {
    SPARROW_CHECK_T(FormatError, p.data.size() == n, f << " packet: " << p.data.size() << " data bytes, need " << n);
  };
  auto need_scales = [&](uint64_t n) {
    SPARROW_CHECK_T(FormatError, p.scales.size() == n, f << " packet: " << p.scales.size() << " scales, need " << n);
  };
  auto floats_finite = [&](size_t offset, uint64_t count) {
    for (uint64_t i = 0; i < count; ++i) {
      float v;
      std::memcpy(&v, p.data.data() + offset + 4 * i, 4);
      SPARROW_CHECK_T(FormatError, std::isfinite(v), f << " packet: non-finite value");
    }
  };
  switch (p.format) {
    case ActFormat::kDense:
      need_params(0);
      need_scales(0);
      need_data(uint64_t{4} * static_cast<uint64_t>(numel));
      floats_finite(0, static_cast<uint64_t>(numel));
      break;
    case ActFormat::kLowRank:
    case ActFormat::kLowRankCached: {
      need_params(4);
      need_scales(0);
      SPARROW_CHECK_T(FormatError, p.params[0] == rows && p.params[1] == cols,
                      f << " packet: factors " << p.params[0] << "x" << p.params[1] << " do not match the shape");
      const uint64_t r = p.params[2];
      // A data basis (streaming) may have more directions than one batch has rows.
      SPARROW_CHECK_T(FormatError, r >= 1 && r <= static_cast<uint64_t>(cols), f << " packet: bad rank " << r);
      SPARROW_CHECK_T(FormatError, p.params[3] >= 1, f << " packet: basis id 0");
      const uint64_t n = r * static_cast<uint64_t>(p.format == ActFormat::kLowRank ? rows + cols : rows);
      need_data(4 * n);
      floats_finite(0, n);
      break;
    }
    case ActFormat::kProjected: {
      need_params(2);
      need_scales(0);
      const uint64_t r = p.params[1];
      SPARROW_CHECK_T(FormatError, p.params[0] == rows,
                      "projected packet: " << p.params[0] << " rows, shape has " << rows);
      SPARROW_CHECK_T(FormatError, r >= 1 && r <= static_cast<uint64_t>(cols), "projected packet: bad rank " << r);
      need_data(4 * r * static_cast<uint64_t>(rows));
      floats_finite(0, r * static_cast<uint64_t>(rows));
      break;
    }
    case ActFormat::kLowRankQ:
    case ActFormat::kLowRankCachedQ:
    case ActFormat::kProjectedQ: {
      const bool projected = p.format == ActFormat::kProjectedQ;
      need_params(projected ? 3 : 7);
      const uint64_t r = projected ? p.params[1] : p.params[2];
      const uint32_t bits = projected ? p.params[2] : p.params[4];
      SPARROW_CHECK_T(FormatError, p.params[0] == rows && (projected || p.params[1] == cols),
                      f << " packet: factor dimensions do not match the shape");
      SPARROW_CHECK_T(FormatError, r >= 1 && r <= static_cast<uint64_t>(cols), f << " packet: bad rank " << r);
      SPARROW_CHECK_T(FormatError, bits == 8 || bits == 4, f << " packet: bits must be 8 or 4, not " << bits);
      if (!projected) {
        SPARROW_CHECK_T(FormatError, p.params[3] >= 1, f << " packet: basis id 0");
        const uint32_t gbits = p.params[5];
        SPARROW_CHECK_T(FormatError, gbits == 32 || gbits == 8 || gbits == 4,
                        f << " packet: gradient bits must be 32, 8 or 4, not " << gbits);
        SPARROW_CHECK_T(FormatError, p.params[6] == 8 || p.params[6] == 4,
                        f << " packet: basis bits must be 8 or 4, not " << p.params[6]);
      }
      const bool with_q = p.format == ActFormat::kLowRankQ;
      need_scales(2 * r * (with_q ? 2 : 1));
      SPARROW_CHECK_T(FormatError, all_finite(p.scales.data(), p.scales.size()), f << " packet: non-finite scale");
      for (uint64_t b = 0; b < p.scales.size() / 2; ++b) {
        // The largest code must decode to a finite value too (finite but huge
        // scales would otherwise decode to inf).
        const float levels = b < r ? static_cast<float>((1u << bits) - 1) : static_cast<float>((1u << p.params[6]) - 1);
        SPARROW_CHECK_T(FormatError, p.scales[2 * b + 1] >= 0, f << " packet: negative step");
        SPARROW_CHECK_T(FormatError, std::isfinite(p.scales[2 * b] + levels * p.scales[2 * b + 1]),
                        f << " packet: scale range overflows");
      }
      need_data(code_bytes(r * static_cast<uint64_t>(rows), bits) +
                (with_q ? code_bytes(r * static_cast<uint64_t>(cols), p.params[6]) : uint64_t{0}));
      break;
    }
    case ActFormat::kQuant: {
      need_params(2);
      const uint32_t bits = p.params[0], block = p.params[1];
      SPARROW_CHECK_T(FormatError, bits == 8 || bits == 4, "quant packet: bits must be 8 or 4, not " << bits);
      SPARROW_CHECK_T(FormatError, block >= 1 && block <= cols, "quant packet: bad block " << block);
      const uint64_t blocks = static_cast<uint64_t>(rows) * ((static_cast<uint64_t>(cols) + block - 1) / block);
      need_scales(2 * blocks);
      SPARROW_CHECK_T(FormatError, all_finite(p.scales.data(), p.scales.size()), "quant packet: non-finite scale");
      for (uint64_t b = 0; b < blocks; ++b)
        SPARROW_CHECK_T(FormatError, p.scales[2 * b + 1] >= 0, "quant packet: negative step");
      need_data(bits == 8 ? static_cast<uint64_t>(numel) : (static_cast<uint64_t>(numel) + 1) / 2);
      break;
    }
    case ActFormat::kTopK: {
      need_params(1);
      need_scales(0);
      const uint64_t k = p.params[0];
      SPARROW_CHECK_T(FormatError, k <= static_cast<uint64_t>(numel), "topk packet: k " << k << " > numel");
      need_data(8 * k);
      int64_t prev = -1;
      for (uint64_t i = 0; i < k; ++i) {
        uint32_t idx;
        std::memcpy(&idx, p.data.data() + 4 * i, 4);
        SPARROW_CHECK_T(FormatError, static_cast<int64_t>(idx) > prev && static_cast<int64_t>(idx) < numel,
                        "topk packet: indices must ascend within [0, " << numel << ")");
        prev = idx;
      }
      floats_finite(4 * k, k);
      break;
    }
    default:
      throw FormatError("activation packet: unknown format");
  }
}

}  // namespace sparrow::edge
