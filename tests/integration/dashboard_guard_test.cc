// Issue 47, items 2 and 6, against the real sparrow-server on loopback: no
// port of the server takes unbounded memory or lets idle connections hold an
// honest dashboard request, and no Error a peer receives carries the server's
// assertion text or a source path (docs/security.md).
#include "tests/integration/fixtures.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdio>
#include <set>

#include "core/model_digest.h"
#include "tests/http_client.h"

namespace sparrow::testing::integ {
namespace {

using sparrow::testing::http_get;
using sparrow::testing::http_status;

// A line of /proc/PID/status ("VmRSS", "VmHWM") in bytes; 0 when missing.
uint64_t proc_status_bytes(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1)) * 1024;
  return 0;
}

// The TCP ports `pid` listens on: its socket descriptors' inodes matched
// against the kernel's tables of listening sockets (state 0A).
std::set<int> listening_ports(pid_t pid) {
  std::set<std::string> inodes;
  const std::string proc = "/proc/" + std::to_string(pid);
  for (const auto& entry : fs::directory_iterator(proc + "/fd")) {
    std::error_code ec;
    const std::string target = fs::read_symlink(entry.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::set<int> ports;
  for (const char* table : {"/net/tcp", "/net/tcp6"}) {
    std::ifstream in(proc + table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream row(line);
      std::string slot, local, remote, state, queues, timer, retr, uid, timeout, inode;
      row >> slot >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (state == "0A" && inodes.count(inode))
        ports.insert(std::stoi(local.substr(local.rfind(':') + 1), nullptr, 16));
    }
  }
  return ports;
}

int connect_from(const std::string& source, int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source.c_str(), &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Streams up to `total` bytes to 127.0.0.1:port as one endless HTTP header
// line (also junk to a ZeroMQ port) from one 1 MB buffer, until the server
// closes or stops reading for 2 s. Returns the bytes it took.
uint64_t flood(int port, uint64_t total) {
  const int fd = sparrow::testing::http_connect(port);
  if (fd < 0) return 0;
  const std::string start = "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Flood: ";
  ::send(fd, start.data(), start.size(), MSG_NOSIGNAL);
  const std::string chunk(1u << 20, 'a');
  uint64_t sent = 0;
  while (sent < total) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, 2000) != 1 || (p.revents & (POLLERR | POLLHUP))) break;
    const ssize_t k = ::send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (k <= 0) break;
    sent += static_cast<uint64_t>(k);
  }
  ::close(fd);
  return sent;
}

struct DashboardServer {
  std::unique_ptr<Process> server;
  std::string endpoint;
  int http_port = 0;
};

DashboardServer start_dashboard_server(const std::string& dir) {
  keygen(dir, 1);
  server_toml(dir, "rounds = 1\nclients_per_round = 1\nround_deadline_s = 60\n");
  DashboardServer s;
  s.server = std::make_unique<Process>(
      std::vector<std::string>{kServerBin, "--config", dir + "/server.toml", "--http", "127.0.0.1:0"},
      dir + "/server.log");
  s.endpoint = server_endpoint(*s.server);
  REQUIRE(s.server->wait_for_log("event=http url=", 30s));
  std::smatch m;
  const std::string log = s.server->log();
  REQUIRE(std::regex_search(log, m, std::regex("event=http url=http://127.0.0.1:(\\d+)/")));
  s.http_port = std::stoi(m[1]);
  return s;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("dashboard guard: 400 MB to every port the server listens on leaves its memory near idle") {
  const std::string dir = fresh_dir("guard_flood");
  DashboardServer s = start_dashboard_server(dir);
  INFO(log_tail(*s.server));
  REQUIRE(http_status(http_get(s.http_port, "/api/progress")) == 200);
  std::this_thread::sleep_for(300ms);
  const pid_t pid = s.server->pid();
  const uint64_t idle = proc_status_bytes(pid, "VmRSS");
  const uint64_t peak_before = proc_status_bytes(pid, "VmHWM");
  REQUIRE(idle > 0);
  const int zmq_port = std::stoi(s.endpoint.substr(s.endpoint.rfind(':') + 1));
  // The ZeroMQ endpoint and the dashboard, and no other listener (a private
  // port would take requests without the guard's limits).
  const std::set<int> ports = listening_ports(pid);
  CHECK(ports == std::set<int>{zmq_port, s.http_port});
  constexpr uint64_t kFlood = 400ull << 20;
  constexpr uint64_t kSlack = 64ull << 20;
  for (const int port : ports) {
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t sent = flood(port, kFlood);
    const double took = seconds_since(t0);
    std::this_thread::sleep_for(200ms);
    const uint64_t rss = proc_status_bytes(pid, "VmRSS");
    const uint64_t peak = proc_status_bytes(pid, "VmHWM");
    const std::string what = port == zmq_port ? "ZeroMQ" : port == s.http_port ? "dashboard" : "other";
    INFO("port " << port << " (" << what << "): took " << sent / 1e6 << " MB in " << took << " s; RSS idle "
                 << idle / 1e6 << " MB, after " << rss / 1e6 << " MB, peak " << peak / 1e6 << " MB ("
                 << peak_before / 1e6 << " MB before)");
    MESSAGE("port " << port << " (" << what << "): took " << sent / 1e6 << " MB; RSS idle " << idle / 1e6
                    << " MB, after " << rss / 1e6 << " MB, peak " << peak / 1e6 << " MB");
    CHECK(rss < idle + kSlack);
    CHECK(peak < std::max(peak_before, idle + kSlack));
  }
  // A 4 KB request asking for the page once per range (1,200 ranges): httplib
  // would build a 277 MB answer; the guard drops Range headers.
  {
    std::string ranges = "0-";
    for (int i = 1; i < 1200; ++i) ranges += ",0-";
    const std::string r = sparrow::testing::http_get(s.http_port, "/", "Range: bytes=" + ranges + "\r\n");
    CHECK(http_status(r) == 200);
    CHECK(r.size() < (1u << 20));
    const uint64_t rss = proc_status_bytes(pid, "VmRSS");
    INFO("RSS after the range request " << rss / 1e6 << " MB");
    CHECK(rss < idle + kSlack);
  }
  CHECK(s.server->running());
  CHECK(http_status(http_get(s.http_port, "/api/run")) == 200);
  s.server->signal(SIGTERM);
  CHECK(s.server->wait(30s).has_value());
  fs::remove_all(dir);
}

TEST_CASE("dashboard guard: an honest request is answered within 1 s while 200 idle connections are open") {
  const std::string dir = fresh_dir("guard_idle");
  DashboardServer s = start_dashboard_server(dir);
  INFO(log_tail(*s.server));
  // 200 connections: half from 127.0.0.1 (the honest client's own address),
  // half from 100 other loopback addresses; every other one sends part of a
  // request head and then trickles a byte at a time.
  std::vector<int> idle;
  std::vector<int> trickling;
  for (int i = 0; i < 200; ++i) {
    const int fd = i % 2 == 0 ? connect_from("127.0.0.1", s.http_port)
                              : connect_from("127.0.3." + std::to_string(1 + i / 2), s.http_port);
    REQUIRE(fd >= 0);
    if (i % 4 < 2) {
      idle.push_back(fd);
    } else {
      const std::string part = "GET /api/run HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
      ::send(fd, part.data(), part.size(), MSG_NOSIGNAL);
      trickling.push_back(fd);
    }
  }
  double worst = 0;
  for (int round = 0; round < 5; ++round) {
    for (const int fd : trickling) ::send(fd, "a", 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string r = sparrow::testing::http_raw(
        s.http_port, "GET /api/progress HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", 5s);
    const double took = seconds_since(t0);
    worst = std::max(worst, took);
    INFO("request " << round << " took " << took << " s");
    CHECK(http_status(r) == 200);
    CHECK(took < 1.0);
    std::this_thread::sleep_for(100ms);
  }
  MESSAGE("slowest honest request with 200 idle connections open: " << worst * 1000 << " ms");
  for (const int fd : idle) ::close(fd);
  for (const int fd : trickling) ::close(fd);
  // 16 connections from the honest client's address that ask for the page
  // and never read it (a 4 KB receive buffer): the per-peer cap is full of
  // answered connections, which a new one may close.
  std::vector<int> not_reading;
  for (int i = 0; i < 16; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    const int small = 4096;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(s.http_port));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0);
    const std::string get = "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    ::send(fd, get.data(), get.size(), MSG_NOSIGNAL);
    not_reading.push_back(fd);
  }
  std::this_thread::sleep_for(1500ms);
  {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string r = sparrow::testing::http_raw(
        s.http_port, "GET /api/progress HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", 5s);
    const double took = seconds_since(t0);
    INFO("with 16 connections not reading their answers: " << took << " s");
    CHECK(http_status(r) == 200);
    CHECK(took < 1.0);
  }
  for (const int fd : not_reading) ::close(fd);
  CHECK(s.server->running());
  s.server->signal(SIGTERM);
  CHECK(s.server->wait(30s).has_value());
  fs::remove_all(dir);
}

namespace {

// A CurveZMQ DEALER with client key `i` (1-based) that says Hello as "c<i>".
class Peer {
 public:
  Peer(const std::string& endpoint, const std::string& dir, int i) : id_("c" + std::to_string(i)) {
    sock_ = zmq::socket_t(ctx_, zmq::socket_type::dealer);
    sparrow::net::make_curve_client(
        sock_, sparrow::net::load_keypair(dir + "/keys/client" + std::to_string(i) + ".key_secret"),
        sparrow::net::load_public_key(dir + "/keys/server.key"));
    sock_.set(zmq::sockopt::linger, 0);
    sock_.connect(endpoint);
  }
  const std::string& id() const { return id_; }

  void send_bytes(const std::string& bytes) { REQUIRE(sock_.send(zmq::buffer(bytes), zmq::send_flags::none)); }
  void send(const sparrow::wire::Message& m) { send_bytes(sparrow::wire::serialize(m)); }

  sparrow::wire::Hello hello(uint64_t digest) const {
    sparrow::wire::Hello h;
    h.client_id = id_;
    h.num_samples = 600;
    h.model = "mlp";
    h.model_digest = digest;
    h.software = "integration-test";
    return h;
  }

  // Every message within `quiet` of the last one (at most `limit` in all);
  // Error texts go to `errors`. The Task, when one came, to `task`.
  void collect(std::vector<std::string>* errors, std::optional<sparrow::wire::Task>* task,
               std::chrono::milliseconds quiet, std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < until) {
      std::optional<sparrow::wire::Message> m;
      zmq::pollitem_t item{static_cast<void*>(sock_), 0, ZMQ_POLLIN, 0};
      if (zmq::poll(&item, 1, quiet) <= 0) return;
      zmq::message_t frame;
      if (!sock_.recv(frame, zmq::recv_flags::dontwait)) continue;
      try {
        m = sparrow::wire::parse(frame.data(), frame.size());
      } catch (const std::exception& e) {
        FAIL_CHECK("the server sent a frame that does not parse: " << e.what());
        continue;
      }
      if (auto* e = std::get_if<sparrow::wire::ErrorBody>(&m->body)) errors->push_back(e->message);
      if (auto* t = std::get_if<sparrow::wire::Task>(&m->body)) *task = *t;
    }
  }

 private:
  zmq::context_t ctx_;
  zmq::socket_t sock_;
  std::string id_;
};

// Byte flips and truncations of `good`, from a fixed seed: the cheap part of
// the wire fuzzer's work, run against the real server.
std::vector<std::string> mutations(const std::string& good, uint64_t seed, int count) {
  std::vector<std::string> out;
  uint64_t x = seed;
  auto next = [&x] {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (int i = 0; i < count; ++i) {
    std::string m = good;
    if (i % 5 == 4) {
      m.resize(next() % good.size());
    } else {
      const int flips = 1 + static_cast<int>(next() % 3);
      // Mostly the first 256 bytes: the header, vtables and offsets.
      for (int f = 0; f < flips; ++f) {
        const size_t span = next() % 4 == 0 ? good.size() : std::min<size_t>(good.size(), 256);
        m[next() % span] ^= static_cast<char>(1 + next() % 255);
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

// A source file reference ("secagg/secagg.cc:672", "/src/x.h") or the
// text SPARROW_CHECK appends.
bool looks_internal(const std::string& text) {
  static const std::regex kSourceRef("\\w\\.(cc|cpp|cu|cuh|h|hpp)(:[0-9]+|\\]|\\)|\\s|$)");
  const std::string source_dir = fs::path(kBin).parent_path().parent_path().string();
  return text.find(" failed at ") != std::string::npos || std::regex_search(text, kSourceRef) ||
         (source_dir.size() > 1 && text.find(source_dir) != std::string::npos);
}

}  // namespace

TEST_CASE("wire errors: no Error a peer receives carries assertion text or a source path") {
  using sparrow::wire::SecAggStage;
  const std::string dir = fresh_dir("wire_errors");
  keygen(dir, 3);
  server_toml(dir,
              "rounds = 1\nclients_per_round = 3\nquorum = 3\nround_deadline_s = 60\nmax_message_mb = 2\n"
              "heartbeat_ms = 1000\nsecagg = \"secagg+:degree=2,threshold=2\"\n");
  // At --log-level debug checks name their source line, which must stay in the server's own log.
  auto server = std::make_unique<Process>(
      std::vector<std::string>{kServerBin, "--config", dir + "/server.toml", "--log-level", "debug"},
      dir + "/server.log");
  const std::string ep = server_endpoint(*server);
  INFO(log_tail(*server));
  const Weights w0 = initial_weights(1);
  const uint64_t digest = sparrow::core::model_digest(w0);

  std::vector<std::unique_ptr<Peer>> peers;
  for (int i = 1; i <= 3; ++i) peers.push_back(std::make_unique<Peer>(ep, dir, i));
  for (auto& p : peers) p->send(as_message(p->hello(digest)));
  std::vector<std::string> errors;
  std::optional<sparrow::wire::Task> task;
  for (int i = 0; i < 300 && !task; ++i) peers[0]->collect(&errors, &task, 100ms, 200ms);
  REQUIRE(task.has_value());
  REQUIRE(task->secagg.has_value());
  const uint32_t index = task->secagg->index;
  Peer& attacker = *peers[0];

  // SecAgg messages out of turn, and broken ones, during the keys exchange:
  // each trips one of the protocol's checks.
  auto secagg = [&](SecAggStage stage) {
    sparrow::wire::SecAgg m;
    m.round = task->round;
    m.client_id = attacker.id();
    m.stage = stage;
    m.index = index;
    return m;
  };
  for (const SecAggStage stage :
       {SecAggStage::kReveal, SecAggStage::kMasked, SecAggStage::kShares, SecAggStage::kKeys, SecAggStage::kUnmask})
    attacker.send(as_message(secagg(stage)));  // Keys without its keys; a stage clients never send
  {
    sparrow::wire::SecAgg m = secagg(SecAggStage::kReveal);
    m.index = index + 1;  // another client's index
    attacker.send(as_message(m));
  }
  attacker.collect(&errors, &task, 1000ms, 10s);
  size_t secagg_errors = 0;
  for (const auto& e : errors) secagg_errors += e.rfind("secagg:", 0) == 0;
  CHECK(secagg_errors >= 3);

  // The malformed-message attacks (tests/integration/integration_test.cc) and
  // mutations of a valid update, Hello and SecAgg message.
  sparrow::wire::ModelUpdate good;
  good.round = task->round;
  good.client_id = attacker.id();
  good.num_samples = 600;
  for (const auto& [name, t] : w0) good.tensors.push_back({name, dense_f32(at::full_like(t, 0.001f))});
  const std::string good_bytes = sparrow::wire::serialize(as_message(good));
  std::vector<std::string> attacks = {good_bytes.substr(0, good_bytes.size() / 2), good_bytes.substr(0, 3), ""};
  for (size_t pos : {size_t{0}, size_t{4}, size_t{8}, size_t{9}}) {
    std::string bad = good_bytes;
    bad[pos] = static_cast<char>(bad[pos] ^ 0x5a);
    attacks.push_back(bad);
  }
  {
    sparrow::wire::Message m = as_message(good);
    m.major = sparrow::wire::kProtocolMajor + 1;
    attacks.push_back(sparrow::wire::serialize(m));
  }
  for (float bad_value : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    sparrow::wire::ModelUpdate u = good;
    std::memcpy(u.tensors[0].tensor.values.data() + 8, &bad_value, 4);
    attacks.push_back(sparrow::wire::serialize(as_message(u)));
  }
  {
    sparrow::wire::ModelUpdate u = good;
    u.tensors[0].tensor = dense_f32(at::zeros({3}));
    attacks.push_back(sparrow::wire::serialize(as_message(u)));
  }
  {
    sparrow::wire::ModelUpdate u = good;  // out-of-range sparse index
    sparrow::compression::Encoded e;
    e.format = sparrow::compression::Format::kSparse;
    e.shape = {10};
    e.value_type = sparrow::compression::ValueType::kF32;
    e.index_coding = sparrow::compression::IndexCoding::kDeltaVarint;
    e.count = 1;
    e.indices = {10};
    e.values.resize(4);
    u.tensors.back().tensor = e;
    attacks.push_back(sparrow::wire::serialize(as_message(u)));
  }
  for (auto& m : mutations(sparrow::wire::serialize(as_message(secagg(SecAggStage::kKeys))), 1, 60))
    attacks.push_back(std::move(m));
  sparrow::wire::ModelUpdate small = good;  // small enough to mutate cheaply
  small.tensors.resize(1);
  small.tensors[0].tensor = dense_f32(at::ones({4}));
  for (auto& m : mutations(sparrow::wire::serialize(as_message(small)), 2, 60)) attacks.push_back(std::move(m));
  for (auto& m : mutations(sparrow::wire::serialize(as_message(attacker.hello(digest))), 3, 60))
    attacks.push_back(std::move(m));
  for (const std::string& a : attacks) attacker.send_bytes(a);
  attacker.collect(&errors, &task, 1500ms, 20s);
  MESSAGE((attacks.size() + 6) << " attacks, " << errors.size() << " Error replies");
  CHECK(errors.size() >= 20);
  for (const std::string& e : errors) {
    INFO("Error text: " << e);
    CHECK_FALSE(looks_internal(e));
  }
  CHECK(server->running());
  // The detail stays in the server's own log.
  const std::string slog = server->log();
  CHECK(slog.find("event=error_detail") != std::string::npos);
  CHECK(slog.find(" failed at ") != std::string::npos);
  server->signal(SIGTERM);
  CHECK(server->wait(30s).has_value());
  fs::remove_all(dir);
}

}  // namespace sparrow::testing::integ
