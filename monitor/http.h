#pragma once
// The dashboard's HTTP endpoint (`--http HOST:PORT` of sparrow-server and
// sparrow-sim; docs/monitoring.md):
//
//   GET /               the dashboard page (Chart.js inlined; polls /api/*)
//   GET /metrics        Prometheus text format 0.0.4
//   GET /api/run        run identity and configuration
//   GET /api/progress   the round in progress
//   GET /api/rounds     completed rounds, ?since=N for those after round N
//   GET /api/clients    client table, most recently seen first, ?limit=N (default 200, max 10000)
//
// Anything else: 404 for unknown paths, 405 for other methods, 400 for bad
// query values or malformed requests, 413/414 for oversized ones.
//
// Access: a loopback address (127.0.0.0/8, ::1, localhost) is open to local
// users, and requests must name a loopback Host (a web page from elsewhere
// cannot read it through DNS rebinding). Any other address needs token_file:
// every request then carries `Authorization: Bearer TOKEN` (or, for opening
// the page in a browser, `?token=TOKEN`; the page forwards it as the header).
//
// The server runs on its own pool of 8 threads; handlers only read the Board
// (short copies under its lock). A slow or hostile HTTP peer is cut off after
// 3 s of silence and occupies at most one thread meanwhile; at most 64 more
// accepted connections wait for a thread (then the kernel's backlog), so a
// flood cannot exhaust the process's descriptors. The program's round loop
// waits on HTTP only for short copies under the board's lock. Limits of cpp-httplib 0.11.4 (docs/monitoring.md): a
// peer that trickles a byte every few seconds keeps its thread, so 8 of them
// make the dashboard unavailable (the run goes on); one endless header line
// is buffered without bound before any check. Off loopback, put a reverse
// proxy that bounds request headers in front.

#include <memory>
#include <string>

#include "monitor/board.h"

namespace sparrow::monitor {

struct HttpAddress {
  std::string host;
  int port = 0;  // 0: any free port
  bool loopback = false;
};
// "127.0.0.1:8080", "localhost:8080", "[::1]:8080", "0.0.0.0:8080". ConfigError
// on anything else (no port, port > 65535, empty host).
HttpAddress parse_http_address(const std::string& address);

class HttpEndpoint {
 public:
  // Binds now (ConfigError when the address is bad, taken, or not loopback
  // without a token file; or the token file is missing or shorter than 16
  // characters) and serves on a background thread until destroyed.
  HttpEndpoint(const std::string& address, const std::string& token_file, std::shared_ptr<const Board> board);
  ~HttpEndpoint();
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  int port() const;
  // "http://HOST:PORT/" with the port resolved.
  const std::string& url() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;  // shared with the serving thread (see ~HttpEndpoint)
};

}  // namespace sparrow::monitor
