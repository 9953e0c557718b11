// The lite client's state file: a round trip keeps every field; a damaged,
// truncated or foreign file is refused naming the file; a save replaces the
// file whole and leaves no temporary behind; the streamed file is the
// documented layout byte for byte.
// LibTorch-free: also built and run in a device build (SPARROW_LITE_ONLY), on arm64 under qemu.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "liteclient/state_file.h"

namespace {

namespace fs = std::filesystem;
using namespace sparrow::liteclient;

// A codec state as DGC keeps one: its u and v slots.
sparrow::compression::flat::State codec_state(uint64_t step, const std::vector<float>& u) {
  sparrow::compression::flat::State st;
  st.step = step;
  st.last_round = static_cast<int64_t>(step);
  st.slot("u", {static_cast<int64_t>(u.size())}).data = u;
  st.slot("v", {static_cast<int64_t>(u.size())}).data.assign(u.size(), 1.5f);
  return st;
}

std::map<std::string, std::string> bytes_of(const CodecStates& c) {
  std::map<std::string, std::string> out;
  for (const auto& [name, st] : c) out[name] = st.serialize();
  return out;
}

ClientState sample() {
  ClientState s;
  s.client_id = "device-7";
  s.digest = 0x1234abcdULL;
  s.run_id = "run-42";
  s.holds_model = true;
  s.held_round = 3;
  s.held = {1.5f, -2.25f, 0.0f, 3e-8f};
  s.rounds = 2;
  s.control = {0.5f, 0.25f, -1.0f, 2.0f};
  s.codec["fc1.weight"] = codec_state(2, {0.5f, -1.0f, 0.25f});
  s.codec["fc1.bias"] = codec_state(1, {7.0f});
  s.committed_round = 3;
  s.answered = true;
  s.prev_control = {0.125f};
  s.prev_codec["fc1.weight"] = codec_state(1, {0.0f, 1.0f, 2.0f});
  return s;
}

void check_same(const ClientState& a, const ClientState& b) {
  CHECK(a.client_id == b.client_id);
  CHECK(a.digest == b.digest);
  CHECK(a.run_id == b.run_id);
  CHECK(a.holds_model == b.holds_model);
  CHECK(a.held_round == b.held_round);
  CHECK(a.held == b.held);
  CHECK(a.rounds == b.rounds);
  CHECK(a.control == b.control);
  CHECK(bytes_of(a.codec) == bytes_of(b.codec));
  CHECK(a.committed_round == b.committed_round);
  CHECK(a.answered == b.answered);
  CHECK(a.prev_control == b.prev_control);
  CHECK(bytes_of(a.prev_codec) == bytes_of(b.prev_codec));
}

std::string path_of(const std::string& name) {
  return (fs::temp_directory_path() / ("liteclient_state_" + name + "_" + std::to_string(::getpid()))).string();
}

std::string refusal(const std::string& bytes) {
  try {
    decode_state(bytes, "state_file 'x.lite'");
  } catch (const sparrow::FormatError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("liteclient state file: round trip in memory and on disk") {
  const ClientState s = sample();
  check_same(decode_state(encode_state(s), "mem"), s);
  const ClientState empty;
  check_same(decode_state(encode_state(empty), "mem"), empty);

  const std::string p = path_of("roundtrip");
  fs::remove(p);
  CHECK_FALSE(load_state(p).has_value());  // none yet
  save_state(p, s);
  CHECK_FALSE(fs::exists(p + ".tmp"));
  auto back = load_state(p);
  REQUIRE(back.has_value());
  check_same(*back, s);
  // A second save replaces the file whole.
  ClientState t = s;
  t.held_round = 4;
  t.held.assign(1000, 0.25f);
  t.codec.erase("fc1.bias");
  save_state(p, t);
  back = load_state(p);
  REQUIRE(back.has_value());
  check_same(*back, t);
  fs::remove(p);
}

TEST_CASE("liteclient state file: damaged, truncated and foreign files are refused") {
  const std::string good = encode_state(sample());
  for (size_t i : {size_t{9}, size_t{20}, good.size() / 2, good.size() - 9, good.size() - 1}) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x10);
    const std::string msg = refusal(bad);
    INFO("flipped byte " << i << ": " << msg);
    CHECK(msg.find("x.lite") != std::string::npos);
    CHECK_FALSE(msg.empty());
  }
  CHECK(refusal(good.substr(0, good.size() / 2)).find("x.lite") != std::string::npos);
  CHECK(refusal(good.substr(0, 10)).find("truncated") != std::string::npos);
  CHECK(refusal(good + "extra").find("x.lite") != std::string::npos);
  std::string foreign = good;
  foreign[0] = 'X';
  CHECK(refusal(foreign).find("magic") != std::string::npos);
  std::string flipped = good;
  flipped[good.size() / 2] = static_cast<char>(flipped[good.size() / 2] ^ 1);
  CHECK(refusal(flipped).find("checksum") != std::string::npos);

  // On disk: the error names the path.
  const std::string p = path_of("damaged");
  {
    std::ofstream out(p, std::ios::binary);
    out << flipped;
  }
  std::string msg;
  try {
    load_state(p);
  } catch (const sparrow::FormatError& e) {
    msg = e.what();
  }
  CHECK(msg.find(p) != std::string::npos);
  fs::remove(p);
}

// The documented layout (state_file.h), written independently of the
// streaming writer, with `codec` and `prev_codec` as raw bytes per tensor.
std::string reference_bytes(const ClientState& s, const std::map<std::string, std::string>& codec,
                            const std::map<std::string, std::string>& prev_codec) {
  std::string out = "SPRWLCST";
  auto raw = [&](const void* p, size_t n) { out.append(static_cast<const char*>(p), n); };
  auto u8 = [&](uint8_t v) { raw(&v, 1); };
  auto u32 = [&](uint32_t v) { raw(&v, 4); };
  auto u64 = [&](uint64_t v) { raw(&v, 8); };
  auto str = [&](const std::string& v) {
    u32(static_cast<uint32_t>(v.size()));
    out += v;
  };
  auto floats = [&](const std::vector<float>& v) {
    u64(v.size());
    raw(v.data(), v.size() * 4);
  };
  auto states = [&](const std::map<std::string, std::string>& c) {
    u32(static_cast<uint32_t>(c.size()));
    for (const auto& [name, bytes] : c) {
      str(name);
      str(bytes);
    }
  };
  u32(1);
  str(s.client_id);
  u64(s.digest);
  str(s.run_id);
  u8(s.holds_model ? 1 : 0);
  u64(s.held_round);
  floats(s.held);
  u64(s.rounds);
  floats(s.control);
  states(codec);
  u64(s.committed_round);
  u8(s.answered ? 1 : 0);
  floats(s.prev_control);
  states(prev_codec);
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : out) h = (h ^ c) * 0x100000001b3ull;
  u64(h);
  return out;
}

std::string file_bytes(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

TEST_CASE("liteclient state file: the streamed file is the documented layout, byte for byte") {
  // Larger than the writer's buffer, with model vectors on both sides of it.
  ClientState s = sample();
  s.held.resize(200000);
  for (size_t i = 0; i < s.held.size(); ++i) s.held[i] = static_cast<float>(i) * 0.5f - 7.0f;
  s.control.assign(70000, -0.75f);
  std::vector<float> u(40000);
  for (size_t i = 0; i < u.size(); ++i) u[i] = static_cast<float>(i % 97) - 3.0f;
  s.codec["fc1.weight"] = codec_state(5, u);
  s.prev_codec["conv.bias"] = codec_state(4, {1.0f, 2.0f});
  s.prev_codec["conv.weight"].slot("q", {2, 3, 4}).data.assign(24, 0.125f);  // a slot of more dims
  const std::string want = reference_bytes(s, bytes_of(s.codec), bytes_of(s.prev_codec));
  CHECK(encode_state(s) == want);
  const std::string p = path_of("layout");
  save_state(p, s);
  const std::string got = file_bytes(p);
  CHECK(got.size() == want.size());
  CHECK(got == want);
  CHECK_FALSE(fs::exists(p + ".tmp"));
  auto back = load_state(p);
  REQUIRE(back.has_value());
  check_same(*back, s);
  fs::remove(p);
}

TEST_CASE("liteclient state file: a codec state that is not one is refused naming the file and tensor") {
  const ClientState s = sample();
  auto codec = bytes_of(s.codec);
  codec["fc1.bias"] = "not a codec state";
  const std::string msg = refusal(reference_bytes(s, codec, bytes_of(s.prev_codec)));
  CHECK(msg.find("x.lite") != std::string::npos);
  CHECK(msg.find("fc1.bias") != std::string::npos);
}

TEST_CASE("liteclient state file: a save into a missing folder is an Error") {
  const std::string p = path_of("nodir") + "/missing/state.lite";
  CHECK_THROWS_AS(save_state(p, sample()), sparrow::Error);
}
