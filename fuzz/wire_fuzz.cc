// libFuzzer target: bytes from a peer, as the server's and the cloud's I/O
// threads receive them. wire::parse must either return a message that passed
// every check or throw sparrow::Error (ProtocolError); each tensor of a parsed
// update is then decoded, which may only refuse with sparrow::Error (formats
// that need a context, such as ACP's shared factor). The same bytes are parsed
// again as sparrow-server parses them (the finiteness scan of dense fp32 values
// deferred) and each tensor is folded into a zero sum (decode_fill), which must
// refuse the same inputs and leave the sum zero when it does. Anything else (a
// crash, a sanitizer report, another exception type, a hang) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
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
  bool refused = false;
  try {
    m = sparrow::wire::parse(data, size, limits);
  } catch (const sparrow::Error&) {
    refused = true;  // what a bad peer must get
  }
  sparrow::wire::ParseLimits deferred = limits;
  deferred.update_values = sparrow::compression::ValueCheck::kDeferDenseF32;
  try {
    const sparrow::wire::Message d = sparrow::wire::parse(data, size, deferred);
    bool all_finite = true;
    if (const auto* u = std::get_if<sparrow::wire::ModelUpdate>(&d.body))
      for (const auto& t : u->tensors) {
        at::Tensor sum = at::zeros({t.tensor.numel()});
        try {
          sparrow::compression::decode_fill(t.tensor, sum, 2.0f);
        } catch (const sparrow::compression::NonFiniteError&) {
          all_finite = false;
          if (sum.ne(0).any().item<bool>()) std::abort();  // a refused fill must leave the sum zero
        } catch (const sparrow::Error&) {
        }
      }
    // Accepted only because the scan was deferred: the fold must find the value.
    if (refused && all_finite) std::abort();
  } catch (const sparrow::Error&) {
  }
  if (refused) return 0;
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
