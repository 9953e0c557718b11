// libFuzzer target: bytes from a peer, as the server's and the cloud's I/O
// threads receive them. wire::parse must either return a message that passed
// every check or throw sparrow::Error (ProtocolError); each tensor of a parsed
// update is then decoded, which may only refuse with sparrow::Error (formats
// that need a context, such as ACP's shared factor). Anything else (a crash, a
// sanitizer report, another exception type, a hang) is a finding.
#include <cstddef>
#include <cstdint>
#include <variant>

#include <ATen/ATen.h>

#include "compression/compressor.h"
#include "core/error.h"
#include "wire/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sparrow::wire::ParseLimits limits;
  limits.max_bytes = size_t{1} << 20;
  limits.max_elements = uint64_t{1} << 22;  // decoding stays cheap per input
  sparrow::wire::Message m;
  try {
    m = sparrow::wire::parse(data, size, limits);
  } catch (const sparrow::Error&) {
    return 0;  // refused: what a bad peer must get
  }
  if (const auto* u = std::get_if<sparrow::wire::ModelUpdate>(&m.body))
    for (const auto& t : u->tensors) {
      try {
        (void)sparrow::compression::decode(t.tensor);
      } catch (const sparrow::Error&) {
      }
      // A masked update (tcs) decodes against the round's mask: here the first
      // params[1] positions, when the tensor holds that many.
      const auto& e = t.tensor;
      if (e.format == sparrow::compression::Format::kSparse &&
          e.index_coding == sparrow::compression::IndexCoding::kMask && e.params.size() >= 2 &&
          static_cast<int64_t>(e.params[1]) <= e.numel()) {
        sparrow::compression::Context ctx;
        ctx.mask = at::arange(static_cast<int64_t>(e.params[1]), at::TensorOptions().dtype(at::kLong));
        try {
          (void)sparrow::compression::decode(e, ctx);
        } catch (const sparrow::Error&) {
        }
      }
    }
  return 0;
}
