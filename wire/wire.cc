// The only translation unit that sees the flatc-generated code: it turns the
// plain structs of wire.h into size-prefixed FlatBuffers and back.
#include "wire/wire.h"

#include <flatbuffers/flatbuffers.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <sstream>
#include <string_view>
#include <unordered_set>

#include "compression/codec_bits.h"
#include "core/error_text.h"
#include "sparrow_generated.h"
#include "wire/checks.h"
#include "wire/packed.h"

namespace sparrow::wire {
namespace {

namespace c = compression;

constexpr char kIdentifier[] = "SPRW";
// Size prefix + root offset + identifier: the least a buffer can be before
// anything else is read (FlatBuffers' own minimum is the same 12 bytes).
constexpr size_t kHeaderBytes = 12;
// Payload vectors are 16-byte aligned so fp32/fp16 values can be read in place.
constexpr size_t kValuesAlign = 16;
// Alignment a received value vector needs to be read in place (fp32 values).
constexpr size_t kViewAlign = alignof(float);
// Our nesting is Message > ModelUpdate > [EncodedTensor] > EncodedTensor > vector
// (5 levels); anything much deeper is an attack, not a message.
constexpr flatbuffers::uoffset_t kMaxDepth = 16;
constexpr flatbuffers::uoffset_t kMaxTables = flatbuffers::uoffset_t{1} << 20;
// An Error reply's message is cut to this many bytes.
constexpr size_t kMaxErrorMessageBytes = 1024;

static_assert(sizeof(kIdentifier) == flatbuffers::kFileIdentifierLength + 1, "identifier is 4 bytes");
static_assert(static_cast<int>(fb::ErrorCode::MAX) == static_cast<int>(ErrorCode::kUnsupported),
              "wire::ErrorCode must mirror fb::ErrorCode");
static_assert(static_cast<int>(fb::Format::MAX) == static_cast<int>(c::Format::kLowRankSparse),
              "fb::Format must mirror compression::Format");
static_assert(static_cast<int>(fb::ValueType::MAX) == static_cast<int>(c::ValueType::kInt8),
              "fb::ValueType must mirror compression::ValueType");
static_assert(static_cast<int>(fb::IndexCoding::MAX) == static_cast<int>(c::IndexCoding::kMask),
              "fb::IndexCoding must mirror compression::IndexCoding");

using detail::check_payload;
using detail::checked_numel;
using detail::fail;
using detail::valid_text;

// The string's bytes, or "" for an absent string; kMalformed unless valid text.
std::string_view text_of(const flatbuffers::String* s, const std::string& what) {
  if (!s) return {};
  if (!valid_text(s->c_str(), s->size())) fail(ErrorCode::kMalformed, what + " is not valid UTF-8 (or contains NUL)");
  return {s->c_str(), s->size()};
}

// Copies a verified FlatBuffers vector (absent = empty). Element-wise reads keep
// this independent of the host's byte order. The verifier (2.0.8) checks only
// the 4-byte alignment of a vector's length, so a vector of 8-byte scalars can
// be misaligned in a hostile buffer: refuse it (a builder never writes one, and
// reading it would be undefined behaviour). The buffer itself is 8-byte aligned
// here, so address alignment is offset alignment.
template <typename T>
std::vector<T> vector_of(const flatbuffers::Vector<T>* v) {
  std::vector<T> out;
  if (!v) return out;
  if (reinterpret_cast<uintptr_t>(v->data()) % alignof(T) != 0)
    fail(ErrorCode::kMalformed, "malformed message: misaligned vector");
  out.resize(v->size());
  for (flatbuffers::uoffset_t i = 0; i < v->size(); ++i) out[i] = v->Get(i);
  return out;
}

std::vector<uint8_t> bytes_of(const flatbuffers::Vector<uint8_t>* v) {
  if (!v) return {};
  return std::vector<uint8_t>(v->data(), v->data() + v->size());
}

// ---- serialize -----------------------------------------------------------------

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Upper bound on the bytes one tensor takes in a message (see encoded_size()).
size_t tensor_bound(const c::Encoded& e, size_t name_bytes) {
  size_t n = 4;  // its offset in ModelUpdate.tensors
  n += 4 + 28;   // vtable: size + table size + 11 field slots, padded
  n += 64;       // table: soffset, 6 offsets, 3 enums, 2 ulongs, padding
  if (name_bytes) n += align_up(4 + name_bytes + 1, 4);
  if (!e.shape.empty()) n += 8 + 8 * e.shape.size();
  if (!e.params.empty()) n += 4 + 4 * e.params.size();
  if (!e.scales.empty()) n += 4 + 4 * e.scales.size();
  if (!e.indices.empty()) n += align_up(4 + e.indices.size(), 4);
  if (!e.values.empty()) n += 4 + e.values.size() + (kValuesAlign - 1);
  return n;
}

template <typename T>
flatbuffers::Offset<flatbuffers::Vector<T>> vector_or_absent(flatbuffers::FlatBufferBuilder& b, const std::vector<T>& v,
                                                             size_t align = 0) {
  if (v.empty()) return 0;  // absent reads as empty and costs nothing
  if (align) b.ForceVectorAlignment(v.size(), sizeof(T), align);
  return b.CreateVector(v.data(), v.size());
}

flatbuffers::Offset<flatbuffers::Vector<uint8_t>> vector_or_absent(flatbuffers::FlatBufferBuilder& b, const c::Bytes& v,
                                                                   size_t align) {
  if (v.empty()) return 0;
  b.ForceVectorAlignment(v.size(), 1, align);
  return b.CreateVector(v.data(), v.size());
}

flatbuffers::Offset<flatbuffers::String> string_or_absent(flatbuffers::FlatBufferBuilder& b, const std::string& s) {
  if (s.empty()) return 0;
  return b.CreateString(s);
}

flatbuffers::Offset<fb::EncodedTensor> build_tensor(flatbuffers::FlatBufferBuilder& b, const NamedTensor& t) {
  const c::Encoded& e = t.tensor;
  const auto name = string_or_absent(b, t.name);
  const auto shape = vector_or_absent(b, e.shape);
  const auto params = vector_or_absent(b, e.params);
  const auto scales = vector_or_absent(b, e.scales);
  const auto indices = vector_or_absent(b, e.indices);
  const auto values = vector_or_absent(b, e.values, kValuesAlign);
  fb::EncodedTensorBuilder tb(b);
  tb.add_name(name);
  tb.add_shape(shape);
  tb.add_format(static_cast<fb::Format>(e.format));
  tb.add_value_type(static_cast<fb::ValueType>(e.value_type));
  tb.add_index_coding(static_cast<fb::IndexCoding>(e.index_coding));
  tb.add_count(e.count);
  tb.add_seed(e.seed);
  tb.add_params(params);
  tb.add_scales(scales);
  tb.add_indices(indices);
  tb.add_values(values);
  return tb.Finish();
}

flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<fb::EncodedTensor>>> build_tensors(
    flatbuffers::FlatBufferBuilder& b, const std::vector<NamedTensor>& ts) {
  if (ts.empty()) return 0;
  std::vector<flatbuffers::Offset<fb::EncodedTensor>> tensors;
  tensors.reserve(ts.size());
  for (const NamedTensor& t : ts) tensors.push_back(build_tensor(b, t));
  return b.CreateVector(tensors);
}

// The Metric tables (their vector is created by the caller, after any string
// it writes first: the golden buffers fix that order).
std::vector<flatbuffers::Offset<fb::Metric>> build_metrics(flatbuffers::FlatBufferBuilder& b,
                                                           const std::vector<std::pair<std::string, double>>& ms) {
  std::vector<flatbuffers::Offset<fb::Metric>> metrics;
  metrics.reserve(ms.size());
  for (const auto& [key, value] : ms) metrics.push_back(fb::CreateMetric(b, string_or_absent(b, key), value));
  return metrics;
}

flatbuffers::Offset<flatbuffers::Vector<uint8_t>> bytes_or_absent(flatbuffers::FlatBufferBuilder& b,
                                                                  const std::string& s) {
  if (s.empty()) return 0;
  return b.CreateVector(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

flatbuffers::Offset<void> build_body(flatbuffers::FlatBufferBuilder& b, const ModelUpdate& u) {
  flatbuffers::Offset<flatbuffers::Vector<uint8_t>> packed = 0;
  if (u.packed) {
    const std::string p =
        detail::pack(u.tensors, u.control_delta.empty() ? std::vector<std::vector<NamedTensor>>{}
                                                        : std::vector<std::vector<NamedTensor>>{u.control_delta});
    packed = b.CreateVector(reinterpret_cast<const uint8_t*>(p.data()), p.size());
  }
  const auto tensors_off = u.packed ? 0 : build_tensors(b, u.tensors);
  const auto control_off = u.packed ? 0 : build_tensors(b, u.control_delta);
  const auto metrics = build_metrics(b, u.metrics);
  const auto client_id = string_or_absent(b, u.client_id);
  const auto metrics_off = metrics.empty() ? 0 : b.CreateVector(metrics);
  return fb::CreateModelUpdate(b, u.round, client_id, u.num_samples, tensors_off, metrics_off, control_off, packed)
      .Union();
}

flatbuffers::Offset<void> build_body(flatbuffers::FlatBufferBuilder& b, const Hello& h) {
  const auto id = string_or_absent(b, h.client_id);
  const auto model = string_or_absent(b, h.model);
  const auto software = string_or_absent(b, h.software);
  const flatbuffers::Optional<uint64_t> last =
      h.last_round ? flatbuffers::Optional<uint64_t>(*h.last_round) : flatbuffers::nullopt;
  return fb::CreateHello(b, id, h.num_samples, model, h.model_digest, last, software).Union();
}

flatbuffers::Offset<void> build_body(flatbuffers::FlatBufferBuilder& b, const Welcome& w) {
  return fb::CreateWelcome(b, string_or_absent(b, w.run_id), w.heartbeat_ms, w.round, w.max_message_bytes, w.model_seed)
      .Union();
}

flatbuffers::Offset<void> build_body(flatbuffers::FlatBufferBuilder& b, const Task& t) {
  const auto weights = t.packed ? 0 : build_tensors(b, t.weights);
  const auto shared = build_tensors(b, t.shared);
  const auto control = build_tensors(b, t.control);
  const auto compression = string_or_absent(b, t.compression);
  const TrainSettings& s = t.train;
  const auto train = fb::CreateTrainSettings(b, string_or_absent(b, s.algorithm), s.local_epochs, s.batch_size, s.lr,
                                             s.momentum, s.weight_decay, s.mu);
  flatbuffers::Offset<fb::SecAggSetup> secagg = 0;
  if (t.secagg) {
    const SecAggSetup& a = *t.secagg;
    secagg = fb::CreateSecAggSetup(b, a.index, a.clients, a.degree, a.threshold, a.graph_seed, a.clip, a.weight);
  }
  flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<fb::ChainStep>>> chain = 0;
  flatbuffers::Offset<flatbuffers::Vector<uint8_t>> packed = 0;
  if (t.packed) {
    const std::string p = detail::pack(t.weights, t.chain);
    packed = b.CreateVector(reinterpret_cast<const uint8_t*>(p.data()), p.size());
  } else if (!t.chain.empty()) {
    std::vector<flatbuffers::Offset<fb::ChainStep>> steps;
    steps.reserve(t.chain.size());
    for (const auto& step : t.chain) steps.push_back(fb::CreateChainStep(b, build_tensors(b, step)));
    chain = b.CreateVector(steps);
  }
  return fb::CreateTask(b, t.round, static_cast<fb::ModelEncoding>(t.model_encoding), t.base_round, weights, train,
                        compression, t.seed, shared, control, t.deadline_ms, secagg, t.clients, chain, packed)
      .Union();
}

flatbuffers::Offset<void> build_body(flatbuffers::FlatBufferBuilder& b, const SecAgg& m) {
  std::vector<flatbuffers::Offset<fb::SecAggPeer>> peers;
  for (const SecAggPeer& p : m.peers)
    peers.push_back(fb::CreateSecAggPeer(b, p.index, bytes_or_absent(b, p.enc_key), bytes_or_absent(b, p.mask_key)));
  std::vector<flatbuffers::Offset<fb::SecAggShare>> shares, evidence;
  for (const SecAggShare& sh : m.shares)
    shares.push_back(
        fb::CreateSecAggShare(b, sh.peer, sh.kind, bytes_or_absent(b, sh.data), bytes_or_absent(b, sh.digest)));
  for (const SecAggShare& sh : m.evidence)
    evidence.push_back(fb::CreateSecAggShare(b, sh.peer, sh.kind, bytes_or_absent(b, sh.data)));
  const auto client_id = string_or_absent(b, m.client_id);
  const auto peers_off = peers.empty() ? 0 : b.CreateVector(peers);
  const auto shares_off = shares.empty() ? 0 : b.CreateVector(shares);
  const auto survivors = vector_or_absent(b, m.survivors);
  const auto dropped = vector_or_absent(b, m.dropped);
  const auto masked = vector_or_absent(b, m.masked, kValuesAlign);
  const auto metrics_list = build_metrics(b, m.metrics);
  const auto metrics = metrics_list.empty() ? 0 : b.CreateVector(metrics_list);
  const auto rejected = vector_or_absent(b, m.rejected);
  const auto commitment = bytes_or_absent(b, m.commitment);
  const auto evidence_off = evidence.empty() ? 0 : b.CreateVector(evidence);
  return fb::CreateSecAgg(b, m.round, client_id, static_cast<fb::SecAggStage>(m.stage), m.index, peers_off, shares_off,
                          survivors, dropped, masked, metrics, rejected, commitment, evidence_off)
      .Union();
}

flatbuffers::Offset<void> build_body(flatbuffers::FlatBufferBuilder& b, const Ack& a) {
  return fb::CreateAck(b, a.round).Union();
}

flatbuffers::Offset<void> build_body(flatbuffers::FlatBufferBuilder& b, const Heartbeat& h) {
  return fb::CreateHeartbeat(b, h.round, h.num_samples).Union();
}

flatbuffers::Offset<void> build_body(flatbuffers::FlatBufferBuilder& b, const Bye& m) {
  return fb::CreateBye(b, string_or_absent(b, m.reason)).Union();
}

flatbuffers::Offset<void> build_body(flatbuffers::FlatBufferBuilder& b, const SplitActivation& a) {
  const auto session = string_or_absent(b, a.session);
  const auto codec = string_or_absent(b, a.codec);
  const auto shape = vector_or_absent(b, a.shape);
  const auto payload = vector_or_absent(b, a.payload, kValuesAlign);
  const auto labels = vector_or_absent(b, a.labels);
  return fb::CreateSplitActivation(b, session, a.step, codec, shape, payload, labels, a.train).Union();
}

flatbuffers::Offset<void> build_body(flatbuffers::FlatBufferBuilder& b, const SplitGradient& g) {
  const auto session = string_or_absent(b, g.session);
  const auto codec = string_or_absent(b, g.codec);
  const auto shape = vector_or_absent(b, g.shape);
  const auto payload = vector_or_absent(b, g.payload, kValuesAlign);
  return fb::CreateSplitGradient(b, session, g.step, codec, shape, payload, g.loss, g.correct).Union();
}

flatbuffers::Offset<void> build_body(flatbuffers::FlatBufferBuilder& b, const ErrorBody& e) {
  const auto message = string_or_absent(b, e.message);
  const flatbuffers::Optional<uint64_t> round =
      e.round ? flatbuffers::Optional<uint64_t>(*e.round) : flatbuffers::nullopt;
  return fb::CreateError(b, static_cast<fb::ErrorCode>(e.code), message, round).Union();
}

fb::Body body_type(const ModelUpdate&) { return fb::Body::ModelUpdate; }
fb::Body body_type(const ErrorBody&) { return fb::Body::Error; }
fb::Body body_type(const Hello&) { return fb::Body::Hello; }
fb::Body body_type(const Welcome&) { return fb::Body::Welcome; }
fb::Body body_type(const Task&) { return fb::Body::Task; }
fb::Body body_type(const Ack&) { return fb::Body::Ack; }
fb::Body body_type(const Heartbeat&) { return fb::Body::Heartbeat; }
fb::Body body_type(const Bye&) { return fb::Body::Bye; }
fb::Body body_type(const SplitActivation&) { return fb::Body::SplitActivation; }
fb::Body body_type(const SplitGradient&) { return fb::Body::SplitGradient; }
fb::Body body_type(const SecAgg&) { return fb::Body::SecAgg; }

size_t tensors_bound(const std::vector<NamedTensor>& ts) {
  size_t n = 8;
  for (const NamedTensor& t : ts) n += tensor_bound(t.tensor, t.name.size());
  return n;
}

size_t size_bound(const ModelUpdate& u) {
  size_t n = 256 + u.client_id.size() + tensors_bound(u.tensors) + tensors_bound(u.control_delta);
  for (const auto& m : u.metrics) n += 64 + m.first.size();
  return n;
}

size_t size_bound(const ErrorBody& e) { return 256 + e.message.size(); }
size_t size_bound(const Hello& h) { return 256 + h.client_id.size() + h.model.size() + h.software.size(); }
size_t size_bound(const Welcome& w) { return 256 + w.run_id.size(); }
size_t size_bound(const Task& t) {
  size_t n = 640 + t.train.algorithm.size() + t.compression.size() + tensors_bound(t.weights) +
             tensors_bound(t.shared) + tensors_bound(t.control);
  for (const auto& step : t.chain) n += 16 + tensors_bound(step);
  return n;  // a packed Task is smaller than its tables
}
size_t size_bound(const Ack&) { return 128; }
size_t size_bound(const Heartbeat&) { return 128; }
size_t size_bound(const Bye& m) { return 128 + m.reason.size(); }
size_t size_bound(const SplitActivation& a) {
  return 256 + a.session.size() + a.codec.size() + 8 * a.shape.size() + a.payload.size() + kValuesAlign +
         8 * a.labels.size();
}
size_t size_bound(const SplitGradient& g) {
  return 256 + g.session.size() + g.codec.size() + 8 * g.shape.size() + g.payload.size() + kValuesAlign;
}
size_t size_bound(const SecAgg& m) {
  size_t n = 256 + m.client_id.size() +
             4 * (m.survivors.size() + m.dropped.size() + m.masked.size() + m.rejected.size()) + kValuesAlign;
  for (const SecAggPeer& p : m.peers) n += 64 + p.enc_key.size() + p.mask_key.size();
  for (const SecAggShare& sh : m.shares) n += 56 + sh.data.size() + sh.digest.size();
  for (const SecAggShare& sh : m.evidence) n += 48 + sh.data.size();
  n += 16 + m.commitment.size();
  for (const auto& mt : m.metrics) n += 64 + mt.first.size();
  return n;
}

// ---- parse ------------------------------------------------------------------------

flatbuffers::Verifier::Options verifier_options() {
  flatbuffers::Verifier::Options o;
  o.max_depth = kMaxDepth;
  o.max_tables = kMaxTables;
  o.check_alignment = true;
  return o;
}

// Reads major and minor after verifying only the root table's header and those
// two fields, so a peer of another major is told so even when the rest of its
// message means something else to us.
std::pair<uint16_t, uint16_t> peek_version(const uint8_t* buf, size_t size) {
  flatbuffers::Verifier v(buf, size, verifier_options());
  const flatbuffers::uoffset_t root = v.VerifyOffset(sizeof(flatbuffers::uoffset_t));
  if (!root) fail(ErrorCode::kMalformed, "malformed message: bad root offset");
  const auto* table = reinterpret_cast<const flatbuffers::Table*>(buf + sizeof(flatbuffers::uoffset_t) + root);
  if (!table->VerifyTableStart(v) || !table->VerifyField<uint16_t>(v, fb::Message::VT_MAJOR, sizeof(uint16_t)) ||
      !table->VerifyField<uint16_t>(v, fb::Message::VT_MINOR, sizeof(uint16_t)))
    fail(ErrorCode::kMalformed, "malformed message: bad root table");
  return {table->GetField<uint16_t>(fb::Message::VT_MAJOR, 0), table->GetField<uint16_t>(fb::Message::VT_MINOR, 0)};
}

// numel of `shape`, checked against the elements the message may still hold.
NamedTensor tensor_of(const fb::EncodedTensor& t, size_t i, uint64_t& budget, const Owner& owner, c::ValueCheck check) {
  NamedTensor out;
  out.name = std::string(text_of(t.name(), "tensor " + std::to_string(i) + "'s name"));
  if (out.name.empty()) fail(ErrorCode::kMalformed, "tensor " + std::to_string(i) + " has no name");
  const std::string& name = out.name;
  c::Encoded& e = out.tensor;
  detail::set_kinds(e, static_cast<uint8_t>(t.format()), static_cast<uint8_t>(t.value_type()),
                    static_cast<uint8_t>(t.index_coding()), name);
  e.count = t.count();
  e.seed = t.seed();
  e.shape = vector_of(t.shape());
  // Before anything that allocates per element (validate() expands seeded
  // indices): shape sanity and the message's element budget.
  if (e.shape.size() > 8)
    fail(ErrorCode::kMalformed, "tensor '" + name + "' has " + std::to_string(e.shape.size()) + " dimensions (max 8)");
  budget -= checked_numel(e.shape, budget, name);
  e.params = vector_of(t.params());
  e.scales = vector_of(t.scales());
  e.indices = bytes_of(t.indices());
  // Values in place when the frame's owner keeps it alive: validate() and the
  // aggregator read them where they arrived. The widest value read in place is
  // fp32, so 4-byte alignment is enough; asking for the builder's 16 would copy
  // every large ZeroMQ message, whose data sits 8 bytes past a 16-byte boundary.
  const auto* tv = t.values();
  if (owner && tv && tv->size() > 0 && reinterpret_cast<uintptr_t>(tv->data()) % kViewAlign == 0)
    e.values = c::Bytes::view(tv->data(), tv->size(), owner);
  else if (tv)
    e.values.assign(tv->data(), tv->data() + tv->size());
  check_payload(e, check, name);
  return out;
}

// A vector of tensors, names unique within it; `budget` is the message's
// remaining element allowance (shared by all its tensor vectors).
std::vector<NamedTensor> tensors_of(const flatbuffers::Vector<flatbuffers::Offset<fb::EncodedTensor>>* tensors,
                                    uint64_t& budget, const Owner& owner, c::ValueCheck check = c::ValueCheck::kScan) {
  std::vector<NamedTensor> out;
  if (!tensors) return out;
  out.reserve(tensors->size());
  std::unordered_set<std::string_view> names;
  for (flatbuffers::uoffset_t i = 0; i < tensors->size(); ++i) {
    const fb::EncodedTensor& t = *tensors->Get(i);
    out.push_back(tensor_of(t, i, budget, owner, check));
    // A view into the verified buffer, which outlives this function.
    if (!names.insert(std::string_view(t.name()->c_str(), t.name()->size())).second)
      fail(ErrorCode::kMalformed, "duplicate tensor name '" + out.back().name + "'");
  }
  return out;
}

// A string field with a length limit (bytes).
std::string bounded_text(const flatbuffers::String* s, const std::string& what, size_t max_bytes = kMaxTextBytes) {
  const std::string_view v = text_of(s, what);
  if (v.size() > max_bytes)
    fail(ErrorCode::kMalformed,
         what + " is " + std::to_string(v.size()) + " bytes (max " + std::to_string(max_bytes) + ")");
  return std::string(v);
}

// Metrics: keys non-empty and unique, values finite.
std::vector<std::pair<std::string, double>> metrics_of(
    const flatbuffers::Vector<flatbuffers::Offset<fb::Metric>>* metrics) {
  std::vector<std::pair<std::string, double>> out;
  if (!metrics) return out;
  out.reserve(metrics->size());
  std::unordered_set<std::string_view> keys;
  for (flatbuffers::uoffset_t i = 0; i < metrics->size(); ++i) {
    const fb::Metric& m = *metrics->Get(i);
    const std::string_view key = text_of(m.key(), "metric " + std::to_string(i) + "'s key");
    if (key.empty()) fail(ErrorCode::kMalformed, "metric " + std::to_string(i) + " has no key");
    if (!keys.insert(key).second) fail(ErrorCode::kMalformed, "duplicate metric '" + std::string(key) + "'");
    if (!std::isfinite(m.value())) fail(ErrorCode::kMalformed, "metric '" + std::string(key) + "' is not finite");
    out.emplace_back(std::string(key), m.value());
  }
  return out;
}

ModelUpdate update_of(const fb::ModelUpdate& u, uint64_t max_elements, const Owner& owner, c::ValueCheck check) {
  ModelUpdate out;
  out.round = u.round();
  out.num_samples = u.num_samples();
  out.client_id = std::string(text_of(u.client_id(), "client_id"));
  uint64_t budget = max_elements;
  if (const auto* packed = u.packed()) {
    if (u.tensors() || u.control_delta())
      fail(ErrorCode::kMalformed, "ModelUpdate: packed tensors next to tensors or control_delta");
    detail::Unpacked p = detail::unpack(packed->data(), packed->size(), budget, 0, check, 2);
    out.tensors = std::move(p.weights);
    if (!p.chain.empty()) out.control_delta = std::move(p.chain[0]);
    out.packed = true;
  }
  if (!out.packed) {
    out.tensors = tensors_of(u.tensors(), budget, owner, check);
    out.control_delta = tensors_of(u.control_delta(), budget, owner);
  }
  out.metrics = metrics_of(u.metrics());
  return out;
}

ErrorBody error_of(const fb::Error& e) {
  ErrorBody out;
  const auto code = static_cast<uint8_t>(e.code());
  out.code = code <= static_cast<uint8_t>(fb::ErrorCode::MAX) ? static_cast<ErrorCode>(code) : ErrorCode::kUnknown;
  out.message = std::string(text_of(e.message(), "error message"));
  if (e.round()) out.round = *e.round();
  return out;
}

Hello hello_of(const fb::Hello& h) {
  Hello out;
  out.client_id = bounded_text(h.client_id(), "client_id", kMaxClientIdBytes);
  if (out.client_id.empty()) fail(ErrorCode::kMalformed, "Hello without a client_id");
  out.num_samples = h.num_samples();
  out.model = bounded_text(h.model(), "model");
  out.model_digest = h.model_digest();
  if (h.last_round()) out.last_round = *h.last_round();
  out.software = bounded_text(h.software(), "software");
  return out;
}

Welcome welcome_of(const fb::Welcome& w) {
  Welcome out;
  out.run_id = bounded_text(w.run_id(), "run_id");
  out.heartbeat_ms = w.heartbeat_ms();
  out.round = w.round();
  out.max_message_bytes = w.max_message_bytes();
  out.model_seed = w.model_seed();
  return out;
}

TrainSettings train_of(const fb::TrainSettings* t) {
  if (!t) fail(ErrorCode::kMalformed, "Task without training settings");
  TrainSettings out;
  out.algorithm = bounded_text(t->algorithm(), "train.algorithm");
  out.local_epochs = t->local_epochs();
  out.batch_size = t->batch_size();
  out.lr = t->lr();
  out.momentum = t->momentum();
  out.weight_decay = t->weight_decay();
  out.mu = t->mu();
  if (out.local_epochs < 1 || out.batch_size < 1)
    fail(ErrorCode::kMalformed, "Task: local_epochs and batch_size must be >= 1");
  if (!std::isfinite(out.lr) || out.lr <= 0) fail(ErrorCode::kMalformed, "Task: lr must be finite and > 0");
  if (!std::isfinite(out.momentum) || out.momentum < 0 || out.momentum >= 1)
    fail(ErrorCode::kMalformed, "Task: momentum must be in [0, 1)");
  if (!std::isfinite(out.weight_decay) || out.weight_decay < 0 || !std::isfinite(out.mu) || out.mu < 0)
    fail(ErrorCode::kMalformed, "Task: weight_decay and mu must be finite and >= 0");
  return out;
}

// The shape of a Task's model encoding (wire.h, Task::chain).
void check_model_encoding(const Task& t) {
  const std::string r = std::to_string(t.round);
  switch (t.model_encoding) {
    case ModelEncoding::kFull:
    case ModelEncoding::kDelta:
      if (!t.chain.empty()) fail(ErrorCode::kMalformed, "Task: a chain with a Full or Delta model");
      return;
    case ModelEncoding::kChain:
      if (!t.weights.empty()) fail(ErrorCode::kMalformed, "Task: a Chain with weights (its deltas go in chain)");
      if (t.chain.size() < 2 || t.base_round >= t.round || t.round - 1 - t.base_round != t.chain.size())
        fail(ErrorCode::kMalformed, "Task: a Chain of round " + r + " from base_round " + std::to_string(t.base_round) +
                                        " with " + std::to_string(t.chain.size()) +
                                        " steps (it needs round - 1 - base_round >= 2 steps)");
      return;
    case ModelEncoding::kPatch:
      if (!t.chain.empty()) fail(ErrorCode::kMalformed, "Task: a chain with a Patch model");
      if (t.base_round >= t.round)
        fail(ErrorCode::kMalformed, "Task: a Patch of round " + r + " from base_round " + std::to_string(t.base_round));
      for (const NamedTensor& nt : t.weights) {
        const c::Encoded& e = nt.tensor;
        if (e.format != c::Format::kSparse || e.value_type != c::ValueType::kF32 ||
            !(e.index_coding == c::IndexCoding::kDeltaVarint || e.index_coding == c::IndexCoding::kBitmap ||
              e.index_coding == c::IndexCoding::kRice))
          fail(ErrorCode::kMalformed, "Task: the patch of '" + nt.name +
                                          "' is not a Sparse fp32 tensor with DeltaVarint, Bitmap or Rice positions");
      }
      return;
  }
}

Task task_of(const fb::Task& t, uint64_t max_elements, const Owner& owner) {
  Task out;
  out.round = t.round();
  const auto enc = static_cast<uint8_t>(t.model_encoding());
  if (enc > static_cast<uint8_t>(fb::ModelEncoding::MAX))
    fail(ErrorCode::kUnsupported, "Task: unknown model encoding " + std::to_string(enc));
  out.model_encoding = static_cast<ModelEncoding>(enc);
  out.base_round = t.base_round();
  uint64_t budget = max_elements;
  out.weights = tensors_of(t.weights(), budget, owner);
  out.train = train_of(t.train());
  out.compression = bounded_text(t.compression(), "compression");
  out.seed = t.seed();
  out.shared = tensors_of(t.shared(), budget, owner);
  out.control = tensors_of(t.control(), budget, owner);
  out.deadline_ms = t.deadline_ms();
  out.clients = t.clients();
  if (const auto* packed = t.packed()) {
    if (t.weights() || t.chain())
      fail(ErrorCode::kMalformed, "Task: packed tensors next to weights or chain (they go in one or the other)");
    detail::Unpacked u = detail::unpack(packed->data(), packed->size(), budget, max_elements);  // own per step
    out.weights = std::move(u.weights);
    out.chain = std::move(u.chain);
    out.packed = true;
  }
  if (const auto* chain = t.chain()) {
    // Each step is at most one model: its own element allowance (a step is
    // applied before the next is read, so this bounds the work per step).
    out.chain.reserve(chain->size());
    for (flatbuffers::uoffset_t i = 0; i < chain->size(); ++i) {
      uint64_t step_budget = max_elements;
      out.chain.push_back(tensors_of(chain->Get(i)->weights(), step_budget, owner));
    }
  }
  check_model_encoding(out);
  if (const fb::SecAggSetup* a = t.secagg()) {
    SecAggSetup g;
    g.index = a->index();
    g.clients = a->clients();
    g.degree = a->degree();
    g.threshold = a->threshold();
    g.graph_seed = a->graph_seed();
    g.clip = a->clip();
    g.weight = a->weight();
    if (g.index < 1 || g.index > g.clients)
      fail(ErrorCode::kMalformed,
           "Task.secagg: index " + std::to_string(g.index) + " outside 1.." + std::to_string(g.clients));
    if (g.threshold < 2 || g.threshold > g.degree || g.degree >= g.clients)
      fail(ErrorCode::kMalformed, "Task.secagg: need 2 <= threshold <= degree < clients (threshold " +
                                      std::to_string(g.threshold) + ", degree " + std::to_string(g.degree) +
                                      ", clients " + std::to_string(g.clients) + ")");
    if (!std::isfinite(g.clip) || g.clip <= 0) fail(ErrorCode::kMalformed, "Task.secagg: clip must be finite and > 0");
    if (!(g.weight > 0 && g.weight <= 1)) fail(ErrorCode::kMalformed, "Task.secagg: weight must be in (0, 1]");
    out.secagg = g;
  }
  return out;
}

std::vector<uint32_t> distinct_indices(const flatbuffers::Vector<uint32_t>* v, const char* what) {
  std::vector<uint32_t> out = vector_of(v);
  if (out.size() > kMaxSecAggPeers) fail(ErrorCode::kMalformed, std::string("SecAgg: too many ") + what);
  std::vector<uint32_t> sorted = out;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    fail(ErrorCode::kMalformed, std::string("SecAgg: repeated index in ") + what);
  return out;
}

std::string key_of(const flatbuffers::Vector<uint8_t>* v, const std::string& what) {
  if (!v || v->size() != kSecAggKeyBytes)
    fail(ErrorCode::kMalformed, "SecAgg: " + what + " must be " + std::to_string(kSecAggKeyBytes) + " bytes");
  return std::string(reinterpret_cast<const char*>(v->data()), v->size());
}

SecAgg secagg_of(const fb::SecAgg& m, uint64_t max_elements) {
  SecAgg out;
  out.round = m.round();
  out.client_id = bounded_text(m.client_id(), "client_id", kMaxClientIdBytes);
  const auto stage = static_cast<uint8_t>(m.stage());
  if (stage > static_cast<uint8_t>(fb::SecAggStage::MAX))
    fail(ErrorCode::kUnsupported, "SecAgg: unknown stage " + std::to_string(stage));
  out.stage = static_cast<SecAggStage>(stage);
  out.index = m.index();
  if (const auto* peers = m.peers()) {
    if (peers->size() > kMaxSecAggPeers) fail(ErrorCode::kMalformed, "SecAgg: too many peers");
    for (flatbuffers::uoffset_t i = 0; i < peers->size(); ++i) {
      const fb::SecAggPeer& p = *peers->Get(i);
      out.peers.push_back({p.index(), key_of(p.enc_key(), "enc_key"), key_of(p.mask_key(), "mask_key")});
    }
  }
  if (const auto* shares = m.shares()) {
    if (shares->size() > 2 * kMaxSecAggPeers) fail(ErrorCode::kMalformed, "SecAgg: too many shares");
    for (flatbuffers::uoffset_t i = 0; i < shares->size(); ++i) {
      const fb::SecAggShare& sh = *shares->Get(i);
      if (sh.kind() > 2) fail(ErrorCode::kMalformed, "SecAgg: unknown share kind " + std::to_string(sh.kind()));
      const auto* d = sh.data();
      if (!d || d->size() == 0 || d->size() > kMaxSecAggShareBytes)
        fail(ErrorCode::kMalformed, "SecAgg: share data must be 1.." + std::to_string(kMaxSecAggShareBytes) + " bytes");
      std::string digest;
      if (const auto* g = sh.digest()) {
        if (g->size() != kSecAggDigestBytes)
          fail(ErrorCode::kMalformed,
               "SecAgg: a share digest must be " + std::to_string(kSecAggDigestBytes) + " bytes");
        digest.assign(reinterpret_cast<const char*>(g->data()), g->size());
      }
      out.shares.push_back(
          {sh.peer(), sh.kind(), std::string(reinterpret_cast<const char*>(d->data()), d->size()), std::move(digest)});
    }
  }
  if (const auto* c = m.commitment()) {
    if (c->size() != kSecAggKeyBytes)
      fail(ErrorCode::kMalformed, "SecAgg: commitment must be " + std::to_string(kSecAggKeyBytes) + " bytes");
    out.commitment.assign(reinterpret_cast<const char*>(c->data()), c->size());
  }
  if (const auto* ev = m.evidence()) {
    if (ev->size() > kMaxSecAggPeers) fail(ErrorCode::kMalformed, "SecAgg: too much evidence");
    for (flatbuffers::uoffset_t i = 0; i < ev->size(); ++i) {
      const fb::SecAggShare& e = *ev->Get(i);
      const auto* d = e.data();
      if (e.kind() != 0 || !d || d->size() == 0 || d->size() > kMaxSecAggShareBytes)
        fail(ErrorCode::kMalformed,
             "SecAgg: evidence must be kind 0 with 1.." + std::to_string(kMaxSecAggShareBytes) + " bytes");
      out.evidence.push_back({e.peer(), 0, std::string(reinterpret_cast<const char*>(d->data()), d->size()), {}});
    }
  }
  out.survivors = distinct_indices(m.survivors(), "survivors");
  out.dropped = distinct_indices(m.dropped(), "dropped");
  out.rejected = distinct_indices(m.rejected(), "rejected");
  if (const auto* v = m.masked()) {
    if (v->size() > max_elements) fail(ErrorCode::kOversize, "SecAgg: masked vector over the element limit");
    out.masked.resize(v->size());
    if (v->size()) std::memcpy(out.masked.data(), v->data(), v->size() * sizeof(uint32_t));  // little-endian hosts
  }
  out.metrics = metrics_of(m.metrics());
  return out;
}

// Shape of a split message: 1..8 dimensions (0..8 when `allow_empty`), each
// >= 0, numel within the element budget.
std::vector<int64_t> split_shape_of(const flatbuffers::Vector<int64_t>* v, uint64_t max_elements, bool allow_empty) {
  std::vector<int64_t> shape = vector_of(v);
  if (shape.size() > 8 || (shape.empty() && !allow_empty))
    fail(ErrorCode::kMalformed, "split message: shape has " + std::to_string(shape.size()) + " dimensions (1..8)");
  checked_numel(shape, max_elements, "split");
  return shape;
}

SplitActivation activation_of(const fb::SplitActivation& a, uint64_t max_elements) {
  SplitActivation out;
  out.session = bounded_text(a.session(), "session", kMaxClientIdBytes);
  if (out.session.empty()) fail(ErrorCode::kMalformed, "SplitActivation without a session");
  out.step = a.step();
  out.codec = bounded_text(a.codec(), "codec");
  out.shape = split_shape_of(a.shape(), max_elements, false);
  out.payload = bytes_of(a.payload());
  out.labels = vector_of(a.labels());
  if (!out.labels.empty() && static_cast<int64_t>(out.labels.size()) != out.shape[0])
    fail(ErrorCode::kMalformed, "SplitActivation: " + std::to_string(out.labels.size()) + " labels for a batch of " +
                                    std::to_string(out.shape[0]));
  for (int64_t l : out.labels)
    if (l < 0) fail(ErrorCode::kMalformed, "SplitActivation: negative label " + std::to_string(l));
  out.train = a.train();
  return out;
}

SplitGradient gradient_of(const fb::SplitGradient& g, uint64_t max_elements) {
  SplitGradient out;
  out.session = bounded_text(g.session(), "session", kMaxClientIdBytes);
  out.step = g.step();
  out.codec = bounded_text(g.codec(), "codec");
  out.shape = split_shape_of(g.shape(), max_elements, true);
  out.payload = bytes_of(g.payload());
  out.loss = g.loss();
  if (!std::isfinite(out.loss)) fail(ErrorCode::kMalformed, "SplitGradient: loss is not finite");
  out.correct = g.correct();
  return out;
}

// A union member the verifier accepted is non-null unless its type tag and
// value disagree.
template <typename T>
const T& body_or_fail(const T* p, const char* name) {
  if (!p) fail(ErrorCode::kMalformed, std::string(name) + " body missing");
  return *p;
}

Message parse_verified(const uint8_t* buf, size_t size, const ParseLimits& limits, const Owner& owner) {
  const auto [major, minor] = peek_version(buf, size);
  if (major != kProtocolMajor) {
    std::ostringstream os;
    os << "protocol version mismatch: peer speaks " << major << "." << minor << ", this build speaks " << kProtocolMajor
       << "." << kProtocolMinor;
    fail(ErrorCode::kVersionMismatch, os.str());
  }
  flatbuffers::Verifier verifier(buf, size, verifier_options());
  if (!fb::VerifySizePrefixedMessageBuffer(verifier))
    fail(ErrorCode::kMalformed, "malformed message: FlatBuffers verification failed");

  const fb::Message* m = fb::GetSizePrefixedMessage(buf);
  Message out;
  out.major = major;
  out.minor = minor;
  switch (m->body_type()) {
    case fb::Body::NONE:
      fail(ErrorCode::kMalformed, "message has no body");
    case fb::Body::ModelUpdate: {
      const fb::ModelUpdate* u = m->body_as_ModelUpdate();
      if (!u) fail(ErrorCode::kMalformed, "ModelUpdate body missing");
      out.body = update_of(*u, limits.max_elements, owner, limits.update_values);
      return out;
    }
    case fb::Body::Error: {
      const fb::Error* e = m->body_as_Error();
      if (!e) fail(ErrorCode::kMalformed, "Error body missing");
      out.body = error_of(*e);
      return out;
    }
    case fb::Body::Hello:
      out.body = hello_of(body_or_fail(m->body_as_Hello(), "Hello"));
      return out;
    case fb::Body::Welcome:
      out.body = welcome_of(body_or_fail(m->body_as_Welcome(), "Welcome"));
      return out;
    case fb::Body::Task:
      out.body = task_of(body_or_fail(m->body_as_Task(), "Task"), limits.max_elements, owner);
      return out;
    case fb::Body::Ack:
      out.body = Ack{body_or_fail(m->body_as_Ack(), "Ack").round()};
      return out;
    case fb::Body::Heartbeat: {
      const auto& hb = body_or_fail(m->body_as_Heartbeat(), "Heartbeat");
      out.body = Heartbeat{hb.round(), hb.num_samples()};
      return out;
    }
    case fb::Body::Bye:
      out.body = Bye{bounded_text(body_or_fail(m->body_as_Bye(), "Bye").reason(), "reason")};
      return out;
    case fb::Body::SplitActivation:
      out.body = activation_of(body_or_fail(m->body_as_SplitActivation(), "SplitActivation"), limits.max_elements);
      return out;
    case fb::Body::SplitGradient:
      out.body = gradient_of(body_or_fail(m->body_as_SplitGradient(), "SplitGradient"), limits.max_elements);
      return out;
    case fb::Body::SecAgg:
      out.body = secagg_of(body_or_fail(m->body_as_SecAgg(), "SecAgg"), limits.max_elements);
      return out;
  }
  fail(ErrorCode::kUnsupported, "unknown message type " + std::to_string(static_cast<int>(m->body_type())) +
                                    " (peer speaks " + std::to_string(major) + "." + std::to_string(minor) + ")");
}

// Cuts to kMaxErrorMessageBytes and replaces bytes that are not valid text with
// '?', so an Error reply always passes the peer's checks.
std::string sanitize(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size() && out.size() < kMaxErrorMessageBytes;) {
    const auto b = static_cast<unsigned char>(s[i]);
    const size_t len = b >= 0xf0 ? 4 : b >= 0xe0 ? 3 : b >= 0xc0 ? 2 : 1;
    if (i + len <= s.size() && valid_text(s.data() + i, len)) {
      if (out.size() + len > kMaxErrorMessageBytes) break;
      out.append(s, i, len);
      i += len;
    } else {
      out += '?';
      ++i;
    }
  }
  return out;
}

}  // namespace

const char* body_name(const Body& body) {
  static const char* const kNames[] = {"ModelUpdate", "Error", "Hello",           "Welcome",       "Task",  "Ack",
                                       "Heartbeat",   "Bye",   "SplitActivation", "SplitGradient", "SecAgg"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == std::variant_size_v<Body>, "a name per body type");
  static_assert(static_cast<size_t>(fb::Body::MAX) == std::variant_size_v<Body>, "wire::Body mirrors fb::Body");
  return kNames[body.index()];
}

const char* secagg_stage_name(SecAggStage s) {
  static const char* const kNames[] = {"keys", "neighbours", "shares", "shares_in", "masked", "unmask", "reveal"};
  static_assert(static_cast<size_t>(fb::SecAggStage::MAX) + 1 == sizeof(kNames) / sizeof(kNames[0]),
                "a name per SecAgg stage");
  const auto i = static_cast<size_t>(s);
  return i < sizeof(kNames) / sizeof(kNames[0]) ? kNames[i] : "unknown";
}

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kUnknown:
      return "unknown";
    case ErrorCode::kVersionMismatch:
      return "version_mismatch";
    case ErrorCode::kMalformed:
      return "malformed";
    case ErrorCode::kOversize:
      return "oversize";
    case ErrorCode::kRejected:
      return "rejected";
    case ErrorCode::kInternal:
      return "internal";
    case ErrorCode::kUnsupported:
      return "unsupported";
  }
  return "unknown";
}

std::string serialize(const Message& m) {
  const size_t bound = std::visit([](const auto& body) { return size_bound(body); }, m.body);
  SPARROW_CHECK(bound < FLATBUFFERS_MAX_BUFFER_SIZE,
                "wire: message of up to " << bound << " bytes exceeds the FlatBuffers limit of 2 GiB");
  // Sized for the whole message up front so building never reallocates.
  flatbuffers::FlatBufferBuilder b(bound);
  const auto body = std::visit([&](const auto& v) { return build_body(b, v); }, m.body);
  const fb::Body type = std::visit([](const auto& v) { return body_type(v); }, m.body);
  b.FinishSizePrefixed(fb::CreateMessage(b, m.major, m.minor, type, body), kIdentifier);
  return std::string(reinterpret_cast<const char*>(b.GetBufferPointer()), b.GetSize());
}

Message parse(const void* data, size_t size, size_t max_bytes) {
  ParseLimits limits;
  limits.max_bytes = max_bytes;
  return parse(data, size, limits);
}

Message parse(const void* data, size_t size, const ParseLimits& limits) { return parse(data, size, limits, nullptr); }

Message parse(const void* data, size_t size, const ParseLimits& limits, Owner owner) {
  if (!data || size == 0) fail(ErrorCode::kMalformed, "empty message");
  if (size > limits.max_bytes || size >= FLATBUFFERS_MAX_BUFFER_SIZE)
    fail(ErrorCode::kOversize, "message of " + std::to_string(size) + " bytes exceeds the limit of " +
                                   std::to_string(std::min<size_t>(limits.max_bytes, FLATBUFFERS_MAX_BUFFER_SIZE - 1)));
  if (size < kHeaderBytes) fail(ErrorCode::kMalformed, "message of " + std::to_string(size) + " bytes is too short");
  const auto* bytes = static_cast<const uint8_t*>(data);
  if (std::memcmp(bytes + 2 * sizeof(flatbuffers::uoffset_t), kIdentifier, flatbuffers::kFileIdentifierLength) != 0)
    fail(ErrorCode::kMalformed, "not a Sparrow message (file identifier is not \"SPRW\")");
  // The size prefix must account for every byte: catches truncation and trailing garbage.
  const uint64_t prefix =
      uint64_t{bytes[0]} | uint64_t{bytes[1]} << 8 | uint64_t{bytes[2]} << 16 | uint64_t{bytes[3]} << 24;
  if (prefix != size - sizeof(flatbuffers::uoffset_t))
    fail(ErrorCode::kMalformed, "size prefix says " + std::to_string(prefix) + " bytes follow, the frame has " +
                                    std::to_string(size - sizeof(flatbuffers::uoffset_t)) + " (truncated or padded)");
  try {
    // The verifier (rightly) insists on aligned scalars; realign a misaligned
    // frame instead of refusing it.
    if (reinterpret_cast<uintptr_t>(bytes) % alignof(uint64_t) == 0) return parse_verified(bytes, size, limits, owner);
    struct alignas(kValuesAlign) Block {
      uint8_t b[kValuesAlign];
    };
    std::unique_ptr<Block[]> copy(new Block[(size + kValuesAlign - 1) / kValuesAlign]);
    std::memcpy(copy.get(), bytes, size);
    return parse_verified(reinterpret_cast<const uint8_t*>(copy.get()), size, limits, nullptr);
  } catch (const std::bad_alloc&) {
    fail(ErrorCode::kInternal, "out of memory parsing a message of " + std::to_string(size) + " bytes");
  }
}

ErrorBody error_for(const std::exception& e, std::optional<uint64_t> round) {
  ErrorBody out;
  out.round = round;
  if (const auto* p = dynamic_cast<const ProtocolError*>(&e)) {
    out.code = p->code();
    out.message = sanitize(core::peer_message(e));
  } else if (dynamic_cast<const FormatError*>(&e)) {
    out.code = ErrorCode::kMalformed;
    out.message = sanitize(core::peer_message(e));
  } else if (dynamic_cast<const sparrow::Error*>(&e)) {
    out.code = ErrorCode::kRejected;
    out.message = sanitize(core::peer_message(e));
  } else {
    out.code = ErrorCode::kInternal;
    out.message = "internal error";
  }
  return out;
}

size_t encoded_size(const compression::Encoded& e, const std::string& name) { return tensor_bound(e, name.size()); }

void apply_patch(const compression::Encoded& e, float* dst, int64_t numel) {
  SPARROW_CHECK_T(FormatError,
                  e.format == c::Format::kSparse && e.value_type == c::ValueType::kF32 &&
                      (e.index_coding == c::IndexCoding::kDeltaVarint || e.index_coding == c::IndexCoding::kBitmap ||
                       e.index_coding == c::IndexCoding::kRice),
                  "patch: not a Sparse fp32 tensor with DeltaVarint, Bitmap or Rice positions");
  c::validate(e);  // sizes, finite values
  SPARROW_CHECK_T(FormatError, e.numel() == numel, "patch: " << e.numel() << " elements against the model's " << numel);
  const std::vector<int64_t> idx = c::detail::decode_indices(e);  // ascending, in range, count of them
  SPARROW_CHECK_T(FormatError, idx.size() == e.count && e.values.size() == 4 * e.count,
                  "patch: " << idx.size() << " positions, " << e.count << " values");
  const uint8_t* v = e.values.data();
  for (size_t i = 0; i < idx.size(); ++i) std::memcpy(dst + idx[i], v + 4 * i, 4);
}

}  // namespace sparrow::wire
