#pragma once
// Codecs for what crosses the cut in split fine-tuning: the activation the
// device's bottom sends up and the gradient the cloud's top sends back.
//
// An ActPacket is one encoded tensor as a plain, self-describing struct with an
// exact byte serialisation (serialize()/deserialize()), so the networked layer can
// send it as one raw frame and the benchmark counts the bytes that would travel.
// Codecs are built from spec strings ("none", "lowrank:...", "q8:block=B",
// "q4:block=B", "topk:ratio=F"), described in edge/codec/act_codec_flat.h.
//
// The LibTorch face of the codecs: the arithmetic, the packet and its checks
// are the torch-free code (edge/codec/, target sparrow_act_codec), run on CPU
// float32 copies of the tensors, so a LibTorch device and a torch-free one
// (flat::ActCodec) send the same bytes for the same input and state, and the
// cloud decodes either. Only the CodecState conversions and the tensor
// plumbing live here.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "edge/codec/act_codec_flat.h"
#include "edge/codec/act_packet.h"

namespace sparrow::edge {

// The device-owned state of one activation codec: for lowrank, the basis Q of the
// last encode (warm start of the next one, and needed to decode the projected
// gradient of that step). Plain data; a resumed device may start with it empty.
// The cloud keeps one too, per device: the last basis it received (basis, basis_id).
struct CodecState {
  at::Tensor basis;           // [M, R] fp32, detached; undefined before the first lowrank encode
  at::Tensor sketch;          // [M, R] running covariance sketch (beta > 0), device only
  at::Tensor tracker;         // [M, R] orth(sketch): the basis the next refresh publishes
  uint32_t basis_id = 0;      // id of `basis` (bumped at every refresh; 0 = none yet)
  uint64_t steps = 0;         // encodes done (keys the random start, schedules refreshes)
  bool refresh_next = false;  // force a basis refresh (e.g. the cloud lost its copy)
};

// CodecState as tensors, for a device's progress file and the cloud's state
// file: "basis", "sketch", "tracker" when defined, and "meta" = basis_id as two
// 16-bit halves, refresh_next, steps as four 16-bit pieces (all exact in fp32).
// The round trip is bit-exact. codec_state_from_tensors reads the keys under
// `prefix`; FormatError when "meta" is missing or malformed.
std::map<std::string, at::Tensor> codec_state_tensors(const CodecState& s, const std::string& prefix = "");
CodecState codec_state_from_tensors(const std::map<std::string, at::Tensor>& t, const std::string& prefix = "");
// The same as compression::State bytes. deserialize_codec_state also reads
// flat::CodecState bytes (a torch-free device's).
std::string serialize_codec_state(const CodecState& s);
CodecState deserialize_codec_state(const std::string& bytes);

// Between the two CodecStates: the same values (fp32, row-major), bit-exact
// both ways.
flat::CodecState to_flat(const CodecState& s);
CodecState from_flat(const flat::CodecState& s);

class ActCodec {
 public:
  // ConfigError for an unknown method, unknown key or bad value.
  explicit ActCodec(const std::string& spec);

  const std::string& spec() const { return flat_.spec(); }
  bool lowrank() const { return flat_.lowrank(); }
  const flat::ActCodec& flat() const { return flat_; }

  // Encodes `x` (float, dim >= 1, treated as [x.size(0), numel / x.size(0)];
  // any device: it is copied to CPU fp32) with flat::ActCodec::encode; does
  // not track gradients. Lowrank updates state.basis; every codec bumps
  // state.steps.
  // infer = true: use the current basis as is (no refresh, state untouched
  // except steps), for evaluation.
  ActPacket encode(const at::Tensor& x, CodecState& state, bool infer = false) const;

 private:
  flat::ActCodec flat_;
};

// Decodes a self-contained packet (dense, lowrank, lowrank_q, quant, topk) after
// validate(). FormatError for anything invalid, and for kProjected(Q) /
// kLowRankCached(Q) (they need state: decode_gradient / decode_activation).
at::Tensor decode(const ActPacket& p);

// Cloud side: decodes an activation with the per-device state `peer`: a kLowRank
// packet's basis is kept in peer (after validation); a kLowRankCached packet is
// decoded with it. FormatError (peer unchanged) when the basis id or shape does
// not match: the device must then refresh its basis (CodecState::refresh_next).
at::Tensor decode_activation(const ActPacket& p, CodecState& peer);

// Cloud side, the way back: G = dL/dA_hat for the activation packet `act`
// (decoded by decode_activation with `peer`). For a lowrank activation this is
// always the projection G Q (kProjected, Q = peer.basis); otherwise `codec`
// encodes G (gradient codecs here are stateless). Error if G's shape is not act's.
ActPacket encode_gradient(const at::Tensor& grad, const ActPacket& act, const ActCodec& codec, const CodecState& peer);

// Device side: the gradient w.r.t. the activation of the step whose encode left
// `state`. kProjected returns (G Q) Q^T with the state's Q; the other formats are
// decode(). FormatError when the packet does not fit `expected_shape` or the state.
at::Tensor decode_gradient(const ActPacket& p, const CodecState& state, const std::vector<int64_t>& expected_shape);

}  // namespace sparrow::edge
