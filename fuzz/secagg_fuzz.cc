// libFuzzer target: SecAgg messages from a peer, fed to the protocol state
// machines (secagg/secagg.h) at the stage they expect. The first byte picks
// the stage and the sender, the rest is a wire message. A fresh server is
// brought to that stage by replaying an honest round of 5 clients (degree 4,
// threshold 3) recorded once; the fuzzed message must either be accepted or
// refused with sparrow::Error, and the server must then still finish the
// honest round's remaining stages without anything but sparrow::Error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <map>
#include <memory>
#include <variant>
#include <vector>

#include "core/error.h"
#include "secagg/secagg.h"
#include "wire/wire.h"

namespace {

using namespace sparrow;

constexpr uint32_t kN = 5;
constexpr size_t kLen = 64;

secagg::Params params() {
  secagg::Params p;
  p.enabled = true;
  p.degree = 4;
  p.threshold = 3;
  return p;
}

// One honest round, recorded: what each client sent at each stage.
struct Honest {
  std::map<uint32_t, wire::SecAgg> keys, shares, masked, reveal;
  std::vector<std::unique_ptr<secagg::Client>> clients;
  Honest() {
    secagg::Server s(params(), 1, kN, 3, kLen);
    for (uint32_t i = 1; i <= kN; ++i) {
      clients.push_back(std::make_unique<secagg::Client>(wire::SecAggSetup{i, kN, 4, 3, 3, 1.0, 0.2}, 1, "c"));
      keys[i] = clients.back()->keys();
      s.add_keys(i, keys[i]);
    }
    for (auto& [i, m] : s.neighbour_messages()) s.add_shares(i, shares[i] = clients[i - 1]->shares(m));
    for (auto& [i, m] : s.shares_in_messages()) {
      clients[i - 1]->receive_shares(m);
      s.add_masked(i, masked[i] = clients[i - 1]->masked(std::vector<uint32_t>(kLen, i)));
    }
    for (auto& [i, m] : s.unmask_messages()) s.add_reveal(i, reveal[i] = clients[i - 1]->reveal(m));
    s.unmask();
  }
};

const Honest& honest() {
  static const Honest h;
  return h;
}

template <class F>
void refused_ok(F f) {
  try {
    f();
  } catch (const Error&) {
  }
}

}  // namespace

// With SPARROW_FUZZ_SEED_DIR set (scripts/fuzz.sh does): the honest round's
// messages as seeds, each with the byte that feeds it where it belongs.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("SPARROW_FUZZ_SEED_DIR");
  if (!dir) return 0;
  const Honest& h = honest();
  int n = 0;
  auto save = [&](int stage, const std::map<uint32_t, wire::SecAgg>& msgs) {
    for (const auto& entry : msgs) {
      const uint32_t i = entry.first;
      wire::Message w;
      w.body = entry.second;
      const std::string bytes = wire::serialize(w);
      std::ofstream f(std::string(dir) + "/seed_" + std::to_string(n++), std::ios::binary);
      f.put(static_cast<char>(stage + 4 * static_cast<int>(i - 1)));
      f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
  };
  save(0, h.keys);
  save(1, h.shares);
  save(2, h.masked);
  save(3, h.reveal);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t stage = data[0] % 4;
  const uint32_t from = 1 + data[0] / 4 % kN;
  wire::ParseLimits limits;
  limits.max_bytes = size_t{1} << 20;
  limits.max_elements = uint64_t{1} << 16;
  wire::SecAgg bad;
  try {
    wire::Message m = wire::parse(data + 1, size - 1, limits);
    const auto* a = std::get_if<wire::SecAgg>(&m.body);
    if (!a) return 0;
    bad = *a;
  } catch (const Error&) {
    return 0;
  }
  const Honest& h = honest();
  secagg::Server s(params(), 1, kN, 3, kLen);
  // The fuzzed message replaces the sender's honest one at its stage.
  auto feed = [&](int st, const std::map<uint32_t, wire::SecAgg>& msgs, auto add) {
    for (const auto& entry : msgs) {  // (clang's C++17 cannot capture a structured binding)
      const uint32_t i = entry.first;
      const wire::SecAgg& m = st == stage && i == from ? bad : entry.second;
      refused_ok([&] { add(i, m); });
    }
  };
  feed(0, h.keys, [&](uint32_t i, const wire::SecAgg& m) { s.add_keys(i, m); });
  refused_ok([&] { (void)s.neighbour_messages(); });
  feed(1, h.shares, [&](uint32_t i, const wire::SecAgg& m) { s.add_shares(i, m); });
  refused_ok([&] { (void)s.shares_in_messages(); });
  feed(2, h.masked, [&](uint32_t i, const wire::SecAgg& m) { s.add_masked(i, m); });
  refused_ok([&] { (void)s.unmask_messages(); });
  feed(3, h.reveal, [&](uint32_t i, const wire::SecAgg& m) { s.add_reveal(i, m); });
  refused_ok([&] { (void)s.unmask(); });
  // A client's side: a fresh client handed the message as its Neighbours.
  secagg::Client c(wire::SecAggSetup{from, kN, 4, 3, 3, 1.0, 0.2}, 1, "c");
  (void)c.keys();
  refused_ok([&] { (void)c.shares(bad); });
  refused_ok([&] { c.receive_shares(bad); });
  return 0;
}
