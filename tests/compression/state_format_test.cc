// The codec-state bytes ("SPST", compression/state_format.h) on their own: the
// documented layout byte for byte, the size and the streamed pieces equal to
// the string, each slot copied into the caller's storage, and every malformed
// input refused with a FormatError that says what is wrong. compression::State
// and flat::State over these: tests/compression/flat_codec_test.cc.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "compression/state_format.h"
#include "core/error.h"

namespace {

namespace sf = sparrow::compression::state_format;

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// The layout written by hand: header, then (name, shape, values) per slot.
struct Slot {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};
std::string by_hand(uint32_t version, uint64_t step, int64_t last_round, const std::vector<Slot>& slots) {
  std::string out("SPST", 4);
  put<uint32_t>(out, version);
  put<uint64_t>(out, step);
  if (version >= 2) put<int64_t>(out, last_round);
  put<uint32_t>(out, static_cast<uint32_t>(slots.size()));
  for (const Slot& s : slots) {
    put<uint32_t>(out, static_cast<uint32_t>(s.name.size()));
    out += s.name;
    put<uint32_t>(out, static_cast<uint32_t>(s.shape.size()));
    for (int64_t d : s.shape) put<int64_t>(out, d);
    out.append(reinterpret_cast<const char*>(s.data.data()), s.data.size() * sizeof(float));
  }
  return out;
}

std::vector<sf::SlotView> views(const std::vector<Slot>& slots) {
  std::vector<sf::SlotView> v;
  for (const Slot& s : slots) v.push_back({&s.name, s.shape.data(), s.shape.size(), s.data.data(), s.data.size()});
  return v;
}

// Reads into a name -> Slot map.
std::map<std::string, Slot> read(const std::string& b, sf::Header* h = nullptr) {
  std::map<std::string, Slot> out;
  const sf::Header got = sf::read(b.data(), b.size(), [&out](std::string name, const std::vector<int64_t>& shape) {
    Slot& s = out[name];
    s.name = name;
    s.shape = shape;
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    s.data.assign(n, -99.0f);
    return s.data.data();
  });
  if (h) *h = got;
  return out;
}

std::string refusal(const std::string& b) {
  try {
    read(b);
  } catch (const sparrow::FormatError& e) {
    return e.what();
  }
  return "(read)";
}

const std::vector<Slot> kSlots = {
    {"q", {2, 3}, {1.5f, -2.0f, 0.25f, 3e-8f, -0.0f, 7.0f}},
    {"u", {0, 4}, {}},
    {"v", {}, {42.0f}},
};

}  // namespace

TEST_CASE("state_format: the written bytes are the layout, in one string or streamed, and read back") {
  const std::string want = by_hand(2, 9, 4, kSlots);
  CHECK(sf::write({9, 4}, views(kSlots)) == want);
  CHECK(sf::size(views(kSlots)) == want.size());
  std::string streamed;
  int pieces = 0;
  sf::write({9, 4}, views(kSlots), [&](const char* p, size_t n) {
    streamed.append(p, n);
    ++pieces;
  });
  CHECK(streamed == want);
  CHECK(pieces > 3);  // in pieces, not built whole first

  sf::Header h;
  const auto back = read(want, &h);
  CHECK(h.step == 9);
  CHECK(h.last_round == 4);
  REQUIRE(back.size() == 3);
  for (const Slot& s : kSlots) {
    CHECK(back.at(s.name).shape == s.shape);
    CHECK(std::memcmp(back.at(s.name).data.data(), s.data.data(), s.data.size() * sizeof(float)) == 0);
  }
  // Version 1 has no last_round: it reads as -1.
  read(by_hand(1, 3, 0, kSlots), &h);
  CHECK(h.step == 3);
  CHECK(h.last_round == -1);
}

TEST_CASE("state_format: a slot whose values do not fit its shape is an Error before any byte is written") {
  const std::string name = "r";
  const std::vector<int64_t> shape = {2, 2};
  const std::vector<float> three = {1, 2, 3};
  const std::vector<sf::SlotView> bad = {{&name, shape.data(), shape.size(), three.data(), three.size()}};
  size_t written = 0;
  CHECK_THROWS_WITH_AS(sf::write({}, bad, [&](const char*, size_t n) { written += n; }),
                       doctest::Contains("compressor state 'r' has 3 values for its shape"), sparrow::Error);
  CHECK(written == 0);
  CHECK_THROWS_AS(sf::size(bad), sparrow::Error);
}

TEST_CASE("state_format: malformed bytes are refused saying what is wrong") {
  const std::string good = by_hand(2, 1, 0, kSlots);
  CHECK(refusal(good.substr(0, 3)) == "compressor state: bad magic");
  CHECK(refusal("SPSX" + good.substr(4)) == "compressor state: bad magic");
  CHECK(refusal(good.substr(0, 4) + std::string("\x03\0\0\0", 4) + good.substr(8)) ==
        "compressor state: unsupported version 3");
  CHECK(refusal(by_hand(2, 1, -2, {})) == "compressor state: bad last round -2");
  CHECK(refusal(good + "z") == "compressor state: trailing bytes");
  CHECK(refusal(good.substr(0, good.size() - 1)).find("compressor state: truncated at byte") == 0);
  CHECK(refusal(by_hand(2, 1, 0, {kSlots[0], kSlots[0]})) == "compressor state: duplicate slot");
  CHECK(refusal(by_hand(2, 1, 0, {{"deep", std::vector<int64_t>(9, 1), {1.0f}}})) ==
        "compressor state: 'deep' has 9 dims");
  CHECK(refusal(by_hand(2, 1, 0, {{"neg", {-1}, {}}})) == "compressor state: bad dimension -1");
  // Each dimension allowed, their product not: refused before anything is allocated.
  CHECK(refusal(by_hand(2, 1, 0, {{"big", {int64_t{1} << 30, int64_t{1} << 30}, {}}})) ==
        "compressor state: tensor too large");
  // A slot's values past the end: refused before the caller allocates it.
  std::string cut = by_hand(2, 1, 0, {{"w", {1000}, {}}});
  int allocs = 0;
  CHECK_THROWS_AS(sf::read(cut.data(), cut.size(),
                           [&allocs](std::string, const std::vector<int64_t>&) -> float* {
                             ++allocs;
                             return nullptr;
                           }),
                  sparrow::FormatError);
  CHECK(allocs == 0);
}
