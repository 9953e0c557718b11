#pragma once
// The split-learning activation codecs without LibTorch (target
// sparrow_act_codec: sparrow_base and Eigen's headers only, so a device build
// such as the arm64 cross-build compiles it). What a LibTorch-free split
// device (sparrow-edge-lite) encodes its activations and decodes its gradients
// with. The LibTorch codecs (edge/act_codec.h) run this same code on CPU
// copies of their tensors, so both give the same packet bytes, the same
// decoded values and the same state for the same input and state
// (tests/edge/act_codec_flat_test.cc).
//
// Specs (core/spec.h), the same strings as the LibTorch codec:
//   "none"                                fp32, dense
//   "lowrank:rank=R,iters=I,warm=1,seed=S,beta=B,refresh=K,ramp=0,bits=32,
//            gbits=<bits>,qbits=8"
//        activation viewed as A [N, M] (N = batch rows, M = features per
//        sample) is sent as factors A_hat = P Q^T with Q (M x R) orthonormal,
//        P = A Q (N x R). Q comes from I power iterations (Q <- orth(A^T (A Q)))
//        started from the previous Q (warm=1) or from a fresh Gaussian (warm=0,
//        a randomized SVD). Defaults R=4, I=1, B=0, K=1. With beta B > 0 the
//        device instead tracks the basis by one power iteration per step on an
//        exponential average of the batches' covariances (a streaming PCA:
//        S <- B S + (1 - B) A^T A T / N, T = orth(S)), so the basis describes
//        the data, not one batch. With refresh K > 1 the basis is published and
//        sent only every K-th step (kLowRank, with a new basis id); the steps
//        between send P alone (kLowRankCached). ramp=1 adds two early
//        refreshes, at steps K/4 and K/2 (K >= 4). The gradient coming back is
//        always the projection G Q (N x R), which the device, holding Q, turns
//        into G Q Q^T. bits=8|4 quantises P (per column of P) and Q to qbits=8|4
//        (per column of Q, refresh steps only); both sides then use the
//        dequantised Q. gbits=32|8|4 is the precision of G Q coming back. With
//        beta > 0, R <= M; otherwise R <= min(N, M).
//   "q8:block=B", "q4:block=B"            per-block affine quantisation of each
//        row (min and step per block of B consecutive values of a row; B=0, the
//        default, is one block per row), round to nearest: |error| <= step / 2.
//   "topk:ratio=F"                        the ceil(F * numel) largest |values|
//        (ties: the lower index) with their flat indices, default F=0.01.
// The same specs (except lowrank) serve as gradient codecs.
//
// Arithmetic: orth() is a Householder QR (Eigen's, reduced Q; the sign of each
// column is LAPACK's convention), products are Eigen's, quantisation rounds to
// nearest-even in float, all on the calling thread. Same build, same bits; a
// different instruction set (x86-64 vs arm64) may round the lowrank products
// differently, which the format does not care about (the receiver decodes
// what was sent).

#include <cstdint>
#include <string>
#include <vector>

#include "edge/codec/act_packet.h"

namespace sparrow::edge::flat {

// A row-major float32 matrix; rows = cols = 0 (and no data) is "none".
struct Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float> data;  // rows * cols values

  bool empty() const { return data.empty(); }
  bool is(int64_t r, int64_t c) const { return !empty() && rows == r && cols == c; }
};

// The device-owned state of one activation codec, plain data (see
// edge::CodecState, its LibTorch twin, for the meaning of each field): for
// lowrank the basis Q of the last published refresh (needed to decode the
// projected gradient of the step), the streaming sketch and tracker (beta > 0),
// the basis id, the step count, the forced-refresh flag. A resumed device may
// start with it empty: its next encode then publishes a fresh basis.
struct CodecState {
  Matrix basis;               // [M, R], empty before the first lowrank encode
  Matrix sketch;              // [M, R] running covariance sketch (beta > 0)
  Matrix tracker;             // [M, R] orth(sketch): what the next refresh publishes
  uint32_t basis_id = 0;      // id of `basis` (bumped at every refresh; 0 = none yet)
  uint64_t steps = 0;         // encodes done (keys the random start, schedules refreshes)
  bool refresh_next = false;  // force a basis refresh (e.g. the cloud lost its copy)

  // Bytes for a device's progress file. Layout (little-endian): magic "SPAC",
  // u32 version (1), u32 basis_id, u32 flags (bit 0: refresh_next), u64 steps,
  // then basis, sketch, tracker, each i64 rows, i64 cols, rows * cols f32. The
  // round trip is bit-exact. deserialize: FormatError for a wrong magic or
  // version, truncated or trailing bytes, a bad matrix shape, non-finite
  // values, or a basis without an id.
  std::string serialize() const;
  static CodecState deserialize(const std::string& bytes);
};

class ActCodec {
 public:
  // ConfigError for an unknown method, unknown key or bad value (the same
  // messages as edge::ActCodec).
  explicit ActCodec(const std::string& spec);

  const std::string& spec() const { return spec_; }
  bool lowrank() const { return kind_ == Kind::kLowRank; }

  // Encodes x: numel(shape) floats, row-major, seen as [shape[0], numel /
  // shape[0]]; the packet carries `shape` (the cloud rebuilds the tensor with
  // it). Every codec bumps state.steps; lowrank reads and updates the basis,
  // sketch, tracker and basis id. infer = true: use the current basis as is,
  // for evaluation: state untouched except steps; where no basis fits or
  // refresh_next is set, a basis is computed for this packet only (sent with
  // basis id 1, not kept). want_gradient is left true: the caller sets it.
  // sparrow::Error for an empty or oversized (>= 2^31 elements) shape.
  // Immutable: encode may run concurrently on different states.
  ActPacket encode(const float* x, const std::vector<int64_t>& shape, CodecState& state, bool infer = false) const;
  // The same for a [rows, cols] activation (the packet's shape is {rows, cols}).
  ActPacket encode(const float* x, int64_t rows, int64_t cols, CodecState& state, bool infer = false) const {
    return encode(x, std::vector<int64_t>{rows, cols}, state, infer);
  }

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

// Decodes a self-contained packet (dense, lowrank, lowrank_q, quant, topk)
// after validate(): numel floats, row-major in p.shape. FormatError for
// anything invalid, and for kProjected(Q) / kLowRankCached(Q) (they need
// state: decode_gradient / decode_activation).
std::vector<float> decode(const ActPacket& p);

// Device side: the gradient w.r.t. the activation of the step whose encode
// left `state` (numel floats in expected_shape). kProjected(Q) returns
// (G Q) Q^T with the state's basis; the other formats are decode().
// FormatError (nothing changes) when the packet is invalid, its shape is not
// expected_shape, or its rank does not match the state's basis.
std::vector<float> decode_gradient(const ActPacket& p, const CodecState& state,
                                   const std::vector<int64_t>& expected_shape);

// Cloud side (the LibTorch cloud runs these): decodes an activation with the
// per-device state `peer`. A kLowRank(Q) packet's basis is kept in peer; a
// kLowRankCached(Q) packet is decoded with it. FormatError (peer unchanged)
// when the basis id or shape does not match: the device must then refresh.
std::vector<float> decode_activation(const ActPacket& p, CodecState& peer);

// Cloud side, the way back: the packet for grad = dL/dA_hat (numel(act.shape)
// floats) of activation `act`, decoded with `peer`. A lowrank activation gets
// the projection G Q (kProjected, or kProjectedQ at the activation's gradient
// bits); otherwise `codec` encodes grad (stateless). sparrow::Error when the
// activation's basis is not the one peer holds.
ActPacket encode_gradient(const float* grad, const ActPacket& act, const ActCodec& codec, const CodecState& peer);

}  // namespace sparrow::edge::flat
