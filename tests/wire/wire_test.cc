#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>

#include "compression/codec_util.h"
#include "compression/compressor.h"
#include "core/error.h"
#include "core/rng.h"
#include "wire/wire.h"

using namespace sparrow;
using namespace sparrow::wire;
using compression::Encoded;
using compression::Format;
using compression::IndexCoding;
using compression::ValueType;

namespace {

// ---- hand-built tensors (no codec randomness, so golden bytes never move) ------

std::vector<uint8_t> f32_bytes(std::initializer_list<float> v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.begin(), out.size());
  return out;
}

// 16-bit patterns (fp16 or bf16), little-endian.
std::vector<uint8_t> u16_bytes(std::initializer_list<uint16_t> v) {
  std::vector<uint8_t> out;
  for (uint16_t h : v) {
    out.push_back(static_cast<uint8_t>(h & 0xff));
    out.push_back(static_cast<uint8_t>(h >> 8));
  }
  return out;
}

Encoded dense(std::vector<int64_t> shape, ValueType vt, std::vector<uint8_t> values) {
  Encoded e;
  e.format = Format::kDense;
  e.shape = std::move(shape);
  e.value_type = vt;
  e.values = std::move(values);
  return e;
}

// numel 300; positions {0, 5, 200, 299}: gaps minus one 0, 4, 194, 98 (194 takes two LEB128 bytes).
Encoded sparse_delta_fp16() {
  Encoded e;
  e.format = Format::kSparse;
  e.shape = {3, 100};
  e.value_type = ValueType::kF16;
  e.index_coding = IndexCoding::kDeltaVarint;
  e.count = 4;
  e.indices = {0x00, 0x04, 0xc2, 0x01, 0x62};
  e.values = u16_bytes({0x3800, 0xbc00, 0x4000, 0xb400});  // 0.5, -1, 2, -0.25
  return e;
}

// numel 10; positions {0, 3, 9} as a bitmap; sign values (+, -, +) with magnitude 0.75.
Encoded sparse_bitmap_sign() {
  Encoded e;
  e.format = Format::kSparse;
  e.shape = {10};
  e.value_type = ValueType::kSign;
  e.index_coding = IndexCoding::kBitmap;
  e.count = 3;
  e.indices = {0x09, 0x02};
  e.values = {0x02};
  e.scales = {0.75f};
  return e;
}

// numel 50; 3 positions drawn from key 0x1234; fp32 values.
Encoded sparse_seeded_f32() {
  Encoded e;
  e.format = Format::kSparse;
  e.shape = {5, 10};
  e.value_type = ValueType::kF32;
  e.index_coding = IndexCoding::kSeeded;
  e.count = 3;
  e.seed = 0x1234;
  e.values = f32_bytes({1.5f, -2.5f, 0.25f});
  return e;
}

// numel 10; 1 bit per element (1 = negative), magnitude 0.125.
Encoded sign_tensor() {
  Encoded e;
  e.format = Format::kSign;
  e.shape = {2, 5};
  e.scales = {0.125f};
  e.values = {0xa5, 0x01};
  return e;
}

// numel 6, levels 4, bucket 4 (two norms); levels 0, +1, 0, -3, 0, 0 as LSB-first
// Elias-gamma codes: 1 | 0 1 0 0 | 1 | 0 0 1 0 0 1 | 1 | 1, then 2 zero padding bits.
Encoded quantized_tensor() {
  Encoded e;
  e.format = Format::kQuantized;
  e.shape = {6};
  e.params = {4, 4};
  e.scales = {1.0f, 2.0f};
  e.values = {0x25, 0x39};
  return e;
}

Encoded ternary_tensor() {  // numel 5: codes 0, 1, 2, 0, 1 (0, +s, -s, 0, +s), 2 bits each
  Encoded e;
  e.format = Format::kTernary;
  e.shape = {5};
  e.scales = {0.5f};
  e.values = {0x24, 0x01};
  return e;
}

Encoded lowrank_tensor() {  // 2x3, rank 1: P (2x1) then Q (3x1)
  Encoded e;
  e.format = Format::kLowRank;
  e.shape = {2, 3};
  e.params = {2, 3, 1};
  e.values = f32_bytes({1, 2, 3, 4, 5});
  return e;
}

// Protocol 1.4: the same 2x3 rank-1 product with int8 factors, one scale per
// factor column: P = [1, 2] as q = [64, 127] with scale 2/127, Q = [3, 4, 5] as
// q = [76, 102, 127] with scale 5/127.
Encoded lowrank_int8_tensor() {
  Encoded e = lowrank_tensor();
  e.value_type = ValueType::kInt8;
  e.scales = {2.0f / 127, 5.0f / 127};
  e.values = {64, 127, 76, 102, 127};  // round(v / scale)
  return e;
}

// Protocol 1.5: the 2x3 rank-1 product plus a sparse correction of 0.5 at
// position 1 and -1 at position 5. Rice b = 0, gaps minus one 1 and 3: unary
// 1 0, 1 1 1 0 -> bits 101110, LSB first 0x1d. Decodes to [3, 4.5, 5, 6, 8, 9].
Encoded lowrank_sparse_tensor() {
  Encoded e = lowrank_tensor();
  e.format = Format::kLowRankSparse;
  e.params = {2, 3, 1, 0};
  e.index_coding = IndexCoding::kRice;
  e.count = 2;
  e.indices = {0x1d};
  e.values = f32_bytes({1, 2, 3, 4, 5, 0.5f, -1});
  return e;
}

Encoded factor_tensor() {  // 2x3, rank 1, the Q factor (3x1)
  Encoded e;
  e.format = Format::kLowRankFactor;
  e.shape = {2, 3};
  e.params = {2, 3, 1, 1};
  e.values = f32_bytes({1, 2, 3});
  return e;
}

// Protocol 1.4: the ACP factor in fp16.
Encoded factor_fp16_tensor() {
  Encoded e = factor_tensor();
  e.value_type = ValueType::kF16;
  e.values = {0x00, 0x3c, 0x00, 0x40, 0x00, 0x42};  // 1, 2, 3
  return e;
}

// A ModelUpdate message of protocol 1.minor.
Message update_message(uint64_t round, std::string client_id, uint64_t num_samples, uint16_t minor,
                       std::vector<NamedTensor> tensors, std::vector<std::pair<std::string, double>> metrics = {}) {
  ModelUpdate u;
  u.round = round;
  u.client_id = std::move(client_id);
  u.num_samples = num_samples;
  u.tensors = std::move(tensors);
  u.metrics = std::move(metrics);
  Message m;
  m.minor = minor;
  m.body = std::move(u);
  return m;
}

Message update_message(std::vector<NamedTensor> tensors, std::vector<std::pair<std::string, double>> metrics = {}) {
  return update_message(3, "c1", 100, kProtocolMinor, std::move(tensors), std::move(metrics));
}

// Protocol 1.3 (tcs): 3 values on the round's mask, one at Rice-coded position 11
// (docs/protocol.md's example).
Encoded masked_tensor() {
  Encoded e;
  e.format = Format::kSparse;
  e.shape = {20};
  e.value_type = ValueType::kInt8;
  e.index_coding = IndexCoding::kMask;
  e.count = 4;
  e.params = {1, 3};
  e.scales = {0.5f, 0.25f};
  e.indices = {0x5f};
  e.values = std::vector<uint8_t>{0x7f, 0x81, 0x00, 0x40};
  return e;
}

// Protocol 1.6: a masked (tcs) update carrying a seeded share of the mask
// (tcs:keep=P), docs/protocol.md's example.
Encoded masked_keep_tensor() {
  Encoded e;
  e.format = Format::kSparse;
  e.shape = {20};
  e.value_type = ValueType::kSign;
  e.index_coding = IndexCoding::kMask;
  e.count = 3;
  e.seed = 7;
  e.params = {1, 6, 0, 2};
  e.scales = {2.0f, 0.5f};
  e.indices = {0x7f, 0x01};
  e.values = std::vector<uint8_t>{0x02};
  return e;
}

// ---- the golden messages: literal values, never generated by a codec -------------

Message golden_dense() {
  // "client-α": non-ASCII UTF-8; a protocol 1.0 buffer.
  return update_message(
      7, "client-\xce\xb1", 1234, 0,
      {{"fc1.weight", dense({2, 3}, ValueType::kF32, f32_bytes({1.0f, -2.0f, 3.5f, 0.0f, -0.125f, 1e-3f}))},
       {"fc1.bias", dense({3}, ValueType::kF16, u16_bytes({0x3c00, 0xc000, 0x0001}))},  // 1, -2, 2^-24
       {"scale", dense({}, ValueType::kBF16, u16_bytes({0x3fc0}))},                     // 1.5
       {"empty", dense({0, 4}, ValueType::kF32, {})}},
      {{"train_loss", 0.6931471805599453}, {"accuracy", 0.875}});
}

Message golden_sparse() {
  return update_message(8, "client-2", 10, 0,
                        {{"conv.weight", sparse_delta_fp16()},
                         {"conv.bias", sparse_bitmap_sign()},
                         {"fc.weight", sign_tensor()},
                         {"fc.bias", sparse_seeded_f32()}});
}

Message golden_error() {
  Message m;
  m.minor = 0;
  m.body = ErrorBody{ErrorCode::kRejected, "round 3 is closed", 3};
  return m;
}

// Protocol 1.1: a SecAgg message with every field set (no stage uses them all).
Message golden_secagg() {
  SecAgg a;
  a.round = 12;
  a.client_id = "edge-9";
  a.stage = SecAggStage::kMasked;
  a.index = 4;
  a.peers.push_back({3, std::string(32, '\x11'), std::string(32, '\x22')});
  a.shares.push_back({5, 2, std::string("\x07") + std::string(32, '\x33')});
  a.survivors = {4, 5};
  a.dropped = {3};
  a.masked = {0u, 1u, 0xffffffffu, 0x80000000u};
  a.metrics = {{"train_loss", 0.5}};
  Message m;
  m.minor = 1;
  m.body = std::move(a);
  return m;
}

// Protocol 1.2: a sparse tensor with Rice-coded indices and int8 values, and an STC one
// (Rice indices, sign values). numel 300, positions {0, 5, 200, 299}: gaps minus one
// 0, 4, 194, 98; with b = 5 each is unary(gap >> 5), a 0, then 5 low bits, LSB first:
//   0 -> 0 00000, 4 -> 0 00100, 194 -> 111111 0 01000, 98 -> 111 0 01000 (33 bits, 5 bytes).
Message golden_rice() {
  Encoded e;
  e.format = Format::kSparse;
  e.shape = {3, 100};
  e.value_type = ValueType::kInt8;
  e.index_coding = IndexCoding::kRice;
  e.count = 4;
  e.params = {5};
  e.scales = {0.5f};
  e.values = std::vector<uint8_t>{0x7f, 0x81, 0x00, 0x02};  // 127, -127, 0, 2 (x 0.5)
  std::vector<uint8_t> bits;
  auto put = [&bits](int n, uint64_t v) {
    for (int i = 0; i < n; ++i) bits.push_back(static_cast<uint8_t>((v >> i) & 1));
  };
  auto rice = [&put](uint64_t gap) {
    for (uint64_t q = gap >> 5; q > 0; --q) put(1, 1);
    put(1, 0);
    put(5, gap & 31);
  };
  for (uint64_t gap : {0, 4, 194, 98}) rice(gap);
  std::vector<uint8_t> bytes((bits.size() + 7) / 8, 0);
  for (size_t i = 0; i < bits.size(); ++i) bytes[i / 8] |= static_cast<uint8_t>(bits[i] << (i % 8));
  e.indices = bytes;
  Encoded stc = e;
  stc.value_type = ValueType::kSign;
  stc.scales = {0.25f};
  stc.values = std::vector<uint8_t>{0x0a};  // +, -, +, -
  return update_message(9, "client-3", 17, 2, {{"fc.weight", e}, {"fc2.weight", stc}});
}

// Protocol 1.3: a masked sparse tensor (docs/protocol.md's example) in an update.
Message golden_mask() { return update_message(10, "client-4", 21, 3, {{"fc.weight", masked_tensor()}}); }

// Protocol 1.4: PowerSGD factors in int8 (one scale per column) and an ACP factor in fp16.
Message golden_lowrank8() {
  return update_message(11, "client-5", 23, 4,
                        {{"fc.weight", lowrank_int8_tensor()}, {"fc2.weight", factor_fp16_tensor()}});
}

// Protocol 1.5: PowerSGD factors with a sparse correction.
Message golden_lowrank_sparse() {
  return update_message(12, "client-6", 29, 5, {{"fc.weight", lowrank_sparse_tensor()}});
}

// Protocol 1.6: a tcs update with a seeded share of the mask.
Message golden_mask_keep() { return update_message(13, "client-7", 31, 6, {{"fc.weight", masked_keep_tensor()}}); }

const std::vector<std::pair<std::string, Message (*)()>>& golden_files() {
  static const std::vector<std::pair<std::string, Message (*)()>> files = {
      {"update_v1_dense.bin", golden_dense},
      {"update_v1_sparse.bin", golden_sparse},
      {"error_v1.bin", golden_error},
      {"secagg_v1_1.bin", golden_secagg},
      {"update_v1_2_rice.bin", golden_rice},
      {"update_v1_3_mask.bin", golden_mask},
      {"update_v1_4_lowrank.bin", golden_lowrank8},
      {"update_v1_5_lowrank_sparse.bin", golden_lowrank_sparse},
      {"update_v1_6_mask_keep.bin", golden_mask_keep}};
  return files;
}

std::string golden_path(const std::string& name) {
  return std::string(SPARROW_SOURCE_DIR) + "/tests/wire/golden/" + name;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "missing golden file " << path << " (regenerate with SPARROW_WRITE_GOLDEN=1)");
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// ---- comparisons: every field ------------------------------------------------------

void check_same(const Encoded& got, const Encoded& want) {
  CHECK(got.format == want.format);
  CHECK(got.shape == want.shape);
  CHECK(got.value_type == want.value_type);
  CHECK(got.index_coding == want.index_coding);
  CHECK(got.count == want.count);
  CHECK(got.seed == want.seed);
  CHECK(got.params == want.params);
  CHECK(got.scales == want.scales);
  CHECK(got.indices == want.indices);
  CHECK(got.values == want.values);
}

void check_same(const Message& got, const Message& want) {
  CHECK(got.major == want.major);
  CHECK(got.minor == want.minor);
  REQUIRE(got.body.index() == want.body.index());
  if (const auto* w = std::get_if<ModelUpdate>(&want.body)) {
    const auto& g = std::get<ModelUpdate>(got.body);
    CHECK(g.round == w->round);
    CHECK(g.client_id == w->client_id);
    CHECK(g.num_samples == w->num_samples);
    REQUIRE(g.tensors.size() == w->tensors.size());
    for (size_t i = 0; i < g.tensors.size(); ++i) {
      CAPTURE(i);
      CHECK(g.tensors[i].name == w->tensors[i].name);
      check_same(g.tensors[i].tensor, w->tensors[i].tensor);
    }
    CHECK(g.metrics == w->metrics);
  } else if (const auto* e = std::get_if<ErrorBody>(&want.body)) {
    const auto& g = std::get<ErrorBody>(got.body);
    CHECK(g.code == e->code);
    CHECK(g.message == e->message);
    CHECK(g.round == e->round);
  } else {
    // The session and split bodies: serialize() is deterministic, so equal
    // bytes mean equal fields (their field-by-field round trip is tested below).
    CHECK(serialize(got) == serialize(want));
  }
}

// The code a rejected buffer gets, or nothing when it parses.
std::optional<ErrorCode> reject_code(const std::string& bytes, const ParseLimits& limits = {}) {
  try {
    parse(bytes, limits);
    return std::nullopt;
  } catch (const ProtocolError& e) {
    return e.code();
  }
}

void expect_rejected(const std::string& bytes, ErrorCode code, const std::string& fragment,
                     const ParseLimits& limits = {}) {
  try {
    parse(bytes, limits);
    FAIL("accepted a message that should be rejected (" << fragment << ")");
  } catch (const ProtocolError& e) {
    CHECK_MESSAGE(e.code() == code, "got " << error_code_name(e.code()) << ": " << e.what());
    CHECK_MESSAGE(std::string(e.what()).find(fragment) != std::string::npos, "message: " << e.what());
  }
}

void put16(std::string& b, size_t at, uint16_t v) {
  b[at] = static_cast<char>(v & 0xff);
  b[at + 1] = static_cast<char>(v >> 8);
}
void put32(std::string& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

// A Message laid out by hand (what serialize() cannot produce): major, a union
// type byte (0 = absent) and, when body_offset != 0, an offset that points at an
// empty table when it is 8.
//   0 size prefix | 4 root offset | 8 "SPRW" | 12 Message vtable | 24 Message table
//   (+4 major, +8 body_type, +12 body) | 40 empty vtable | 44 empty table
std::string raw_message(uint16_t major, uint8_t body_type, uint32_t body_offset = 8) {
  std::string b(48, '\0');
  put32(b, 0, 44);
  put32(b, 4, 20);
  std::memcpy(&b[8], "SPRW", 4);
  put16(b, 12, 12);
  put16(b, 14, 16);
  put16(b, 16, 4);
  put16(b, 18, 0);
  put16(b, 20, body_type ? 8 : 0);
  put16(b, 22, body_offset ? 12 : 0);
  put32(b, 24, 12);
  put16(b, 28, major);
  b[32] = static_cast<char>(body_type);
  put32(b, 36, body_offset);
  put16(b, 40, 4);
  put16(b, 42, 4);
  put32(b, 44, 4);
  return b;
}

// One of each session and split message, every field set.
std::vector<Message> session_messages() {
  std::vector<Message> out(8);
  Hello h;
  h.client_id = "edge-7";
  h.num_samples = 600;
  h.model = "mlp";
  h.model_digest = 0x1234567890abcdefull;
  h.last_round = 41;
  h.software = "sparrow-client 0.1.0";
  out[0].body = h;
  out[1].body = Welcome{"run-1", 2500, 42, 1u << 20, 77};
  Task t;
  t.round = 42;
  t.model_encoding = ModelEncoding::kDelta;
  t.base_round = 41;
  t.weights = {{"fc.weight", dense({2, 2}, ValueType::kF32, f32_bytes({1, 2, 3, 4}))},
               {"fc.bias", sparse_delta_fp16()}};
  t.train = TrainSettings{"fedprox", 2, 16, 0.05, 0.9, 1e-4, 0.01};
  t.compression = "dgc:ratio=0.001";
  t.seed = 99;
  t.shared = {{"fc.weight", factor_tensor()}};
  t.control = {{"fc.bias", dense({2}, ValueType::kF32, f32_bytes({0.5f, -0.5f}))}};
  t.deadline_ms = 30000;
  out[2].body = t;
  out[3].body = Ack{42};
  out[4].body = Heartbeat{42};
  out[5].body = Bye{"shutting down"};
  SplitActivation a;
  a.session = "edge-7";
  a.step = 3;
  a.codec = "q8";
  a.shape = {2, 3};
  a.payload = {1, 2, 3, 4, 5, 6, 7, 8};
  a.labels = {0, 9};
  out[6].body = a;
  SplitGradient g;
  g.session = "edge-7";
  g.step = 3;
  g.codec = "none";
  g.shape = {2, 3};
  g.payload = {9, 8, 7};
  g.loss = 0.75;
  g.correct = 1;
  out[7].body = g;
  // 1.10: a packed Chain (two steps, the first naming both tensors), so the
  // truncation and mutation tests below cover packed tensor lists too.
  Task c;
  c.round = 45;
  c.model_encoding = ModelEncoding::kChain;
  c.base_round = 42;
  c.chain = {{{"fc.weight", dense({2, 2}, ValueType::kF32, f32_bytes({1, 2, 3, 4}))}, {"fc.bias", sparse_delta_fp16()}},
             {{"fc.bias", sparse_delta_fp16()}}};
  c.packed = true;
  out.emplace_back().body = c;
  return out;
}

std::vector<std::string> corpus() {
  std::vector<std::string> out;
  for (const auto& [name, make] : golden_files()) out.push_back(serialize(make()));
  out.push_back(serialize(update_message(
      {{"q", quantized_tensor()}, {"t", ternary_tensor()}, {"p", lowrank_tensor()}, {"f", factor_tensor()}},
      {{"loss", 1.25}})));
  Message no_round;
  no_round.body = ErrorBody{ErrorCode::kMalformed, "x", std::nullopt};
  out.push_back(serialize(no_round));
  for (const Message& m : session_messages()) out.push_back(serialize(m));
  return out;
}

// Mutation trials per base message; SPARROW_WIRE_FUZZ_TRIALS raises it for a
// long run by hand (e.g. under the sanitizers).
int trials(int def) {
  const char* env = std::getenv("SPARROW_WIRE_FUZZ_TRIALS");
  return env ? std::max(1, std::atoi(env)) : def;
}

// A parsed message must be usable: every tensor validates (and the dense and
// sparse ones decode), and it survives another serialize/parse unchanged.
void check_usable(const Message& m) {
  if (const auto* u = std::get_if<ModelUpdate>(&m.body)) {
    for (const NamedTensor& t : u->tensors) {
      CHECK_NOTHROW(compression::validate(t.tensor));
      // (Small ones only: a mutated shape may legitimately ask for a huge tensor.)
      // (A masked sparse tensor decodes only with its round's mask.)
      if ((t.tensor.format == Format::kDense || t.tensor.format == Format::kSparse) && t.tensor.numel() <= (1 << 20) &&
          t.tensor.index_coding != IndexCoding::kMask)
        CHECK_NOTHROW(compression::decode(t.tensor));
    }
  }
  check_same(parse(serialize(m)), m);
}

}  // namespace

// ---- round trips ---------------------------------------------------------------------

TEST_CASE("wire: every format round trips field for field") {
  const Message m = update_message({{"dense", dense({2, 2}, ValueType::kF32, f32_bytes({1, 2, 3, 4}))},
                                    {"delta", sparse_delta_fp16()},
                                    {"bitmap", sparse_bitmap_sign()},
                                    {"seeded", sparse_seeded_f32()},
                                    {"sign", sign_tensor()},
                                    {"qsgd", quantized_tensor()},
                                    {"ternary", ternary_tensor()},
                                    {"lowrank", lowrank_tensor()},
                                    {"factor", factor_tensor()},
                                    {"lowrank_int8", lowrank_int8_tensor()},
                                    {"factor_fp16", factor_fp16_tensor()},
                                    {"lowrank_sparse", lowrank_sparse_tensor()},
                                    {"masked", masked_tensor()}},
                                   {{"loss", 0.5}, {"seconds", 12.0}});
  const std::string bytes = serialize(m);
  const Message back = parse(bytes);
  check_same(back, m);
  CHECK(back.major == kProtocolMajor);
  CHECK(back.minor == kProtocolMinor);
  // Deterministic: the same message gives the same bytes.
  CHECK(serialize(m) == bytes);
  CHECK(serialize(back) == bytes);
}

TEST_CASE("wire: dense codec output survives the wire and decodes identically") {
  at::manual_seed(3);
  for (const char* spec : {"none", "fp16", "bf16"}) {
    CAPTURE(spec);
    auto c = compression::make_compressor(spec);
    ModelUpdate u;
    u.client_id = "codec";
    for (auto shape : {std::vector<int64_t>{1000}, {7, 13}, {2, 3, 4, 5}, {}}) {
      compression::State s;
      u.tensors.push_back({"t" + std::to_string(u.tensors.size()), c->encode(at::randn(shape), s, {})});
    }
    Message m;
    m.body = u;
    const Message back = parse(serialize(m));
    check_same(back, m);
    const auto& got = std::get<ModelUpdate>(back.body).tensors;
    for (size_t i = 0; i < got.size(); ++i)
      CHECK(at::equal(compression::decode(got[i].tensor), compression::decode(u.tensors[i].tensor)));
  }
}

TEST_CASE("wire: error messages round trip, with and without a round") {
  for (std::optional<uint64_t> round :
       {std::optional<uint64_t>{}, std::optional<uint64_t>{0}, std::optional<uint64_t>{~uint64_t{0}}}) {
    Message m;
    m.body = ErrorBody{ErrorCode::kVersionMismatch, "peer speaks 2.0", round};
    check_same(parse(serialize(m)), m);
  }
  Message empty;
  empty.body = ErrorBody{};
  check_same(parse(serialize(empty)), empty);
}

TEST_CASE("wire: a large tensor round trips and its values are 16-byte aligned in the frame") {
  const size_t n = 1 << 20;
  std::vector<uint8_t> values(n * 4);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<uint8_t>(i * 7 + 1);
  for (size_t i = 0; i < n; ++i) values[4 * i + 3] &= 0x3f;  // keep every float finite
  const Message m = update_message({{"big", dense({1024, 1024}, ValueType::kF32, values)}});
  const std::string bytes = serialize(m);
  CHECK(bytes.size() < values.size() + 256);
  const size_t at = bytes.find(std::string(reinterpret_cast<const char*>(values.data()), 64));
  REQUIRE(at != std::string::npos);
  CHECK(at % 16 == 0);
  check_same(parse(bytes), m);
}

TEST_CASE("wire: a misaligned frame is realigned, not refused") {
  const std::string bytes = serialize(golden_sparse());
  std::string shifted(bytes.size() + 1, '\0');
  std::memcpy(&shifted[1], bytes.data(), bytes.size());
  check_same(parse(shifted.data() + 1, bytes.size()), golden_sparse());
}

TEST_CASE("wire: a newer minor version is accepted, another major is not") {
  Message m = golden_dense();
  m.minor = kProtocolMinor + 5;
  const Message back = parse(serialize(m));
  CHECK(back.minor == kProtocolMinor + 5);
  check_same(back, m);

  for (uint16_t major : {uint16_t{0}, uint16_t{kProtocolMajor + 1}, uint16_t{65535}}) {
    m.major = major;
    expect_rejected(serialize(m), ErrorCode::kVersionMismatch, "peer speaks " + std::to_string(major) + ".");
  }
  // The version is read before the body is verified: a future major whose body
  // means nothing to us is still told "version mismatch", not "malformed".
  expect_rejected(raw_message(kProtocolMajor + 1, 1, 0x7ffffff0u), ErrorCode::kVersionMismatch, "peer speaks 2.0");
  expect_rejected(raw_message(kProtocolMajor, 1, 0x7ffffff0u), ErrorCode::kMalformed, "verification failed");
}

TEST_CASE("wire: hand-laid buffers: empty bodies, no body, unknown body types") {
  // The layout in raw_message() is a valid FlatBuffer: an empty ModelUpdate table.
  const Message empty_update = parse(raw_message(kProtocolMajor, 1));
  const auto& u = std::get<ModelUpdate>(empty_update.body);
  CHECK(u.round == 0);
  CHECK(u.client_id.empty());
  CHECK(u.tensors.empty());
  CHECK(u.metrics.empty());
  CHECK(empty_update.minor == 0);  // absent field: its default
  const Message empty_error = parse(raw_message(kProtocolMajor, 2));
  CHECK(std::get<ErrorBody>(empty_error.body).code == ErrorCode::kUnknown);
  CHECK(!std::get<ErrorBody>(empty_error.body).round);

  expect_rejected(raw_message(kProtocolMajor, 0, 0), ErrorCode::kMalformed, "no body");
  expect_rejected(raw_message(kProtocolMajor, 1, 0), ErrorCode::kMalformed, "body missing");
  expect_rejected(raw_message(kProtocolMajor, 2, 0), ErrorCode::kMalformed, "body missing");
  expect_rejected(raw_message(kProtocolMajor, 12), ErrorCode::kUnsupported, "unknown message type 12");
}

// ---- golden buffers --------------------------------------------------------------------

TEST_CASE("wire: golden buffers (regenerate with SPARROW_WRITE_GOLDEN=1)") {
  const char* write = std::getenv("SPARROW_WRITE_GOLDEN");
  // "1": write the files that are missing (a new minor's); "all": rewrite every one (a new major only).
  if (write && (std::string(write) == "1" || std::string(write) == "all")) {
    for (const auto& [name, make] : golden_files()) {
      if (std::string(write) == "1" && std::ifstream(golden_path(name)).good()) continue;
      const std::string bytes = serialize(make());
      std::ofstream out(golden_path(name), std::ios::binary | std::ios::trunc);
      REQUIRE(out.good());
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      MESSAGE("wrote " << golden_path(name) << " (" << bytes.size() << " bytes)");
    }
  }
  // Bytes written by protocol 1.0 (and 1.1) must parse into exactly these
  // values forever.
  for (const auto& golden : golden_files()) {
    const auto& name = golden.first;  // not a structured binding: CAPTURE's lambda captures it (C++17)
    CAPTURE(name);
    const std::string bytes = read_file(golden_path(name));
    const Message got = parse(bytes);
    check_same(got, golden.second());
    CHECK(got.major == 1);
    // "..._v1_N_..." was written by protocol 1.N; "..._v1_<word>" and "..._v1.bin" by 1.0.
    const size_t at = name.find("v1_");
    const int minor =
        at != std::string::npos && std::isdigit(static_cast<unsigned char>(name[at + 3])) ? name[at + 3] - '0' : 0;
    CHECK(got.minor == minor);
  }
}

TEST_CASE("wire: golden 1.2 update (Rice indices, int8 and sign values) decodes to its values") {
  const Message m = parse(read_file(golden_path("update_v1_2_rice.bin")));
  const auto& u = std::get<ModelUpdate>(m.body);
  REQUIRE(u.tensors.size() == 2);
  const at::Tensor a = sparrow::compression::decode(u.tensors[0].tensor).reshape(-1);
  const at::Tensor b = sparrow::compression::decode(u.tensors[1].tensor).reshape(-1);
  at::Tensor want_a = at::zeros({300});
  want_a[0] = 63.5f;
  want_a[5] = -63.5f;
  want_a[299] = 1.0f;
  CHECK(at::equal(a, want_a));
  at::Tensor want_b = at::zeros({300});
  want_b[0] = 0.25f;
  want_b[5] = -0.25f;
  want_b[200] = 0.25f;
  want_b[299] = -0.25f;
  CHECK(at::equal(b, want_b));
}

TEST_CASE("wire: golden dense update, field by field") {
  const Message m = parse(read_file(golden_path("update_v1_dense.bin")));
  const auto& u = std::get<ModelUpdate>(m.body);
  CHECK(u.round == 7);
  CHECK(u.client_id == "client-\xce\xb1");
  CHECK(u.num_samples == 1234);
  REQUIRE(u.tensors.size() == 4);
  CHECK(u.tensors[0].name == "fc1.weight");
  const at::Tensor w = compression::decode(u.tensors[0].tensor);
  CHECK(w.sizes() == at::IntArrayRef({2, 3}));
  CHECK(w[0][2].item<float>() == 3.5f);
  CHECK(w[1][1].item<float>() == -0.125f);
  const at::Tensor b = compression::decode(u.tensors[1].tensor);  // fp16
  CHECK(b[1].item<float>() == -2.0f);
  CHECK(b[2].item<float>() == std::ldexp(1.0f, -24));  // smallest fp16 subnormal
  CHECK(u.tensors[2].tensor.shape.empty());
  CHECK(compression::decode(u.tensors[2].tensor).item<float>() == 1.5f);  // bf16 scalar
  CHECK(u.tensors[3].tensor.numel() == 0);
  REQUIRE(u.metrics.size() == 2);
  CHECK(u.metrics[0].first == "train_loss");
  CHECK(u.metrics[0].second == 0.6931471805599453);
  CHECK(u.metrics[1].first == "accuracy");
  CHECK(u.metrics[1].second == 0.875);
}

TEST_CASE("wire: golden sparse update decodes to the documented values") {
  const Message m = parse(read_file(golden_path("update_v1_sparse.bin")));
  const auto& t = std::get<ModelUpdate>(m.body).tensors;
  REQUIRE(t.size() == 4);
  // Delta varint: positions 0, 5, 200, 299 of a 3x100 tensor, fp16 values.
  const at::Tensor a = compression::decode(t[0].tensor).flatten();
  CHECK(a.nonzero().numel() == 4);
  CHECK(a[0].item<float>() == 0.5f);
  CHECK(a[5].item<float>() == -1.0f);
  CHECK(a[200].item<float>() == 2.0f);
  CHECK(a[299].item<float>() == -0.25f);
  // Bitmap 0x09 0x02: positions 0, 3, 9; sign bits 0b010: +, -, + times 0.75.
  const at::Tensor b = compression::decode(t[1].tensor);
  const std::vector<float> want_b = {0.75f, 0, 0, -0.75f, 0, 0, 0, 0, 0, 0.75f};
  CHECK(at::equal(b, at::tensor(want_b)));
  // Seeded: the positions are a function of the key alone (docs/protocol.md
  // derives 17, 18, 27 for key 0x1234, k = 3, n = 50).
  const at::Tensor d = compression::decode(t[3].tensor).flatten();
  CHECK(d.nonzero().numel() == 3);
  CHECK(d[17].item<float>() == 1.5f);
  CHECK(d[18].item<float>() == -2.5f);
  CHECK(d[27].item<float>() == 0.25f);
}

TEST_CASE("wire: the worked examples of docs/protocol.md hold") {
  auto values = [](const Encoded& e) {
    const at::Tensor t = compression::decode(e).flatten();
    return std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
  };
  CHECK(values(quantized_tensor()) == std::vector<float>{0, 0.25f, 0, -0.75f, 0, 0});
  CHECK(values(ternary_tensor()) == std::vector<float>{0, 0.5f, -0.5f, 0, 0.5f});
  const float m = 0.125f;
  CHECK(values(sign_tensor()) == std::vector<float>{-m, m, -m, m, m, -m, m, -m, -m, m});
  CHECK(values(lowrank_tensor()) == std::vector<float>{3, 4, 5, 6, 8, 10});
  const std::vector<float> q8 = values(lowrank_int8_tensor());
  const std::vector<float> want8{3, 4, 5, 6, 8, 10};
  REQUIRE(q8.size() == want8.size());
  for (size_t i = 0; i < q8.size(); ++i) CHECK(q8[i] == doctest::Approx(want8[i]).epsilon(0.02));
  CHECK(values(lowrank_sparse_tensor()) == std::vector<float>{3, 4.5f, 5, 6, 8, 9});

  // The counter RNG.
  CHECK(rng::at(0, 0) == 0xe220a8397b1dcdafull);
  CHECK(rng::at(0x1234, 0) == 0x5f642f87d5e23888ull);
  CHECK(rng::derive(1, 2) == 0xf2826f98653e9e57ull);
  CHECK(rng::hash_name("fc1.weight") == 0x0fc5ab63896269edull);
  // Seeded positions, sparse path (2k <= n) and Fisher-Yates path (2k > n).
  Encoded s = sparse_seeded_f32();
  std::vector<float> got = values(s);
  for (int64_t i : {17, 18, 27}) CHECK(got[i] != 0.0f);
  s.count = 40;
  s.values = std::vector<uint8_t>(40 * 4, 0);
  for (size_t i = 0; i < 40; ++i) {
    const float one = 1.0f;
    std::memcpy(&s.values[4 * i], &one, 4);
  }
  got = values(s);
  std::vector<int64_t> missing;
  for (int64_t i = 0; i < 50; ++i)
    if (got[i] == 0.0f) missing.push_back(i);
  CHECK(missing == std::vector<int64_t>{6, 19, 22, 24, 25, 33, 44, 45, 47, 49});
}

// ---- corpus: truncations and mutations ----------------------------------------------------

TEST_CASE("wire: the masked (tcs) example of docs/protocol.md decodes as documented") {
  const Message m = parse(serialize(update_message({{"w", masked_tensor()}})));
  const Encoded e = std::get<ModelUpdate>(m.body).tensors.at(0).tensor;
  compression::Context ctx;
  ctx.mask = at::tensor(std::vector<int64_t>{2, 4, 8});
  const at::Tensor d = compression::decode(e, ctx);
  at::Tensor want = at::zeros({20});
  want[2] = 63.5f;
  want[4] = -63.5f;
  want[11] = 16.0f;
  CHECK(at::equal(d, want));
  CHECK_THROWS_AS(compression::decode(e), sparrow::FormatError);  // needs the round's mask
}

TEST_CASE("wire: the 1.6 masked update with a seeded share (tcs keep) decodes as documented") {
  const std::string bytes = read_file(golden_path("update_v1_6_mask_keep.bin"));
  const Message m = parse(bytes);
  CHECK(m.minor == 6);
  const Encoded e = std::get<ModelUpdate>(m.body).tensors.at(0).tensor;
  compression::Context ctx;
  ctx.mask = at::tensor(std::vector<int64_t>{1, 3, 5, 7, 9, 11});
  // docs/protocol.md: seeded_positions(7, 2, 6) = 0, 2, the mask's positions 1 and 5.
  CHECK(compression::detail::seeded_indices(7, 2, 6) == std::vector<int64_t>{0, 2});
  const at::Tensor d = compression::decode(e, ctx);
  at::Tensor want = at::zeros({20});
  want[1] = 2.0f;
  want[5] = -2.0f;
  want[15] = 0.5f;
  CHECK(at::equal(d, want));
  CHECK_THROWS_AS(compression::decode(e), sparrow::FormatError);  // needs the round's mask
  ctx.mask = at::tensor(std::vector<int64_t>{1, 3, 5, 7, 9});
  CHECK_THROWS_AS(compression::decode(e, ctx), sparrow::FormatError);  // of m = 6 positions
}

TEST_CASE("wire: every truncation of a valid message is rejected") {
  for (const std::string& bytes : corpus()) {
    for (size_t len = 0; len < bytes.size(); ++len) {
      CAPTURE(len);
      CHECK(reject_code(bytes.substr(0, len)) == ErrorCode::kMalformed);
    }
  }
}

TEST_CASE("wire: truncations that also fix up the size prefix never yield a different message") {
  // Cutting the frame and rewriting the size prefix to match leaves it to the
  // FlatBuffers verifier and our checks; the only acceptable survivors are cuts
  // of trailing alignment padding, which change nothing.
  size_t rejected = 0, total = 0;
  for (const std::string& bytes : corpus()) {
    const Message original = parse(bytes);
    for (size_t len = 12; len < bytes.size(); ++len) {
      std::string cut = bytes.substr(0, len);
      put32(cut, 0, static_cast<uint32_t>(len - 4));
      ++total;
      try {
        check_same(parse(cut), original);
      } catch (const ProtocolError&) {
        ++rejected;
      }
    }
  }
  CHECK(rejected > total * 9 / 10);
}

TEST_CASE("wire: random byte mutations never crash and never yield an invalid message") {
  // 1-4 bytes flipped or overwritten per trial, deterministic. A mutant either
  // fails with ProtocolError or parses into a message that validates, decodes
  // and re-serializes to itself.
  const std::vector<std::string> bases = corpus();
  const int kTrials = trials(4000);
  size_t accepted = 0, rejected = 0, other = 0;
  std::string first_other;
  rng::Stream r(20240601);
  for (const std::string& base : bases) {
    for (int trial = 0; trial < kTrials; ++trial) {
      std::string m = base;
      const int edits = 1 + static_cast<int>(r.below(4));
      for (int k = 0; k < edits; ++k) {
        const size_t pos = r.below(m.size());
        if (r.below(2))
          m[pos] = static_cast<char>(m[pos] ^ static_cast<char>(1u << r.below(8)));
        else
          m[pos] = static_cast<char>(r.below(256));
      }
      try {
        const Message parsed = parse(m);
        ++accepted;
        check_usable(parsed);
      } catch (const ProtocolError&) {
        ++rejected;
      } catch (const std::exception& e) {
        if (!other++) first_other = e.what();
      }
    }
  }
  CHECK_MESSAGE(other == 0, "non-ProtocolError exception: " << first_other);
  CHECK(accepted + rejected == bases.size() * kTrials);
  CHECK(rejected > 0);
  CHECK(accepted > 0);  // some mutations land on payload bytes that stay valid
  MESSAGE("mutations: " << accepted << " accepted, " << rejected << " rejected");
}

TEST_CASE("wire: mutations behind a correct size prefix and identifier") {
  // As above, but the header is kept intact so every mutation reaches the verifier.
  const std::vector<std::string> bases = corpus();
  const int kTrials = trials(2000);
  rng::Stream r(7);
  size_t non_protocol = 0;
  for (const std::string& base : bases) {
    for (int trial = 0; trial < kTrials; ++trial) {
      std::string m = base;
      const int edits = 1 + static_cast<int>(r.below(4));
      for (int k = 0; k < edits; ++k) m[12 + r.below(m.size() - 12)] = static_cast<char>(r.below(256));
      try {
        check_usable(parse(m));
      } catch (const ProtocolError&) {
      } catch (const std::exception&) {
        ++non_protocol;
      }
    }
  }
  CHECK(non_protocol == 0);
}

TEST_CASE("wire: a misaligned vector of 8-byte scalars is refused, not read") {
  // Re-point the shape vector 4 bytes further: still in bounds, and its length
  // word (the low half of dimension 0 = 2) passes the verifier, but its int64
  // elements now sit at 4 mod 8.
  std::string bytes = serialize(update_message({{"w", dense({2, 3}, ValueType::kF32, f32_bytes({1, 2, 3, 4, 5, 6}))}}));
  const std::string shape_vec("\x02\0\0\0\x02\0\0\0\0\0\0\0\x03\0\0\0\0\0\0\0", 20);
  const size_t at = bytes.find(shape_vec);
  REQUIRE(at != std::string::npos);
  size_t patched = 0;
  for (size_t p = 0; p + 4 <= at; p += 4) {
    uint32_t off;
    std::memcpy(&off, &bytes[p], 4);
    if (p + off == at) {
      put32(bytes, p, off + 4);
      ++patched;
    }
  }
  REQUIRE(patched == 1);
  expect_rejected(bytes, ErrorCode::kMalformed, "misaligned");
}

// ---- specific bad messages -------------------------------------------------------------------

TEST_CASE("wire: rejects empty, short, foreign, oversize and padded buffers") {
  const std::string good = serialize(golden_sparse());
  CHECK_THROWS_AS(parse(nullptr, 0), ProtocolError);
  expect_rejected(std::string(), ErrorCode::kMalformed, "empty");
  expect_rejected(good.substr(0, 8), ErrorCode::kMalformed, "too short");

  std::string foreign = good;
  std::memcpy(&foreign[8], "FLAT", 4);
  expect_rejected(foreign, ErrorCode::kMalformed, "file identifier");

  CHECK_NOTHROW(parse(good.data(), good.size(), good.size()));
  CHECK(reject_code(good, ParseLimits{good.size() - 1, kDefaultMaxElements}) == ErrorCode::kOversize);
  expect_rejected(good, ErrorCode::kOversize, "exceeds the limit", ParseLimits{100, kDefaultMaxElements});

  expect_rejected(good + std::string(1, '\0'), ErrorCode::kMalformed, "size prefix");
  std::string wrong_prefix = good;
  put32(wrong_prefix, 0, static_cast<uint32_t>(good.size()));
  expect_rejected(wrong_prefix, ErrorCode::kMalformed, "size prefix");
}

TEST_CASE("wire: rejects tensors that fail validation") {
  auto one = [](Encoded e) { return serialize(update_message({{"w", std::move(e)}})); };

  SUBCASE("shape and values size mismatch") {
    expect_rejected(one(dense({3}, ValueType::kF32, f32_bytes({1, 2}))), ErrorCode::kMalformed, "tensor 'w': dense");
    Encoded e = lowrank_tensor();
    e.shape = {7};
    expect_rejected(one(e), ErrorCode::kMalformed, "tensor 'w'");
  }
  SUBCASE("a low-rank sparse correction without Rice positions, or beyond the tensor") {
    Encoded e = lowrank_sparse_tensor();
    e.index_coding = IndexCoding::kNone;
    expect_rejected(one(e), ErrorCode::kMalformed, "Rice coded");
    e = lowrank_sparse_tensor();
    e.indices = {0x3d};  // gaps 1 and 4: position 6 of 6
    expect_rejected(one(e), ErrorCode::kMalformed, "out of range");
  }
  SUBCASE("index out of range") {
    Encoded e = sparse_delta_fp16();
    e.indices = {0x00, 0x04, 0xc2, 0x01, 0x63};  // last gap one too far: position 300 of 300
    expect_rejected(one(e), ErrorCode::kMalformed, "out of range");
    Encoded b = sparse_bitmap_sign();
    b.indices = {0x09, 0x04};  // bit 10 of a 10-element tensor
    expect_rejected(one(b), ErrorCode::kMalformed, "beyond numel");
  }
  SUBCASE("count larger than numel") {
    Encoded e = sparse_seeded_f32();
    e.count = 51;
    e.values.resize(51 * 4, 0);
    expect_rejected(one(e), ErrorCode::kMalformed, "exceeds numel");
  }
  SUBCASE("NaN and infinite values") {
    expect_rejected(one(dense({2}, ValueType::kF32, f32_bytes({1.0f, std::nanf("")}))), ErrorCode::kMalformed,
                    "not finite");
    expect_rejected(one(dense({2}, ValueType::kF16, u16_bytes({0x3c00, 0x7c00}))), ErrorCode::kMalformed,
                    "not finite");  // fp16 +inf
    expect_rejected(one(dense({1}, ValueType::kBF16, u16_bytes({0x7fc0}))), ErrorCode::kMalformed, "not finite");
    Encoded s = sparse_seeded_f32();
    s.values = f32_bytes({1.0f, std::numeric_limits<float>::infinity(), 0.0f});
    expect_rejected(one(s), ErrorCode::kMalformed, "not finite");
  }
  SUBCASE("NaN scale") {
    Encoded e = sign_tensor();
    e.scales = {std::nanf("")};
    expect_rejected(one(e), ErrorCode::kMalformed, "scale 0 is not finite");
    Encoded q = quantized_tensor();
    q.scales[1] = -std::numeric_limits<float>::infinity();
    expect_rejected(one(q), ErrorCode::kMalformed, "not finite");
  }
  SUBCASE("bad shapes") {
    expect_rejected(one(dense({2, -1}, ValueType::kF32, {})), ErrorCode::kMalformed, "negative dimension");
    expect_rejected(one(dense(std::vector<int64_t>(9, 1), ValueType::kF32, f32_bytes({1}))), ErrorCode::kMalformed,
                    "9 dimensions");
  }
  SUBCASE("formats and encodings this build does not know") {
    Encoded e = sign_tensor();
    e.format = static_cast<Format>(8);
    expect_rejected(one(e), ErrorCode::kUnsupported, "unknown format 8");
    e = dense({1}, static_cast<ValueType>(5), {0});
    expect_rejected(one(e), ErrorCode::kUnsupported, "unknown value type 5");
    e = dense({1}, ValueType::kInt8, {0});  // known since 1.2, but not for a dense tensor
    e.scales = {1.0f};
    expect_rejected(one(e), ErrorCode::kMalformed, "int8 value type is not allowed");
    e = sparse_seeded_f32();
    e.index_coding = static_cast<IndexCoding>(200);
    expect_rejected(one(e), ErrorCode::kUnsupported, "unknown index coding 200");
  }
}

TEST_CASE("wire: the element limit is checked before a tensor is expanded") {
  // A 100-byte message must not make the receiver expand 2^40 seeded positions.
  Encoded e = sparse_seeded_f32();
  e.shape = {int64_t{1} << 20, int64_t{1} << 20};
  const std::string bytes = serialize(update_message({{"huge", e}}));
  expect_rejected(bytes, ErrorCode::kOversize, "element limit");
  // The limit is over the whole message: two tensors of 50 elements need 100.
  const std::string two = serialize(update_message({{"a", sparse_seeded_f32()}, {"b", sparse_seeded_f32()}}));
  CHECK(reject_code(two, ParseLimits{kDefaultMaxMessageBytes, 99}) == ErrorCode::kOversize);
  CHECK(!reject_code(two, ParseLimits{kDefaultMaxMessageBytes, 100}));
}

TEST_CASE("wire: rejects bad names, metrics and text") {
  SUBCASE("duplicate tensor names") {
    expect_rejected(serialize(update_message({{"w", sign_tensor()}, {"v", sign_tensor()}, {"w", sign_tensor()}})),
                    ErrorCode::kMalformed, "duplicate tensor name 'w'");
  }
  SUBCASE("empty tensor name") {
    expect_rejected(serialize(update_message({{"", sign_tensor()}})), ErrorCode::kMalformed, "has no name");
  }
  SUBCASE("names that are not UTF-8 text") {
    expect_rejected(serialize(update_message({{"bad\xff", sign_tensor()}})), ErrorCode::kMalformed, "UTF-8");
    expect_rejected(serialize(update_message({{std::string("a\0b", 3), sign_tensor()}})), ErrorCode::kMalformed,
                    "UTF-8");
    expect_rejected(serialize(update_message({{"\xc0\x80", sign_tensor()}})), ErrorCode::kMalformed,
                    "UTF-8");  // overlong
    expect_rejected(serialize(update_message({{"\xed\xa0\x80", sign_tensor()}})), ErrorCode::kMalformed,
                    "UTF-8");  // surrogate
    Message m = update_message({});
    std::get<ModelUpdate>(m.body).client_id = "\x80";
    expect_rejected(serialize(m), ErrorCode::kMalformed, "client_id");
    CHECK_NOTHROW(
        parse(serialize(update_message({{"\xf0\x9f\x90\xa6.weight", sign_tensor()}}))));  // a 4-byte character
  }
  SUBCASE("non-finite metrics") {
    expect_rejected(serialize(update_message({}, {{"loss", std::nan("")}})), ErrorCode::kMalformed,
                    "metric 'loss' is not finite");
    expect_rejected(serialize(update_message({}, {{"loss", -HUGE_VAL}})), ErrorCode::kMalformed, "not finite");
  }
  SUBCASE("duplicate and empty metric keys") {
    expect_rejected(serialize(update_message({}, {{"loss", 1}, {"loss", 2}})), ErrorCode::kMalformed,
                    "duplicate metric 'loss'");
    expect_rejected(serialize(update_message({}, {{"", 1}})), ErrorCode::kMalformed, "has no key");
  }
  SUBCASE("error codes this build does not know read as unknown") {
    Message m;
    m.body = ErrorBody{static_cast<ErrorCode>(77), "from the future", 1};
    CHECK(std::get<ErrorBody>(parse(serialize(m)).body).code == ErrorCode::kUnknown);
  }
}

// ---- helpers for servers and benchmarks ---------------------------------------------------------

TEST_CASE("wire: error_for maps exceptions to Error bodies a peer accepts") {
  const auto bad = golden_sparse();
  try {
    Message m = bad;
    m.major = 9;
    parse(serialize(m));
    FAIL("expected a ProtocolError");
  } catch (const std::exception& e) {
    const ErrorBody body = error_for(e, 4);
    CHECK(body.code == ErrorCode::kVersionMismatch);
    CHECK(body.message.find("peer speaks 9.0") != std::string::npos);
    CHECK(body.round == 4);
  }
  CHECK(error_for(FormatError("x")).code == ErrorCode::kMalformed);
  CHECK(error_for(ConfigError("bad key")).code == ErrorCode::kRejected);
  CHECK(error_for(ConfigError("bad key")).message == "bad key");
  const ErrorBody internal = error_for(std::runtime_error("secret path /etc/x"));
  CHECK(internal.code == ErrorCode::kInternal);
  CHECK(internal.message == "internal error");
  CHECK(!internal.round);

  // Whatever the exception says, the reply is valid text of bounded size.
  const ErrorBody dirty = error_for(Error("name \xff\xfe with " + std::string(5000, 'x')));
  CHECK(dirty.message.size() == 1024);
  CHECK(dirty.message.substr(0, 14) == "name ?? with x");
  Message reply;
  reply.body = dirty;
  CHECK_NOTHROW(parse(serialize(reply)));
  const ErrorBody multibyte = error_for(Error(std::string(1023, 'a') + "\xce\xb1"));  // never cut inside a character
  CHECK(multibyte.message == std::string(1023, 'a'));
}

TEST_CASE("wire: error_code_name covers every code") {
  CHECK(std::string(error_code_name(ErrorCode::kVersionMismatch)) == "version_mismatch");
  CHECK(std::string(error_code_name(ErrorCode::kMalformed)) == "malformed");
  CHECK(std::string(error_code_name(ErrorCode::kOversize)) == "oversize");
  CHECK(std::string(error_code_name(ErrorCode::kRejected)) == "rejected");
  CHECK(std::string(error_code_name(ErrorCode::kInternal)) == "internal");
  CHECK(std::string(error_code_name(ErrorCode::kUnsupported)) == "unsupported");
  CHECK(std::string(error_code_name(ErrorCode::kUnknown)) == "unknown");
}

TEST_CASE("wire: encoded_size bounds what a tensor adds to a message") {
  const size_t empty = serialize(update_message({})).size();
  for (const Encoded& e :
       {dense({1000}, ValueType::kF32, std::vector<uint8_t>(4000, 0)), sparse_delta_fp16(), sparse_bitmap_sign(),
        sparse_seeded_f32(), sign_tensor(), quantized_tensor(), ternary_tensor(), lowrank_tensor(), factor_tensor(),
        lowrank_sparse_tensor(), dense({}, ValueType::kF16, {0, 0})}) {
    CAPTURE(compression::format_name(e.format));
    const size_t actual = serialize(update_message({{"layer.weight", e}})).size() - empty;
    const size_t bound = encoded_size(e, "layer.weight");
    CHECK(bound >= actual);
    CHECK(bound <= actual + 64);
    CHECK(bound >= e.payload_bytes());
  }
}

// ---- session and split messages ------------------------------------------------------

TEST_CASE("wire: session and split messages round trip field for field") {
  const std::vector<Message> ms = session_messages();
  const Message h = parse(serialize(ms[0]));
  const auto& hello = std::get<Hello>(h.body);
  CHECK(hello.client_id == "edge-7");
  CHECK(hello.num_samples == 600);
  CHECK(hello.model == "mlp");
  CHECK(hello.model_digest == 0x1234567890abcdefull);
  CHECK(hello.last_round == std::optional<uint64_t>(41));
  CHECK(hello.software == "sparrow-client 0.1.0");
  CHECK(std::string(body_name(h.body)) == "Hello");

  const auto w = std::get<Welcome>(parse(serialize(ms[1])).body);
  CHECK(w.run_id == "run-1");
  CHECK(w.heartbeat_ms == 2500);
  CHECK(w.round == 42);
  CHECK(w.max_message_bytes == (1u << 20));
  CHECK(w.model_seed == 77);

  const auto t = std::get<Task>(parse(serialize(ms[2])).body);
  const auto& want = std::get<Task>(ms[2].body);
  CHECK(t.round == 42);
  CHECK(t.model_encoding == ModelEncoding::kDelta);
  CHECK(t.base_round == 41);
  REQUIRE(t.weights.size() == 2);
  CHECK(t.weights[1].name == "fc.bias");
  check_same(t.weights[1].tensor, want.weights[1].tensor);
  CHECK(t.train.algorithm == "fedprox");
  CHECK(t.train.local_epochs == 2);
  CHECK(t.train.batch_size == 16);
  CHECK(t.train.lr == 0.05);
  CHECK(t.train.momentum == 0.9);
  CHECK(t.train.weight_decay == 1e-4);
  CHECK(t.train.mu == 0.01);
  CHECK(t.compression == "dgc:ratio=0.001");
  CHECK(t.seed == 99);
  REQUIRE(t.shared.size() == 1);
  check_same(t.shared[0].tensor, want.shared[0].tensor);
  REQUIRE(t.control.size() == 1);
  check_same(t.control[0].tensor, want.control[0].tensor);
  CHECK(t.deadline_ms == 30000);

  CHECK(std::get<Ack>(parse(serialize(ms[3])).body).round == 42);
  CHECK(std::get<Heartbeat>(parse(serialize(ms[4])).body).round == 42);
  CHECK(std::get<Bye>(parse(serialize(ms[5])).body).reason == "shutting down");

  const auto a = std::get<SplitActivation>(parse(serialize(ms[6])).body);
  CHECK(a.session == "edge-7");
  CHECK(a.step == 3);
  CHECK(a.codec == "q8");
  CHECK(a.shape == std::vector<int64_t>{2, 3});
  CHECK(a.payload == std::vector<uint8_t>{1, 2, 3, 4, 5, 6, 7, 8});
  CHECK(a.labels == std::vector<int64_t>{0, 9});
  CHECK(a.train);

  const auto g = std::get<SplitGradient>(parse(serialize(ms[7])).body);
  CHECK(g.codec == "none");
  CHECK(g.payload == std::vector<uint8_t>{9, 8, 7});
  CHECK(g.loss == 0.75);
  CHECK(g.correct == 1);

  // SCAFFOLD's control delta travels with the update.
  Message u = update_message({{"w", dense({2}, ValueType::kF32, f32_bytes({1, 2}))}});
  std::get<ModelUpdate>(u.body).control_delta = {{"w", dense({2}, ValueType::kF32, f32_bytes({3, 4}))}};
  const auto pu = std::get<ModelUpdate>(parse(serialize(u)).body);
  REQUIRE(pu.control_delta.size() == 1);
  check_same(pu.control_delta[0].tensor, std::get<ModelUpdate>(u.body).control_delta[0].tensor);
}

TEST_CASE("wire: session and split messages with bad fields are refused") {
  const std::vector<Message> ms = session_messages();
  Message m = ms[0];
  std::get<Hello>(m.body).client_id = "";
  expect_rejected(serialize(m), ErrorCode::kMalformed, "without a client_id");
  std::get<Hello>(m.body).client_id = std::string(kMaxClientIdBytes + 1, 'a');
  expect_rejected(serialize(m), ErrorCode::kMalformed, "client_id is 257 bytes");
  std::get<Hello>(m.body).client_id = "bad\xff";
  expect_rejected(serialize(m), ErrorCode::kMalformed, "UTF-8");

  for (double lr : {0.0, -1.0, std::nan(""), HUGE_VAL}) {
    Message t = ms[2];
    std::get<Task>(t.body).train.lr = lr;
    expect_rejected(serialize(t), ErrorCode::kMalformed, "lr must be");
  }
  Message t = ms[2];
  std::get<Task>(t.body).train.momentum = 1.0;
  expect_rejected(serialize(t), ErrorCode::kMalformed, "momentum");
  t = ms[2];
  std::get<Task>(t.body).train.batch_size = 0;
  expect_rejected(serialize(t), ErrorCode::kMalformed, "batch_size");
  t = ms[2];
  std::get<Task>(t.body).weights.push_back(std::get<Task>(t.body).weights[0]);
  expect_rejected(serialize(t), ErrorCode::kMalformed, "duplicate tensor name");

  Message a = ms[6];
  std::get<SplitActivation>(a.body).labels = {1, 2, 3};
  expect_rejected(serialize(a), ErrorCode::kMalformed, "3 labels for a batch of 2");
  a = ms[6];
  std::get<SplitActivation>(a.body).labels = {1, -2};
  expect_rejected(serialize(a), ErrorCode::kMalformed, "negative label");
  a = ms[6];
  std::get<SplitActivation>(a.body).shape = {};
  expect_rejected(serialize(a), ErrorCode::kMalformed, "shape has 0 dimensions");
  a = ms[6];
  std::get<SplitActivation>(a.body).shape = {1 << 20, 1 << 20};
  expect_rejected(serialize(a), ErrorCode::kOversize, "element limit");
  a = ms[6];
  std::get<SplitActivation>(a.body).session = "";
  expect_rejected(serialize(a), ErrorCode::kMalformed, "without a session");

  Message g = ms[7];
  std::get<SplitGradient>(g.body).loss = std::nan("");
  expect_rejected(serialize(g), ErrorCode::kMalformed, "loss is not finite");
}

TEST_CASE("wire: SecAgg messages and a Task's secagg setup round trip and bad ones are refused") {
  const Message g = golden_secagg();
  const auto a = std::get<SecAgg>(parse(serialize(g)).body);
  const auto& want = std::get<SecAgg>(g.body);
  CHECK(a.round == 12);
  CHECK(a.client_id == "edge-9");
  CHECK(a.stage == SecAggStage::kMasked);
  CHECK(a.index == 4);
  REQUIRE(a.peers.size() == 1);
  CHECK(a.peers[0].index == 3);
  CHECK(a.peers[0].enc_key == want.peers[0].enc_key);
  CHECK(a.peers[0].mask_key == want.peers[0].mask_key);
  REQUIRE(a.shares.size() == 1);
  CHECK(a.shares[0].peer == 5);
  CHECK(a.shares[0].kind == 2);
  CHECK(a.shares[0].data == want.shares[0].data);
  CHECK(a.survivors == want.survivors);
  CHECK(a.dropped == want.dropped);
  CHECK(a.masked == want.masked);
  CHECK(a.metrics == want.metrics);
  CHECK(std::string(secagg_stage_name(a.stage)) == "masked");

  Message t = session_messages()[2];
  std::get<Task>(t.body).secagg = SecAggSetup{2, 10, 8, 5, 77, 4.0, 0.125};
  const auto pt = std::get<Task>(parse(serialize(t)).body);
  REQUIRE(pt.secagg);
  CHECK(pt.secagg->index == 2);
  CHECK(pt.secagg->clients == 10);
  CHECK(pt.secagg->degree == 8);
  CHECK(pt.secagg->threshold == 5);
  CHECK(pt.secagg->graph_seed == 77);
  CHECK(pt.secagg->clip == 4.0);
  CHECK(pt.secagg->weight == 0.125);
  CHECK_FALSE(std::get<Task>(parse(serialize(session_messages()[2])).body).secagg);

  auto bad_setup = [&](SecAggSetup s, const char* what) {
    Message b = t;
    std::get<Task>(b.body).secagg = s;
    expect_rejected(serialize(b), ErrorCode::kMalformed, what);
  };
  bad_setup({0, 10, 8, 5, 1, 4.0, 0.1}, "index 0 outside");
  bad_setup({11, 10, 8, 5, 1, 4.0, 0.1}, "index 11 outside");
  bad_setup({1, 10, 8, 1, 1, 4.0, 0.1}, "threshold");
  bad_setup({1, 10, 10, 5, 1, 4.0, 0.1}, "degree < clients");
  bad_setup({1, 10, 8, 5, 1, std::nan(""), 0.1}, "clip");
  bad_setup({1, 10, 8, 5, 1, 4.0, 1.5}, "weight");

  auto bad = [&](auto edit, ErrorCode code, const char* what) {
    Message b = g;
    edit(std::get<SecAgg>(b.body));
    expect_rejected(serialize(b), code, what);
  };
  bad([](SecAgg& x) { x.peers[0].enc_key = "short"; }, ErrorCode::kMalformed, "enc_key must be 32 bytes");
  bad([](SecAgg& x) { x.shares[0].kind = 3; }, ErrorCode::kMalformed, "unknown share kind");
  bad([](SecAgg& x) { x.shares[0].data = std::string(300, 'x'); }, ErrorCode::kMalformed, "share data");
  bad([](SecAgg& x) { x.survivors = {1, 1}; }, ErrorCode::kMalformed, "repeated index in survivors");
  bad([](SecAgg& x) { x.stage = static_cast<SecAggStage>(9); }, ErrorCode::kUnsupported, "unknown stage 9");
  bad([](SecAgg& x) { x.metrics = {{"a", std::nan("")}}; }, ErrorCode::kMalformed, "not finite");
  ParseLimits small;
  small.max_elements = 3;
  expect_rejected(serialize(g), ErrorCode::kOversize, "element limit", small);
}

TEST_CASE("parse with an owner: dense values are views into the frame, decoded the same") {
  compression::register_builtins();
  auto none = compression::make_compressor("none");
  compression::State st;
  at::manual_seed(5);
  const at::Tensor x = at::randn({300, 7});
  ModelUpdate u;
  u.round = 3;
  u.client_id = "c";
  u.num_samples = 10;
  u.tensors = {{"w", none->encode(x, st, {})}};
  Message m;
  m.body = u;
  const auto frame = std::make_shared<const std::string>(serialize(m));
  const Message copied = parse(*frame);
  const Message viewed = parse(frame->data(), frame->size(), ParseLimits{}, frame);
  const auto& cv = std::get<ModelUpdate>(copied.body).tensors.at(0).tensor.values;
  const auto& vv = std::get<ModelUpdate>(viewed.body).tensors.at(0).tensor.values;
  CHECK_FALSE(cv.is_view());
  REQUIRE(vv.is_view());
  CHECK(vv.data() >= reinterpret_cast<const uint8_t*>(frame->data()));
  CHECK(vv.data() + vv.size() <= reinterpret_cast<const uint8_t*>(frame->data()) + frame->size());
  CHECK(at::equal(compression::decode(std::get<ModelUpdate>(viewed.body).tensors.at(0).tensor), x));
  // ZeroMQ keeps a large message 8 bytes past a 16-byte boundary (after its
  // header): still read in place.
  const auto shifted = std::make_shared<std::string>(frame->size() + 8, '\0');
  std::memcpy(shifted->data() + 8, frame->data(), frame->size());
  REQUIRE(reinterpret_cast<uintptr_t>(shifted->data() + 8) % 16 == 8);
  const Message at8 = parse(shifted->data() + 8, frame->size(), ParseLimits{}, shifted);
  CHECK(std::get<ModelUpdate>(at8.body).tensors.at(0).tensor.values.is_view());
  CHECK(at::equal(compression::decode(std::get<ModelUpdate>(at8.body).tensors.at(0).tensor), x));
  // A NaN in the frame is refused in place as it is when copied.
  std::string bad = *frame;
  const size_t at = static_cast<size_t>(vv.data() - reinterpret_cast<const uint8_t*>(frame->data())) + 8;
  const float nan = std::nanf("");
  std::memcpy(bad.data() + at, &nan, 4);
  const auto bad_frame = std::make_shared<const std::string>(bad);
  CHECK_THROWS_AS(parse(bad_frame->data(), bad_frame->size(), ParseLimits{}, bad_frame), ProtocolError);
  CHECK_THROWS_AS(parse(bad), ProtocolError);
  // A receiver that defers the scan of updates' dense fp32 values (the server:
  // its aggregator scans while folding) gets the update; the scan still runs
  // for whoever reads the values next.
  ParseLimits deferred;
  deferred.update_values = compression::ValueCheck::kDeferDenseF32;
  const Message later = parse(bad_frame->data(), bad_frame->size(), deferred, bad_frame);
  const compression::Encoded& unscanned = std::get<ModelUpdate>(later.body).tensors.at(0).tensor;
  CHECK_THROWS_AS(compression::validate(unscanned), compression::NonFiniteError);
  CHECK_THROWS_AS(compression::decode(unscanned), compression::NonFiniteError);
  // Only updates: a Task's dense values are scanned as before.
  Task t;
  t.round = 1;
  t.weights = {{"w", none->encode(x, st, {})}};
  Message tm;
  tm.body = t;
  const std::string good_task = serialize(tm);
  CHECK_NOTHROW(parse(good_task.data(), good_task.size(), deferred));
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(t.weights[0].tensor.values.data(), &inf, 4);
  tm.body = t;
  const std::string bad_task = serialize(tm);
  CHECK_THROWS_AS(parse(bad_task.data(), bad_task.size(), deferred), ProtocolError);
}
