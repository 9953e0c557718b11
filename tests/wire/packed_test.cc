// Packed tensor lists (protocol 1.10, wire/packed.h): a catch-up Task's
// weights and chain round trip field for field, cost what packed_size and
// the packed_*_size parts say, and every malformed byte string is refused
// with a ProtocolError (never a crash, never a different message).
#include "tests/sparrow_test.h"

#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <vector>

#include "compression/compressor.h"
#include "wire/packed.h"
#include "wire/wire.h"

using namespace sparrow;
using namespace sparrow::wire;

namespace {

// Codec output of several kinds, as a downlink step carries it.
std::vector<NamedTensor> step(int seed, const std::vector<std::string>& codecs) {
  at::manual_seed(seed);
  const std::vector<std::pair<std::string, std::vector<int64_t>>> params = {
      {"fc1.weight", {64, 30}}, {"fc1.bias", {64}}, {"fc2.weight", {10, 64}}, {"fc2.bias", {10}}};
  std::vector<NamedTensor> out;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto c = compression::make_compressor(codecs[i % codecs.size()]);
    compression::State st;
    compression::Context ctx;
    ctx.name = params[i].first;
    ctx.seed = 7;
    out.push_back({params[i].first, c->encode(at::randn(params[i].second), st, ctx)});
  }
  return out;
}

void check_same(const std::vector<NamedTensor>& got, const std::vector<NamedTensor>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    const compression::Encoded &g = got[i].tensor, &w = want[i].tensor;
    CHECK(got[i].name == want[i].name);
    CHECK(g.format == w.format);
    CHECK(g.shape == w.shape);
    CHECK(g.value_type == w.value_type);
    CHECK(g.index_coding == w.index_coding);
    CHECK(g.count == w.count);
    CHECK(g.seed == w.seed);
    CHECK(g.params == w.params);
    CHECK(g.scales == w.scales);
    CHECK(g.indices == w.indices);
    CHECK(g.values == w.values);
  }
}

Task chain_task(size_t steps) {
  Task t;
  t.model_encoding = ModelEncoding::kChain;
  t.base_round = 10;
  t.round = t.base_round + 1 + steps;
  for (size_t s = 0; s < steps; ++s)
    t.chain.push_back(step(static_cast<int>(s), {"stc:ratio=0.05", "none", "topk:ratio=0.1", "qsgd:levels=4"}));
  return t;
}

Task parsed(const Task& t) {
  Message m;
  m.body = t;
  return std::get<Task>(parse(serialize(m)).body);
}

std::string bytes_of(const Task& t) {
  Message m;
  m.body = t;
  return serialize(m);
}

ErrorCode unpack_code(const std::string& blob, uint64_t max_elements = kDefaultMaxElements) {
  uint64_t budget = max_elements;
  try {
    wire::detail::unpack(reinterpret_cast<const uint8_t*>(blob.data()), blob.size(), budget, max_elements);
  } catch (const ProtocolError& e) {
    return e.code();
  }
  FAIL("the packed bytes were accepted");
  return ErrorCode::kUnknown;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

// A blob with one table entry ("w", shape {4}) and one list of `records`
// (each already laid out).
std::string blob(const std::vector<std::string>& records, size_t lists = 1) {
  std::string b;
  put_varint(b, 1);
  b += std::string("\x01w\x01\x04", 4);
  put_varint(b, lists);
  put_varint(b, records.size());
  for (const auto& r : records) b += r;
  for (size_t l = 1; l < lists; ++l) put_varint(b, 0);
  return b;
}

// A dense fp32 record of "w" (4 values).
std::string dense_record(uint8_t name_index = 0, float v = 1.0f) {
  std::string r;
  put_varint(r, name_index);
  r += std::string("\x00\x00\x00", 3);      // Dense, F32, None
  r += std::string("\x00\x00\x00\x00", 4);  // count, seed, #params, #scales
  put_varint(r, 0);                         // #index bytes
  put_varint(r, 16);
  for (int i = 0; i < 4; ++i) r.append(reinterpret_cast<const char*>(&v), 4);
  return r;
}

}  // namespace

TEST_CASE("packed: a Chain task round trips field for field, and parse says it came packed") {
  Task t = chain_task(3);
  t.packed = true;
  const Task back = parsed(t);
  CHECK(back.packed);
  CHECK(back.model_encoding == ModelEncoding::kChain);
  CHECK(back.weights.empty());
  REQUIRE(back.chain.size() == 3);
  for (size_t s = 0; s < 3; ++s) check_same(back.chain[s], t.chain[s]);
  // The same task as tables parses to the same tensors, and is not packed.
  Task tables = t;
  tables.packed = false;
  const Task tb = parsed(tables);
  CHECK_FALSE(tb.packed);
  for (size_t s = 0; s < 3; ++s) check_same(tb.chain[s], back.chain[s]);
}

TEST_CASE("packed: Delta and Patch tasks round trip, steps may name a subset of the tensors") {
  Task d;
  d.round = 5;
  d.base_round = 3;
  d.model_encoding = ModelEncoding::kDelta;
  d.weights = step(1, {"topk:ratio=0.2"});
  d.weights.erase(d.weights.begin() + 1);  // a step that left fc1.bias unchanged
  d.packed = true;
  const Task back = parsed(d);
  CHECK(back.packed);
  check_same(back.weights, d.weights);

  Task c = chain_task(2);
  c.chain[1].erase(c.chain[1].begin());  // the second step without fc1.weight
  c.packed = true;
  const Task cb = parsed(c);
  REQUIRE(cb.chain.size() == 2);
  check_same(cb.chain[1], c.chain[1]);
}

TEST_CASE("packed: a sparse step costs a fraction of its tables' framing, and the size functions are exact") {
  Task t = chain_task(4);
  for (auto& s : t.chain) s = step(static_cast<int>(s.size()), {"stc:ratio=0.01"});
  t.packed = true;
  const size_t packed = bytes_of(t).size();
  Task tables = t;
  tables.packed = false;
  const size_t table_bytes = bytes_of(tables).size();
  CAPTURE(packed);
  CAPTURE(table_bytes);
  // 16 tensors of a handful of positions each: the tables' ~100+ bytes of
  // framing per tensor dominate; packed records take ~15.
  CHECK(packed + 16 * 80 < table_bytes);
  // packed_size is the field's bytes; the parts add up to the blob.
  const size_t field = packed_size(t.weights, t.chain);
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& nt : t.chain[0]) {
    names.push_back(nt.name);
    shapes.push_back(nt.tensor.shape);
  }
  size_t parts = packed_frame_size(names, shapes, 1 + t.chain.size()) + packed_list_size(t.weights);
  for (const auto& s : t.chain) parts += packed_list_size(s);
  CHECK(parts == field);
  CHECK(field == 16 + wire::detail::pack(t.weights, t.chain).size());
  // The message without the field differs from the packed message by at most the field.
  Task none = t;
  none.chain.clear();
  none.model_encoding = ModelEncoding::kDelta;
  none.packed = false;
  CHECK(packed - bytes_of(none).size() <= field);
  CHECK(packed - bytes_of(none).size() + 16 >= field);
  CHECK(packed - bytes_of(none).size() >= field - 16);
}

TEST_CASE("packed: every truncation and every malformed field is refused with its code") {
  Task t = chain_task(2);
  const std::string b = wire::detail::pack(t.weights, t.chain);
  for (size_t n = 0; n < b.size(); ++n) {
    CAPTURE(n);
    CHECK(unpack_code(b.substr(0, n)) == ErrorCode::kMalformed);
  }
  CHECK(unpack_code(b + std::string(1, '\0')) == ErrorCode::kMalformed);  // bytes after the last list
  // A well-formed baseline of the hand-laid blobs parses.
  {
    const std::string ok = blob({dense_record()});
    uint64_t budget = kDefaultMaxElements;
    const auto u =
        wire::detail::unpack(reinterpret_cast<const uint8_t*>(ok.data()), ok.size(), budget, kDefaultMaxElements);
    REQUIRE(u.weights.size() == 1);
    CHECK(u.weights[0].name == "w");
    CHECK(u.weights[0].tensor.shape == std::vector<int64_t>{4});
  }
  CHECK(unpack_code(blob({dense_record(1)})) == ErrorCode::kMalformed);                 // name index outside the table
  CHECK(unpack_code(blob({dense_record(), dense_record()})) == ErrorCode::kMalformed);  // a name twice in a list
  CHECK(unpack_code(blob({dense_record(0, NAN)})) == ErrorCode::kMalformed);            // a non-finite value
  CHECK(unpack_code(blob({dense_record()}, 0)) == ErrorCode::kMalformed);               // no list
  CHECK(unpack_code(blob({dense_record()}).substr(0, 1) + "\x00") == ErrorCode::kMalformed);  // empty name
  CHECK(unpack_code(blob({dense_record()}), 3) == ErrorCode::kOversize);  // 4 elements over a limit of 3
  std::string fmt = dense_record();
  fmt[1] = 42;  // a format of a newer peer
  CHECK(unpack_code(blob({fmt})) == ErrorCode::kUnsupported);
  std::string wrong = dense_record();
  wrong[wrong.size() - 17] = 15;  // 15 value bytes for 4 fp32 values
  CHECK(unpack_code(blob({wrong})) == ErrorCode::kMalformed);
  // An over-long varint, a table that claims more entries than bytes, 9 dimensions, invalid UTF-8.
  CHECK(unpack_code(std::string(11, '\xff')) == ErrorCode::kMalformed);
  CHECK(unpack_code(std::string("\x7f\x01w\x01\x04", 5)) == ErrorCode::kMalformed);
  CHECK(unpack_code(std::string("\x01\x01w\x09", 4) + std::string(9, '\x01') + "\x01\x00") == ErrorCode::kMalformed);
  CHECK(unpack_code(std::string("\x01\x01\xff\x01\x04\x01\x00", 7)) == ErrorCode::kMalformed);
  // A chain step's elements count against its own allowance, list 0's against the message's.
  const std::string two = blob({dense_record()}, 2);
  uint64_t budget = 4;
  CHECK_NOTHROW(wire::detail::unpack(reinterpret_cast<const uint8_t*>(two.data()), two.size(), budget, 4));
}

TEST_CASE("packed: a packed chain applies to the same model as its tables (decode_add in order)") {
  Task t = chain_task(3);
  t.packed = true;
  const Task back = parsed(t);
  for (const auto& nt : t.chain[0]) {
    at::Tensor a = at::zeros(nt.tensor.shape), b = at::zeros(nt.tensor.shape);
    for (size_t s = 0; s < 3; ++s) {
      for (const auto& x : t.chain[s])
        if (x.name == nt.name) compression::decode_add(x.tensor, a, 1.0f);
      for (const auto& x : back.chain[s])
        if (x.name == nt.name) compression::decode_add(x.tensor, b, 1.0f);
    }
    CHECK(at::equal(a, b));
  }
}

TEST_CASE(
    "packed: a sparse update (and its control delta) round trips packed, dense updates and old servers get tables") {
  ModelUpdate u;
  u.round = 7;
  u.client_id = "c1";
  u.num_samples = 60;
  u.tensors = step(3, {"stc:ratio=0.05", "topk:ratio=0.1"});
  u.metrics = {{"train_loss", 0.5}};
  CHECK(packs_well(u, kPackedMinor));
  CHECK_FALSE(packs_well(u, kPackedMinor - 1));
  for (bool control : {false, true}) {
    CAPTURE(control);
    ModelUpdate v = u;
    if (control) v.control_delta = step(4, {"none"});
    v.packed = true;
    Message m;
    m.body = v;
    const auto back = std::get<ModelUpdate>(parse(serialize(m)).body);
    CHECK(back.packed);
    CHECK(back.round == 7);
    CHECK(back.client_id == "c1");
    CHECK(back.metrics == v.metrics);
    check_same(back.tensors, v.tensors);
    check_same(back.control_delta, v.control_delta);
    Message tables = m;
    std::get<ModelUpdate>(tables.body).packed = false;
    CHECK(serialize(m).size() < serialize(tables).size());
  }
  ModelUpdate d = u;
  d.tensors.push_back({"extra", step(5, {"none"})[0].tensor});
  CHECK_FALSE(packs_well(d, kPackedMinor));
  // Three lists are not an update.
  const std::string three = wire::detail::pack(u.tensors, {u.tensors, u.tensors});
  uint64_t budget = kDefaultMaxElements;
  CHECK_THROWS_AS(wire::detail::unpack(reinterpret_cast<const uint8_t*>(three.data()), three.size(), budget, 0,
                                       compression::ValueCheck::kScan, 2),
                  ProtocolError);
}
