#include "tests/sparrow_test.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/error.h"
#include "wire/net.h"

namespace fs = std::filesystem;
using namespace sparrow;

namespace {

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("sparrow_net_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::string endpoint_of(zmq::socket_t& s) { return s.get(zmq::sockopt::last_endpoint); }

wire::Message heartbeat(uint64_t round) {
  wire::Message m;
  m.body = wire::Heartbeat{round};
  return m;
}

}  // namespace

TEST_CASE("net: key pairs are written and read back as certificates") {
  const std::string dir = temp_dir("keys");
  const net::KeyPair keys = net::generate_keypair();
  CHECK(net::is_z85_key(keys.public_key));
  CHECK(net::is_z85_key(keys.secret_key));
  CHECK(keys.public_key != keys.secret_key);
  net::write_keypair(dir, "server", keys);
  struct stat st {};
  REQUIRE(::stat((dir + "/server.key_secret").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);

  const net::KeyPair back = net::load_keypair(dir + "/server.key_secret");
  CHECK(back.public_key == keys.public_key);
  CHECK(back.secret_key == keys.secret_key);
  CHECK(net::load_public_key(dir + "/server.key") == keys.public_key);
  CHECK(net::load_public_key(dir + "/server.key_secret") == keys.public_key);

  // The public file has no secret; an existing pair is never overwritten.
  CHECK_THROWS_AS(net::load_keypair(dir + "/server.key"), ConfigError);
  CHECK_THROWS_AS(net::write_keypair(dir, "server", net::generate_keypair()), ConfigError);
  CHECK_THROWS_AS(net::load_public_key(dir + "/missing.key"), ConfigError);

  // A secret that does not belong to the public key is refused.
  const net::KeyPair other = net::generate_keypair();
  std::ofstream(dir + "/mixed.key_secret")
      << "curve\n    public-key = \"" << keys.public_key << "\"\n    secret-key = \"" << other.secret_key << "\"\n";
  CHECK_THROWS_WITH_AS(net::load_keypair(dir + "/mixed.key_secret"), doctest::Contains("does not match"), ConfigError);
  std::ofstream(dir + "/garbage.key") << "public-key = \"not a key\"\n";
  CHECK_THROWS_AS(net::load_public_key(dir + "/garbage.key"), ConfigError);
  fs::remove_all(dir);
}

TEST_CASE("net: allow lists from a directory or a file") {
  const std::string dir = temp_dir("allow");
  const net::KeyPair a = net::generate_keypair(), b = net::generate_keypair(), c = net::generate_keypair();
  net::write_keypair(dir + "/clients", "a", a);
  net::write_keypair(dir + "/clients", "b", b);
  const auto from_dir = net::load_allow_list(dir + "/clients");
  CHECK(from_dir == std::set<std::string>{a.public_key, b.public_key});

  std::ofstream(dir + "/allow.txt") << "# operators' list\n" << c.public_key << "  # edge-3\n\nclients/a.key\n";
  CHECK(net::load_allow_list(dir + "/allow.txt") == std::set<std::string>{a.public_key, c.public_key});
  std::ofstream(dir + "/bad.txt") << c.public_key << "\nnot-a-key-nor-a-file\n";
  CHECK_THROWS_WITH_AS(net::load_allow_list(dir + "/bad.txt"), doctest::Contains("line 2"), ConfigError);
  // An entry too long to be a file name (found by fuzz_allow_list: std::filesystem threw).
  std::ofstream(dir + "/long.txt") << std::string(5000, 'x') << "\n";
  CHECK_THROWS_WITH_AS(net::load_allow_list(dir + "/long.txt"), doctest::Contains("line 1"), ConfigError);

  // '#' is a Z85 character: a key holding one is still a key, not a comment.
  net::KeyPair hashed;
  for (int i = 0; i < 1000 && hashed.public_key.find('#') == std::string::npos; ++i) hashed = net::generate_keypair();
  REQUIRE(hashed.public_key.find('#') != std::string::npos);
  std::ofstream(dir + "/hash.txt") << hashed.public_key << "\n" << hashed.public_key << "\t# again\n";
  CHECK(net::load_allow_list(dir + "/hash.txt") == std::set<std::string>{hashed.public_key});

  // A list that admits nobody is refused: a server behind it could never be reached.
  std::ofstream(dir + "/empty.txt") << "# nobody yet\n";
  CHECK_THROWS_WITH_AS(net::load_allow_list(dir + "/empty.txt"), doctest::Contains("admits no key"), ConfigError);
  fs::create_directories(dir + "/none");
  CHECK_THROWS_WITH_AS(net::load_allow_list(dir + "/none"), doctest::Contains("admits no key"), ConfigError);
  fs::remove_all(dir);
}

TEST_CASE("net: endpoints are checked before bind and connect") {
  for (const char* ok :
       {"tcp://127.0.0.1:7070", "tcp://*:0", "tcp://*:*", "tcp://[::1]:65535", "ipc:///tmp/s.sock", "inproc://x"})
    CHECK_NOTHROW(net::check_endpoint("listen", ok, true));
  CHECK_NOTHROW(net::check_endpoint("server", "tcp://host.example:1", false));
  for (const char* bad : {"notanendpoint", "tcp://127.0.0.1:99999", "tcp://127.0.0.1", "tcp://:80", "udp://h:1",
                          "tcp://h:7o70", "tcp://h:", "ipc://"})
    CHECK_THROWS_WITH_AS(net::check_endpoint("listen", bad, true), doctest::Contains("listen"), sparrow::ConfigError);
  CHECK_THROWS_AS(net::check_endpoint("server", "tcp://h:*", false), sparrow::ConfigError);
  CHECK_THROWS_AS(net::check_endpoint("server", "tcp://h:0", false), sparrow::ConfigError);
}

TEST_CASE("net: CURVE admits listed keys only and names the sender") {
  zmq::context_t ctx;
  const net::KeyPair server = net::generate_keypair(), good = net::generate_keypair(), bad = net::generate_keypair();
  int decisions = 0;
  std::mutex mu;
  net::ZapHandler zap(ctx, {good.public_key}, [&](const std::string&, const std::string&, bool) {
    std::lock_guard<std::mutex> lock(mu);
    ++decisions;
  });
  zmq::socket_t router(ctx, zmq::socket_type::router);
  net::make_curve_server(router, server);
  net::set_limits(router, 1 << 20);
  router.bind("tcp://127.0.0.1:*");
  const std::string ep = endpoint_of(router);

  auto client = [&](const net::KeyPair& keys) {
    zmq::socket_t s(ctx, zmq::socket_type::dealer);
    net::make_curve_client(s, keys, server.public_key);
    net::set_limits(s, 1 << 20);
    s.connect(ep);
    return s;
  };
  zmq::socket_t ok = client(good);
  zmq::socket_t refused = client(bad);
  REQUIRE(net::send(ok, heartbeat(7)));
  net::send(refused, heartbeat(8), true);  // queued until a handshake that never succeeds

  // The server sees exactly the listed client's frame, tagged with its key.
  zmq::pollitem_t item{static_cast<void*>(router), 0, ZMQ_POLLIN, 0};
  REQUIRE(zmq::poll(&item, 1, std::chrono::milliseconds(5000)) == 1);
  zmq::message_t id, body;
  REQUIRE(router.recv(id));
  REQUIRE(id.more());
  REQUIRE(router.recv(body));
  CHECK(net::peer_key(body) == good.public_key);
  const wire::Message got = wire::parse(body.data(), body.size());
  CHECK(std::get<wire::Heartbeat>(got.body).round == 7);

  // A reply reaches the client.
  REQUIRE(net::send_to(router, id.to_string(), heartbeat(9), false));
  const auto reply = net::receive(ok, 5000);
  REQUIRE(reply);
  CHECK(std::get<wire::Heartbeat>(reply->body).round == 9);

  // Nothing ever arrives from the unlisted key.
  CHECK(zmq::poll(&item, 1, std::chrono::milliseconds(500)) == 0);
  for (int i = 0; i < 50 && zap.refused() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(zap.refused() >= 1);
  CHECK(zap.admitted() == 1);
  std::lock_guard<std::mutex> lock(mu);
  CHECK(decisions >= 2);
}

TEST_CASE("net: oversized frames are dropped by libzmq before they reach us") {
  zmq::context_t ctx;
  zmq::socket_t router(ctx, zmq::socket_type::router);
  net::set_limits(router, 1024);
  router.bind("tcp://127.0.0.1:*");
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  net::set_limits(dealer, 1 << 20);
  dealer.connect(endpoint_of(router));
  REQUIRE(dealer.send(zmq::buffer(std::string(4096, 'x')), zmq::send_flags::none));
  zmq::pollitem_t item{static_cast<void*>(router), 0, ZMQ_POLLIN, 0};
  CHECK(zmq::poll(&item, 1, std::chrono::milliseconds(500)) == 0);
  // A receive() of a garbage frame throws ProtocolError, never crashes.
  zmq::socket_t d2(ctx, zmq::socket_type::dealer);
  net::set_limits(d2, 1 << 20);
  d2.connect(endpoint_of(router));
  REQUIRE(d2.send(zmq::buffer(std::string("garbage!garbage!")), zmq::send_flags::none));
  REQUIRE(zmq::poll(&item, 1, std::chrono::milliseconds(5000)) == 1);
  zmq::message_t id, body;
  REQUIRE(router.recv(id));
  REQUIRE(router.recv(body));
  CHECK_THROWS_AS(wire::parse(body.data(), body.size()), wire::ProtocolError);
}
