#pragma once
// The Sparrow wire format as plain structs. wire/sparrow.fbs is the schema and
// docs/protocol.md its description for other languages; only wire/*.cc sees the
// FlatBuffers-generated code.
//
// A message is one size-prefixed FlatBuffer (a uint32 length, then a buffer
// whose root is `Message`, file identifier "SPRW"): serialize() produces those
// bytes, parse() turns bytes from a peer back into structs after checking
// everything (FlatBuffers verifier, protocol version, every tensor through
// compression::validate(), names, metrics). parse() never aborts and never
// reads out of bounds; every failure is a ProtocolError whose code() is what
// an Error reply should carry.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "compression/encoded.h"
#include "core/error.h"

namespace sparrow::wire {

// Major: a receiver refuses any other major. Minor: additions an older peer can
// ignore (new optional fields, new union members it answers with kUnsupported).
// 1.1: secure aggregation (SecAgg, Task.secagg); 1.2: Int8 sparse values and Rice-coded indices;
// 1.3: masked sparse updates (IndexCoding Mask, the server's mask in Task.shared);
// 1.4: low-rank factors (LowRank, LowRankFactor) in fp16, bf16 or int8;
// 1.5: LowRankSparse (PowerSGD factors plus a Rice-coded sparse correction);
// 1.6: masked updates that carry a seeded share of the mask (params {b, m, B, k}, key in seed);
// 1.7: SecAgg.rejected (a Masked message names the neighbours whose pair was bad);
// 1.8: SecAgg.commitment, SecAggShare.digest and SecAgg.evidence (verifiable reveals and reports);
// 1.9: downlink catch-up, Task model encodings Chain (Task.chain) and Patch;
// 1.10: packed tensor lists (Task.packed: a catch-up task's weights and chain
// with each name and shape once per message, records in varints).
constexpr uint16_t kProtocolMajor = 1, kProtocolMinor = 10;
// The first minor whose clients read Chain and Patch tasks (older ones get Full).
constexpr uint16_t kCatchupMinor = 9;
// The first minor whose clients read Task.packed (older ones get tables).
constexpr uint16_t kPackedMinor = 10;

// parse() refuses larger buffers before looking at them (kOversize).
constexpr size_t kDefaultMaxMessageBytes = size_t{1} << 30;
// parse() refuses a message whose tensors hold more elements in total
// (sum of numel) (kOversize). Bounds the memory that validating and decoding
// take; a receiver that knows its model should pass the model's size instead.
constexpr uint64_t kDefaultMaxElements = uint64_t{1} << 28;

// Mirrors fb::ErrorCode in wire/sparrow.fbs (same numbers); codes only grow.
enum class ErrorCode : uint8_t {
  kUnknown = 0,          // unspecified, or a code newer than this build knows
  kVersionMismatch = 1,  // protocol major differs
  kMalformed = 2,        // failed FlatBuffers verification or our checks
  kOversize = 3,         // more bytes or tensor elements than the receiver accepts
  kRejected = 4,         // well formed, but refused in the receiver's current state
  kInternal = 5,         // the receiver failed for reasons of its own
  kUnsupported = 6,      // a message type / format / encoding the receiver lacks
};

const char* error_code_name(ErrorCode code);

// A message the receiver refuses. Derives from FormatError so code that only
// knows "bad bytes" still catches it.
class ProtocolError : public FormatError {
 public:
  ProtocolError(ErrorCode code, const std::string& what) : FormatError(what), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

struct NamedTensor {
  std::string name;  // non-empty, unique within the update
  compression::Encoded tensor;
};

struct ModelUpdate {
  uint64_t round = 0;  // the round this update was computed for
  std::string client_id;
  uint64_t num_samples = 0;  // the client's FedAvg weight
  std::vector<NamedTensor> tensors;
  std::vector<std::pair<std::string, double>> metrics;  // keys non-empty and unique, values finite
  std::vector<NamedTensor> control_delta;               // SCAFFOLD only; names unique
  // 1.10: serialize() writes `tensors` and `control_delta` as ModelUpdate.packed
  // (send it only to a server of minor >= kPackedMinor); parse() sets it when
  // they came so.
  bool packed = false;
};

// Whether a client packs its update for a server of protocol 1.`server_minor`:
// from 1.10 on, unless a tensor is Dense (dense values stay in tables, where
// the server reads them in place).
bool packs_well(const ModelUpdate& u, uint16_t server_minor);

struct ErrorBody {
  ErrorCode code = ErrorCode::kUnknown;
  std::string message;
  std::optional<uint64_t> round;  // absent when unknown or not about a round
};

// The session messages (docs/protocol.md, "A round"). Field meanings are the
// schema's (wire/sparrow.fbs); parse() enforces what the comments say.
constexpr size_t kMaxClientIdBytes = 256;  // Hello.client_id: 1..256 bytes of UTF-8
constexpr size_t kMaxTextBytes = 4096;     // every other string field

struct Hello {
  std::string client_id;  // non-empty, <= kMaxClientIdBytes
  uint64_t num_samples = 0;
  std::string model;
  uint64_t model_digest = 0;
  std::optional<uint64_t> last_round;
  std::string software;
};

struct Welcome {
  std::string run_id;
  uint32_t heartbeat_ms = 0;
  uint64_t round = 0;
  uint64_t max_message_bytes = 0;
  uint64_t model_seed = 0;
};

// kChain and kPatch (1.9): downlink catch-up (sparrow.fbs; docs/protocol.md).
enum class ModelEncoding : uint8_t { kFull = 0, kDelta = 1, kChain = 2, kPatch = 3 };

struct TrainSettings {  // client::TrainConfig on the wire; parse() checks ranges
  std::string algorithm = "fedavg";
  uint32_t local_epochs = 1, batch_size = 32;     // >= 1
  double lr = 0.01;                               // finite, > 0
  double momentum = 0, weight_decay = 0, mu = 0;  // finite; momentum in [0, 1), others >= 0
};

// A client's part in a SecAgg+ round (docs/security.md). parse() checks
// 1 <= index <= clients, 2 <= threshold <= degree < clients, clip finite and
// > 0, weight in (0, 1].
struct SecAggSetup {
  uint32_t index = 0, clients = 0, degree = 0, threshold = 0;
  uint64_t graph_seed = 0;
  double clip = 0, weight = 0;
};

struct Task {
  uint64_t round = 0;
  ModelEncoding model_encoding = ModelEncoding::kFull;
  uint64_t base_round = 0;
  std::vector<NamedTensor> weights;  // names unique
  TrainSettings train;
  std::string compression;
  uint64_t seed = 0;
  std::vector<NamedTensor> shared;   // ACP shared factors; names unique
  std::vector<NamedTensor> control;  // SCAFFOLD server control; names unique
  uint64_t deadline_ms = 0;
  std::optional<SecAggSetup> secagg;  // present: answer with SecAgg messages (1.1)
  uint32_t clients = 0;               // clients selected for the round; 0 = not said (sparrow.fbs)
  // kChain (1.9): C_{base_round+1} .. C_{round-1}, each step's names unique.
  // parse() checks the encoding's shape: a Chain has >= 2 steps, exactly
  // round - 1 - base_round of them, and no `weights`; a Patch's tensors are
  // Sparse fp32 with explicit positions (apply_patch); a Full or Delta task
  // has no chain. Whether the names and shapes fit the model is the client's check.
  std::vector<std::vector<NamedTensor>> chain;
  // 1.10: serialize() writes `weights` and `chain` as Task.packed (send it only
  // to a peer of minor >= kPackedMinor); parse() sets it when they came so.
  bool packed = false;
};

struct Ack {
  uint64_t round = 0;
};

struct Heartbeat {
  uint64_t round = 0;
  uint64_t num_samples = 0;  // client -> server: samples held now; 0 = as at Hello (sparrow.fbs)
};

struct Bye {
  std::string reason;
};

// Split fine-tuning (docs/split.md): a codec payload and its shape. parse()
// checks the frame (text, shape rank 1..8, element budget, labels one per
// batch row when present, finite loss); the codec named by `codec` checks the
// payload itself when it decodes.
struct SplitActivation {
  std::string session;
  uint64_t step = 0;
  std::string codec;
  std::vector<int64_t> shape;
  std::vector<uint8_t> payload;
  std::vector<int64_t> labels;  // empty, or shape[0] entries
  bool train = true;
};

struct SplitGradient {
  std::string session;
  uint64_t step = 0;
  std::string codec;
  std::vector<int64_t> shape;  // empty when no gradient is sent
  std::vector<uint8_t> payload;
  double loss = 0;  // finite
  uint64_t correct = 0;
};

// Secure aggregation (wire/sparrow.fbs, SecAgg; docs/security.md). parse()
// checks the frame: a known stage, keys of exactly kSecAggKeyBytes, share kinds
// 0..2 and data of at most kMaxSecAggShareBytes, at most kMaxSecAggPeers peers
// and shares, survivors/dropped without repeats, metrics as in ModelUpdate and
// masked within the element limit. What each stage must carry is checked by
// the protocol code (secagg/secagg.h).
enum class SecAggStage : uint8_t { kKeys = 0, kNeighbours, kShares, kSharesIn, kMasked, kUnmask, kReveal };
constexpr size_t kSecAggKeyBytes = 32;
constexpr size_t kSecAggDigestBytes = 64;
constexpr size_t kMaxSecAggShareBytes = 256;
constexpr size_t kMaxSecAggPeers = 4096;

struct SecAggPeer {
  uint32_t index = 0;
  std::string enc_key, mask_key;  // X25519 public keys
};

struct SecAggShare {
  uint32_t peer = 0;
  uint8_t kind = 0;  // 0 encrypted pair, 1 self-mask seed share, 2 mask key share
  std::string data;
  std::string digest{};  // Shares, SharesIn (1.8): digests of the pair's two shares, 64 bytes
};

struct SecAgg {
  uint64_t round = 0;
  std::string client_id;
  SecAggStage stage = SecAggStage::kKeys;
  uint32_t index = 0;
  std::vector<SecAggPeer> peers;
  std::vector<SecAggShare> shares;
  std::vector<uint32_t> survivors, dropped;
  std::vector<uint32_t> masked;
  std::vector<std::pair<std::string, double>> metrics;
  std::vector<uint32_t> rejected;     // Masked: neighbours whose pair was bad (1.7)
  std::string commitment;             // Shares: commitment to the self-mask seed, 32 bytes (1.8)
  std::vector<SecAggShare> evidence;  // Masked: per rejected neighbour, key agreement and proof (1.8)
};

const char* secagg_stage_name(SecAggStage s);

using Body = std::variant<ModelUpdate, ErrorBody, Hello, Welcome, Task, Ack, Heartbeat, Bye, SplitActivation,
                          SplitGradient, SecAgg>;

struct Message {
  uint16_t major = kProtocolMajor, minor = kProtocolMinor;
  Body body;
};

// The body type's name as in the schema ("ModelUpdate", "Hello", ...), for logs.
const char* body_name(const Body& body);

// Limits parse() enforces before it allocates anything proportional to them.
struct ParseLimits {
  size_t max_bytes = kDefaultMaxMessageBytes;
  uint64_t max_elements = kDefaultMaxElements;
  // How a ModelUpdate's tensors are validated. kDeferDenseF32 leaves the
  // finiteness scan of dense fp32 values to their consumer (the aggregator,
  // which scans them while folding: compression::decode_fill); every
  // consumer validates, so deferring moves the scan and never drops it.
  compression::ValueCheck update_values = compression::ValueCheck::kScan;
};

// The exact bytes that go on the wire (one ZeroMQ frame). Does not validate the
// tensors (the receiver does); throws sparrow::Error only when the message
// cannot be represented (over FlatBuffers' 2 GiB limit).
std::string serialize(const Message& m);

// Parses and fully checks bytes from a peer. Throws ProtocolError:
//   kOversize        size > limits.max_bytes, or total numel > limits.max_elements
//   kMalformed       empty/short buffer, wrong identifier or size prefix, failed
//                    verification, no body, invalid tensor (compression::validate),
//                    empty/duplicate names, non-finite metrics, invalid UTF-8
//   kVersionMismatch major != kProtocolMajor (a newer minor is accepted)
//   kUnsupported     a body type, tensor format, value type or index coding this
//                    build does not know
// `data` needs no particular alignment (a misaligned buffer is copied first).
Message parse(const void* data, size_t size, const ParseLimits& limits);
// Keeps the frame alive: tensors' values are then views into it
// (compression::Bytes::view), not copies, so a large dense update is verified
// and folded where it arrived. `owner` must keep [data, data + size) unchanged.
using Owner = std::shared_ptr<const void>;
Message parse(const void* data, size_t size, const ParseLimits& limits, Owner owner);
Message parse(const void* data, size_t size, size_t max_bytes = kDefaultMaxMessageBytes);
inline Message parse(const std::string& bytes, const ParseLimits& limits = {}) {
  return parse(bytes.data(), bytes.size(), limits);
}

// The Error body to answer a failed message with: a ProtocolError keeps its
// code and message; another FormatError is kMalformed, another sparrow::Error
// kRejected (both with their message, as core::peer_message makes it: no
// " [COND failed at FILE:LINE]"); anything else is kInternal with a generic
// message (internal details are not sent to peers; the caller logs them).
ErrorBody error_for(const std::exception& e, std::optional<uint64_t> round = std::nullopt);

// Bytes `e` adds to a serialized ModelUpdate when sent under `name`: its
// EncodedTensor table, vtable, vectors and alignment padding. An upper bound,
// at most 64 bytes above the exact figure, computed without serializing;
// compare with Encoded::payload_bytes() for the framing overhead.
size_t encoded_size(const compression::Encoded& e, const std::string& name = {});

// Packed tensor lists (Task.packed, 1.10; docs/protocol.md). The bytes of one
// tensor's record whose name has index `name_index` in the message's name
// table (exact); of a list of them (its count and records; `name_index` per
// tensor, default: their positions); and what a Task.packed adds around its
// lists: the name table for `names` and `shapes`, the list count and the
// field's FlatBuffers framing (16 bytes, as packed_size).
size_t packed_tensor_size(const compression::Encoded& e, size_t name_index = 0);
size_t packed_list_size(const std::vector<NamedTensor>& ts, const std::vector<size_t>& name_index = {});
size_t packed_frame_size(const std::vector<std::string>& names, const std::vector<std::vector<int64_t>>& shapes,
                         size_t lists);
// The bytes a Task.packed of these lists takes in the message: the packed
// bytes (exact; it packs them to count) plus 16 for the field's framing (an
// upper bound: offset, length, padding, vtable slot).
size_t packed_size(const std::vector<NamedTensor>& weights, const std::vector<std::vector<NamedTensor>>& chain);

// Patch tasks (1.9): sets dst[i] = v for each position i and fp32 value v of a
// Sparse tensor with F32 values and DeltaVarint, Bitmap or Rice positions (set,
// not add: the client ends with the server's values bit for bit). Checks
// everything before writing: FormatError for another format, value type or
// coding, for positions outside [0, numel), or when numel differs from the
// tensor's; dst is then unchanged. Torch-free, for both clients.
void apply_patch(const compression::Encoded& e, float* dst, int64_t numel);

}  // namespace sparrow::wire
