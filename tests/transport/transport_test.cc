// The transport seam (transport/transport.h): the ZeroMQ implementation on
// tcp://127.0.0.1:* and the in-process one on mem://, each test run against
// both through the same interface.
#include "tests/sparrow_test.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "transport/inproc.h"
#include "transport/transport.h"
#include "wire/net.h"

using namespace sparrow;  // NOLINT(google-build-using-namespace)
using namespace std::chrono_literals;
using transport::HandshakeEvent;
using transport::SendResult;
using Clock = std::chrono::steady_clock;

namespace {

// Runs `body` with a bind endpoint of each built-in kind.
void each_transport(const std::string& name, const std::function<void(const std::string& bind)>& body) {
  for (const std::string& bind :
       {std::string("tcp://127.0.0.1:*"), "mem://transport_test_" + name + "_" + std::to_string(::getpid())}) {
    CAPTURE(bind);
    body(bind);
  }
}

std::string text(const transport::Frame& f) { return std::string(f.data(), f.size()); }

// The next inbound frame within `limit`.
std::optional<transport::Inbound> receive_within(transport::Listener& l, std::chrono::milliseconds limit) {
  const auto until = Clock::now() + limit;
  while (Clock::now() < until) {
    if (auto in = l.receive()) return in;
    l.poll(10ms, true);
  }
  return std::nullopt;
}

// Handshake events of `c` within `limit`, until one of `kinds` shows.
std::vector<HandshakeEvent> events_until(transport::Connection& c, std::initializer_list<HandshakeEvent::Kind> kinds,
                                         std::chrono::milliseconds limit) {
  std::vector<HandshakeEvent> all;
  const auto until = Clock::now() + limit;
  while (Clock::now() < until) {
    (void)c.receive(20ms);
    for (auto& e : c.handshake_events()) {
      all.push_back(e);
      for (auto k : kinds)
        if (e.kind == k) return all;
    }
  }
  return all;
}

bool has(const std::vector<HandshakeEvent>& events, HandshakeEvent::Kind kind) {
  for (const auto& e : events)
    if (e.kind == kind) return true;
  return false;
}

}  // namespace

TEST_CASE("transport: a frame goes to the listener and a reply comes back to the peer that sent it") {
  each_transport("roundtrip", [](const std::string& bind) {
    auto l = transport::listen(bind, {});
    CHECK(l->endpoint().find("*") == std::string::npos);  // the port resolved
    auto c = transport::connect(l->endpoint(), {});
    // A connection may still be in its handshake: the first frame waits in its queue.
    REQUIRE(c->send("hello") == SendResult::kSent);
    auto in = receive_within(*l, 5s);
    REQUIRE(in);
    CHECK(text(in->frame) == "hello");
    CHECK_FALSE(in->peer.empty());
    CHECK(in->key.empty());  // no keys: no authenticated identity
    CHECK_FALSE(in->extra_frames);
    REQUIRE(l->send(in->peer, "world") == SendResult::kSent);
    auto back = c->receive(5s);
    REQUIRE(back);
    CHECK(text(*back) == "world");
  });
}

TEST_CASE("transport: with many peers each reply reaches the peer it names") {
  each_transport("many", [](const std::string& bind) {
    auto l = transport::listen(bind, {});
    constexpr int kPeers = 8;
    std::vector<std::unique_ptr<transport::Connection>> cs;
    for (int i = 0; i < kPeers; ++i) {
      cs.push_back(transport::connect(l->endpoint(), {}));
      REQUIRE(cs.back()->send("peer " + std::to_string(i)) == SendResult::kSent);
    }
    std::set<std::string> ids;
    for (int i = 0; i < kPeers; ++i) {
      auto in = receive_within(*l, 5s);
      REQUIRE(in);
      ids.insert(in->peer);
      // Echo to the sender: each connection must get back what it sent.
      REQUIRE(l->send(in->peer, "to " + text(in->frame)) == SendResult::kSent);
    }
    CHECK(ids.size() == kPeers);
    for (int i = 0; i < kPeers; ++i) {
      auto back = cs[i]->receive(5s);
      REQUIRE(back);
      CHECK(text(*back) == "to peer " + std::to_string(i));
    }
  });
}

TEST_CASE("transport: with keys a frame carries the client's public key and a key off the allow-list is refused") {
  each_transport("keys", [](const std::string& bind) {
    const net::KeyPair server = net::generate_keypair(), good = net::generate_keypair(), bad = net::generate_keypair();
    std::mutex mu;
    std::vector<std::pair<std::string, bool>> decisions;
    transport::ListenOptions lo;
    lo.public_key = server.public_key;
    lo.secret_key = server.secret_key;
    lo.allowed = {good.public_key};
    lo.on_auth = [&](const std::string& key, const std::string&, bool admitted) {
      std::lock_guard<std::mutex> g(mu);
      decisions.emplace_back(key, admitted);
    };
    auto l = transport::listen(bind, lo);
    auto client = [&](const net::KeyPair& k, const std::string& server_key) {
      transport::ConnectOptions co;
      co.public_key = k.public_key;
      co.secret_key = k.secret_key;
      co.server_key = server_key;
      return transport::connect(l->endpoint(), co);
    };

    auto ok = client(good, server.public_key);
    REQUIRE(ok->send("from good") == SendResult::kSent);
    auto in = receive_within(*l, 5s);
    REQUIRE(in);
    CHECK(text(in->frame) == "from good");
    CHECK(in->key == good.public_key);
    CHECK(has(events_until(*ok, {HandshakeEvent::Kind::kSucceeded}, 2s), HandshakeEvent::Kind::kSucceeded));

    auto refused = client(bad, server.public_key);
    (void)refused->send("from bad");
    const auto ev = events_until(*refused, {HandshakeEvent::Kind::kRefused}, 5s);
    CHECK(has(ev, HandshakeEvent::Kind::kRefused));
    CHECK_FALSE(receive_within(*l, 200ms));  // nothing of the refused client's arrives
    {
      std::lock_guard<std::mutex> g(mu);
      bool told = false;
      for (const auto& [key, admitted] : decisions) told = told || (key == bad.public_key && !admitted);
      CHECK(told);
    }

    // A client without keys never gets through to a server with keys.
    auto plain = transport::connect(l->endpoint(), {});
    (void)plain->send("plain");
    const auto pe = events_until(*plain, {HandshakeEvent::Kind::kMismatch, HandshakeEvent::Kind::kFailed}, 5s);
    CHECK((has(pe, HandshakeEvent::Kind::kMismatch) || has(pe, HandshakeEvent::Kind::kFailed) ||
           has(pe, HandshakeEvent::Kind::kDisconnected)));
    CHECK_FALSE(receive_within(*l, 200ms));
  });
}

TEST_CASE("transport: a full queue is a value (would block), not a wait") {
  each_transport("wouldblock", [](const std::string& bind) {
    transport::ListenOptions lo;
    lo.queue_limit = 2;
    auto l = transport::listen(bind, lo);
    transport::ConnectOptions co;
    co.queue_limit = 2;
    auto c = transport::connect(l->endpoint(), co);
    REQUIRE(c->send("hi") == SendResult::kSent);
    auto in = receive_within(*l, 5s);
    REQUIRE(in);
    // The client reads nothing: the listener's sends to it must stop being
    // queued (ZeroMQ also fills the socket buffers first).
    const std::string big(256 << 10, 'x');
    int sent = 0;
    bool blocked = false;
    const auto t0 = Clock::now();
    for (int i = 0; i < 4000 && !blocked; ++i) {
      const SendResult r = l->send(in->peer, big);
      if (r == SendResult::kWouldBlock) {
        blocked = true;
      } else {
        REQUIRE(r == SendResult::kSent);
        ++sent;
      }
    }
    CHECK(blocked);
    CHECK(Clock::now() - t0 < 10s);  // no send waited
    MESSAGE("sends queued before would-block: " << sent);
    // Once the client has read what was queued, sends go through again.
    int got = 0;
    while (c->receive(500ms)) ++got;
    CHECK(got == sent);
    CHECK(l->send(in->peer, "again") == SendResult::kSent);
    auto again = c->receive(5s);
    REQUIRE(again);
    CHECK(text(*again) == "again");
  });
}

TEST_CASE("transport: a client with no server to talk to fills its queue and then would block") {
  each_transport("noserver", [](const std::string& bind) {
    // An endpoint nobody listens on: a free port once bound, or an unbound name.
    std::string ep;
    {
      auto l = transport::listen(bind, {});
      ep = l->endpoint();
    }
    transport::ConnectOptions co;
    co.queue_limit = 4;
    auto c = transport::connect(ep, co);
    bool blocked = false;
    for (int i = 0; i < 100 && !blocked; ++i) blocked = c->send("x") == SendResult::kWouldBlock;
    CHECK(blocked);
    CHECK_FALSE(c->receive(20ms));
  });
}

TEST_CASE("transport: a peer that is gone is a value") {
  each_transport("gone", [](const std::string& bind) {
    auto l = transport::listen(bind, {});
    CHECK(l->send("no such peer", "x") == SendResult::kPeerGone);
    auto c = transport::connect(l->endpoint(), {});
    REQUIRE(c->send("hi") == SendResult::kSent);
    auto in = receive_within(*l, 5s);
    REQUIRE(in);
    c.reset();
    // The listener learns of the close when its transport does (at once in
    // process, after the TCP close with ZeroMQ).
    bool gone = false;
    const auto until = Clock::now() + 5s;
    while (!gone && Clock::now() < until) {
      gone = l->send(in->peer, "x") == SendResult::kPeerGone;
      if (!gone) l->poll(10ms, false);
    }
    CHECK(gone);
  });
}

TEST_CASE("transport: receive and poll return after their timeout, and wake() ends a poll early") {
  each_transport("timeouts", [](const std::string& bind) {
    auto l = transport::listen(bind, {});
    auto c = transport::connect(l->endpoint(), {});
    auto t0 = Clock::now();
    CHECK_FALSE(c->receive(100ms));
    auto waited = Clock::now() - t0;
    CHECK(waited >= 90ms);
    CHECK(waited < 2s);

    t0 = Clock::now();
    CHECK_FALSE(l->poll(100ms, true));
    waited = Clock::now() - t0;
    CHECK(waited >= 90ms);
    CHECK(waited < 2s);

    std::thread waker([&] {
      std::this_thread::sleep_for(50ms);
      l->wake();  // from another thread: the contract allows it
    });
    t0 = Clock::now();
    CHECK_FALSE(l->poll(10s, true));
    waited = Clock::now() - t0;
    waker.join();
    CHECK(waited < 5s);

    // A frame that is queued but not wanted does not end a poll.
    REQUIRE(c->send("queued") == SendResult::kSent);
    std::this_thread::sleep_for(200ms);
    CHECK_FALSE(l->poll(50ms, false));
    auto in = receive_within(*l, 5s);
    REQUIRE(in);
    CHECK(text(in->frame) == "queued");
  });
}

TEST_CASE("transport: endpoints pick their implementation by scheme") {
  CHECK(transport::scheme_of("tcp://127.0.0.1:1") == "tcp");
  CHECK(transport::scheme_of("mem://x") == "mem");
  CHECK_THROWS_AS(transport::scheme_of("127.0.0.1:1"), ConfigError);
  CHECK_THROWS_WITH_AS(transport::listen("nope://x", {}), doctest::Contains("unknown transport 'nope'"), ConfigError);
  // A name binds once per process, as a port does once per host.
  const std::string ep = "mem://transport_test_twice_" + std::to_string(::getpid());
  auto first = transport::listen(ep, {});
  CHECK_THROWS_WITH_AS(transport::listen(ep, {}), doctest::Contains("cannot bind"), ConfigError);
  first.reset();
  CHECK_NOTHROW(transport::listen(ep, {}));
  // A scheme registered by name serves the endpoints that name it.
  int listens = 0;
  transport::register_transport("counted", {[&](const std::string&, const transport::ListenOptions& o) {
                                              ++listens;
                                              return transport::inproc_listen(
                                                  "mem://counted_" + std::to_string(::getpid()), o);
                                            },
                                            transport::inproc_connect});
  auto l = transport::listen("counted://x", {});
  CHECK(listens == 1);
  CHECK(l->endpoint() == "mem://counted_" + std::to_string(::getpid()));
}

TEST_CASE("transport mem: a connection made before its listener attaches once one binds the name") {
  const std::string ep = "mem://transport_test_late_" + std::to_string(::getpid());
  auto c = transport::connect(ep, {});
  CHECK(c->send("too early") == SendResult::kWouldBlock);
  auto l = transport::listen(ep, {});
  bool sent = false;
  const auto until = Clock::now() + 2s;
  while (!sent && Clock::now() < until) {
    sent = c->send("now") == SendResult::kSent;
    if (!sent) std::this_thread::sleep_for(10ms);
  }
  REQUIRE(sent);
  auto in = receive_within(*l, 1s);
  REQUIRE(in);
  CHECK(text(in->frame) == "now");
  // The listener goes: the frames it queued still arrive, then the connection
  // reports the close.
  REQUIRE(l->send(in->peer, "bye") == SendResult::kSent);
  l.reset();
  auto bye = c->receive(1s);
  REQUIRE(bye);
  CHECK(text(*bye) == "bye");
  CHECK_FALSE(c->receive(50ms));
  CHECK(has(c->handshake_events(), HandshakeEvent::Kind::kDisconnected));
}

TEST_CASE("transport mem: a frame over the listener's max_message_bytes closes the connection") {
  const std::string ep = "mem://transport_test_big_" + std::to_string(::getpid());
  transport::ListenOptions lo;
  lo.max_message_bytes = 16;
  auto l = transport::listen(ep, lo);
  auto c = transport::connect(ep, {});
  REQUIRE(c->send("small") == SendResult::kSent);
  auto in = receive_within(*l, 1s);
  REQUIRE(in);
  (void)c->send(std::string(17, 'x'));
  CHECK_FALSE(receive_within(*l, 100ms));
  CHECK(l->send(in->peer, "x") == SendResult::kPeerGone);
}
