// sparrow-client's update that never reached the server: the state is
// committed (error feedback's residual and SCAFFOLD's c_i advanced) before the
// update leaves; when the client dies there, or its connection closes, the
// server asks for the round again. The update then sent must be the lost one,
// byte for byte, and the state after the Ack the one a client that was never
// interrupted has: no residual or control step applied twice. A scripted
// server on the in-process transport (mem://).
#include "tests/sparrow_test.h"

#include <unistd.h>

#include <chrono>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>

#include "client/session.h"
#include "client/trainer.h"
#include "compression/compressor.h"
#include "core/models.h"
#include "state/store.h"
#include "tests/client/session_fixture.h"
#include "transport/transport.h"
#include "wire/wire.h"

namespace fs = std::filesystem;
using namespace sparrow;
using namespace std::chrono_literals;
using client::ClientSession;
using client::Weights;
using namespace sparrow::testing::client_fixture;  // NOLINT(google-build-using-namespace)

namespace {

constexpr const char* kCompression = "topk:ratio=0.01,ef=true";

std::string temp_dir(const std::string& name) { return fresh_dir("sparrow_replay_test", name); }

core::Dataset make_data() {
  core::Dataset d;
  d.x = at::cos(at::arange(16 * 784).to(at::kFloat) * 0.29f).reshape({16, 1, 28, 28});
  d.y = at::arange(16, at::kLong).remainder(10);
  return d;
}

wire::Task full_task(uint64_t round, uint64_t seed) {
  wire::Task t;
  t.round = round;
  t.model_encoding = wire::ModelEncoding::kFull;
  auto none = compression::make_compressor("none");
  for (const auto& [k, v] : client::get_weights(*core::make_model("mlp", 40 + round))) {
    compression::State s;
    t.weights.push_back({k, none->encode(v.contiguous(), s, {})});
  }
  t.train.algorithm = "scaffold";  // c_i is client state too
  t.train.local_epochs = 1;
  t.train.batch_size = 8;
  t.train.lr = 0.05;
  t.compression = kCompression;
  t.seed = seed;
  return t;
}

// The update's tensors and control delta as bytes (its metrics hold times).
std::string update_bytes(wire::ModelUpdate u) {
  u.metrics.clear();
  wire::Message m;
  m.body = std::move(u);
  return wire::serialize(m);
}

// The server's side: one listener, whatever connection spoke last.
class Script {
 public:
  explicit Script(const std::string& ep) : listener_(transport::listen(ep, {})) {}
  // The next message that is not a Heartbeat (answered when `answer`).
  wire::Message next(bool answer = true) {
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < until) {
      if (!listener_->poll(100ms, true)) continue;
      auto in = listener_->receive();
      if (!in) continue;
      peer_ = in->peer;
      wire::Message m = wire::parse(in->frame.data(), in->frame.size(), wire::ParseLimits{});
      if (auto* h = std::get_if<wire::Heartbeat>(&m.body)) {
        if (answer) send(wire::Heartbeat{h->round});
        continue;
      }
      return m;
    }
    FAIL("no message from the client within 20 s");
    return {};
  }
  template <class T>
  T expect(bool answer = true) {
    wire::Message m = next(answer);
    auto* t = std::get_if<T>(&m.body);
    REQUIRE_MESSAGE(t != nullptr, "got " << std::string(wire::body_name(m.body)));
    return *t;
  }
  void send(wire::Body body) {
    wire::Message m;
    m.body = std::move(body);
    REQUIRE(listener_->send(peer_, wire::serialize(m)) == transport::SendResult::kSent);
  }
  void welcome(uint32_t heartbeat_ms) {
    wire::Welcome w;
    w.run_id = "run-replay";
    w.heartbeat_ms = heartbeat_ms;
    w.model_seed = 7;
    send(w);
  }
  const std::string& peer() const { return peer_; }

 private:
  std::unique_ptr<transport::Listener> listener_;
  std::string peer_;
};

client::SessionConfig config(const std::string& ep, const std::string& dir) {
  return session_config(ep, dir, "carol", 1000, 50);
}

// The persisted state (key 0) and the meta values of the replay, read after
// the session is gone.
struct Persisted {
  std::string state;  // ClientState bytes
  std::string commit_round, commit_answered;
};
Persisted read_state(const std::string& dir) {
  auto store = state::ClientStateStore::open(dir + "/state.db");
  Persisted p;
  auto st = store->get(0);
  REQUIRE(st.has_value());
  p.state = st->serialize();
  p.commit_round = store->get_meta("commit.round").value_or("");
  p.commit_answered = store->get_meta("commit.answered").value_or("");
  return p;
}

}  // namespace

TEST_CASE("session: a round asked again after its update was lost sends the same update, state as uninterrupted") {
  const std::string tag = std::to_string(::getpid());
  // The uninterrupted client: round 1, Ack, round 2, Ack.
  std::string want1, want2;
  const std::string ref_dir = temp_dir("ref");
  {
    const std::string ep = "mem://session_replay_ref_" + tag;
    Script server(ep);
    ClientSession session(config(ep, ref_dir), make_data());
    Running run(session);
    server.expect<wire::Hello>();
    server.welcome(1000);
    server.send(full_task(1, 11));
    want1 = update_bytes(server.expect<wire::ModelUpdate>());
    server.send(wire::Ack{1});
    server.send(full_task(2, 12));
    want2 = update_bytes(server.expect<wire::ModelUpdate>());
    server.send(wire::Ack{2});
    server.send(wire::Bye{"run finished"});
    run.th.join();
    REQUIRE_FALSE(run.error);
    CHECK(run.result == std::optional<bool>(true));
  }
  const Persisted ref = read_state(ref_dir);
  CHECK(ref.commit_round == "2");
  CHECK(ref.commit_answered == "1");

  // What follows the lost update: round 1 again, Ack, round 2, Ack.
  auto resume = [&](Script& server, ClientSession& session, Running& run, uint32_t heartbeat_ms) {
    server.welcome(heartbeat_ms);
    server.send(full_task(1, 11));
    CHECK_MESSAGE((update_bytes(server.expect<wire::ModelUpdate>()) == want1), "round 1 asked again");
    server.send(wire::Ack{1});
    server.send(full_task(2, 12));
    CHECK_MESSAGE((update_bytes(server.expect<wire::ModelUpdate>()) == want2), "round 2 after it");
    server.send(wire::Ack{2});
    server.send(wire::Bye{"run finished"});
    run.th.join();
    REQUIRE_FALSE(run.error);
    CHECK(run.result == std::optional<bool>(true));
    CHECK(session.counters().updates_acked == 2);
  };

  SUBCASE("the client stops (as a crash would) after committing round 1; a new process is asked again") {
    const std::string dir = temp_dir("restart");
    const std::string ep = "mem://session_replay_restart_" + tag;
    Script server(ep);
    {
      ClientSession session(config(ep, dir), make_data());
      Running run(session);
      server.expect<wire::Hello>();
      server.welcome(1000);
      server.send(full_task(1, 11));
      CHECK_MESSAGE((update_bytes(server.expect<wire::ModelUpdate>()) == want1), "the update that is lost");
      session.stop();  // no Ack: as if the update never arrived
      run.th.join();
      REQUIRE_FALSE(run.error);
      server.expect<wire::Bye>();
    }
    const Persisted mid = read_state(dir);
    CHECK(mid.commit_round == "1");
    CHECK(mid.commit_answered == "0");
    CHECK_MESSAGE((mid.state != ref.state), "the state of round 1 committed");
    {
      ClientSession session(config(ep, dir), make_data());
      Running run(session);
      server.expect<wire::Hello>();
      resume(server, session, run, 1000);
    }
    const Persisted after = read_state(dir);
    CHECK_MESSAGE((after.state == ref.state), "the state after the Acks");
    CHECK(after.commit_answered == "1");
    fs::remove_all(dir);
  }

  SUBCASE("the connection closes after round 1 was committed; the server asks again on the new one") {
    const std::string dir = temp_dir("reconnect");
    const std::string ep = "mem://session_replay_reconnect_" + tag;
    Script server(ep);
    {
      ClientSession session(config(ep, dir), make_data());
      Running run(session);
      server.expect<wire::Hello>();
      const std::string first_peer = server.peer();
      server.welcome(50);
      server.send(full_task(1, 11));
      CHECK_MESSAGE((update_bytes(server.expect<wire::ModelUpdate>()) == want1), "the update that is lost");
      // The update is taken as lost: no Ack, no answer to heartbeats, until the
      // client gives the connection up and says Hello on a new one.
      server.expect<wire::Hello>(/*answer=*/false);
      CHECK(server.peer() != first_peer);
      CHECK(session.counters().reconnects >= 1);
      resume(server, session, run, 1000);
    }
    CHECK_MESSAGE((read_state(dir).state == ref.state), "the state after the Acks");
    fs::remove_all(dir);
  }
  fs::remove_all(ref_dir);
}
