// The lite client's state file: a round trip keeps every field; a damaged,
// truncated or foreign file is refused naming the file; a save replaces the
// file whole and leaves no temporary behind.
// LibTorch-free: also built and run in a device build (SPARROW_LITE_ONLY), on arm64 under qemu.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "core/error.h"
#include "liteclient/state_file.h"

namespace {

namespace fs = std::filesystem;
using namespace sparrow::liteclient;

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
  s.codec["fc1.weight"] = std::string("SPST\0\x01residual", 14);
  s.codec["fc1.bias"] = "x";
  s.committed_round = 3;
  s.answered = true;
  s.prev_control = {0.125f};
  s.prev_codec["fc1.weight"] = "before";
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
  CHECK(a.codec == b.codec);
  CHECK(a.committed_round == b.committed_round);
  CHECK(a.answered == b.answered);
  CHECK(a.prev_control == b.prev_control);
  CHECK(a.prev_codec == b.prev_codec);
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

TEST_CASE("liteclient state file: a save into a missing folder is an Error") {
  const std::string p = path_of("nodir") + "/missing/state.lite";
  CHECK_THROWS_AS(save_state(p, sample()), sparrow::Error);
}
