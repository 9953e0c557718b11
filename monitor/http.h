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
// query values or malformed requests, 413 for a body, 431 for a head over
// 8 KB, 408 for a head not complete within 3 s.
//
// Access: a loopback address (127.0.0.0/8, ::1, localhost) is open to local
// users, and requests must name a loopback Host (a web page from elsewhere
// cannot read it through DNS rebinding). Any other address needs token_file:
// every request then carries `Authorization: Bearer TOKEN` (or, for opening
// the page in a browser, `?token=TOKEN`; the page forwards it as the header).
//
// One guard thread owns the only listening socket and every connection
// (non-blocking I/O; no listener exists besides the public one). It reads each
// request head under hard limits (8 KB, 3 s in all; 431 / 408 answered by the
// guard itself, bodies refused with 413) and hands the complete head to one
// of 2 workers, which run cpp-httplib's request handling on it in memory;
// the guard sends the answer within 10 s. Connections are capped at 128 in
// all and 16 per peer address (IPv6: per /64); a new connection over a cap
// closes the oldest one still sending its head (or reading its answer for
// over 1 s), so idle, trickling and non-reading connections cannot keep an
// honest request waiting. Memory is bounded: heads by 8 KB a connection, an
// answer by 16 MB, answers waiting to be sent by 32 MB; Range headers are
// dropped (a multi-range answer repeats the page per range). Handlers only
// read the Board (short copies under its lock): the program's round loop
// never waits on a peer.

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
  std::shared_ptr<Impl> impl_;
};

}  // namespace sparrow::monitor
