#pragma once
// A minimal HTTP/1.1 client over a raw socket for the dashboard tests: it can
// send well-formed requests and the malformed, oversized and slow ones a
// library client would refuse to send.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>

namespace sparrow::testing {

// Connects to 127.0.0.1:port; -1 on failure.
inline int http_connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// True once `r` holds a whole response (headers and Content-Length bytes of body).
inline bool http_complete(const std::string& r) {
  const size_t end = r.find("\r\n\r\n");
  if (end == std::string::npos) return false;
  const std::string head = r.substr(0, end);
  size_t at = head.find("Content-Length: ");
  if (at == std::string::npos) at = head.find("content-length: ");
  if (at == std::string::npos) return false;  // read until the server closes
  const size_t len = std::stoul(head.substr(at + 16));
  return r.size() >= end + 4 + len;
}

// Sends `request` as it is and reads one response: until it is complete, the
// server closes, or `timeout`.
inline std::string http_raw(int port, const std::string& request,
                            std::chrono::milliseconds timeout = std::chrono::milliseconds(10000)) {
  const int fd = http_connect(port);
  if (fd < 0) return "";
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string out;
  const auto until = std::chrono::steady_clock::now() + timeout;
  char buf[65536];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (http_complete(out)) break;
  }
  ::close(fd);
  return out;
}

// GET path with `headers` ("Name: value\r\n" lines); Host 127.0.0.1 unless given.
inline std::string http_get(int port, const std::string& path, const std::string& headers = "") {
  const std::string host = headers.find("Host:") == std::string::npos ? "Host: 127.0.0.1\r\n" : "";
  return http_raw(port, "GET " + path + " HTTP/1.1\r\n" + host + headers + "Connection: close\r\n\r\n");
}

// The status code of a response (0 when there is none).
inline int http_status(const std::string& response) {
  if (response.rfind("HTTP/1.", 0) != 0 || response.size() < 12) return 0;
  return std::stoi(response.substr(9, 3));
}

inline std::string http_body(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}

}  // namespace sparrow::testing
