// Test helper: raw HTTP over blocking sockets on 127.0.0.1, for poking the daemons' /metrics
// ports with well-formed, malformed and slow requests.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace geofp8::testing {

// A connected socket with a 10 s receive timeout (a hung server fails a test, not hangs it), or -1.
inline int HttpConnect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// Writes what the peer takes; a server that closes early (431, 503) is not an error here.
inline void HttpSend(int fd, const std::string& bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += size_t(n);
  }
}

inline std::string HttpReadAll(int fd) {
  std::string out;
  char buf[8192];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) out.append(buf, size_t(n));
  return out;
}

// One request on a fresh connection; everything the server wrote until it closed.
inline std::string HttpExchange(int port, const std::string& request) {
  const int fd = HttpConnect(port);
  if (fd < 0) return "";
  HttpSend(fd, request);
  std::string out = HttpReadAll(fd);
  ::close(fd);
  return out;
}

// The status code of a response, or -1 if it is not an HTTP/1.1 response.
inline int HttpStatus(const std::string& response) {
  if (response.rfind("HTTP/1.1 ", 0) != 0 || response.size() < 12) return -1;
  return std::stoi(response.substr(9, 3));
}

inline std::string HttpBody(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}

}  // namespace geofp8::testing
