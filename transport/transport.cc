#include "transport/transport.h"

#include <map>
#include <mutex>

#include "transport/inproc.h"
#include "transport/zmq_transport.h"

namespace sparrow::transport {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, Transport> by_scheme;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: listeners may outlive static destruction order
  return *r;
}

Transport find(const std::string& endpoint) {
  register_builtins();
  const std::string scheme = scheme_of(endpoint);
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  auto it = r.by_scheme.find(scheme);
  SPARROW_CHECK_T(ConfigError, it != r.by_scheme.end(),
                  "'" << endpoint << "': unknown transport '" << scheme << "' (tcp, ipc, inproc or mem)");
  return it->second;
}

}  // namespace

Frame::Frame(std::string bytes) {
  auto owned = std::make_shared<const std::string>(std::move(bytes));
  data_ = owned->data();
  size_ = owned->size();
  owner_ = std::move(owned);
}

std::string client_cause(const HandshakeEvent& e, bool curve) {
  using Kind = HandshakeEvent::Kind;
  switch (e.kind) {
    case Kind::kRefused:
      return "the server refused this client's key (ZAP status " + std::to_string(e.value) +
             "): its public key is not on the server's allow-list, or `key` names another key pair";
    case Kind::kMismatch:
      return curve ? "the server speaks plain TCP and this client CURVE: set insecure = true to match it (or run "
                     "the server without --insecure)"
                   : "the server requires CurveZMQ and this client speaks plain TCP (insecure = true): set "
                     "`server_key` and `key` instead";
    case Kind::kFailed:
    case Kind::kDisconnected:
      return curve ? "the CURVE handshake fails: `server_key` is probably not this server's public key "
                     "(or the server refused the key)"
                   // A server that requires CURVE closes a plain client's
                   // connection; on a loaded machine the client often sees
                   // only that, never the mechanism mismatch (reproduced with
                   // the cores busy): name the likely cause here too.
                   : "the handshake with the server fails: the server probably requires CurveZMQ (set `server_key` "
                     "and `key` instead of insecure = true), or it is not a Sparrow server";
    default:
      return "the handshake with the server fails";
  }
}

void register_transport(const std::string& scheme, Transport transport) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  r.by_scheme[scheme] = std::move(transport);
}

void register_builtins() {
  static std::once_flag once;
  std::call_once(once, [] {
    // A scheme registered before keeps its implementation.
    Registry& r = registry();
    std::lock_guard<std::mutex> g(r.mu);
    const Transport zmq{zmq_listen, zmq_connect};
    for (const char* scheme : {"tcp", "ipc", "inproc"}) r.by_scheme.emplace(scheme, zmq);
    r.by_scheme.emplace("mem", Transport{inproc_listen, inproc_connect});
  });
}

std::string scheme_of(const std::string& endpoint) {
  const auto sep = endpoint.find("://");
  SPARROW_CHECK_T(ConfigError, sep != std::string::npos && sep > 0,
                  "'" << endpoint << "' is not an endpoint (expected SCHEME://ADDRESS, e.g. tcp://HOST:PORT)");
  return endpoint.substr(0, sep);
}

std::unique_ptr<Listener> listen(const std::string& endpoint, const ListenOptions& options) {
  return find(endpoint).listen(endpoint, options);
}

std::unique_ptr<Connection> connect(const std::string& endpoint, const ConnectOptions& options) {
  return find(endpoint).connect(endpoint, options);
}

}  // namespace sparrow::transport
