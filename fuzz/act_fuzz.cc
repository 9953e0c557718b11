// libFuzzer target: the split's activation and gradient packets, as the cloud
// and the device receive them (SplitActivation/SplitGradient payloads), and
// the codec spec string a device names. ActPacket::deserialize must return a
// validated packet or throw sparrow::Error; a valid packet is then decoded the
// way each side decodes it (plain, against a held basis, as a gradient for a
// pending activation), which may only refuse with sparrow::Error. The first
// byte picks the mode.
#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "edge/act_codec.h"

namespace {

// A basis both sides could hold: M = 16 features, rank 4, id 1.
sparrow::edge::CodecState held_state() {
  sparrow::edge::CodecState s;
  s.basis = torch::eye(16).slice(1, 0, 4).contiguous();
  s.basis_id = 1;
  return s;
}

}  // namespace

// With SPARROW_FUZZ_SEED_DIR set (scripts/fuzz.sh does), writes one packet of
// each format there before libFuzzer reads its corpus: real activations
// encoded by every codec, and gradients for them.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("SPARROW_FUZZ_SEED_DIR");
  if (!dir) return 0;
  torch::manual_seed(1);
  const at::Tensor x = torch::rand({8, 16});
  int i = 0;
  auto save = [&](uint8_t mode, const std::vector<uint8_t>& bytes) {
    std::ofstream f(std::string(dir) + "/seed_" + std::to_string(i++), std::ios::binary);
    f.put(static_cast<char>(mode));
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  };
  for (const char* spec :
       {"none", "q8:block=4", "q4:block=0", "topk:ratio=0.1", "lowrank:rank=4", "lowrank:rank=4,beta=0.9,refresh=2",
        "lowrank:rank=4,bits=8,gbits=8", "lowrank:rank=4,bits=4,gbits=4,beta=0.5,refresh=2"}) {
    sparrow::edge::ActCodec codec(spec);
    sparrow::edge::CodecState state, peer;
    for (int step = 0; step < 2; ++step) {
      const sparrow::edge::ActPacket a = codec.encode(x, state);
      save(0, a.serialize());
      (void)sparrow::edge::decode_activation(a, peer);
      const sparrow::edge::ActPacket g = sparrow::edge::encode_gradient(torch::rand({8, 16}), a, codec, peer);
      save(1, g.serialize());
    }
    const std::string text(spec);
    save(2, std::vector<uint8_t>(text.begin(), text.end()));
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0] % 3;
  ++data;
  --size;
  try {
    if (mode == 2) {  // a codec spec from a SplitActivation
      sparrow::edge::ActCodec codec(std::string(reinterpret_cast<const char*>(data), size));
      (void)codec.lowrank();
      return 0;
    }
    const sparrow::edge::ActPacket p = sparrow::edge::ActPacket::deserialize(data, size);
    if (p.numel() > (int64_t{1} << 22)) return 0;  // decoding stays cheap per input
    if (mode == 0) {                               // the cloud: an activation, plain or against the device's basis
      try {
        (void)sparrow::edge::decode(p);
      } catch (const sparrow::Error&) {
      }
      sparrow::edge::CodecState peer = held_state();
      (void)sparrow::edge::decode_activation(p, peer);
    } else {  // the device: a gradient for its pending [8, 16] activation
      (void)sparrow::edge::decode_gradient(p, held_state(), {8, 16});
    }
  } catch (const sparrow::Error&) {
  }
  return 0;
}
