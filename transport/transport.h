#pragma once
// sparrow_transport: the seam between the service (server/, client/) and the
// bytes on the wire, after gloo's transport/device.h. The server holds a
// Listener (a ROUTER: many peers, each known by a routing id and, with keys,
// by its authenticated public key); a client holds a Connection (a DEALER to
// one server). Which implementation serves an endpoint is chosen by its
// scheme through a string-keyed registry:
//
//   tcp://HOST:PORT, ipc://PATH, inproc://NAME  ZeroMQ (zmq_transport.h): CurveZMQ
//                                               and ZAP when keys are given
//   mem://NAME                                  the in-process hub (inproc.h): queues
//                                               in this process, no sockets; for
//                                               tests and embedding, never across processes
//
// Both carry one wire::Message per frame (docs/protocol.md). Expected outcomes
// are values (nothing arrived in time: nullopt; a full queue or a gone peer:
// SendResult); real failures throw TransportError (or ConfigError for what
// the configuration got wrong: an endpoint that cannot be bound).

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"

namespace sparrow::transport {

// A failure of the transport itself (not of a peer): the caller logs it and
// goes on, or stops.
class TransportError : public Error {
 public:
  using Error::Error;
};

// One received message, owning its bytes: a ZeroMQ message as it arrived
// (zero-copy) or a std::string. The owner is type-erased so that this header
// needs no ZeroMQ, and it is the shared_ptr wire::parse takes to keep views
// into the bytes (a large dense update is verified and folded where it
// arrived). Copies share the bytes.
class Frame {
 public:
  Frame() = default;
  explicit Frame(std::string bytes);
  // [data, data + size), kept alive and unchanged by `owner`.
  Frame(const void* data, size_t size, std::shared_ptr<const void> owner)
      : data_(static_cast<const char*>(data)), size_(size), owner_(std::move(owner)) {}

  const char* data() const { return data_; }
  size_t size() const { return size_; }
  // Holds the bytes alive for as long as the returned pointer lives
  // (wire::Owner).
  const std::shared_ptr<const void>& owner() const { return owner_; }

 private:
  const char* data_ = nullptr;
  size_t size_ = 0;
  std::shared_ptr<const void> owner_;
};

enum class SendResult {
  kSent,        // queued for the peer
  kWouldBlock,  // the peer's queue is full, or (client) no server is connected yet
  kPeerGone,    // (listener) no connection has this routing id (any more)
};

// What a handshake did, as seen by one side: what a peer cannot learn from
// messages (it never gets one), e.g. that the server refused its key.
struct HandshakeEvent {
  enum class Kind {
    kConnected,     // a connection was made (client) or accepted (listener)
    kSucceeded,     // the handshake completed (keys accepted)
    kRefused,       // the server refused the client's key (`value`: the ZAP status, 400)
    kMismatch,      // one side uses keys, the other does not
    kFailed,        // any other handshake failure (e.g. the client has another server key)
    kDisconnected,  // the connection closed
  };
  Kind kind = Kind::kFailed;
  uint32_t value = 0;   // ZAP status or the implementation's error code
  std::string address;  // the endpoint or peer address the implementation reports
};

// A sentence naming the likely cause of a failed handshake, for a client
// (`curve`: the client uses keys).
std::string client_cause(const HandshakeEvent& e, bool curve);

// Called for every key decision of a listener with keys: (client public key
// in Z85, peer address, admitted). From a thread of the transport's (ZeroMQ:
// the ZAP thread; mem: the connecting thread): must be thread-safe and must
// not call back into the listener.
using AuthObserver = std::function<void(const std::string& key, const std::string& address, bool admitted)>;

struct ListenOptions {
  // The server's CurveZMQ key pair (Z85). Empty secret_key: no keys (plain:
  // neither encrypted nor authenticated); otherwise a client is admitted only
  // when its public key is in `allowed`, and every frame carries that key.
  std::string public_key, secret_key;
  std::set<std::string> allowed;
  AuthObserver on_auth;
  uint64_t max_message_bytes = uint64_t{256} << 20;  // a peer that sends more is disconnected
  int heartbeat_ms = 0;                              // transport-level liveness probes (> 0: on)
  int queue_limit = 1000;                            // messages queued per peer and direction
};

struct ConnectOptions {
  // The client's own key pair and the server's public key (Z85). Empty
  // server_key: no keys.
  std::string public_key, secret_key, server_key;
  uint64_t max_message_bytes = uint64_t{256} << 20;
  int heartbeat_ms = 0;
  int queue_limit = 1000;
};

// A frame from one peer, as a Listener receives it.
struct Inbound {
  std::string peer;           // routing id: stable for one connection, opaque
  std::string key;            // the peer's authenticated public key (Z85); empty without keys
  Frame frame;                // the message
  bool extra_frames = false;  // the peer sent more frames after it (dropped; answer with an Error)
};

// The server's side: a bound endpoint with many peers.
//
// Threads: one thread at a time owns it (constructs it, then hands it to the
// I/O thread, which alone calls poll/receive/send/handshake_events; then the
// destructor); wake() may be called from any thread. Nothing blocks except
// poll() and close().
class Listener {
 public:
  virtual ~Listener() = default;

  // The endpoint as bound, with an ephemeral port resolved
  // ("tcp://127.0.0.1:41234" for "tcp://127.0.0.1:*").
  virtual const std::string& endpoint() const = 0;
  // Waits up to `timeout` until a frame can be received (only when
  // `want_read`: otherwise frames stay queued, the peers' queues fill and
  // they see back-pressure) or wake() is called. True when a frame is ready.
  virtual bool poll(std::chrono::milliseconds timeout, bool want_read) = 0;
  // Makes a poll() in progress (or the next one) return now. Thread-safe.
  virtual void wake() = 0;
  // The next frame, without waiting; nullopt when none is queued.
  virtual std::optional<Inbound> receive() = 0;
  // Queues `bytes` as one frame for `peer`, without waiting.
  virtual SendResult send(const std::string& peer, const std::string& bytes) = 0;
  // Handshake failures since the last call (a listener with keys; empty otherwise).
  virtual std::vector<HandshakeEvent> handshake_events() = 0;
  // Gives frames still queued up to `linger` to leave, then closes. The
  // listener is unusable afterwards; the destructor closes at once.
  virtual void close(std::chrono::milliseconds linger) = 0;
};

// A client's side: one connection to a listener. Made connecting: the
// transport (re)connects in the background until the connection is destroyed.
//
// Threads: one thread at a time. Nothing blocks except receive().
class Connection {
 public:
  virtual ~Connection() = default;

  // Queues `bytes` as one frame, without waiting.
  virtual SendResult send(const std::string& bytes) = 0;
  // Waits up to `timeout` for a frame; nullopt when none came (or a signal
  // interrupted the wait).
  virtual std::optional<Frame> receive(std::chrono::milliseconds timeout) = 0;
  // Handshake events since the last call.
  virtual std::vector<HandshakeEvent> handshake_events() = 0;
};

// One scheme's implementation.
struct Transport {
  // Binds `endpoint`. ConfigError "cannot bind 'ENDPOINT': why" when it cannot.
  std::function<std::unique_ptr<Listener>(const std::string& endpoint, const ListenOptions&)> listen;
  std::function<std::unique_ptr<Connection>(const std::string& endpoint, const ConnectOptions&)> connect;
};

// Adds (or replaces) the implementation of `scheme` ("tcp", "mem", ...).
// Thread-safe.
void register_transport(const std::string& scheme, Transport transport);
// The built-in schemes: tcp, ipc, inproc (ZeroMQ) and mem (in-process),
// each unless registered before. Idempotent; listen() and connect() call it.
void register_builtins();

// The scheme of "scheme://rest" (ConfigError without "://").
std::string scheme_of(const std::string& endpoint);
// Through the registry, by the endpoint's scheme; ConfigError for a scheme
// nobody registered.
std::unique_ptr<Listener> listen(const std::string& endpoint, const ListenOptions& options);
std::unique_ptr<Connection> connect(const std::string& endpoint, const ConnectOptions& options);

}  // namespace sparrow::transport
