// The dashboard's building blocks: the Board's JSON and Prometheus renderings,
// address parsing, and the HTTP endpoint against well-formed, malformed,
// oversized, slow and unauthorised requests (raw sockets, tests/http_client.h).
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "monitor/board.h"
#include "monitor/http.h"
#include "monitor/page.h"
#include "tests/http_client.h"

namespace {

using namespace sparrow::monitor;
using namespace sparrow::testing;
namespace fs = std::filesystem;

RoundPoint point(int64_t r, double acc) {
  RoundPoint p;
  p.round = r;
  p.finished = 1.7e9 + static_cast<double>(r);
  p.duration_s = 0.5;
  p.accuracy = acc;
  p.loss = std::isnan(acc) ? NAN : 1.0 - acc;
  p.train_loss = 0.25;
  p.bytes_up = 1000 * static_cast<uint64_t>(r);
  p.bytes_down = 4000;
  p.selected = 3;
  p.accepted = 2;
  p.rejected = 1;
  p.dropped = 1;
  p.epsilon = NAN;
  return p;
}

std::shared_ptr<Board> sample_board() {
  auto b = std::make_shared<Board>();
  RunInfo info;
  info.program = "sparrow-server";
  info.run_id = "run-\"x\"";
  info.model = "mlp";
  info.config = "model = \"mlp\"\n</script><b>";
  info.rounds_total = 10;
  info.started = 1.7e9;
  b->set_run(info);
  b->add_round(point(2, NAN));
  b->add_round(point(1, 0.5));
  b->add_round(point(3, 0.75));
  std::vector<ClientInfo> cs;
  for (int i = 0; i < 5; ++i)
    cs.push_back({"c" + std::to_string(i), i % 2 == 0, 100.0 + i, i, 10u * static_cast<uint64_t>(i), 20, 60});
  b->set_clients(cs);
  b->update_progress([](Progress& p) {
    p.round = 4;
    p.phase = "training";
    p.selected = 3;
    p.received = 1;
    p.deadline = NAN;
  });
  return b;
}

std::string write_token(const std::string& name, const std::string& token) {
  const fs::path p = fs::temp_directory_path() / ("sparrow_monitor_" + name + "_" + std::to_string(::getpid()));
  std::ofstream(p) << token << "\n";
  return p.string();
}

}  // namespace

TEST_CASE("monitor board: rounds in order, since= filters, NaN is null") {
  auto b = sample_board();
  const std::string all = b->rounds_json(0);
  CHECK(all.find("\"round\":1,") < all.find("\"round\":2,"));
  CHECK(all.find("\"round\":2,") < all.find("\"round\":3,"));
  CHECK(all.find("\"accuracy\":null") != std::string::npos);  // round 2 was not evaluated
  const std::string later = b->rounds_json(2);
  CHECK(later.find("\"round\":3,") != std::string::npos);
  CHECK(later.find("\"round\":1,") == std::string::npos);
  CHECK(later.find("\"round\":2,") == std::string::npos);
  CHECK(b->rounds_json(3) == "{\"rounds\":[]}");
  // A round published again (a resumed run) replaces the old point.
  b->add_round(point(2, 0.6));
  CHECK(b->rounds().size() == 3);
  CHECK(b->rounds()[1].accuracy == doctest::Approx(0.6));
  // Strings are escaped.
  const std::string run = b->run_json();
  CHECK(run.find("\"run_id\":\"run-\\\"x\\\"\"") != std::string::npos);
  CHECK(run.find("\\n</script>") != std::string::npos);
}

TEST_CASE("monitor board: clients most recently seen first, limited") {
  auto b = sample_board();
  const std::string j = b->clients_json(2);
  CHECK(j.rfind("{\"total\":5,\"connected\":3,", 0) == 0);
  CHECK(j.find("\"id\":\"c4\"") < j.find("\"id\":\"c3\""));
  CHECK(j.find("\"id\":\"c2\"") == std::string::npos);
  CHECK(j.find("\"bytes_up\":40") != std::string::npos);
}

TEST_CASE("monitor board: Prometheus exposition") {
  auto b = sample_board();
  const std::string m = b->prometheus();
  CHECK(m.find("# TYPE sparrow_rounds_completed gauge\nsparrow_rounds_completed 3\n") != std::string::npos);
  CHECK(m.find("sparrow_accuracy 0.75\n") != std::string::npos);
  CHECK(m.find("sparrow_uplink_bytes_total 6000\n") != std::string::npos);
  CHECK(m.find("sparrow_updates_dropped_total 3\n") != std::string::npos);
  CHECK(m.find("sparrow_round_updates_received 1\n") != std::string::npos);
  CHECK(m.find("sparrow_clients_known 5\n") != std::string::npos);
  CHECK(m.find("sparrow_info{program=\"sparrow-server\",run_id=\"run-\\\"x\\\"\",model=\"mlp\"} 1\n") !=
        std::string::npos);
  CHECK(m.find("sparrow_dp_epsilon") == std::string::npos);  // no DP: not exported
  Totals t;
  t.bytes_in = 123;
  t.rejected["malformed"] = 7;
  b->set_totals(t);
  const std::string m2 = b->prometheus();
  CHECK(m2.find("sparrow_wire_received_bytes_total 123\n") != std::string::npos);
  CHECK(m2.find("sparrow_messages_rejected_total{reason=\"malformed\"} 7\n") != std::string::npos);
  // Every sample line belongs to a family declared with # TYPE before it.
  std::istringstream in(m2);
  std::string line, family;
  while (std::getline(in, line)) {
    if (line.rfind("# TYPE ", 0) == 0) {
      family = line.substr(7, line.find(' ', 7) - 7);
    } else if (line[0] != '#') {
      INFO(line);
      CHECK(line.rfind(family, 0) == 0);
    }
  }
}

TEST_CASE("monitor http: addresses") {
  CHECK(parse_http_address("127.0.0.1:8080").loopback);
  CHECK(parse_http_address("127.3.2.1:0").port == 0);
  CHECK(parse_http_address("localhost:80").loopback);
  CHECK(parse_http_address("[::1]:8080").loopback);
  CHECK(parse_http_address("[::1]:8080").host == "::1");
  CHECK_FALSE(parse_http_address("0.0.0.0:8080").loopback);
  CHECK_FALSE(parse_http_address("10.1.2.3:8080").loopback);
  for (const char* bad : {"", "8080", "127.0.0.1", "127.0.0.1:", ":8080", "127.0.0.1:99999", "127.0.0.1:80x",
                          "::1:8080", "[::1]8080", "127.0.0.1:-1"}) {
    INFO(bad);
    CHECK_THROWS_AS(parse_http_address(bad), sparrow::ConfigError);
  }
}

TEST_CASE("monitor http: pages, API and errors on loopback") {
  auto board = sample_board();
  HttpEndpoint ep("127.0.0.1:0", "", board);
  const int port = ep.port();
  REQUIRE(port > 0);
  CHECK(ep.url() == "http://127.0.0.1:" + std::to_string(port) + "/");

  const std::string page = http_get(port, "/");
  CHECK(http_status(page) == 200);
  CHECK(page.find("Content-Type: text/html") != std::string::npos);
  CHECK(page.find("Chart.js v3.9.1") != std::string::npos);  // inlined: nothing to fetch
  CHECK(page.find("/*SPARROW_") == std::string::npos);       // every marker replaced
  CHECK(page.find("src=\"http") == std::string::npos);
  CHECK(page.find("Content-Security-Policy") != std::string::npos);

  const std::string metrics = http_get(port, "/metrics");
  CHECK(http_status(metrics) == 200);
  CHECK(http_body(metrics) == board->prometheus());
  CHECK(http_body(http_get(port, "/api/rounds?since=2")) == board->rounds_json(2));
  CHECK(http_body(http_get(port, "/api/clients?limit=3")).find("\"total\":5") != std::string::npos);
  CHECK(http_body(http_get(port, "/api/progress")).find("\"phase\":\"training\"") != std::string::npos);
  CHECK(http_body(http_get(port, "/api/run")).find("\"program\":\"sparrow-server\"") != std::string::npos);

  // Errors: each answered, none fatal.
  CHECK(http_status(http_get(port, "/nope")) == 404);
  CHECK(http_status(http_get(port, "/api/rounds?since=abc")) == 400);
  CHECK(http_status(http_get(port, "/api/rounds?since=-1")) == 400);
  CHECK(http_status(http_get(port, "/api/clients?limit=0")) == 400);
  CHECK(http_status(http_get(port, "/api/clients?limit=99999999999999999999")) == 400);
  CHECK(http_status(http_raw(port,
                             "POST /api/run HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n"
                             "Connection: close\r\n\r\nhi")) == 413);  // no bodies
  CHECK(http_status(http_raw(port, "POST /api/run HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n")) == 405);
  CHECK(http_status(http_raw(port, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n")) == 413);
  CHECK(http_status(http_raw(port, "DELETE / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")) == 405);
  CHECK(http_status(http_raw(port, "garbage\r\n\r\n")) == 400);
  CHECK(http_status(http_raw(port, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + std::string(100000, 'x') +
                                       "\r\nConnection: close\r\n\r\n")) == 431);
  CHECK(http_status(http_get(port, "/" + std::string(20000, 'a'))) == 431);
  // One endless header line: answered 431 after 8 KB, never buffered whole.
  {
    const int fd = http_connect(port);
    REQUIRE(fd >= 0);
    const std::string start = "GET / HTTP/1.1\r\nX-Endless: ";
    ::send(fd, start.data(), start.size(), MSG_NOSIGNAL);
    const std::string chunk(65536, 'x');
    size_t sent = 0;
    for (int i = 0; i < 64; ++i) {  // up to 4 MB, until the server stops reading
      const ssize_t k = ::send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k <= 0) break;
      sent += static_cast<size_t>(k);
    }
    std::string got;
    char buf[4096];
    for (int i = 0; i < 200; ++i) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 5000) != 1) break;
      const ssize_t k = ::recv(fd, buf, sizeof buf, 0);
      if (k <= 0) break;
      got.append(buf, static_cast<size_t>(k));
    }
    CHECK(http_status(got) == 431);
    ::close(fd);
  }
  // A peer trickling its request a byte at a time: cut off at the 3 s head deadline.
  {
    const int fd = http_connect(port);
    REQUIRE(fd >= 0);
    const auto t0 = std::chrono::steady_clock::now();
    std::string got;
    for (char c : std::string("GET /api/run HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaa")) {
      if (::send(fd, &c, 1, MSG_NOSIGNAL) != 1) break;
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 300) == 1) break;  // the server answered
    }
    char buf[4096];
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 5000) == 1) {
      const ssize_t k = ::recv(fd, buf, sizeof buf, 0);
      if (k > 0) got.assign(buf, static_cast<size_t>(k));
    }
    CHECK(http_status(got) == 408);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(6));
    ::close(fd);
  }
  // Another site's page cannot read a loopback dashboard through DNS rebinding.
  CHECK(http_status(http_get(port, "/api/run", "Host: evil.example:80\r\n")) == 403);
  CHECK(http_status(http_get(port, "/api/run", "Host: localhost:" + std::to_string(port) + "\r\n")) == 200);

  // Slow clients: connections that never finish a request are cut off after
  // the read timeout (3 s); meanwhile requests are answered once a thread is
  // free, and the board's writers (the round loop) never wait on HTTP.
  std::vector<int> slow;
  for (int i = 0; i < 12; ++i) {
    const int fd = http_connect(port);
    REQUIRE(fd >= 0);
    const std::string half = "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n";  // never ends
    CHECK(::send(fd, half.data(), half.size(), MSG_NOSIGNAL) > 0);
    slow.push_back(fd);
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 1000; ++i) board->update_progress([](Progress& p) { p.received = 2; });
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(100));
  const std::string during = http_raw(
      port, "GET /api/progress HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", std::chrono::seconds(30));
  CHECK(http_status(during) == 200);
  CHECK(http_body(during).find("\"received\":2") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(15));
  // Each slow connection was closed by the server (EOF, possibly after a 408/400).
  for (int fd : slow) {
    ssize_t n = 1;
    char buf[256];
    for (int k = 0; k < 100 && n > 0; ++k) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 10000) != 1) break;
      n = ::recv(fd, buf, sizeof buf, 0);
    }
    CHECK(n == 0);
    ::close(fd);
  }
  CHECK(http_status(http_get(port, "/metrics")) == 200);
}

TEST_CASE("monitor http: a second endpoint on the same port is refused") {
  auto board = sample_board();
  HttpEndpoint a("127.0.0.1:0", "", board);
  CHECK_THROWS_AS(HttpEndpoint("127.0.0.1:" + std::to_string(a.port()), "", board), sparrow::ConfigError);
  CHECK(http_status(http_get(a.port(), "/api/run")) == 200);
}

TEST_CASE("monitor http: a token is needed off loopback and checked") {
  auto board = sample_board();
  // Not loopback without a token: refused before anything binds.
  CHECK_THROWS_WITH_AS(HttpEndpoint("0.0.0.0:0", "", board), doctest::Contains("token"), sparrow::ConfigError);
  CHECK_THROWS_AS(HttpEndpoint("0.0.0.0:0", write_token("short", "abc"), board), sparrow::ConfigError);
  CHECK_THROWS_AS(HttpEndpoint("0.0.0.0:0", "/nonexistent/token", board), sparrow::ConfigError);
  const std::string token = "s3cret-token-0123456789";
  HttpEndpoint ep("0.0.0.0:0", write_token("good", token), board);
  const int port = ep.port();
  CHECK(http_status(http_get(port, "/api/run")) == 401);
  CHECK(http_status(http_get(port, "/")) == 401);
  CHECK(http_status(http_get(port, "/api/run", "Authorization: Bearer wrong-token-0123456789\r\n")) == 401);
  CHECK(http_status(http_get(port, "/api/run", "Authorization: Bearer " + token + "\r\n")) == 200);
  CHECK(http_status(http_get(port, "/metrics", "Authorization: Bearer " + token + "\r\n")) == 200);
  CHECK(http_status(http_get(port, "/?token=" + token)) == 200);  // opening the page in a browser
  // With a token, any Host is fine (it is how a remote browser addresses it).
  CHECK(http_status(http_get(port, "/api/run", "Host: dash.example\r\nAuthorization: Bearer " + token + "\r\n")) ==
        200);
}

TEST_CASE("monitor page: report data is inlined and cannot close its script element") {
  ReportRun r;
  r.name = "run_a";
  r.run.program = "sparrow-sim";
  r.run.config = "note = \"</script><script>alert(1)</script>\"\n# <!--<script>\n";
  r.rounds = {point(1, 0.5), point(2, NAN)};
  const std::string page = report_page({r});
  CHECK(page.find("window.SPARROW_STATIC = {") != std::string::npos);
  CHECK(page.find("\"name\":\"run_a\"") != std::string::npos);
  CHECK(page.find("</script><script>alert(1)") == std::string::npos);
  CHECK(page.find("\\u003c/script>\\u003cscript>alert(1)\\u003c/script>") != std::string::npos);
  CHECK(page.find("<!--") == std::string::npos);  // "<!--" in a config would change where the element ends
  CHECK(page.find("/*SPARROW_") == std::string::npos);
}

TEST_CASE("monitor board: progress says what a round needs, headline figures, and a finished run has no deadline") {
  auto b = sample_board();
  RunInfo info = b->run();
  info.min_clients = 2;
  info.quorum = 2;
  info.clients_per_round = 3;
  b->set_run(info);
  // Waiting: the clients a round needs to start are in the API, for the page's wording.
  b->update_progress([](Progress& p) {
    p.phase = "waiting";
    p.selected = p.received = 0;
    p.clients_connected = 1;
  });
  std::string p = b->progress_json();
  CHECK(p.find("\"min_clients\":2,\"quorum\":2,") != std::string::npos);
  CHECK(b->run_json().find("\"min_clients\":2,\"quorum\":2,\"clients_per_round\":3,") != std::string::npos);
  // Headline figures from the rounds: accuracy of round 3 (round 2 was not
  // evaluated), bytes each way, ETA = mean round duration x rounds left.
  CHECK(p.find("\"accuracy\":0.75,\"accuracy_round\":3,") != std::string::npos);
  CHECK(p.find("\"bytes_up_total\":6000,\"bytes_down_total\":12000,") != std::string::npos);
  CHECK(p.find("\"eta_s\":3.5,") != std::string::npos);  // 0.5 s x (10 - 3) rounds
  // Training with a deadline: the deadline is given.
  b->update_progress([](Progress& p) {
    p.phase = "training";
    p.deadline = 1.8e9;
  });
  CHECK(b->progress_json().find("\"deadline\":1800000000,") != std::string::npos);
  // Done: no deadline left over from the last round, and no time left.
  b->update_progress([](Progress& p) {
    p.phase = "done";
    p.rounds_completed = 10;
  });
  p = b->progress_json();
  CHECK(p.find("\"deadline\":null,") != std::string::npos);
  CHECK(p.find("\"eta_s\":0,") != std::string::npos);
  // Stopped: no deadline, no ETA.
  b->update_progress([](Progress& p) { p.phase = "stopped"; });
  p = b->progress_json();
  CHECK(p.find("\"deadline\":null,") != std::string::npos);
  CHECK(p.find("\"eta_s\":null,") != std::string::npos);
  // Before any round: nothing to estimate from.
  Board empty;
  CHECK(empty.progress_json().find("\"accuracy\":null,\"accuracy_round\":0,") != std::string::npos);
  CHECK(empty.progress_json().find("\"eta_s\":null,") != std::string::npos);
}

TEST_CASE("monitor page: the progress wording, headline figures and runs table columns are on the page") {
  const std::string page = dashboard_page();
  // The words the page builds its progress line from, and the headline elements.
  for (const char* part :
       {"needed to start (min_clients)", "close the round at its deadline", "Run complete: ", "clients trained",
        "id=\"headline-accuracy\"", "id=\"headline-eta\"", "id=\"headline-up\"", "id=\"headline-down\"",
        "<th>compression</th><th>downlink</th>", "<th class=\"num\">total bytes</th><th>differing settings</th>",
        "id=\"chart-bytes_round\"", "id=\"chart-acc_total\""})
    CHECK_MESSAGE(page.find(part) != std::string::npos, part);
  // The deadline is shown only while a round trains: never "s left" once done.
  const size_t done = page.find("setText('progress-deadline', 'done')");
  const size_t left = page.find("' s left in this round'");
  REQUIRE(done != std::string::npos);
  REQUIRE(left != std::string::npos);
  CHECK(done < left);
}
