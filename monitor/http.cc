#include "monitor/http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <netdb.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <chrono>
#include <cctype>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "core/error.h"
#include "monitor/page.h"

namespace sparrow::monitor {

namespace {

constexpr size_t kThreads = 8;     // HTTP worker threads (each mostly waits on a socket)
constexpr size_t kMaxQueued = 64;  // accepted connections waiting for a thread
constexpr time_t kTimeoutS = 3;    // read/write/keep-alive timeouts: a slow peer holds a thread this long

bool loopback_host(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr a{};
  if (inet_pton(AF_INET, host.c_str(), &a) == 1) return (ntohl(a.s_addr) >> 24) == 127;
  return false;
}

// A pool whose queue is bounded: when every thread is busy and kMaxQueued
// connections wait, the accept loop waits too (the kernel's backlog holds the
// rest), so a flood of connections cannot take the process's descriptors,
// which the ZeroMQ side needs.
class BoundedPool : public httplib::TaskQueue {
 public:
  BoundedPool(size_t threads, size_t max_queued) : max_(max_queued) {
    for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { work(); });
  }
  ~BoundedPool() override = default;
  void enqueue(std::function<void()> fn) override {
    std::unique_lock<std::mutex> g(mu_);
    space_.wait(g, [&] { return queue_.size() < max_ || stop_; });
    queue_.push_back(std::move(fn));  // after shutdown too: the task closes its socket
    ready_.notify_one();
  }
  void shutdown() override {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    ready_.notify_all();
    space_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  void work() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> g(mu_);
        ready_.wait(g, [&] { return !queue_.empty() || stop_; });
        if (queue_.empty()) return;  // stopping, and every queued connection was handled
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      space_.notify_one();
      fn();
    }
  }
  std::mutex mu_;
  std::condition_variable ready_, space_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> threads_;
  size_t max_;
  bool stop_ = false;
};

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
// that grows without bound, and its timeout applies to each read, not to the
// request: one endless header line would take the process's memory, and a
// peer trickling a byte every two seconds would keep a thread forever. So
// peers never talk to it directly. The guard owns the public socket; for each
// connection it reads the request head under hard limits (8 KB, 3 s in all),
// answers 431 / 408 / 413 itself when they are broken, and otherwise passes
// the head (one request per connection, "Connection: close") to httplib on a
// private loopback port and copies the answer back under a deadline.

constexpr size_t kMaxHead = 8192;
constexpr auto kHeadDeadline = std::chrono::seconds(3);
constexpr auto kAnswerDeadline = std::chrono::seconds(10);

using SteadyClock = std::chrono::steady_clock;

int ms_left(SteadyClock::time_point until) {
  const auto d = std::chrono::duration_cast<std::chrono::milliseconds>(until - SteadyClock::now()).count();
  return d <= 0 ? 0 : static_cast<int>(std::min<int64_t>(d, 60000));
}

// Writes all of `data` before `until`; false on error or deadline.
bool send_all(int fd, const char* data, size_t n, SteadyClock::time_point until) {
  size_t sent = 0;
  while (sent < n) {
    pollfd p{fd, POLLOUT, 0};
    const int left = ms_left(until);
    if (left == 0 || ::poll(&p, 1, left) <= 0) return false;
    const ssize_t k = ::send(fd, data + sent, n - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (k <= 0) return false;
    sent += static_cast<size_t>(k);
  }
  return true;
}

void answer(int fd, int status, const char* reason, const std::string& body) {
  const std::string r = "HTTP/1.1 " + std::to_string(status) + " " + reason +
                        "\r\nContent-Type: text/plain\r\nContent-Length: " + std::to_string(body.size()) +
                        "\r\nConnection: close\r\nCache-Control: no-store\r\n\r\n" + body;
  send_all(fd, r.data(), r.size(), SteadyClock::now() + std::chrono::seconds(1));
  // A lingering close: closing with unread input would send a reset that can
  // destroy the answer before the peer reads it. Stop writing, then discard
  // what the peer still sends (at most 256 KB, 500 ms).
  ::shutdown(fd, SHUT_WR);
  const auto until = SteadyClock::now() + std::chrono::milliseconds(500);
  char buf[4096];
  for (size_t drained = 0; drained < (256u << 10);) {
    pollfd p{fd, POLLIN, 0};
    const int left = ms_left(until);
    if (left == 0 || ::poll(&p, 1, left) <= 0) break;
    const ssize_t k = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (k <= 0) break;
    drained += static_cast<size_t>(k);
  }
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// One client connection: read the head, check it, relay it. Closes `fd`.
void relay(int fd, int upstream_port) {
  struct Close {
    int fd;
    ~Close() { ::close(fd); }
  } close_client{fd};
  const auto head_until = SteadyClock::now() + kHeadDeadline;
  std::string head;
  char buf[4096];
  size_t end = std::string::npos;
  while (end == std::string::npos) {
    if (head.size() > kMaxHead) return answer(fd, 431, "Request Header Fields Too Large", "request head over 8 KB\n");
    pollfd p{fd, POLLIN, 0};
    const int left = ms_left(head_until);
    if (left == 0 || ::poll(&p, 1, left) <= 0) return answer(fd, 408, "Request Timeout", "request too slow\n");
    const ssize_t k = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (k <= 0) return;  // the peer went away
    head.append(buf, static_cast<size_t>(k));
    end = head.find("\r\n\r\n");
  }
  if (end + 4 > kMaxHead) return answer(fd, 431, "Request Header Fields Too Large", "request head over 8 KB\n");
  head.resize(end + 2);  // the request line and headers, each ending in CRLF; anything after is dropped
  // One request per connection; no bodies (the dashboard is read-only).
  std::string out;
  size_t pos = 0;
  bool first = true;
  while (pos < head.size()) {
    const size_t eol = head.find("\r\n", pos);
    const std::string line = head.substr(pos, eol - pos);
    pos = eol + 2;
    if (!first) {
      const std::string name = lower(line.substr(0, line.find(':')));
      if (name == "connection" || name == "keep-alive") continue;
      if (name == "transfer-encoding" ||
          (name == "content-length" && line.find_first_not_of(" 0", line.find(':') + 1) != std::string::npos))
        return answer(fd, 413, "Payload Too Large", "the dashboard takes no request bodies\n");
    }
    first = false;
    out += line + "\r\n";
  }
  out += "Connection: close\r\n\r\n";
  const int up = ::socket(AF_INET, SOCK_STREAM, 0);
  if (up < 0) return answer(fd, 503, "Service Unavailable", "busy\n");
  Close close_up{up};
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(upstream_port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(up, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    return answer(fd, 503, "Service Unavailable", "busy\n");
  const auto until = SteadyClock::now() + kAnswerDeadline;
  if (!send_all(up, out.data(), out.size(), until)) return;
  for (;;) {
    pollfd p{up, POLLIN, 0};
    const int left = ms_left(until);
    if (left == 0 || ::poll(&p, 1, left) <= 0) return;
    const ssize_t k = ::recv(up, buf, sizeof buf, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (k <= 0) return;  // httplib closed after its answer
    if (!send_all(fd, buf, static_cast<size_t>(k), until)) return;
  }
}

// The public listening socket (SO_REUSEADDR, not SO_REUSEPORT: a second
// program on the same port fails to start); the port resolved.
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
    fd = ::socket(r->ai_family, r->ai_socktype | SOCK_CLOEXEC, r->ai_protocol);
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
  std::atomic<bool> done{false};  // listen_after_bind returned
  std::shared_ptr<const Board> board;
  HttpAddress address;
  std::string token;  // empty: none required
  std::string page;
  httplib::Server svr;  // on a private loopback port: only the guard talks to it
  std::thread thread;
  int upstream_port = 0;
  // The guard: the public socket, its accept thread and its pool.
  int listen_fd = -1;
  std::atomic<bool> stopping{false};
  std::thread acceptor;
  std::unique_ptr<BoundedPool> guards;
  int port = 0;
  std::string url;

  void accept_loop() {
    while (!stopping.load()) {
      pollfd p{listen_fd, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      const int up = upstream_port;
      guards->enqueue([fd, up] { relay(fd, up); });  // waits while the pool's queue is full
    }
  }

  void install() {
    svr.new_task_queue = [] { return new BoundedPool(kThreads, kMaxQueued); };
    // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, which would
    // let a second program bind the same port and take half its requests.
    svr.set_socket_options([](socket_t sock) {
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    });
    svr.set_read_timeout(kTimeoutS, 0);
    svr.set_write_timeout(kTimeoutS, 0);
    svr.set_keep_alive_timeout(kTimeoutS);
    svr.set_keep_alive_max_count(100);
    svr.set_payload_max_length(4096);  // requests are GETs: no body worth reading

    svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
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
    svr.set_error_handler([](const httplib::Request&, httplib::Response& res) {
      if (!res.body.empty()) return;
      // (Oversized heads and bodies never get here: the guard answers them.)
      const char* what =
          res.status == 404 ? "not found: try /, /metrics or /api/{run,progress,rounds,clients}\n" : "bad request\n";
      res.set_content(what, "text/plain");
    });
    svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
      res.status = 500;
      res.set_content("internal error\n", "text/plain");
    });

    svr.Get("/", [this](const httplib::Request&, httplib::Response& res) {
      res.set_header("Content-Security-Policy",
                     "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                     "img-src data:; connect-src 'self'");
      res.set_content(page, "text/html; charset=utf-8");
    });
    svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(board->prometheus(), "text/plain; version=0.0.4; charset=utf-8");
    });
    svr.Get("/api/run", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(board->run_json(), "application/json");
    });
    svr.Get("/api/progress", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(board->progress_json(), "application/json");
    });
    svr.Get("/api/rounds", [this](const httplib::Request& req, httplib::Response& res) {
      int64_t since = 0;
      if (req.has_param("since") && !parse_count(req.get_param_value("since"), 0, INT64_MAX / 16, &since))
        return bad_request(res, "since must be a round number (an integer >= 0)");
      res.set_content(board->rounds_json(since), "application/json");
    });
    svr.Get("/api/clients", [this](const httplib::Request& req, httplib::Response& res) {
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
  // httplib on a private loopback port; the guard on the public address.
  impl_->upstream_port = impl_->svr.bind_to_any_port("127.0.0.1");
  SPARROW_CHECK(impl_->upstream_port > 0, "http: cannot bind a loopback port for the dashboard's server");
  impl_->listen_fd = listen_on(impl_->address, &impl_->port);
  SPARROW_CHECK_T(ConfigError, impl_->listen_fd >= 0,
                  "http: cannot bind " << address << " (in use, or not an address of this machine)");
  const std::string shown = host.find(':') != std::string::npos ? "[" + host + "]" : host;
  impl_->url = "http://" + shown + ":" + std::to_string(impl_->port) + "/";
  // The thread owns a reference: if it cannot be joined in time at
  // destruction (peers holding its pool), it is detached with what it uses.
  std::shared_ptr<Impl> im = impl_;
  impl_->thread = std::thread([im] {
    if (!im->svr.listen_after_bind())
      std::fprintf(stderr, "sparrow: the dashboard's HTTP server stopped (accept failed); the run goes on\n");
    im->done = true;
  });
  impl_->guards = std::make_unique<BoundedPool>(kThreads, kMaxQueued);
  impl_->acceptor = std::thread([im] { im->accept_loop(); });
}

HttpEndpoint::~HttpEndpoint() {
  // The guard first: no new connections; those in progress end within their
  // deadlines (3 s for the head, 10 s for the answer).
  impl_->stopping = true;
  if (impl_->acceptor.joinable()) impl_->acceptor.join();
  ::close(impl_->listen_fd);
  impl_->guards->shutdown();
  // stop() is a no-op until the loop runs, and the pool's shutdown waits for
  // connections in progress: repeat stop() and wait at most 5 s, then leave
  // the thread to finish on its own (it holds the Impl).
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!impl_->done.load() && std::chrono::steady_clock::now() < until) {
    impl_->svr.stop();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (impl_->done.load())
    impl_->thread.join();
  else
    impl_->thread.detach();
}

int HttpEndpoint::port() const { return impl_->port; }
const std::string& HttpEndpoint::url() const { return impl_->url; }

}  // namespace sparrow::monitor
