// The /metrics responder (see http_server.h): one poll loop over non-blocking sockets, a parser
// for the request head only, and one response per connection, written with MSG_NOSIGNAL.
#include "platform/common/http_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <list>
#include <string_view>
#include <vector>

#include "kernels/common/check.h"

namespace geofp8::http {
namespace {

using Clock = std::chrono::steady_clock;

std::string ErrnoText(const char* what, int err) {
  return std::string(what) + ": " + std::strerror(err);
}

// RFC 9110 tchar: the characters of a method or header name.
bool IsTokenChar(char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

bool IsToken(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!IsTokenChar(c)) return false;
  }
  return true;
}

struct Response {
  int code = 200;
  std::string reason = "OK";
  std::string extra_headers;  // each line ends in \r\n
  std::string body;
  bool head_only = false;
};

std::string Serialize(const Response& r) {
  std::string out = "HTTP/1.1 " + std::to_string(r.code) + " " + r.reason + "\r\n";
  out += r.code == 200 ? "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                       : "Content-Type: text/plain; charset=utf-8\r\n";
  out += "Content-Length: " + std::to_string(r.body.size()) + "\r\n";
  out += r.extra_headers;
  out += "Connection: close\r\n\r\n";
  if (!r.head_only) out += r.body;
  return out;
}

Response Error(int code, const char* reason) {
  Response r;
  r.code = code;
  r.reason = reason;
  r.body = std::to_string(code) + " " + reason + "\n";
  return r;
}

// Finds the end of the request head: the first empty line. Bare LF line ends are tolerated, as
// RFC 9112 section 2.2 allows. Returns the offset just past the empty line, or npos.
size_t HeadEnd(std::string_view buf) {
  for (size_t i = 0; i < buf.size(); ++i) {
    if (buf[i] != '\n') continue;
    if (i + 1 < buf.size() && buf[i + 1] == '\n') return i + 2;
    if (i + 2 < buf.size() && buf[i + 1] == '\r' && buf[i + 2] == '\n') return i + 3;
  }
  return std::string_view::npos;
}

// Parses a complete request head and decides the response; `render` runs only for a valid
// GET or HEAD of /metrics.
Response Respond(std::string_view head, const MetricsServer::Render& render) {
  std::vector<std::string_view> lines;
  size_t start = 0;
  while (start < head.size()) {
    size_t nl = head.find('\n', start);
    if (nl == std::string_view::npos) nl = head.size();
    std::string_view line = head.substr(start, nl - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) break;
    lines.push_back(line);
    start = nl + 1;
  }
  if (lines.empty()) return Error(400, "Bad Request");
  // Request line: METHOD SP request-target SP HTTP-version, exactly two single spaces.
  const std::string_view request = lines[0];
  const size_t sp1 = request.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : request.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || request.find(' ', sp2 + 1) != std::string_view::npos) {
    return Error(400, "Bad Request");
  }
  const std::string_view method = request.substr(0, sp1);
  const std::string_view target = request.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string_view version = request.substr(sp2 + 1);
  if (!IsToken(method) || target.empty() || target[0] != '/') return Error(400, "Bad Request");
  for (char c : target) {
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) return Error(400, "Bad Request");
  }
  if (version.size() != 8 || version.substr(0, 5) != "HTTP/" || version[6] != '.' ||
      version[5] < '0' || version[5] > '9' || version[7] < '0' || version[7] > '9') {
    return Error(400, "Bad Request");
  }
  if (version[5] != '1') return Error(505, "HTTP Version Not Supported");
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == std::string_view::npos || !IsToken(lines[i].substr(0, colon))) {
      return Error(400, "Bad Request");
    }
  }
  std::string_view path = target.substr(0, target.find('?'));
  const bool head_only = method == "HEAD";  // a response to HEAD never has a body (RFC 9110)
  if (path != "/metrics") {
    Response r = Error(404, "Not Found");
    r.head_only = head_only;
    return r;
  }
  if (method != "GET" && !head_only) {
    Response r = Error(405, "Method Not Allowed");
    r.extra_headers = "Allow: GET, HEAD\r\n";
    return r;
  }
  Response r;
  try {
    r.body = render();
  } catch (const std::exception& e) {
    r = Error(500, "Internal Server Error");
    r.body += std::string(e.what()) + "\n";
  }
  r.head_only = head_only;
  return r;
}

void SetNonBlocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

}  // namespace

struct MetricsServer::Connection {
  enum class State { kReading, kWriting, kDraining };
  int fd = -1;
  State state = State::kReading;
  Clock::time_point accepted;  // when its slot was taken (eviction picks the oldest reader)
  Clock::time_point deadline;
  std::string in;   // the request head read so far
  std::string out;  // the response not yet written
  size_t written = 0;
};

bool SplitHostPort(const std::string& listen, std::string* host, int* port) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon + 1 >= listen.size() || listen.size() - colon > 6) {
    return false;
  }
  int p = 0;
  for (size_t i = colon + 1; i < listen.size(); ++i) {
    if (listen[i] < '0' || listen[i] > '9') return false;
    p = p * 10 + (listen[i] - '0');
  }
  if (p > 65535) return false;
  *host = listen.substr(0, colon);
  *port = p;
  return true;
}

MetricsServer::MetricsServer(const std::string& host_in, int port, Render render,
                             MetricsServerOptions options)
    : render_(std::move(render)), options_(options) {
  GEOFP8_CHECK(
      options_.max_connections >= 1 && options_.io_timeout_ms >= 1 && options_.max_head_bytes >= 64,
      "MetricsServerOptions out of range");
  if (port < 0 || port > 65535) throw geofp8::Error("port must be in [0, 65535]");
  std::string host = host_in;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc =
      ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) throw geofp8::Error(std::string("resolve: ") + ::gai_strerror(rc));
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_error = ErrnoText("socket", errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      last_error = ErrnoText("bind", errno);
      ::close(fd);
      continue;
    }
    if (::listen(fd, 128) != 0) {
      last_error = ErrnoText("listen", errno);
      ::close(fd);
      continue;
    }
    listen_fd_ = fd;
    break;
  }
  ::freeaddrinfo(res);
  if (listen_fd_ < 0) throw geofp8::Error(last_error);
  SetNonBlocking(listen_fd_);
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
  port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (::pipe2(wake_fds_, O_CLOEXEC | O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(listen_fd_);
    throw geofp8::Error(ErrnoText("pipe", err));
  }
  thread_ = std::thread([this] { Loop(); });
}

MetricsServer::~MetricsServer() {
  const char byte = 0;
  [[maybe_unused]] ssize_t n = ::write(wake_fds_[1], &byte, 1);
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_fds_[0]);
  ::close(wake_fds_[1]);
}

void MetricsServer::Loop() {
  std::list<Connection> conns;
  const auto io_timeout = std::chrono::milliseconds(options_.io_timeout_ms);
  Clock::time_point accept_paused_until{};  // after EMFILE: avoid spinning on a full fd table
  std::vector<pollfd> fds;
  std::vector<Connection*> polled;
  char buf[4096];

  auto close_conn = [&](std::list<Connection>::iterator it) {
    ::close(it->fd);
    return conns.erase(it);
  };
  // After bytes arrived: once the head is complete (or too long), the response is due.
  auto advance = [&](Connection& c, Clock::time_point after) {
    const size_t end = HeadEnd(c.in);
    if (end == std::string::npos && c.in.size() <= options_.max_head_bytes) return;
    Response r = end == std::string::npos || end > options_.max_head_bytes
                     ? Error(431, "Request Header Fields Too Large")
                     : Respond(std::string_view(c.in).substr(0, end), render_);
    c.out = Serialize(r);
    c.in.clear();
    c.state = Connection::State::kWriting;
    c.deadline = after + io_timeout;
  };
  for (;;) {
    const Clock::time_point now = Clock::now();
    fds.clear();
    polled.clear();
    fds.push_back({wake_fds_[0], POLLIN, 0});
    const bool accepting = now >= accept_paused_until;
    fds.push_back({listen_fd_, short(accepting ? POLLIN : 0), 0});
    Clock::time_point next = accepting ? now + io_timeout : accept_paused_until;
    for (Connection& c : conns) {
      fds.push_back({c.fd, short(c.state == Connection::State::kWriting ? POLLOUT : POLLIN), 0});
      polled.push_back(&c);
      if (c.deadline < next) next = c.deadline;
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count();
    const int ready = ::poll(fds.data(), fds.size(), int(std::max<int64_t>(wait, 0) + 1));
    if (ready < 0 && errno != EINTR) break;  // cannot happen with valid fds; stop serving
    if (fds[0].revents != 0) break;          // the destructor asks us to stop

    // Connections first: ready ones make progress, expired ones are dropped.
    const Clock::time_point after = Clock::now();
    for (size_t i = 0; i < polled.size(); ++i) {
      Connection& c = *polled[i];
      const short ev = fds[i + 2].revents;
      if (ev & (POLLIN | POLLHUP | POLLERR)) {
        if (c.state == Connection::State::kReading) {
          const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
          if (n < 0 && errno != EAGAIN && errno != EINTR) {
            c.deadline = Clock::time_point::min();  // connection broken: drop
            continue;
          }
          if (n == 0 && c.in.empty()) {
            c.deadline = Clock::time_point::min();  // closed without a request: drop
            continue;
          }
          if (n == 0) {
            // Half-closed in the middle of a head: it can never complete. Say so.
            c.out = Serialize(Error(400, "Bad Request"));
            c.in.clear();
            c.state = Connection::State::kWriting;
            c.deadline = after + io_timeout;
          } else if (n > 0) {
            c.in.append(buf, size_t(n));
            advance(c, after);
            if (c.state == Connection::State::kReading) continue;
          }
        } else if (c.state == Connection::State::kDraining) {
          const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
          if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
            c.deadline = Clock::time_point::min();  // client closed: done
          }
          continue;
        }
      }
      // Writing is tried at once: the socket buffer usually takes the whole response.
      if (c.state == Connection::State::kWriting) {
        const ssize_t n = ::send(c.fd, c.out.data() + c.written, c.out.size() - c.written,
                                 MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno != EAGAIN && errno != EINTR) {
          c.deadline = Clock::time_point::min();
          continue;
        }
        if (n > 0) c.written += size_t(n);
        if (c.written == c.out.size()) {
          stats_.responses.fetch_add(1, std::memory_order_relaxed);
          c.out.clear();
          ::shutdown(c.fd, SHUT_WR);
          c.state = Connection::State::kDraining;
          c.deadline = after + std::chrono::milliseconds(options_.linger_ms);
        }
      }
    }
    for (auto it = conns.begin(); it != conns.end();) {
      if (it->deadline <= after) {
        if (it->deadline != Clock::time_point::min() && it->state != Connection::State::kDraining) {
          stats_.timed_out.fetch_add(1, std::memory_order_relaxed);
        }
        it = close_conn(it);
      } else {
        ++it;
      }
    }

    if (!accepting || !(fds[1].revents & POLLIN)) continue;
    for (;;) {
      // Full: the oldest connection still waiting for its head makes room (408). A scraper's
      // head comes within a round trip of its connect, long before 63 newer connections push it
      // out, so clients that never finish a head cannot hold the slots between them. One
      // accepted in this pass has not been polled yet and is not evicted before it could be: if
      // only such ones are waiting, the rest stay in the listen backlog, in order, until the
      // next pass has read their heads.
      const bool full = conns.size() >= size_t(options_.max_connections);
      auto victim = conns.end();
      bool fresh_reader = false;
      for (auto it = conns.begin(); full && it != conns.end(); ++it) {
        if (it->state != Connection::State::kReading) continue;
        if (it->accepted == after) {
          fresh_reader = true;
        } else if (victim == conns.end() || it->accepted < victim->accepted) {
          victim = it;
        }
      }
      if (full && victim == conns.end() && fresh_reader) break;
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          accept_paused_until = after + std::chrono::milliseconds(100);
        }
        break;  // EAGAIN: drained; ECONNABORTED and friends: the next poll retries
      }
      stats_.accepted.fetch_add(1, std::memory_order_relaxed);
      if (victim != conns.end()) {
        const std::string slow = Serialize(Error(408, "Request Timeout"));
        [[maybe_unused]] ssize_t n =
            ::send(victim->fd, slow.data(), slow.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        close_conn(victim);
        stats_.evicted.fetch_add(1, std::memory_order_relaxed);
      } else if (full) {
        // Every slot is a response in flight. Best effort and never blocking: the client
        // learns why, and the slot stays free.
        const std::string busy = Serialize(Error(503, "Service Unavailable"));
        [[maybe_unused]] ssize_t n =
            ::send(fd, busy.data(), busy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        ::close(fd);
        stats_.rejected_busy.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      Connection c;
      c.fd = fd;
      c.accepted = after;
      c.deadline = after + io_timeout;
      conns.push_back(std::move(c));
    }
  }
  for (Connection& c : conns) ::close(c.fd);
}

}  // namespace geofp8::http
