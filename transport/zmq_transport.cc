#include "transport/zmq_transport.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <zmq.hpp>

#include "wire/net.h"

namespace sparrow::transport {
namespace {

[[noreturn]] void fail(const zmq::error_t& e) { throw TransportError(std::string("ZeroMQ: ") + e.what()); }

Frame frame_of(zmq::message_t&& m) {
  // The message itself owns the bytes: no copy (the ingest path of large updates).
  auto owned = std::make_shared<zmq::message_t>(std::move(m));
  const void* data = owned->data();
  const size_t size = owned->size();
  return Frame(data, size, std::move(owned));
}

void set_queue_limit(zmq::socket_t& socket, int limit) {
  socket.set(zmq::sockopt::sndhwm, limit);
  socket.set(zmq::sockopt::rcvhwm, limit);
}

// Handshake events of one socket's connections, read from libzmq's socket
// monitor (an inproc PAIR). Not thread-safe: the thread that owns the socket
// reads it.
class HandshakeMonitor {
 public:
  HandshakeMonitor(zmq::context_t& ctx, zmq::socket_t& socket) : watched_(&socket), pair_(ctx, zmq::socket_type::pair) {
    static std::atomic<uint64_t> next_id{0};
    const std::string ep = "inproc://sparrow-monitor-" + std::to_string(next_id.fetch_add(1));
    const int events = ZMQ_EVENT_CONNECTED | ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED |
                       ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                       ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
    if (zmq_socket_monitor(socket.handle(), ep.c_str(), events) != 0) fail(zmq::error_t());
    pair_.set(zmq::sockopt::linger, 0);
    pair_.connect(ep);
  }
  ~HandshakeMonitor() {
    // Stop monitoring before the PAIR goes (the watched socket may still live).
    if (watched_ && watched_->handle()) zmq_socket_monitor(watched_->handle(), nullptr, 0);
  }
  HandshakeMonitor(const HandshakeMonitor&) = delete;
  HandshakeMonitor& operator=(const HandshakeMonitor&) = delete;

  // The events queued so far, without waiting.
  std::vector<HandshakeEvent> drain() {
    using Kind = HandshakeEvent::Kind;
    std::vector<HandshakeEvent> out;
    for (;;) {
      zmq::message_t head;
      if (!pair_.recv(head, zmq::recv_flags::dontwait)) break;
      zmq::message_t addr;
      if (head.more()) (void)pair_.recv(addr, zmq::recv_flags::dontwait);
      if (head.size() < 6) continue;
      uint16_t id;
      uint32_t value;
      std::memcpy(&id, head.data(), 2);
      std::memcpy(&value, static_cast<const char*>(head.data()) + 2, 4);
      HandshakeEvent e;
      e.value = value;
      e.address = addr.to_string();
      switch (id) {
        case ZMQ_EVENT_CONNECTED:
        case ZMQ_EVENT_ACCEPTED:
          e.kind = Kind::kConnected;
          break;
        case ZMQ_EVENT_DISCONNECTED:
          e.kind = Kind::kDisconnected;
          break;
        case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
          e.kind = Kind::kSucceeded;
          break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
          e.kind = Kind::kRefused;
          break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
          e.kind = value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH ? Kind::kMismatch : Kind::kFailed;
          break;
        default:
          e.kind = Kind::kFailed;
      }
      out.push_back(std::move(e));
    }
    return out;
  }

 private:
  zmq::socket_t* watched_;
  zmq::socket_t pair_;
};

// wake(): an eventfd the I/O thread polls next to the socket, so that a reply
// queued by another thread leaves at once instead of after the poll interval.
class EventFd {
 public:
  EventFd() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
    if (fd_ < 0) throw TransportError(std::string("eventfd: ") + std::strerror(errno));
  }
  EventFd(const EventFd&) = delete;
  EventFd& operator=(const EventFd&) = delete;
  ~EventFd() { ::close(fd_); }
  int fd() const { return fd_; }
  void signal() const {
    const uint64_t one = 1;
    (void)!::write(fd_, &one, sizeof one);  // only fails when the counter is full: already signalled
  }
  void clear() const {
    uint64_t v;
    (void)!::read(fd_, &v, sizeof v);
  }

 private:
  int fd_;
};

class ZmqListener final : public Listener {
 public:
  ZmqListener(const std::string& endpoint, const ListenOptions& o) : router_(ctx_, zmq::socket_type::router) {
    const bool curve = !o.secret_key.empty();
    if (curve) {
      // The ZAP handler before the socket is bound: libzmq consults it for
      // every handshake once one exists.
      zap_ = std::make_unique<net::ZapHandler>(ctx_, o.allowed, o.on_auth);
      net::make_curve_server(router_, net::KeyPair{o.public_key, o.secret_key});
    }
    net::set_limits(router_, o.max_message_bytes, o.heartbeat_ms);
    set_queue_limit(router_, o.queue_limit);
    router_.set(zmq::sockopt::router_mandatory, 1);
    // Peers that speak plain TCP to a CURVE server never reach the ZAP
    // handler: the socket monitor is where they show.
    if (curve) monitor_ = std::make_unique<HandshakeMonitor>(ctx_, router_);
    try {
      router_.bind(endpoint);
    } catch (const zmq::error_t& e) {
      throw ConfigError("cannot bind '" + endpoint + "': " + e.what());
    }
    endpoint_ = router_.get(zmq::sockopt::last_endpoint);
  }

  ~ZmqListener() override { close(std::chrono::milliseconds(0)); }

  const std::string& endpoint() const override { return endpoint_; }

  bool poll(std::chrono::milliseconds timeout, bool want_read) override {
    zmq::pollitem_t items[2] = {{static_cast<void*>(router_), 0, static_cast<short>(want_read ? ZMQ_POLLIN : 0), 0},
                                {nullptr, wake_.fd(), ZMQ_POLLIN, 0}};
    try {
      zmq::poll(items, 2, timeout);
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) return false;
      fail(e);
    }
    if (items[1].revents & ZMQ_POLLIN) wake_.clear();
    return want_read && (items[0].revents & ZMQ_POLLIN);
  }

  void wake() override { wake_.signal(); }

  std::optional<Inbound> receive() override {
    try {
      for (;;) {
        std::optional<net::RoutedFrame> in = net::receive_routed(router_);
        if (!in) return std::nullopt;
        if (!in->payload) continue;  // a routing id alone (ROUTER never delivers one)
        Inbound out;
        out.peer = std::move(in->routing_id);
        out.key = net::peer_key(in->frame);
        out.extra_frames = in->extra_frames;
        out.frame = frame_of(std::move(in->frame));
        return out;
      }
    } catch (const zmq::error_t& e) {
      fail(e);
    }
  }

  SendResult send(const std::string& peer, const std::string& bytes) override {
    try {
      if (!router_.send(zmq::buffer(peer), zmq::send_flags::dontwait | zmq::send_flags::sndmore))
        return SendResult::kWouldBlock;
      // A ROUTER queues the whole message once its first frame is taken.
      return router_.send(zmq::buffer(bytes), zmq::send_flags::dontwait) ? SendResult::kSent : SendResult::kWouldBlock;
    } catch (const zmq::error_t& e) {
      if (e.num() == EHOSTUNREACH) return SendResult::kPeerGone;  // ZMQ_ROUTER_MANDATORY
      fail(e);
    }
  }

  std::vector<HandshakeEvent> handshake_events() override {
    return monitor_ ? monitor_->drain() : std::vector<HandshakeEvent>{};
  }

  void close(std::chrono::milliseconds linger) override {
    if (!router_.handle()) return;
    try {
      router_.set(zmq::sockopt::linger, static_cast<int>(linger.count()));
    } catch (const zmq::error_t&) {
    }
    monitor_.reset();  // stop monitoring before the socket goes (its events would find no reader)
    router_.close();
    zap_.reset();
  }

 private:
  zmq::context_t ctx_{1};
  std::unique_ptr<net::ZapHandler> zap_;  // after ctx_, before the socket: destroyed after it
  zmq::socket_t router_;
  std::unique_ptr<HandshakeMonitor> monitor_;  // of router_ (CURVE only)
  EventFd wake_;
  std::string endpoint_;
};

class ZmqConnection final : public Connection {
 public:
  ZmqConnection(const std::string& endpoint, const ConnectOptions& o) : sock_(ctx_, zmq::socket_type::dealer) {
    if (!o.server_key.empty()) net::make_curve_client(sock_, net::KeyPair{o.public_key, o.secret_key}, o.server_key);
    net::set_limits(sock_, o.max_message_bytes, o.heartbeat_ms);
    set_queue_limit(sock_, o.queue_limit);
    monitor_ = std::make_unique<HandshakeMonitor>(ctx_, sock_);
    try {
      sock_.connect(endpoint);
    } catch (const zmq::error_t& e) {
      throw ConfigError("cannot connect to '" + endpoint + "': " + e.what());
    }
  }

  ~ZmqConnection() override {
    monitor_.reset();
    sock_.close();
  }

  SendResult send(const std::string& bytes) override {
    try {
      return sock_.send(zmq::buffer(bytes), zmq::send_flags::dontwait) ? SendResult::kSent : SendResult::kWouldBlock;
    } catch (const zmq::error_t& e) {
      fail(e);
    }
  }

  std::optional<Frame> receive(std::chrono::milliseconds timeout) override {
    zmq::pollitem_t item{static_cast<void*>(sock_), 0, ZMQ_POLLIN, 0};
    try {
      if (zmq::poll(&item, 1, timeout) <= 0) return std::nullopt;
      zmq::message_t frame;
      if (!sock_.recv(frame, zmq::recv_flags::dontwait)) return std::nullopt;
      return frame_of(std::move(frame));
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) return std::nullopt;
      fail(e);
    }
  }

  std::vector<HandshakeEvent> handshake_events() override { return monitor_->drain(); }

 private:
  zmq::context_t ctx_;
  zmq::socket_t sock_;
  std::unique_ptr<HandshakeMonitor> monitor_;  // of sock_
};

}  // namespace

std::unique_ptr<Listener> zmq_listen(const std::string& endpoint, const ListenOptions& options) {
  return std::make_unique<ZmqListener>(endpoint, options);
}

std::unique_ptr<Connection> zmq_connect(const std::string& endpoint, const ConnectOptions& options) {
  return std::make_unique<ZmqConnection>(endpoint, options);
}

}  // namespace sparrow::transport
