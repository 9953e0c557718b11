#include "transport/inproc.h"

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

namespace sparrow::transport {
namespace {

using Clock = std::chrono::steady_clock;
using Kind = HandshakeEvent::Kind;

// How often a connection that is not attached tries again (ZeroMQ's default
// reconnect interval).
constexpr auto kRetry = std::chrono::milliseconds(100);

// One connection as its listener sees it; guarded by the Port's mutex.
struct Peer {
  std::string id;
  std::string key;                 // authenticated public key; empty without keys
  uint64_t max_message_bytes = 0;  // the client's inbound limit
  size_t queue_limit = 0;          // the client's inbound queue
  std::deque<std::string> inbox;   // frames for the client
  size_t in_flight = 0;            // its frames in the port's inbox
  bool open = true;                // false: closed by either side; the client detaches
  std::condition_variable cv;      // the client waits here (with the port's mutex)
};

// A bound name: the listener's state, shared with its connections.
struct Port {
  std::string endpoint;
  ListenOptions options;
  std::mutex mu;
  std::condition_variable cv;  // the listener waits here
  bool closed = false;
  bool woken = false;
  struct In {
    std::shared_ptr<Peer> from;
    Inbound message;
  };
  std::deque<In> inbox;
  std::map<std::string, std::shared_ptr<Peer>> peers;  // routing id -> open connection
  std::vector<HandshakeEvent> events;                  // failures (a port with keys)
  uint64_t next_id = 0;
};

// Names to ports. Lock order: the hub's mutex, then a port's.
struct Hub {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<Port>> ports;
};

Hub& hub() {
  static Hub* h = new Hub;  // never destroyed: connections may outlive static destruction order
  return *h;
}

// Closes `p` on its port (the mutex held): both sides see it closed.
void drop_locked(Port& port, Peer& p) {
  p.open = false;
  port.peers.erase(p.id);
  p.cv.notify_all();
}

class InprocListener final : public Listener {
 public:
  InprocListener(const std::string& endpoint, const ListenOptions& o) : port_(std::make_shared<Port>()) {
    port_->endpoint = endpoint;
    port_->options = o;
    Hub& h = hub();
    std::lock_guard<std::mutex> g(h.mu);
    SPARROW_CHECK_T(ConfigError, endpoint.size() > 6,
                    "cannot bind '" << endpoint << "': a mem:// endpoint needs a name (mem://NAME)");
    SPARROW_CHECK_T(ConfigError, !h.ports.count(endpoint),
                    "cannot bind '" << endpoint << "': the name is bound by another listener in this process");
    h.ports[endpoint] = port_;
  }

  ~InprocListener() override { close(std::chrono::milliseconds(0)); }

  const std::string& endpoint() const override { return port_->endpoint; }

  bool poll(std::chrono::milliseconds timeout, bool want_read) override {
    std::unique_lock<std::mutex> g(port_->mu);
    port_->cv.wait_for(g, timeout, [&] { return port_->woken || (want_read && !port_->inbox.empty()); });
    port_->woken = false;
    return want_read && !port_->inbox.empty();
  }

  void wake() override {
    std::lock_guard<std::mutex> g(port_->mu);
    port_->woken = true;
    port_->cv.notify_all();
  }

  std::optional<Inbound> receive() override {
    std::lock_guard<std::mutex> g(port_->mu);
    if (port_->inbox.empty()) return std::nullopt;
    Port::In in = std::move(port_->inbox.front());
    port_->inbox.pop_front();
    --in.from->in_flight;
    return std::move(in.message);
  }

  SendResult send(const std::string& peer, const std::string& bytes) override {
    std::lock_guard<std::mutex> g(port_->mu);
    auto it = port_->peers.find(peer);
    if (it == port_->peers.end()) return SendResult::kPeerGone;
    Peer& p = *it->second;
    if (p.inbox.size() >= p.queue_limit) return SendResult::kWouldBlock;
    if (bytes.size() > p.max_message_bytes) {
      drop_locked(*port_, p);  // the client closes a connection that sends it too much (libzmq's maxmsgsize)
      return SendResult::kSent;
    }
    p.inbox.push_back(bytes);
    p.cv.notify_all();
    return SendResult::kSent;
  }

  std::vector<HandshakeEvent> handshake_events() override {
    std::lock_guard<std::mutex> g(port_->mu);
    return std::exchange(port_->events, {});
  }

  // Frames already queued stay with their connections: nothing to linger for.
  void close(std::chrono::milliseconds /*linger*/) override {
    {
      Hub& h = hub();
      std::lock_guard<std::mutex> g(h.mu);
      auto it = h.ports.find(port_->endpoint);
      if (it != h.ports.end() && it->second == port_) h.ports.erase(it);
    }
    std::lock_guard<std::mutex> g(port_->mu);
    if (port_->closed) return;
    port_->closed = true;
    for (auto& [id, p] : port_->peers) p->cv.notify_all();
    port_->peers.clear();
    port_->inbox.clear();
  }

 private:
  std::shared_ptr<Port> port_;
};

class InprocConnection final : public Connection {
 public:
  InprocConnection(const std::string& endpoint, const ConnectOptions& o) : endpoint_(endpoint), options_(o) {
    SPARROW_CHECK_T(ConfigError, endpoint.size() > 6,
                    "cannot connect to '" << endpoint << "': a mem:// endpoint needs a name (mem://NAME)");
  }

  ~InprocConnection() override { detach(/*event=*/false); }

  SendResult send(const std::string& bytes) override {
    if (!attached()) return SendResult::kWouldBlock;  // a DEALER without a connection queues nothing
    Port& port = *port_;
    std::lock_guard<std::mutex> g(port.mu);
    if (port.closed || !peer_->open) return SendResult::kWouldBlock;
    if (peer_->in_flight >= static_cast<size_t>(port.options.queue_limit)) return SendResult::kWouldBlock;
    if (bytes.size() > port.options.max_message_bytes) {
      drop_locked(port, *peer_);  // the listener closes a connection that sends it too much
      return SendResult::kSent;
    }
    Port::In in;
    in.from = peer_;
    in.message.peer = peer_->id;
    in.message.key = peer_->key;
    in.message.frame = Frame(bytes);
    port.inbox.push_back(std::move(in));
    ++peer_->in_flight;
    port.cv.notify_all();
    return SendResult::kSent;
  }

  std::optional<Frame> receive(std::chrono::milliseconds timeout) override {
    const auto until = Clock::now() + timeout;
    for (;;) {
      if (attached()) {
        std::shared_ptr<Port> port = port_;
        std::unique_lock<std::mutex> g(port->mu);
        peer_->cv.wait_until(g, until, [&] { return !peer_->inbox.empty() || !peer_->open || port->closed; });
        // Frames queued before a close are still delivered (a final Bye).
        if (!peer_->inbox.empty()) {
          Frame f(std::move(peer_->inbox.front()));
          peer_->inbox.pop_front();
          return f;
        }
        if (peer_->open && !port->closed) return std::nullopt;  // timed out
        g.unlock();
        detach(/*event=*/true);
        continue;
      }
      const auto now = Clock::now();
      if (now >= until) return std::nullopt;
      std::this_thread::sleep_for(std::min<Clock::duration>(
          until - now, std::max<Clock::duration>(next_try_ - now, std::chrono::milliseconds(1))));
    }
  }

  std::vector<HandshakeEvent> handshake_events() override {
    (void)attached();  // a handshake happens when it is due, as in the background with ZeroMQ
    return std::exchange(events_, {});
  }

 private:
  // Attached to an open listener, trying to attach when due (every kRetry).
  bool attached() {
    if (peer_) return true;
    const auto now = Clock::now();
    if (now < next_try_) return false;
    next_try_ = now + kRetry;
    std::shared_ptr<Port> port;
    {
      Hub& h = hub();
      std::lock_guard<std::mutex> g(h.mu);
      auto it = h.ports.find(endpoint_);
      if (it == h.ports.end()) return false;  // nobody listens: no handshake, as with a refused TCP connect
      port = it->second;
    }
    const ListenOptions& lo = port->options;
    const bool server_curve = !lo.secret_key.empty(), client_curve = !options_.server_key.empty();
    std::optional<Kind> failure;
    uint32_t value = 0;
    bool auth = false, admitted = false;
    if (server_curve != client_curve) {
      failure = Kind::kMismatch;
    } else if (server_curve && options_.server_key != lo.public_key) {
      failure = Kind::kFailed;  // the client's box for another key does not open
    } else if (server_curve) {
      auth = true;
      admitted = lo.allowed.count(options_.public_key) > 0;
      if (!admitted) failure = Kind::kRefused, value = 400;
    }
    {
      std::lock_guard<std::mutex> g(port->mu);
      if (port->closed) return false;
      events_.push_back({Kind::kConnected, 0, endpoint_});
      if (failure) {
        events_.push_back({*failure, value, endpoint_});
        if (server_curve && *failure != Kind::kRefused) port->events.push_back({*failure, value, port->endpoint});
      } else {
        events_.push_back({Kind::kSucceeded, 0, endpoint_});
        auto p = std::make_shared<Peer>();
        p->id = "mem-" + std::to_string(++port->next_id);
        if (server_curve) p->key = options_.public_key;
        p->max_message_bytes = options_.max_message_bytes;
        p->queue_limit = static_cast<size_t>(options_.queue_limit);
        port->peers[p->id] = p;
        peer_ = std::move(p);
        port_ = port;
      }
    }
    // Outside the port's mutex: the observer may log.
    if (auth && lo.on_auth) lo.on_auth(options_.public_key, endpoint_, admitted);
    return peer_ != nullptr;
  }

  void detach(bool event) {
    if (!peer_) return;
    {
      std::lock_guard<std::mutex> g(port_->mu);
      if (peer_->open) drop_locked(*port_, *peer_);
    }
    peer_.reset();
    port_.reset();
    if (event) events_.push_back({Kind::kDisconnected, 0, endpoint_});
  }

  std::string endpoint_;
  ConnectOptions options_;
  std::shared_ptr<Port> port_;  // set while attached
  std::shared_ptr<Peer> peer_;
  Clock::time_point next_try_{};
  std::vector<HandshakeEvent> events_;
};

}  // namespace

std::unique_ptr<Listener> inproc_listen(const std::string& endpoint, const ListenOptions& options) {
  return std::make_unique<InprocListener>(endpoint, options);
}

std::unique_ptr<Connection> inproc_connect(const std::string& endpoint, const ConnectOptions& options) {
  return std::make_unique<InprocConnection>(endpoint, options);
}

}  // namespace sparrow::transport
