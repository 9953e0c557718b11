// Integration tests for issue 48 (hardening, default path): text a peer sends
// never forges a log line nor reaches a terminal or the dashboard unescaped,
// and refused handshakes cannot flood the log (docs/security.md, "Peer text"
// and "Log rate limits").
#include "tests/integration/fixtures.h"
// (fixtures.h first: it includes sparrow_test.h before LibTorch.)

#include <csignal>
#include <thread>

#include "core/model_digest.h"
#include "tests/http_client.h"

namespace {

using namespace sparrow::testing::integ;

// The forged id: a newline that starts a complete log line of its own, and
// terminal escapes (clear screen, set the window title).
const std::string kForgedId =
    "evil\n2020-01-01T00:00:00.000 level=info event=round_completed round=999 updates=9 "
    "selected=9\x1b[2J\x1b]0;pwned\x07";
// A Hello `software` and a Bye reason with the same kinds of bytes.
const std::string kSoftware = "sw/1.0\x1b[31m\n2020-01-01T00:00:01.000 level=info event=forged_software \"q\"\\";
const std::string kByeReason = "going\r\n2020-01-01T00:00:02.000 level=info event=forged_bye\x1b[2J";

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// No byte that a terminal or a log reader acts on, other than the newlines
// that end lines.
bool inert(const std::string& s) {
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == 0x1b || c == 0x07 || c == '\r' || c == 0x7f) return false;
  }
  return true;
}

sparrow::wire::Hello hello(const std::string& id, const std::string& software) {
  sparrow::wire::Hello h;
  h.client_id = id;
  h.num_samples = 600;
  h.model = "mlp";
  h.model_digest = sparrow::core::model_digest(initial_weights(1));
  h.software = software;
  return h;
}

}  // namespace

TEST_CASE("integration: peer text is refused or escaped in the log, status and dashboard") {
  using sparrow::testing::http_body;
  using sparrow::testing::http_get;
  const std::string dir = fresh_dir("peer_text");
  keygen(dir, 1);
  // No round starts (it needs 2 clients): the peer's session is all there is.
  server_toml(dir, "rounds = 1\nclients_per_round = 2\nquorum = 2\nround_deadline_s = 60\nheartbeat_ms = 1000\n");
  Process server({kServerBin, "--config", dir + "/server.toml", "--http", "127.0.0.1:0"}, dir + "/server.log");
  const std::string ep = server_endpoint(server);
  std::smatch m;
  std::string slog = server.log();
  REQUIRE(std::regex_search(slog, m, std::regex("event=http url=http://127.0.0.1:(\\d+)/")));
  const int port = std::stoi(m[1]);
  INFO(log_tail(server));

  RawPeer peer(ep, dir);
  // The forged id is refused with an Error; so is one with a space, and an
  // id over 64 characters.
  CHECK(peer.error_for(sparrow::wire::serialize(as_message(hello(kForgedId, "x")))) ==
        sparrow::wire::ErrorCode::kRejected);
  CHECK(peer.error_for(sparrow::wire::serialize(as_message(hello("a b", "x")))) == sparrow::wire::ErrorCode::kRejected);
  CHECK(peer.error_for(sparrow::wire::serialize(as_message(hello(std::string(65, 'a'), "x")))) ==
        sparrow::wire::ErrorCode::kRejected);
  // A valid id with a hostile `software`, then a hostile Bye reason.
  peer.send(as_message(hello("c1", kSoftware)));
  bool welcomed = false;
  for (int i = 0; i < 50 && !welcomed; ++i)
    if (auto r = peer.receive(200)) welcomed = std::holds_alternative<sparrow::wire::Welcome>(r->body);
  REQUIRE(welcomed);

  // The dashboard: the id and the software as printable() text inside the
  // JSON string (no \u001b for a page to decode back into an escape).
  std::string clients;
  for (int i = 0; i < 50; ++i) {
    clients = http_body(http_get(port, "/api/clients"));
    if (clients.find("\"id\":\"c1\"") != std::string::npos) break;
    std::this_thread::sleep_for(100ms);
  }
  INFO(clients);
  CHECK(clients.find("\"software\":\"sw/1.0\\\\x1b[31m\\\\x0a2020-01-01T00:00:01.000 level=info "
                     "event=forged_software \\\\\\\"q\\\\\\\"\\\\\\\\\"") != std::string::npos);
  CHECK(clients.find("\\u001b") == std::string::npos);
  CHECK(clients.find("\\n") == std::string::npos);
  CHECK(clients.find("evil") == std::string::npos);
  CHECK(inert(clients));

  sparrow::wire::Bye bye;
  bye.reason = kByeReason;
  peer.send(as_message(bye));
  REQUIRE(server.wait_for_log("event=client_bye", 30s));
  server.signal(SIGTERM);
  REQUIRE(server.wait(60s).has_value());

  // The log: no forged line, no escape byte, each peer string escaped.
  slog = server.log();
  CHECK(inert(slog));
  CHECK(slog.find("\n2020-01-01") == std::string::npos);
  CHECK(slog.find("event=hello_refused client=\"evil\\x0a2020-01-01T00:00:00.000 level=info "
                  "event=round_completed round=999 updates=9 selected=9\\x1b[2J\\x1b]0;pwned\\x07\"") !=
        std::string::npos);
  CHECK(count(slog, "event=hello_refused") == 3);
  CHECK(slog.find("software=\"sw/1.0\\x1b[31m\\x0a2020-01-01T00:00:01.000 level=info event=forged_software "
                  "\\\"q\\\"\\\\\"") != std::string::npos);
  CHECK(slog.find("reason=\"going\\x0d\\x0a2020-01-01T00:00:02.000 level=info event=forged_bye\\x1b[2J\"") !=
        std::string::npos);

  // `sparrow-server status`, text and JSON: the refused ids were never
  // stored; the software is shown escaped.
  REQUIRE(run_tool({kServerBin, "status", "--db", dir + "/server.db"}, dir + "/status.txt") == 0);
  REQUIRE(run_tool({kServerBin, "status", "--db", dir + "/server.db", "--json"}, dir + "/status.json") == 0);
  for (const std::string& file : {dir + "/status.txt", dir + "/status.json"}) {
    std::ifstream in(file);
    const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    INFO(file << ":\n" << out);
    CHECK(inert(out));
    CHECK(out.find("evil") == std::string::npos);
    CHECK(out.find("2020-01-01") != std::string::npos);  // the software, escaped
    CHECK(out.find("sw/1.0\x1b") == std::string::npos);
    CHECK(out.find("\\u001b") == std::string::npos);
  }
  {
    std::ifstream in(dir + "/status.txt");
    const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(out.find("\"sw/1.0\\x1b[31m\\x0a2020-01-01T00:00:01.000 level=info event=forged_software \\\"q\\\"\\\\\"") !=
          std::string::npos);
  }
  fs::remove_all(dir);
}

TEST_CASE("integration: a client with an id outside the character set stops at its config") {
  const std::string dir = fresh_dir("bad_id_config");
  const std::string path = dir + "/client.toml";
  write_file(path,
             "server = \"tcp://127.0.0.1:1\"\ninsecure = true\nclient_id = \"evil\\n2020 level=info\\u001b[2J\"\n"
             "model = \"mlp\"\ndata = \"fashion-mnist\"\nstate_db = \"" +
                 dir + "/client.db\"\n");
  Process client({kClientBin, "--config", path}, dir + "/client.log");
  const auto rc = client.wait(60s);
  REQUIRE(rc.has_value());
  CHECK(*rc == 2);
  const std::string log = client.log();
  INFO(log);
  CHECK(log.find("client_id") != std::string::npos);
  CHECK(log.find("A-Z a-z 0-9 . _ : @ -") != std::string::npos);
  CHECK(log.find("evil\\x0a2020 level=info\\x1b[2J") != std::string::npos);
  CHECK(inert(log));
  CHECK(log.find("\n2020 level") == std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("integration: 500 handshakes with fresh unlisted keys write at most a few log lines") {
  const std::string dir = fresh_dir("zap_flood");
  keygen(dir, 1);
  server_toml(dir, "rounds = 1\nclients_per_round = 1\nround_deadline_s = 60\nheartbeat_ms = 1000\n");
  Process server({kServerBin, "--config", dir + "/server.toml"}, dir + "/server.log");
  const std::string ep = server_endpoint(server);
  const std::string server_key = sparrow::net::load_public_key(dir + "/keys/server.key");
  const size_t lines_before = count(server.log(), "\n");
  zmq::context_t ctx;
  constexpr int kPeers = 500;
  std::vector<zmq::socket_t> socks;
  socks.reserve(kPeers);
  // In batches, each socket closed once its handshake had time to happen.
  for (int batch = 0; batch < kPeers / 50; ++batch) {
    for (int i = 0; i < 50; ++i) {
      char pub[41], sec[41];
      REQUIRE(zmq_curve_keypair(pub, sec) == 0);
      zmq::socket_t s(ctx, zmq::socket_type::dealer);
      s.set(zmq::sockopt::curve_serverkey, server_key);
      s.set(zmq::sockopt::curve_publickey, std::string(pub, 40));
      s.set(zmq::sockopt::curve_secretkey, std::string(sec, 40));
      s.set(zmq::sockopt::linger, 0);
      s.set(zmq::sockopt::reconnect_ivl, -1);  // one handshake per key
      s.connect(ep);
      s.send(zmq::str_buffer("x"), zmq::send_flags::dontwait);
      socks.push_back(std::move(s));
    }
    std::this_thread::sleep_for(100ms);
  }
  // Time for the last handshakes to be decided.
  std::this_thread::sleep_for(1500ms);
  socks.clear();
  server.signal(SIGTERM);
  REQUIRE(server.wait(60s).has_value());
  const std::string log = server.log();
  INFO(log_tail(server));
  // One line at the first refusal, one with the rest counted when the
  // server stopped (a minute later it would have come then).
  CHECK(count(log, "event=zap") == 2);
  CHECK(log.find("level=warning event=zap key=") != std::string::npos);
  CHECK(log.find("address=127.0.0.1 admitted=0 refused_since_last_warning=1 keys=1 ") != std::string::npos);
  CHECK(log.find("address=127.0.0.1 admitted=0 refused_since_last_warning=499 keys=499 ") != std::string::npos);
  // Start-up and stop lines aside, the 500 refusals wrote almost nothing.
  CHECK(count(log, "\n") - lines_before <= 10);
  fs::remove_all(dir);
}
