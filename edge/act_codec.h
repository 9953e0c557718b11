#pragma once
// Codecs for what crosses the cut in split fine-tuning: the activation the
// device's bottom sends up and the gradient the cloud's top sends back.
//
// An ActPacket is one encoded tensor as a plain, self-describing struct with an
// exact byte serialisation (serialize()/deserialize()), so the networked layer can
// send it as one raw frame and the benchmark counts the bytes that would travel.
// Codecs are built from spec strings (core/spec.h):
//   "none"                                fp32, dense
//   "lowrank:rank=R,iters=I,warm=1,seed=S,beta=B,refresh=K" activation viewed as
//        A [N, M] (N = batch rows, M = features per sample) is sent as factors
//        A_hat = P Q^T with Q (M x R) orthonormal, P = A Q (N x R). Q comes from I
//        power iterations (Q <- orth(A^T (A Q))) started from the previous Q
//        (warm=1) or from a fresh Gaussian (warm=0, a randomized SVD). Defaults
//        R=4, I=1, B=0, K=1. With beta B > 0 the device instead tracks the basis
//        by one power iteration per step on an exponential average of the
//        batches' covariances (a streaming PCA: S <- B S + (1 - B) A^T A T / N,
//        T = orth(S)), so the basis describes the data, not one batch (I and warm
//        then only matter before tracking starts). With refresh K > 1 the basis
//        is published (set to T, or recomputed) and sent only every K-th step
//        (kLowRank, with a new basis id); the steps between send P alone
//        (kLowRankCached), which the cloud decodes with the basis it kept
//        (decode_activation). ramp=1 adds two early refreshes, at steps K/4 and
//        K/2 (K >= 4), while the tracker is still converging. The gradient coming back is always the projection
//        G Q (N x R): with Q detached, A_hat = A Q Q^T, so dL/dA = G Q Q^T
//        exactly, and the device, which keeps Q, rebuilds it from G Q (see
//        docs/split.md).
//        bits=8|4 (default 32: fp32 factors) quantises the factors: P, sent
//        every step, to `bits` per value with a (min, step) pair per column of P
//        (per component: their ranges differ by orders of magnitude); the basis Q
//        to qbits=8|4 (default 8) per value with a pair per column of Q (sent
//        at refreshes only). Both sides use the
//        dequantised Q (the device projects with it and rebuilds the gradient
//        with it), so the projected gradient stays exact w.r.t. what the cloud
//        decoded. gbits=32|8|4 (default: bits) is the precision of the projected
//        gradient G Q coming back (same per-column scheme). With beta > 0 the
//        rank may exceed the batch size (the basis describes the data, not one
//        batch): R <= M; otherwise R <= min(N, M) as before.
//   "q8:block=B", "q4:block=B"            per-block affine quantisation of each
//        row (min and step per block of B consecutive values of a row; B=0, the
//        default, is one block per row), round to nearest: |error| <= step / 2.
//   "topk:ratio=F"                        the ceil(F * numel) largest |values|
//        with their flat indices (uint32), default F=0.01.
// The same specs (except lowrank) serve as gradient codecs.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace sparrow::edge {

enum class ActFormat : uint8_t {
  // data: numel fp32.
  kDense = 0,
  // params {rows N, cols M, rank R, basis id}; data: P (N x R) then Q (M x R),
  // fp32 row-major.
  kLowRank = 1,
  // params {rows N, rank R}; data: G Q (N x R) fp32. Decoding needs the device's Q.
  kProjected = 2,
  // params {rows N, cols M, rank R, basis id}; data: P (N x R) fp32. Decoding
  // needs the Q of the last kLowRank packet with that basis id.
  kLowRankCached = 5,
  // Quantised factors (lowrank bits=8|4). params {rows N, cols M, rank R, basis
  // id, bits 8|4, gradient bits 32|8|4, basis bits 8|4}; scales: (min, step) per
  // column of P (R pairs), then per column of Q (R pairs); data: P's codes column
  // by column (i.e. P^T row-major) at `bits` per code, then Q's codes column by
  // column at basis bits. 4-bit codes two per byte, low nibble first, each matrix
  // padded to a byte.
  kLowRankQ = 6,
  // As kLowRankQ without Q: params the same; scales: R pairs for P; data: P's codes.
  kLowRankCachedQ = 7,
  // Quantised projected gradient: params {rows N, rank R, bits 8|4}; scales: R
  // (min, step) pairs, one per column of G Q; data: (G Q)^T codes row-major.
  kProjectedQ = 8,
  // params {bits 8|4, block}; scales: (min, step) per block, row by row; data:
  // one code per element, row-major; 4-bit codes two per byte, low nibble first.
  kQuant = 3,
  // params {k}; data: k ascending uint32 flat indices, then k fp32 values.
  kTopK = 4,
};

const char* act_format_name(ActFormat f);

struct ActPacket {
  ActFormat format = ActFormat::kDense;
  // Set on activations whose sender needs the gradient back (the bottom trains);
  // unset when the bottom is frozen: then nothing needs to come back.
  bool want_gradient = true;
  std::vector<int64_t> shape;  // the tensor's shape; shape[0] is the batch
  std::vector<uint32_t> params;
  std::vector<float> scales;
  std::vector<uint8_t> data;

  // Byte layout (little-endian): u8 format, u8 ndim, u16 flags (bit 0:
  // want_gradient), u32 #params, u32 #scales, u64 #data bytes, then shape (i64
  // each), params (u32), scales (f32), data. wire_bytes() == serialize().size().
  static constexpr size_t kHeaderBytes = 20;
  size_t wire_bytes() const;
  std::vector<uint8_t> serialize() const;
  // FormatError for truncated or trailing bytes or an unknown format; then
  // validate()s the result.
  static ActPacket deserialize(const uint8_t* bytes, size_t size);

  int64_t numel() const;
};

// Structural checks on a packet from outside: shape sane (1..8 dims, positive,
// < 2^31 elements), params/scales/data sizes exactly what the format needs,
// floats finite, steps >= 0, top-k indices ascending and in range. FormatError.
void validate(const ActPacket& p);

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
// The same as compression::State bytes.
std::string serialize_codec_state(const CodecState& s);
CodecState deserialize_codec_state(const std::string& bytes);

class ActCodec {
 public:
  // ConfigError for an unknown method, unknown key or bad value.
  explicit ActCodec(const std::string& spec);

  const std::string& spec() const { return spec_; }
  bool lowrank() const { return kind_ == Kind::kLowRank; }

  // Encodes `x` (float, dim >= 1, treated as [x.size(0), numel / x.size(0)]);
  // does not track gradients. Lowrank updates state.basis; every codec bumps
  // state.steps.
  // infer = true: use the current basis as is (no refresh, state untouched
  // except steps), for evaluation.
  ActPacket encode(const at::Tensor& x, CodecState& state, bool infer = false) const;

 private:
  enum class Kind { kNone, kLowRank, kQuant, kTopK };
  std::string spec_;
  Kind kind_ = Kind::kNone;
  int64_t rank_ = 4;
  int64_t iters_ = 1;
  bool warm_ = true;
  uint64_t seed_ = 0;
  double beta_ = 0;
  int64_t refresh_ = 1;
  bool ramp_ = false;
  int bits_ = 8;
  int64_t block_ = 0;
  double ratio_ = 0.01;
  int factor_bits_ = 32;    // lowrank: precision of P (32 = fp32 formats)
  int gradient_bits_ = 32;  // lowrank: precision of the projected gradient
  int basis_bits_ = 8;      // lowrank with quantised factors: precision of Q
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
