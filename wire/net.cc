#include "wire/net.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "core/error_text.h"

namespace sparrow::net {
namespace {

namespace fs = std::filesystem;

constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";
constexpr size_t kZ85KeyChars = 40;

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return {};
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

// `key = "value"` inside a certificate's curve section.
std::optional<std::string> cert_value(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const std::string t = trim(line);
    if (t.rfind(key, 0) != 0) continue;
    std::string rest = trim(t.substr(key.size()));
    if (rest.empty() || rest[0] != '=') continue;
    rest = trim(rest.substr(1));
    if (rest.size() >= 2 && rest.front() == '"' && rest.back() == '"') rest = rest.substr(1, rest.size() - 2);
    return rest;
  }
  return std::nullopt;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("cannot read key file '" + path + "': " + std::strerror(errno));
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

std::string cert_text(const KeyPair& keys, bool with_secret) {
  std::time_t now = std::time(nullptr);
  char when[64];
  std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::ostringstream os;
  os << "#   ****  Generated on " << when << " by sparrow-server keygen  ****\n"
     << (with_secret
             ? "#   ZeroMQ CURVE **Secret** Certificate\n#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change "
               "its permissions.\n"
             : "#   ZeroMQ CURVE Public Certificate\n#   Exchange securely, or use a secure mechanism to "
               "verify the contents\n#   of this file after exchange.\n")
     << "\nmetadata\ncurve\n    public-key = \"" << keys.public_key << "\"\n";
  if (with_secret) os << "    secret-key = \"" << keys.secret_key << "\"\n";
  return os.str();
}

void write_new_file(const std::string& path, const std::string& text, mode_t mode) {
  if (fs::exists(path)) throw ConfigError("refusing to overwrite existing key file '" + path + "'");
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw ConfigError("cannot write key file '" + path + "': " + std::strerror(errno));
  // Restrict before the secret is written.
  if (::chmod(path.c_str(), mode) != 0) throw ConfigError("cannot chmod '" + path + "': " + std::strerror(errno));
  out << text;
  out.close();
  if (!out) throw ConfigError("cannot write key file '" + path + "'");
}

std::string frame_string(const zmq::message_t& m) { return std::string(static_cast<const char*>(m.data()), m.size()); }

}  // namespace

KeyPair generate_keypair() {
  char pub[kZ85KeyChars + 1], sec[kZ85KeyChars + 1];
  if (zmq_curve_keypair(pub, sec) != 0)
    throw Error(std::string("cannot generate a CURVE key pair: ") + zmq_strerror(zmq_errno()) +
                " (libzmq built without CURVE?)");
  return {pub, sec};
}

bool is_z85_key(const std::string& z85) {
  if (z85.size() != kZ85KeyChars) return false;
  uint8_t out[32];
  return zmq_z85_decode(out, z85.c_str()) != nullptr;
}

void write_keypair(const std::string& dir, const std::string& name, const KeyPair& keys) {
  SPARROW_CHECK_T(ConfigError, !name.empty() && name.find('/') == std::string::npos,
                  "key name '" << name << "' must be non-empty and contain no '/'");
  SPARROW_CHECK_T(ConfigError, is_z85_key(keys.public_key) && is_z85_key(keys.secret_key), "invalid key pair");
  std::error_code ec;
  fs::create_directories(dir, ec);
  SPARROW_CHECK_T(ConfigError, !ec, "cannot create key directory '" << dir << "': " << ec.message());
  const std::string base = (fs::path(dir) / name).string();
  write_new_file(base + ".key_secret", cert_text(keys, true), 0600);
  write_new_file(base + ".key", cert_text(keys, false), 0644);
}

std::string write_client_keys(const std::string& dir, int clients) {
  std::string list = "# sparrow-server allow-list: one client public key (Z85) or .key file per line\n";
  for (int i = 1; i <= clients; ++i) {
    const std::string name = "client" + std::to_string(i);
    write_keypair(dir, name, generate_keypair());
    list += name + ".key\n";
  }
  const std::string allow = (fs::path(dir) / "allow.txt").string();
  write_new_file(allow, list, 0644);
  return allow;
}

KeyPair load_keypair(const std::string& path) {
  const std::string text = read_text(path);
  const auto pub = cert_value(text, "public-key");
  const auto sec = cert_value(text, "secret-key");
  SPARROW_CHECK_T(ConfigError, pub && is_z85_key(*pub), "key file '" << path << "' has no valid public-key");
  SPARROW_CHECK_T(ConfigError, sec && is_z85_key(*sec),
                  "key file '" << path << "' has no valid secret-key (pass the .key_secret file)");
  // The secret must belong to the public key.
  char derived[kZ85KeyChars + 1];
  SPARROW_CHECK_T(ConfigError, zmq_curve_public(derived, sec->c_str()) == 0 && *pub == derived,
                  "key file '" << path << "': public-key does not match secret-key");
  return {*pub, *sec};
}

std::string load_public_key(const std::string& path) {
  const std::string text = read_text(path);
  const auto pub = cert_value(text, "public-key");
  SPARROW_CHECK_T(ConfigError, pub && is_z85_key(*pub), "key file '" << path << "' has no valid public-key");
  return *pub;
}

namespace {
std::set<std::string> read_allow_list(const std::string& path);
}  // namespace

std::set<std::string> load_allow_list(const std::string& path) {
  std::set<std::string> out = read_allow_list(path);
  SPARROW_CHECK_T(ConfigError, !out.empty(),
                  "allow-list '" << path << "' admits no key: no client could connect (add .key files or Z85 keys)");
  return out;
}

void check_endpoint(const std::string& key, const std::string& endpoint, bool for_bind) {
  auto bad = [&](const std::string& why) {
    throw ConfigError(key + ": '" + endpoint + "' is not a usable ZeroMQ endpoint: " + why);
  };
  const auto sep = endpoint.find("://");
  if (sep == std::string::npos) bad("expected tcp://HOST:PORT (or ipc://PATH, inproc://NAME)");
  const std::string transport = endpoint.substr(0, sep), rest = endpoint.substr(sep + 3);
  if (transport == "ipc" || transport == "inproc" || transport == "mem") {
    if (rest.empty()) bad("empty " + transport + " address");
    return;
  }
  if (transport != "tcp") bad("unknown transport '" + transport + "' (tcp, ipc or inproc)");
  const auto colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0) bad("expected tcp://HOST:PORT");
  const std::string port = rest.substr(colon + 1);
  if (port == "*") {
    if (!for_bind) bad("a connect needs a port number, not '*'");
    return;
  }
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos)
    bad("port '" + port + "' is not a number in 0..65535");
  const long p = std::stol(port);
  if (p > 65535) bad("port " + port + " is above 65535");
  if (p == 0 && !for_bind) bad("a connect needs a port in 1..65535");
}

namespace {
std::set<std::string> read_allow_list(const std::string& path) {
  std::set<std::string> out;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (const auto& entry : fs::directory_iterator(path, ec))
      if (entry.is_regular_file() && entry.path().extension() == ".key")
        out.insert(load_public_key(entry.path().string()));
    SPARROW_CHECK_T(ConfigError, !ec, "cannot list allow-list directory '" << path << "': " << ec.message());
    return out;
  }
  const std::string text = read_text(path);
  const fs::path base = fs::path(path).parent_path();
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    // '#' is in the Z85 alphabet, so a comment is a '#' that starts the line
    // or follows whitespace; the entry is the line's first word.
    const std::string t = trim(line);
    if (t.empty() || t[0] == '#') continue;
    const std::string entry = t.substr(0, t.find_first_of(" \t"));
    const std::string rest = trim(t.substr(entry.size()));
    SPARROW_CHECK_T(ConfigError, rest.empty() || rest[0] == '#',
                    "allow-list '" << path << "' line " << lineno << ": unexpected text after the entry");
    if (is_z85_key(entry)) {
      out.insert(entry);
      continue;
    }
    const fs::path p = fs::path(entry).is_absolute() ? fs::path(entry) : base / entry;
    std::error_code ec;  // a name too long for the file system is no file either (found by fuzz_allow_list)
    SPARROW_CHECK_T(ConfigError, fs::exists(p, ec) && !ec,
                    "allow-list '" << path << "' line " << lineno << ": neither a Z85 key nor an existing key file");
    out.insert(load_public_key(p.string()));
  }
  return out;
}
}  // namespace

ZapHandler::ZapHandler(zmq::context_t& ctx, std::set<std::string> allowed, Observer observer)
    : socket_(ctx, zmq::socket_type::rep), allowed_(std::move(allowed)), observer_(std::move(observer)) {
  socket_.set(zmq::sockopt::linger, 0);
  socket_.bind(kZapEndpoint);
  thread_ = std::thread([this] { run(); });
}

ZapHandler::~ZapHandler() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void ZapHandler::set_allowed(std::set<std::string> allowed) {
  std::lock_guard<std::mutex> lock(mu_);
  allowed_ = std::move(allowed);
}

void ZapHandler::run() {
  // RFC 27 request: version, request id, domain, address, identity, mechanism,
  // credentials...; reply: version, request id, status code, status text,
  // user id, metadata.
  while (!stop_) {
    zmq::pollitem_t item{static_cast<void*>(socket_), 0, ZMQ_POLLIN, 0};
    try {
      if (zmq::poll(&item, 1, std::chrono::milliseconds(100)) <= 0) continue;
      std::vector<zmq::message_t> frames;
      do {
        frames.emplace_back();
        if (!socket_.recv(frames.back(), zmq::recv_flags::none)) break;
      } while (frames.back().more());
      std::string status = "400", text = "malformed ZAP request", user;
      std::string version = frames.size() > 0 ? frame_string(frames[0]) : "";
      std::string request_id = frames.size() > 1 ? frame_string(frames[1]) : "";
      std::string address = frames.size() > 3 ? frame_string(frames[3]) : "";
      if (frames.size() >= 7 && version == "1.0" && frame_string(frames[5]) == "CURVE" && frames[6].size() == 32) {
        char z85[kZ85KeyChars + 1];
        zmq_z85_encode(z85, static_cast<const uint8_t*>(frames[6].data()), 32);
        const std::string key(z85);
        bool ok;
        {
          std::lock_guard<std::mutex> lock(mu_);
          ok = allowed_.count(key) > 0;
        }
        if (ok) {
          status = "200", text = "OK", user = key;
          ++admitted_;
        } else {
          text = "client key not allowed";
          ++refused_;
        }
        if (observer_) observer_(key, address, ok);
      } else {
        ++refused_;
        if (observer_) observer_("", address, false);
      }
      socket_.send(zmq::buffer(version.empty() ? std::string("1.0") : version), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(request_id), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(status), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(text), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(user), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(std::string()), zmq::send_flags::none);
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;  // context shutting down
    }
  }
}

void make_curve_server(zmq::socket_t& socket, const KeyPair& server) {
  socket.set(zmq::sockopt::curve_server, 1);
  socket.set(zmq::sockopt::curve_secretkey, server.secret_key);
  socket.set(zmq::sockopt::zap_domain, kZapDomain);
}

void make_curve_client(zmq::socket_t& socket, const KeyPair& client, const std::string& server_public_key) {
  SPARROW_CHECK_T(ConfigError, is_z85_key(server_public_key), "invalid server public key");
  socket.set(zmq::sockopt::curve_serverkey, server_public_key);
  socket.set(zmq::sockopt::curve_publickey, client.public_key);
  socket.set(zmq::sockopt::curve_secretkey, client.secret_key);
}

void set_limits(zmq::socket_t& socket, uint64_t max_message_bytes, int heartbeat_ms) {
  socket.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(max_message_bytes));
  socket.set(zmq::sockopt::linger, 0);
  if (heartbeat_ms > 0) {
    socket.set(zmq::sockopt::heartbeat_ivl, heartbeat_ms);
    socket.set(zmq::sockopt::heartbeat_timeout, 3 * heartbeat_ms);
    socket.set(zmq::sockopt::heartbeat_ttl, 3 * heartbeat_ms);
  }
}

std::string peer_key(const zmq::message_t& frame) {
  const char* user = zmq_msg_gets(const_cast<zmq_msg_t*>(frame.handle()), "User-Id");
  return user ? std::string(user) : std::string();
}

bool send(zmq::socket_t& socket, const wire::Message& message, bool dont_wait) {
  const std::string bytes = wire::serialize(message);
  return socket.send(zmq::buffer(bytes), dont_wait ? zmq::send_flags::dontwait : zmq::send_flags::none).has_value();
}

bool send_bytes_to(zmq::socket_t& router, const std::string& routing_id, const std::string& bytes, bool dont_wait) {
  const auto flags = dont_wait ? zmq::send_flags::dontwait : zmq::send_flags::none;
  try {
    if (!router.send(zmq::buffer(routing_id), flags | zmq::send_flags::sndmore)) return false;
    return router.send(zmq::buffer(bytes), flags).has_value();
  } catch (const zmq::error_t& e) {
    if (e.num() == EHOSTUNREACH) return false;  // ZMQ_ROUTER_MANDATORY: the peer is gone
    throw;
  }
}

bool send_to(zmq::socket_t& router, const std::string& routing_id, const wire::Message& message, bool dont_wait) {
  return send_bytes_to(router, routing_id, wire::serialize(message), dont_wait);
}

std::optional<RoutedFrame> receive_routed(zmq::socket_t& router) {
  zmq::message_t id;
  if (!router.recv(id, zmq::recv_flags::dontwait)) return std::nullopt;
  RoutedFrame out;
  out.routing_id.assign(static_cast<const char*>(id.data()), id.size());
  if (!id.more()) {
    out.payload = false;
    return out;
  }
  if (!router.recv(out.frame, zmq::recv_flags::none)) return std::nullopt;
  while (out.frame.more()) {
    zmq::message_t drop;
    (void)router.recv(drop, zmq::recv_flags::none);
    out.extra_frames = true;
    if (!drop.more()) break;
  }
  return out;
}

std::optional<wire::Message> receive(zmq::socket_t& socket, int timeout_ms, const wire::ParseLimits& limits) {
  zmq::pollitem_t item{static_cast<void*>(socket), 0, ZMQ_POLLIN, 0};
  if (zmq::poll(&item, 1, std::chrono::milliseconds(timeout_ms)) <= 0) return std::nullopt;
  zmq::message_t frame;
  if (!socket.recv(frame, zmq::recv_flags::dontwait)) return std::nullopt;
  return wire::parse(frame.data(), frame.size(), limits);
}

wire::Message error_message(wire::ErrorCode code, const std::string& text, std::optional<uint64_t> round) {
  wire::Message m;
  m.body = wire::ErrorBody{code, core::peer_text(text), round};
  return m;
}

}  // namespace sparrow::net
