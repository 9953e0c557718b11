#pragma once
// What the lite client's session tests share (session_test.cc,
// catchup_session_test.cc): a fake SessionTrainer whose update is a fixed
// function of the global model, dense task tensors, and the scripted server's
// side of one connection on the in-process transport. LibTorch-free: the
// device build (arm64 under qemu) runs these tests too.

#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "compression/flat_codec.h"
#include "core/error.h"
#include "liteclient/session.h"
#include "transport/transport.h"
#include "wire/wire.h"

namespace sparrow::testing::lite_script {

namespace flat = compression::flat;
using namespace std::chrono_literals;

// Two parameters; the update is a fixed function of the global model and the seed.
class FakeTrainer : public liteclient::SessionTrainer {
 public:
  FakeTrainer() : layout_(liteclient::Layout::make({"w", "b"}, {{2, 3}, {3}})) {}
  const liteclient::Layout& layout() const override { return layout_; }
  uint64_t num_samples() const override { return 10; }
  bool stateful(const std::string&) const override { return false; }
  void check(const wire::TrainSettings& s) override {
    if (s.algorithm != "fedavg") throw ConfigError("algorithm '" + s.algorithm + "' is not supported");
  }
  liteclient::LocalUpdate train(const wire::TrainSettings& s, const std::vector<float>& global, uint64_t seed,
                                std::vector<float>*, const std::vector<float>*) override {
    check(s);
    liteclient::LocalUpdate u;
    for (size_t i = 0; i < global.size(); ++i) u.delta.push_back(expected(global[i], i, seed));
    u.num_samples = 10;
    u.mean_loss = 0.5;
    ++calls;
    return u;
  }
  static float expected(float g, size_t i, uint64_t seed) {
    return 0.5f * g + 0.001f * static_cast<float>(i) + static_cast<float>(seed % 7);
  }
  int calls = 0;

 private:
  liteclient::Layout layout_;
};

inline wire::NamedTensor dense(const std::string& name, const std::vector<int64_t>& shape, const float* v) {
  flat::State scratch_state;
  return {name, flat::make_codec("none")->encode(v, shape, scratch_state, {})};
}

// The scripted server's side of one connection.
class Script {
 public:
  explicit Script(const std::string& ep) : listener_(transport::listen(ep, {})) {}
  // The next message that is not a Heartbeat (within 10 s).
  wire::Message next() {
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (std::chrono::steady_clock::now() < until) {
      if (!listener_->poll(100ms, true)) continue;
      auto in = listener_->receive();
      if (!in) continue;
      peer_ = in->peer;
      wire::Message m = wire::parse(in->frame.data(), in->frame.size(), wire::ParseLimits{});
      if (std::holds_alternative<wire::Heartbeat>(m.body)) continue;
      return m;
    }
    FAIL("no message from the client within 10 s");
    return {};
  }
  void send(wire::Body body) {
    wire::Message m;
    m.body = std::move(body);
    REQUIRE(listener_->send(peer_, wire::serialize(m)) == transport::SendResult::kSent);
  }

 private:
  std::unique_ptr<transport::Listener> listener_;
  std::string peer_;
};

}  // namespace sparrow::testing::lite_script
