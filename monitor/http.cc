#include "monitor/http.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "monitor/page.h"

namespace sparrow::monitor {

namespace {

bool loopback_host(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) == 1) return (ntohl(a.s_addr) >> 24) == 127;
  return false;
}

std::string read_token(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  SPARROW_CHECK_T(ConfigError, in, "http token file " << path << " cannot be read");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string t = ss.str();
  while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.pop_back();
  while (!t.empty() && std::isspace(static_cast<unsigned char>(t.front()))) t.erase(t.begin());
  SPARROW_CHECK_T(
      ConfigError, t.size() >= 16,
      "http token file " << path << " must hold a token of at least 16 characters (it has " << t.size() << ")");
  for (char c : t)
    SPARROW_CHECK_T(ConfigError, c > 0x20 && c < 0x7f,
                    "http token file " << path << ": the token must be printable ASCII without spaces");
  return t;
}

bool same_secret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char d = 0;
  for (size_t i = 0; i < a.size(); ++i) d |= static_cast<unsigned char>(a[i] ^ b[i]);
  return d == 0;
}

// The host part of a Host header ("127.0.0.1:8080", "[::1]:8080", "localhost").
std::string host_of(const std::string& h) {
  if (!h.empty() && h.front() == '[') {
    const size_t close = h.find(']');
    return close == std::string::npos ? h : h.substr(1, close - 1);
  }
  const size_t colon = h.rfind(':');
  return colon == std::string::npos ? h : h.substr(0, colon);
}

bool parse_count(const std::string& s, int64_t lo, int64_t hi, int64_t* out) {
  if (s.empty() || s.size() > 18) return false;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  if (v < lo || v > hi) return false;
  *out = v;
  return true;
}

// ---- the guard ------------------------------------------------------------------
//
// cpp-httplib 0.11.4 (Debian's) reads a request line by line into a buffer
// that grows without bound, its timeout applies to each read, not to the
// request, and it holds a thread per connection: one endless header line
// would take the process's memory, and a few peers trickling a byte every two
// seconds would take every thread. So httplib never sees a socket. The guard
// owns the one listening socket and every connection, in one thread, with
// non-blocking I/O: it reads each request head under hard limits (8 KB, 3 s
// in all), answers 431 / 408 / 413 itself, and hands a complete head to a
// worker, which runs httplib's request handling on that head in memory
// (process_request on a Stream over a string: routing, the handlers, the
// answer's headers) and gives the answer back as bytes; the guard sends them
// under a deadline. No listener exists besides the public one, so no local
// process can reach httplib without these limits.
//
// Caps (docs/monitoring.md): at most kMaxConnections open connections, and
// kMaxPerPeer from one peer address (an IPv6 peer: its /64). A connection
// beyond a cap closes the oldest one of that peer (or, over the total, of
// anyone) that is still sending its head or has been reading its answer for
// over a second, so idle, trickling and non-reading connections cannot keep
// an honest request out: it is served as soon as it arrives. When none can be
// closed (all are being answered), the new connection is refused.

constexpr size_t kMaxHead = 8192;
constexpr auto kHeadDeadline = std::chrono::seconds(3);
constexpr auto kGuardAnswerDeadline = std::chrono::seconds(1);
constexpr auto kAnswerDeadline = std::chrono::seconds(10);
constexpr auto kLinger = std::chrono::milliseconds(500);
constexpr size_t kMaxDrain = 256u << 10;
constexpr size_t kMaxConnections = 128;  // descriptors: the ZeroMQ side needs the rest
constexpr size_t kMaxPerPeer = 16;
constexpr size_t kWorkers = 2;  // handlers only copy from the Board
// Answers waiting to be sent, all connections together. Beyond it, complete
// heads wait for answers to drain (each within kAnswerDeadline). A single
// answer is about the page (~250 KB) or /api/clients?limit=10000 at most;
// one over kMaxAnswer is replaced by a 500.
constexpr size_t kMaxAnswerBytes = 32u << 20;
constexpr size_t kMaxAnswer = 16u << 20;
// A connection still receiving its answer after this long is a slow reader:
// a new connection from its peer may close it (see Guard::evict).
constexpr auto kSlowReader = std::chrono::seconds(1);

using SteadyClock = std::chrono::steady_clock;

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string guard_answer(int status, const char* reason, const std::string& body) {
  return "HTTP/1.1 " + std::to_string(status) + " " + reason +
         "\r\nContent-Type: text/plain\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\nConnection: close\r\nCache-Control: no-store\r\n\r\n" + body;
}

// A complete request head (request line and headers, ending in an empty line)
// as httplib gets it: one request per connection, no body. Either the request
// to hand over or, when `status` is set, the guard's own answer.
struct CheckedHead {
  std::string request;
  std::string refusal;  // a whole answer; empty when `request` goes to httplib
};

CheckedHead check_head(const std::string& head) {
  CheckedHead out;
  size_t pos = 0;
  bool first = true;
  while (pos < head.size()) {
    const size_t eol = head.find("\r\n", pos);
    if (eol == std::string::npos) break;
    const std::string line = head.substr(pos, eol - pos);
    pos = eol + 2;
    if (line.empty()) break;
    if (!first) {
      const std::string name = lower(line.substr(0, line.find(':')));
      // Dropped: one request per connection, no bodies, and no ranges (httplib
      // answers "Range: bytes=0-,0-,..." with a copy of the page per range: a
      // 4 KB request made a 277 MB answer).
      if (name == "connection" || name == "keep-alive" || name == "expect" || name == "range" || name == "if-range")
        continue;
      if (name == "transfer-encoding" ||
          (name == "content-length" && line.find_first_not_of(" 0", line.find(':') + 1) != std::string::npos)) {
        out.refusal = guard_answer(413, "Payload Too Large", "the dashboard takes no request bodies\n");
        return out;
      }
    }
    first = false;
    out.request += line + "\r\n";
  }
  out.request += "Connection: close\r\n\r\n";
  return out;
}

// httplib's view of one request: the head the guard read, and the answer
// collected in memory for the guard to send.
class HeadStream : public httplib::Stream {
 public:
  HeadStream(const std::string& head, const std::string& peer_ip, int peer_port, std::string* answer)
      : head_(head), ip_(peer_ip), port_(peer_port), answer_(answer) {}
  bool is_readable() const override { return at_ < head_.size(); }
  bool is_writable() const override { return true; }
  ssize_t read(char* ptr, size_t size) override {
    const size_t n = std::min(size, head_.size() - at_);
    std::memcpy(ptr, head_.data() + at_, n);
    at_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (answer_->size() + size > kMaxAnswer) {
      overflow_ = true;
      return -1;
    }
    answer_->append(ptr, size);
    return static_cast<ssize_t>(size);
  }
  bool overflow() const { return overflow_; }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = ip_;
    port = port_;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip.clear();
    port = 0;
  }
  socket_t socket() const override { return INVALID_SOCKET; }

 private:
  const std::string& head_;
  size_t at_ = 0;
  std::string ip_;
  int port_;
  std::string* answer_;
  bool overflow_ = false;
};

// httplib's routing, handlers and answer writing, without its sockets.
class Router : public httplib::Server {
 public:
  // The answer to `head` (one complete request, "Connection: close"); empty
  // when there is none or it would be over kMaxAnswer.
  std::string answer(const std::string& head, const std::string& peer_ip, int peer_port) {
    std::string out;
    HeadStream stream(head, peer_ip, peer_port, &out);
    bool closed = false;
    process_request(stream, /*close_connection=*/true, closed, nullptr);
    if (stream.overflow()) out.clear();
    return out;
  }
};

// Who a connection counts against: its IPv4 address, or an IPv6 address's /64
// (one host commonly holds a whole /64). `ip` gets the full address.
std::string peer_of(const sockaddr_storage& ss, std::string* ip, int* port) {
  char text[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(ss);
    ::inet_ntop(AF_INET, &a.sin_addr, text, sizeof text);
    *ip = text;
    *port = ntohs(a.sin_port);
    return *ip;
  }
  const auto& a = reinterpret_cast<const sockaddr_in6&>(ss);
  *port = ntohs(a.sin6_port);
  if (IN6_IS_ADDR_V4MAPPED(&a.sin6_addr)) {
    ::inet_ntop(AF_INET, a.sin6_addr.s6_addr + 12, text, sizeof text);
    *ip = text;
    return *ip;
  }
  ::inet_ntop(AF_INET6, &a.sin6_addr, text, sizeof text);
  *ip = text;
  in6_addr prefix = a.sin6_addr;
  std::memset(prefix.s6_addr + 8, 0, 8);
  ::inet_ntop(AF_INET6, &prefix, text, sizeof text);
  return std::string(text) + "/64";
}

// The guard: one thread owns the listening socket and every connection;
// kWorkers threads make answers. Connections move Head -> Queued -> Working
// -> Writing -> Draining (a lingering close), or Head -> Writing for the
// guard's own answers.
class Guard {
 public:
  Guard(int listen_fd, Router* router) : listen_fd_(listen_fd), router_(router) {
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    SPARROW_CHECK(wake_fd_ >= 0, "http: eventfd failed: " << std::strerror(errno));
    for (size_t i = 0; i < kWorkers; ++i) workers_.emplace_back([this] { work(); });
    thread_ = std::thread([this] { loop(); });
  }
  ~Guard() {
    stopping_ = true;
    {
      std::lock_guard<std::mutex> g(mu_);
      jobs_stop_ = true;
    }
    jobs_cv_.notify_all();
    wake();
    thread_.join();
    for (auto& t : workers_) t.join();
    for (auto& entry : conns_) ::close(entry.second.fd);
    ::close(wake_fd_);
  }
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;

 private:
  enum class State { kHead, kQueued, kWorking, kWriting, kDraining };
  struct Conn {
    int fd = -1;
    std::string peer, ip;
    int port = 0;
    State state = State::kHead;
    std::string buf;  // the head being read, then the answer being sent
    size_t done = 0;  // bytes of the answer sent, or bytes drained
    SteadyClock::time_point opened, deadline;
    SteadyClock::time_point writing_since;  // kWriting: when the answer started going out
  };
  struct Job {
    uint64_t id;
    std::string head, ip;
    int port;
  };

  void wake() {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t k = ::write(wake_fd_, &one, sizeof one);
  }

  void work() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> g(mu_);
        jobs_cv_.wait(g, [&] { return jobs_stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      std::string answer;
      try {
        answer = router_->answer(job.head, job.ip, job.port);
      } catch (const std::exception&) {  // handlers' exceptions are answered 500 by httplib; this is a backstop
        answer.clear();
      }
      if (answer.empty()) answer = guard_answer(500, "Internal Server Error", "internal error\n");
      {
        std::lock_guard<std::mutex> g(mu_);
        answers_.emplace_back(job.id, std::move(answer));
      }
      wake();
    }
  }

  void close_conn(std::unordered_map<uint64_t, Conn>::iterator it) {
    Conn& c = it->second;
    if (c.state == State::kWriting) answer_bytes_ -= c.buf.size();
    ::close(c.fd);
    auto p = per_peer_.find(c.peer);
    if (p != per_peer_.end() && --p->second == 0) per_peer_.erase(p);
    conns_.erase(it);
  }

  // Closes the longest-open connection of `peer` (of anyone when empty) that
  // is still sending its head, is already answered, or has been reading its
  // answer for over kSlowReader; false when there is none.
  bool evict(const std::string& peer) {
    const auto slow = SteadyClock::now() - kSlowReader;
    auto oldest = conns_.end();
    for (auto it = conns_.begin(); it != conns_.end(); ++it) {
      const Conn& c = it->second;
      if (c.state != State::kHead && c.state != State::kDraining &&
          !(c.state == State::kWriting && c.writing_since < slow))
        continue;
      if (!peer.empty() && c.peer != peer) continue;
      if (oldest == conns_.end() || c.opened < oldest->second.opened) oldest = it;
    }
    if (oldest == conns_.end()) return false;
    close_conn(oldest);
    return true;
  }

  void admit(int fd, const sockaddr_storage& ss) {
    std::string ip;
    int port = 0;
    const std::string peer = peer_of(ss, &ip, &port);
    auto p = per_peer_.find(peer);
    if ((p != per_peer_.end() && p->second >= kMaxPerPeer && !evict(peer)) ||
        (conns_.size() >= kMaxConnections && !evict(""))) {
      ::close(fd);
      return;
    }
    Conn c;
    c.fd = fd;
    c.peer = peer;
    c.ip = std::move(ip);
    c.port = port;
    c.opened = SteadyClock::now();
    c.deadline = c.opened + kHeadDeadline;
    conns_.emplace(next_id_++, std::move(c));
    per_peer_[peer]++;
  }

  void start_writing(Conn& c, std::string answer, SteadyClock::duration limit) {
    c.state = State::kWriting;
    c.buf = std::move(answer);
    c.done = 0;
    c.writing_since = SteadyClock::now();
    c.deadline = c.writing_since + limit;
    answer_bytes_ += c.buf.size();
  }

  // Reads what the peer sent; false when the connection is to be closed.
  bool on_readable(uint64_t id, Conn& c) {
    char buf[4096];
    for (;;) {
      const ssize_t k = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (k <= 0) return false;  // the peer went away (or reset)
      if (c.state == State::kDraining) {
        c.done += static_cast<size_t>(k);
        if (c.done >= kMaxDrain) return false;
        continue;
      }
      const size_t from = c.buf.size() < 3 ? 0 : c.buf.size() - 3;
      c.buf.append(buf, static_cast<size_t>(k));
      const size_t end = c.buf.find("\r\n\r\n", from);
      if (end == std::string::npos ? c.buf.size() > kMaxHead : end + 4 > kMaxHead) {
        c.buf.clear();
        start_writing(c, guard_answer(431, "Request Header Fields Too Large", "request head over 8 KB\n"),
                      kGuardAnswerDeadline);
        return true;
      }
      if (end == std::string::npos) continue;
      c.buf.resize(end + 4);  // anything after the head is dropped (no bodies, no pipelining)
      CheckedHead h = check_head(c.buf);
      if (!h.refusal.empty()) {
        c.buf.clear();
        start_writing(c, std::move(h.refusal), kGuardAnswerDeadline);
        return true;
      }
      c.buf = std::move(h.request);
      c.state = State::kQueued;
      queued_.push_back(id);
      return true;
    }
  }

  // Sends what it can of the answer; false when the connection is to be closed.
  bool on_writable(Conn& c) {
    while (c.done < c.buf.size()) {
      const ssize_t k = ::send(c.fd, c.buf.data() + c.done, c.buf.size() - c.done, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (k <= 0) return false;
      c.done += static_cast<size_t>(k);
    }
    // A lingering close: closing with unread input would send a reset that
    // can destroy the answer before the peer reads it. Stop writing, then
    // discard what the peer still sends (at most kMaxDrain, kLinger).
    answer_bytes_ -= c.buf.size();
    std::string().swap(c.buf);
    ::shutdown(c.fd, SHUT_WR);
    c.state = State::kDraining;
    c.done = 0;
    c.deadline = SteadyClock::now() + kLinger;
    return true;
  }

  void dispatch() {
    std::lock_guard<std::mutex> g(mu_);
    while (!queued_.empty() && working_ < kWorkers && answer_bytes_ < kMaxAnswerBytes) {
      const uint64_t id = queued_.front();
      queued_.pop_front();
      auto it = conns_.find(id);
      if (it == conns_.end() || it->second.state != State::kQueued) continue;
      Conn& c = it->second;
      c.state = State::kWorking;
      jobs_.push_back(Job{id, std::move(c.buf), c.ip, c.port});
      c.buf.clear();
      ++working_;
      jobs_cv_.notify_one();
    }
  }

  void collect_answers() {
    uint64_t count = 0;
    [[maybe_unused]] const ssize_t k = ::read(wake_fd_, &count, sizeof count);
    std::deque<std::pair<uint64_t, std::string>> done;
    {
      std::lock_guard<std::mutex> g(mu_);
      done.swap(answers_);
      working_ -= done.size();
    }
    for (auto& [id, answer] : done) {
      auto it = conns_.find(id);
      if (it != conns_.end()) start_writing(it->second, std::move(answer), kAnswerDeadline);
    }
  }

  void accept_some() {
    for (int i = 0; i < 64; ++i) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        admit(fd, ss);
        continue;
      }
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        accept_paused_until_ = SteadyClock::now() + std::chrono::milliseconds(100);
      return;  // EAGAIN, or a connection that went away before it was accepted
    }
  }

  void loop() {
    std::vector<pollfd> fds;
    std::vector<uint64_t> ids;
    while (!stopping_.load()) {
      const auto now = SteadyClock::now();
      fds.clear();
      ids.clear();
      fds.push_back({wake_fd_, POLLIN, 0});
      const bool accepting = now >= accept_paused_until_;
      fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
      auto next = now + std::chrono::seconds(1);
      for (const auto& [id, c] : conns_) {
        short events = 0;
        if (c.state == State::kHead || c.state == State::kDraining) events = POLLIN;
        if (c.state == State::kWriting) events = POLLOUT;
        if (events == 0) continue;  // at a worker: its deadline is the worker's
        fds.push_back({c.fd, events, 0});
        ids.push_back(id);
        next = std::min(next, c.deadline);
      }
      if (!accepting) next = std::min(next, accept_paused_until_);
      const auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count();
      const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait_ms, 0) + 1));
      if (ready < 0 && errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      if (ready > 0) {
        if (fds[0].revents) collect_answers();
        for (size_t i = 2; i < fds.size(); ++i) {
          if (!fds[i].revents) continue;
          auto it = conns_.find(ids[i - 2]);
          if (it == conns_.end()) continue;
          Conn& c = it->second;
          bool keep = true;
          if (c.state == State::kWriting)
            keep = on_writable(c);
          else if (c.state == State::kHead || c.state == State::kDraining)
            keep = on_readable(it->first, c);
          if (!keep) close_conn(it);
        }
        if (fds[1].revents) accept_some();  // after the events: admission may close connections
      }
      // Deadlines: a head not complete in 3 s gets 408; an answer not sent in
      // time, or a linger that ran out, ends the connection.
      const auto after = SteadyClock::now();
      for (auto it = conns_.begin(); it != conns_.end();) {
        auto cur = it++;
        Conn& c = cur->second;
        if (c.deadline > after || c.state == State::kQueued || c.state == State::kWorking) continue;
        if (c.state == State::kHead) {
          c.buf.clear();
          start_writing(c, guard_answer(408, "Request Timeout", "request too slow\n"), kGuardAnswerDeadline);
        } else {
          close_conn(cur);
        }
      }
      dispatch();
    }
  }

  int listen_fd_;
  Router* router_;
  int wake_fd_ = -1;
  std::atomic<bool> stopping_{false};
  // The guard thread's own (no lock): connections, per-peer counts, the queue.
  std::unordered_map<uint64_t, Conn> conns_;
  std::map<std::string, size_t> per_peer_;
  std::deque<uint64_t> queued_;
  uint64_t next_id_ = 1;
  size_t answer_bytes_ = 0;
  SteadyClock::time_point accept_paused_until_{};
  // Shared with the workers, under mu_.
  std::mutex mu_;
  std::condition_variable jobs_cv_;
  std::deque<Job> jobs_;
  std::deque<std::pair<uint64_t, std::string>> answers_;
  size_t working_ = 0;
  bool jobs_stop_ = false;
  std::vector<std::thread> workers_;
  std::thread thread_;
};

// The public listening socket (SO_REUSEADDR, not SO_REUSEPORT: a second
// program on the same port fails to start; non-blocking: the guard accepts
// until EAGAIN); the port resolved.
int listen_on(const HttpAddress& addr, int* port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(addr.port);
  if (::getaddrinfo(addr.host.c_str(), service.c_str(), &hints, &res) != 0 || !res) return -1;
  int fd = -1;
  for (addrinfo* r = res; r && fd < 0; r = r->ai_next) {
    fd = ::socket(r->ai_family, r->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, r->ai_protocol);
    if (fd < 0) continue;
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (::bind(fd, r->ai_addr, r->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd < 0) return -1;
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  *port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                   : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return fd;
}

}  // namespace

HttpAddress parse_http_address(const std::string& address) {
  HttpAddress a;
  std::string port;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    SPARROW_CHECK_T(ConfigError, close != std::string::npos && close + 1 < address.size() && address[close + 1] == ':',
                    "http address '" << address << "': expected [IPv6]:PORT");
    a.host = address.substr(1, close - 1);
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    SPARROW_CHECK_T(ConfigError, colon != std::string::npos && address.find(':') == colon,
                    "http address '" << address << "': expected HOST:PORT, e.g. 127.0.0.1:8080");
    a.host = address.substr(0, colon);
    port = address.substr(colon + 1);
  }
  SPARROW_CHECK_T(ConfigError, !a.host.empty(), "http address '" << address << "': the host is empty");
  int64_t p = 0;
  SPARROW_CHECK_T(ConfigError, parse_count(port, 0, 65535, &p),
                  "http address '" << address << "': the port must be a number from 0 to 65535");
  a.port = static_cast<int>(p);
  a.loopback = loopback_host(a.host);
  return a;
}

struct HttpEndpoint::Impl {
  std::shared_ptr<const Board> board;
  HttpAddress address;
  std::string token;  // empty: none required
  std::string page;
  Router router;  // routing and handlers only: it owns no socket
  int listen_fd = -1;
  std::unique_ptr<Guard> guard;
  int port = 0;
  std::string url;

  void install() {
    router.set_payload_max_length(4096);  // the guard refuses bodies; this is a backstop

    router.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      res.set_header("Cache-Control", "no-store");
      res.set_header("X-Content-Type-Options", "nosniff");
      if (req.method != "GET" && req.method != "HEAD") {
        res.status = 405;
        res.set_header("Allow", "GET, HEAD");
        res.set_content("method not allowed: the dashboard is read-only\n", "text/plain");
        return httplib::Server::HandlerResponse::Handled;
      }
      if (token.empty()) {
        // Loopback without a token: only for requests addressed to a
        // loopback name, so another site's page cannot rebind its DNS name
        // to 127.0.0.1 and read the dashboard.
        if (!loopback_host(host_of(req.get_header_value("Host")))) {
          res.status = 403;
          res.set_content("forbidden: the Host header must name a loopback address\n", "text/plain");
          return httplib::Server::HandlerResponse::Handled;
        }
        return httplib::Server::HandlerResponse::Unhandled;
      }
      std::string given;
      const std::string auth = req.get_header_value("Authorization");
      if (auth.rfind("Bearer ", 0) == 0) given = auth.substr(7);
      if (given.empty() && req.has_param("token")) given = req.get_param_value("token");
      if (!same_secret(given, token)) {
        res.status = 401;
        res.set_header("WWW-Authenticate", "Bearer realm=\"sparrow\"");
        res.set_content("unauthorized: send Authorization: Bearer TOKEN (or open the page with ?token=TOKEN)\n",
                        "text/plain");
        return httplib::Server::HandlerResponse::Handled;
      }
      return httplib::Server::HandlerResponse::Unhandled;
    });
    router.set_error_handler([](const httplib::Request&, httplib::Response& res) {
      if (!res.body.empty()) return;
      // (Oversized heads and bodies never get here: the guard answers them.)
      const char* what =
          res.status == 404 ? "not found: try /, /metrics or /api/{run,progress,rounds,clients}\n" : "bad request\n";
      res.set_content(what, "text/plain");
    });
    router.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
      res.status = 500;
      res.set_content("internal error\n", "text/plain");
    });

    router.Get("/", [this](const httplib::Request&, httplib::Response& res) {
      res.set_header("Content-Security-Policy",
                     "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                     "img-src data:; connect-src 'self'");
      res.set_content(page, "text/html; charset=utf-8");
    });
    router.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(board->prometheus(), "text/plain; version=0.0.4; charset=utf-8");
    });
    router.Get("/api/run", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(board->run_json(), "application/json");
    });
    router.Get("/api/progress", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(board->progress_json(), "application/json");
    });
    router.Get("/api/rounds", [this](const httplib::Request& req, httplib::Response& res) {
      int64_t since = 0;
      if (req.has_param("since") && !parse_count(req.get_param_value("since"), 0, INT64_MAX / 16, &since))
        return bad_request(res, "since must be a round number (an integer >= 0)");
      res.set_content(board->rounds_json(since), "application/json");
    });
    router.Get("/api/clients", [this](const httplib::Request& req, httplib::Response& res) {
      int64_t limit = 200;
      if (req.has_param("limit") && !parse_count(req.get_param_value("limit"), 1, 10000, &limit))
        return bad_request(res, "limit must be an integer from 1 to 10000");
      res.set_content(board->clients_json(static_cast<size_t>(limit)), "application/json");
    });
  }

  static void bad_request(httplib::Response& res, const std::string& why) {
    res.status = 400;
    res.set_content(why + "\n", "text/plain");
  }
};

HttpEndpoint::HttpEndpoint(const std::string& address, const std::string& token_file,
                           std::shared_ptr<const Board> board)
    : impl_(std::make_shared<Impl>()) {
  SPARROW_CHECK(board != nullptr, "HttpEndpoint needs a board");
  impl_->board = std::move(board);
  impl_->address = parse_http_address(address);
  if (!token_file.empty()) {
    impl_->token = read_token(token_file);
  } else {
    SPARROW_CHECK_T(ConfigError, impl_->address.loopback,
                    "http address " << address
                                    << " is not a loopback address: give a token file (--http-token FILE) so that "
                                       "only holders of the token can read the dashboard");
  }
  impl_->page = dashboard_page();
  impl_->install();
  const std::string& host = impl_->address.host;
  impl_->listen_fd = listen_on(impl_->address, &impl_->port);
  SPARROW_CHECK_T(ConfigError, impl_->listen_fd >= 0,
                  "http: cannot bind " << address << " (in use, or not an address of this machine)");
  const std::string shown = host.find(':') != std::string::npos ? "[" + host + "]" : host;
  impl_->url = "http://" + shown + ":" + std::to_string(impl_->port) + "/";
  try {
    impl_->guard = std::make_unique<Guard>(impl_->listen_fd, &impl_->router);
  } catch (...) {
    ::close(impl_->listen_fd);
    throw;
  }
}

HttpEndpoint::~HttpEndpoint() {
  // The guard never waits on a peer: its thread and workers stop at once, and
  // every open connection is closed.
  impl_->guard.reset();
  ::close(impl_->listen_fd);
}

int HttpEndpoint::port() const { return impl_->port; }
const std::string& HttpEndpoint::url() const { return impl_->url; }

}  // namespace sparrow::monitor
