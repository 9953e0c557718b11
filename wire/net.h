#pragma once
// sparrow_net: ZeroMQ transport for the wire format, shared by sparrow-server,
// sparrow-client and sparrow-edge (the simulator never links it).
//
// - Keys: CurveZMQ key pairs as Z85 text (40 characters), stored in ZeroMQ's
//   certificate format (the zcert text CZMQ writes, so `zcert`-made files load
//   too): NAME.key holds the public key only and can be handed out;
//   NAME.key_secret holds both and is written with mode 0600.
// - ZapHandler: the ZAP (ZeroMQ RFC 27) authenticator a CURVE server needs. It
//   admits a client only when its long-term public key is on the allow-list and
//   reports the key as the connection's User-Id, so the server knows which key
//   sent each frame (peer_key()).
// - Socket set-up for CURVE server and client, and message send/receive helpers
//   that move one wire::Message per frame.
// The server and the client session reach ZeroMQ through transport/ (which
// uses these); sparrow-edge uses them directly.
//
// docs/protocol.md, "Security", describes the handshake for other languages.

#include <zmq.hpp>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "wire/wire.h"

namespace sparrow::net {

// A CurveZMQ key pair, Z85-encoded (40 characters each).
struct KeyPair {
  std::string public_key;
  std::string secret_key;
};

// A fresh key pair (libsodium through libzmq). Error when libzmq was built
// without CURVE support.
KeyPair generate_keypair();

// True when `z85` is 40 characters of the Z85 alphabet (a 32-byte key).
bool is_z85_key(const std::string& z85);

// Writes DIR/NAME.key (public key) and DIR/NAME.key_secret (both; mode 0600),
// creating DIR. Refuses (ConfigError) to overwrite an existing file.
void write_keypair(const std::string& dir, const std::string& name, const KeyPair& keys);
// Key pairs client1..clientN in `dir` and `dir`/allow.txt, an allow-list naming
// their public key files (relative to it); returns the allow-list's path.
// Refuses to replace any existing file (ConfigError).
std::string write_client_keys(const std::string& dir, int clients);

// Reads a certificate file. load_keypair needs the secret file (ConfigError
// when the file has no secret-key); load_public_key reads either file.
// ConfigError naming the path for a missing, unreadable or malformed file.
KeyPair load_keypair(const std::string& path);
std::string load_public_key(const std::string& path);

// The allow-list: a directory (every *.key certificate in it), or a file with
// one entry per line, each either a Z85 public key or the path of a .key file
// (relative to the list's directory). A comment starts with a '#' at the start
// of a line or after whitespace ('#' is a Z85 character, so a key may hold one).
// ConfigError for an entry that is neither, and for a list that admits no key
// (a CURVE server behind it could never be reached).
std::set<std::string> load_allow_list(const std::string& path);

// Checks an endpoint before bind/connect, so that a typo is a clear
// ConfigError naming `key` rather than libzmq's "Invalid argument" or a silent
// wrap-around: "tcp://HOST:PORT" with PORT in 0..65535 ('*' or 0 only when
// `for_bind`: an ephemeral port), "ipc://PATH" or "inproc://NAME" with a
// non-empty rest; also "mem://NAME", the in-process transport of the server
// and the client session (transport/inproc.h), which ZeroMQ programs such as
// sparrow-edge cannot bind.
void check_endpoint(const std::string& key, const std::string& endpoint, bool for_bind);

// The ZAP authenticator for one context. Construct it before binding a CURVE
// server socket on `ctx` (libzmq consults the handler for every handshake once
// one is bound); destroy it after the sockets. Thread-safe.
class ZapHandler {
 public:
  // Called for every decision: (client public key in Z85, peer address, admitted).
  using Observer = std::function<void(const std::string& key, const std::string& address, bool admitted)>;

  ZapHandler(zmq::context_t& ctx, std::set<std::string> allowed, Observer observer = {});
  ~ZapHandler();
  ZapHandler(const ZapHandler&) = delete;
  ZapHandler& operator=(const ZapHandler&) = delete;

  // Replaces the allow-list (e.g. after the operator edited the file).
  void set_allowed(std::set<std::string> allowed);
  uint64_t admitted() const { return admitted_.load(); }
  uint64_t refused() const { return refused_.load(); }

 private:
  void run();

  zmq::socket_t socket_;  // REP on inproc://zeromq.zap.01, bound in the constructor, then used by thread_ only
  mutable std::mutex mu_;
  std::set<std::string> allowed_;
  Observer observer_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> admitted_{0}, refused_{0};
  std::thread thread_;
};

// The ZAP domain Sparrow servers use.
constexpr const char* kZapDomain = "sparrow";

// CURVE server: own key pair, ZAP domain kZapDomain (so a ZapHandler decides).
void make_curve_server(zmq::socket_t& socket, const KeyPair& server);
// CURVE client: own key pair and the server's public key.
void make_curve_client(zmq::socket_t& socket, const KeyPair& client, const std::string& server_public_key);

// Common options: ZMQ_MAXMSGSIZE (libzmq drops the connection of a peer that
// sends more), linger 0, and ZeroMQ's own heartbeats (so dead TCP peers are
// noticed) when heartbeat_ms > 0.
void set_limits(zmq::socket_t& socket, uint64_t max_message_bytes, int heartbeat_ms = 0);

// The Z85 CURVE public key of the peer that sent `frame` (its User-Id property
// as the ZapHandler set it); empty on a plain-TCP connection.
std::string peer_key(const zmq::message_t& frame);

// One wire::Message as one frame. send_to() prefixes the ROUTER routing id.
// Both return false when the message could not be queued (ZMQ_DONTWAIT and the
// peer's queue is full, or the peer is gone on a ROUTER with
// ZMQ_ROUTER_MANDATORY).
bool send(zmq::socket_t& socket, const wire::Message& message, bool dont_wait = false);
bool send_to(zmq::socket_t& router, const std::string& routing_id, const wire::Message& message, bool dont_wait = true);
bool send_bytes_to(zmq::socket_t& router, const std::string& routing_id, const std::string& bytes,
                   bool dont_wait = true);

// One message from a ROUTER socket, without waiting: the routing id and the
// payload frame. A peer that sent several payload frames gets them read and
// dropped (`extra_frames`); the caller answers with an Error. `payload` is
// false for a routing id with no frame after it (ROUTER never produces one).
// nullopt when nothing is queued.
struct RoutedFrame {
  std::string routing_id;
  zmq::message_t frame;
  bool payload = true;
  bool extra_frames = false;
};
std::optional<RoutedFrame> receive_routed(zmq::socket_t& router);

// Waits up to timeout_ms (-1 = forever) for a frame on `socket` (DEALER/REQ
// side) and parses it. nullopt on timeout. A frame that fails to parse throws
// wire::ProtocolError (the caller decides whether to answer with an Error).
std::optional<wire::Message> receive(zmq::socket_t& socket, int timeout_ms, const wire::ParseLimits& limits = {});

// A message carrying only an Error body. `text` goes out as core::peer_text
// makes it (no " [COND failed at FILE:LINE]"): the caller logs the full text.
wire::Message error_message(wire::ErrorCode code, const std::string& text, std::optional<uint64_t> round = {});

}  // namespace sparrow::net
