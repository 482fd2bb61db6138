// Tests of the /metrics responder over real sockets on 127.0.0.1: paths, methods, malformed and
// oversized heads, slow clients, many concurrent connections, and that it keeps answering.
#include "platform/common/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "kernels/common/check.h"
#include "tests/common/http_client.h"

namespace geofp8::http {
namespace {

using std::chrono::milliseconds;

const char kBody[] = "# TYPE up gauge\nup 1\n";

// The shared raw-HTTP helpers (tests/common/http_client.h) under this file's short names.
constexpr auto& Connect = testing::HttpConnect;
constexpr auto& SendAll = testing::HttpSend;
constexpr auto& ReadAll = testing::HttpReadAll;
constexpr auto& Exchange = testing::HttpExchange;
constexpr auto& StatusCode = testing::HttpStatus;

std::string Header(const std::string& response, const std::string& name) {
  const size_t at = response.find("\r\n" + name + ": ");
  if (at == std::string::npos) return "";
  const size_t start = at + name.size() + 4;
  return response.substr(start, response.find("\r\n", start) - start);
}

std::string Body(const std::string& response) {
  const size_t at = response.find("\r\n\r\n");
  return at == std::string::npos ? "" : response.substr(at + 4);
}

std::string Get(int port, const std::string& path = "/metrics") {
  return Exchange(port, "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
}

TEST(HttpServerTest, GetMetricsServesTheRenderedText) {
  std::atomic<int> renders{0};
  MetricsServer server("127.0.0.1", 0, [&] {
    ++renders;
    return std::string(kBody);
  });
  ASSERT_GT(server.port(), 0);
  const std::string r = Get(server.port());
  EXPECT_EQ(StatusCode(r), 200) << r;
  EXPECT_EQ(Header(r, "Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(Header(r, "Content-Length"), std::to_string(sizeof kBody - 1));
  EXPECT_EQ(Header(r, "Connection"), "close");
  EXPECT_EQ(Body(r), kBody);
  EXPECT_EQ(renders.load(), 1);
  // HTTP/1.0 without Host, a query string and bare LF line ends are all a scrape too.
  EXPECT_EQ(Body(Exchange(server.port(), "GET /metrics HTTP/1.0\r\n\r\n")), kBody);
  EXPECT_EQ(StatusCode(Get(server.port(), "/metrics?name[]=up")), 200);
  EXPECT_EQ(StatusCode(Exchange(server.port(), "GET /metrics HTTP/1.1\nHost: x\n\n")), 200);
}

TEST(HttpServerTest, HeadHasLengthButNoBody) {
  MetricsServer server("127.0.0.1", 0, [] { return std::string(kBody); });
  const std::string r = Exchange(server.port(), "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(StatusCode(r), 200) << r;
  EXPECT_EQ(Header(r, "Content-Length"), std::to_string(sizeof kBody - 1));
  EXPECT_EQ(Body(r), "");
}

TEST(HttpServerTest, OtherPathsAre404AndOtherMethods405) {
  std::atomic<int> renders{0};
  MetricsServer server("127.0.0.1", 0, [&] {
    ++renders;
    return std::string(kBody);
  });
  for (const char* path : {"/", "/metricsx", "/metrics/", "/favicon.ico", "/../metrics", "//"}) {
    EXPECT_EQ(StatusCode(Get(server.port(), path)), 404) << path;
  }
  const std::string head404 = Exchange(server.port(), "HEAD / HTTP/1.1\r\n\r\n");
  EXPECT_EQ(StatusCode(head404), 404);
  EXPECT_EQ(Header(head404, "Content-Length"), "14");  // of the body a GET would get
  EXPECT_EQ(Body(head404), "");
  for (const char* method : {"POST", "PUT", "DELETE", "OPTIONS", "TRACE", "PATCH", "BREW"}) {
    const std::string r =
        Exchange(server.port(), std::string(method) + " /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(StatusCode(r), 405) << method;
    EXPECT_EQ(Header(r, "Allow"), "GET, HEAD") << method;
  }
  EXPECT_EQ(renders.load(), 0);
}

TEST(HttpServerTest, MalformedRequestsAre400) {
  MetricsServer server("127.0.0.1", 0, [] { return std::string(kBody); });
  const std::vector<std::string> bad = {
      std::string("\x00\x01\x02\xff\r\n\r\n", 8),
      "\r\n\r\n",
      "GET\r\n\r\n",
      "GET /metrics\r\n\r\n",
      "GET  /metrics HTTP/1.1\r\n\r\n",
      "GET /metrics HTTP/1.1 extra\r\n\r\n",
      "GET metrics HTTP/1.1\r\n\r\n",
      "GET http://x/metrics HTTP/1.1\r\n\r\n",
      "GET /metrics HTTP/1\r\n\r\n",
      "GET /metrics FTP/1.1\r\n\r\n",
      "G(T /metrics HTTP/1.1\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
      "GET /metrics HTTP/1.1\r\nBad Name: x\r\n\r\n",
      "GET /met\x01rics HTTP/1.1\r\n\r\n",
  };
  for (const std::string& request : bad) {
    EXPECT_EQ(StatusCode(Exchange(server.port(), request)), 400) << request;
  }
  EXPECT_EQ(StatusCode(Exchange(server.port(), "GET /metrics HTTP/2.0\r\n\r\n")), 505);
  // A head cut off by the client's half-close can never complete.
  const int fd = Connect(server.port());
  SendAll(fd, "GET /metrics HTTP/1.1\r\nHost");
  ::shutdown(fd, SHUT_WR);
  EXPECT_EQ(StatusCode(ReadAll(fd)), 400);
  ::close(fd);
  EXPECT_EQ(StatusCode(Get(server.port())), 200);
}

TEST(HttpServerTest, OversizedHeadIs431) {
  MetricsServer server("127.0.0.1", 0, [] { return std::string(kBody); });
  // Without an end of head, and with one past the limit.
  EXPECT_EQ(
      StatusCode(Exchange(server.port(), "GET /metrics HTTP/1.1\r\nX: " + std::string(9000, 'a'))),
      431);
  EXPECT_EQ(StatusCode(Exchange(server.port(), "GET /metrics HTTP/1.1\r\nX: " +
                                                   std::string(8190, 'a') + "\r\n\r\n")),
            431);
  EXPECT_EQ(
      StatusCode(Exchange(server.port(), "GET /" + std::string(100000, 'm') + " HTTP/1.1\r\n\r\n")),
      431);
  // Just under the limit is fine.
  EXPECT_EQ(StatusCode(Exchange(server.port(), "GET /metrics HTTP/1.1\r\nX: " +
                                                   std::string(8000, 'a') + "\r\n\r\n")),
            200);
}

TEST(HttpServerTest, RenderFailureIs500AndTheServerGoesOn) {
  std::atomic<bool> fail{true};
  MetricsServer server("127.0.0.1", 0, [&]() -> std::string {
    if (fail) throw std::runtime_error("collector broke");
    return kBody;
  });
  const std::string r = Get(server.port());
  EXPECT_EQ(StatusCode(r), 500);
  EXPECT_NE(Body(r).find("collector broke"), std::string::npos);
  fail = false;
  EXPECT_EQ(Body(Get(server.port())), kBody);
}

TEST(HttpServerTest, SlowClientDoesNotBlockAScrapeAndIsDroppedAtItsDeadline) {
  MetricsServerOptions options;
  // A scrape takes about a millisecond; one that waited for the slow client would take its whole
  // deadline. The deadline leaves a loaded machine's scheduler a second of room between the two.
  options.io_timeout_ms = 1500;
  MetricsServer server(
      "127.0.0.1", 0, [] { return std::string(kBody); }, options);
  const int slow = Connect(server.port());
  SendAll(slow, "GET /metr");  // and never more
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(Body(Get(server.port())), kBody);
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(1000));
  // The slow client gets nothing and its connection is closed once its time is up.
  EXPECT_EQ(ReadAll(slow), "");
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(1000));
  ::close(slow);
  EXPECT_EQ(server.stats().timed_out.load(), 1u);
}

TEST(HttpServerTest, ExcessConnectionsGet503AndSlotsComeBack) {
  MetricsServerOptions options;
  options.max_connections = 4;
  // Larger than the socket buffers: a client that does not read holds its slot mid-response.
  const std::string big(16 << 20, 'x');
  std::atomic<int> renders{0};
  MetricsServer server(
      "127.0.0.1", 0,
      [&] {
        ++renders;
        return big;
      },
      options);
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(Connect(server.port()));
    SendAll(held.back(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");  // and never read
  }
  // Wait until all four are responses in flight: no slot is waiting for a head.
  while (renders.load() < 4) std::this_thread::sleep_for(milliseconds(1));
  EXPECT_EQ(StatusCode(Get(server.port())), 503);
  EXPECT_EQ(server.stats().evicted.load(), 0u);
  for (int fd : held) ::close(fd);
  // Closed slots are reclaimed on the server's next read of each.
  std::string r;
  for (int i = 0; i < 200 && StatusCode(r) != 200; ++i) {
    r = Get(server.port());
    if (StatusCode(r) != 200) std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_EQ(StatusCode(r), 200);
  EXPECT_EQ(Body(r).size(), big.size());
}

// Issue #31 item 6: slow clients that reconnect as fast as they are dropped held every slot, and
// 0 of 19 scrapes succeeded. When every slot is taken, the oldest unfinished head makes room.
TEST(HttpServerTest, IdleConnectionsHoldingEverySlotLoseThemToAScrape) {
  MetricsServerOptions options;
  options.max_connections = 4;
  MetricsServer server(
      "127.0.0.1", 0, [] { return std::string(kBody); }, options);
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(Connect(server.port()));
    SendAll(held.back(), "GET /met");  // and never more
  }
  while (server.stats().accepted.load() < 4) std::this_thread::sleep_for(milliseconds(1));
  const std::string r = Get(server.port());
  EXPECT_EQ(StatusCode(r), 200) << r;
  EXPECT_EQ(Body(r), kBody);
  EXPECT_EQ(server.stats().evicted.load(), 1u);
  // The oldest was the one evicted, and it was told why.
  EXPECT_EQ(StatusCode(ReadAll(held[0])), 408);
  for (int fd : held) ::close(fd);
}

TEST(HttpServerTest, ScrapesAnswerWhileTwoHundredSlowClientsKeepReconnecting) {
  MetricsServerOptions options;  // the daemons' defaults: 64 slots
  MetricsServer server(
      "127.0.0.1", 0, [] { return std::string(kBody); }, options);
  std::atomic<bool> stop{false};
  std::vector<std::thread> attackers;
  for (int t = 0; t < 4; ++t) {
    attackers.emplace_back([&] {
      std::vector<int> fds(50, -1);  // 4 x 50 = 200 slow clients
      while (!stop.load()) {
        for (int& fd : fds) {
          // A connection the server dropped (or never took) is replaced at once.
          char b;
          if (fd >= 0 && ::recv(fd, &b, 1, MSG_DONTWAIT) == 0) {
            ::close(fd);
            fd = -1;
          } else if (fd >= 0 && ::recv(fd, &b, 1, MSG_DONTWAIT | MSG_PEEK) > 0) {
            ::close(fd);
            fd = -1;
          }
          if (fd < 0 && (fd = Connect(server.port())) >= 0) SendAll(fd, "GET /met");
        }
        std::this_thread::sleep_for(milliseconds(10));
      }
      for (int fd : fds) {
        if (fd >= 0) ::close(fd);
      }
    });
  }
  std::this_thread::sleep_for(milliseconds(500));  // every slot taken, and more waiting
  int ok = 0;
  std::string failures;
  for (int i = 0; i < 20; ++i) {
    const int code = StatusCode(Get(server.port()));
    ok += code == 200;
    if (code != 200) failures += " " + std::to_string(code);
    std::this_thread::sleep_for(milliseconds(100));
  }
  stop = true;
  for (auto& t : attackers) t.join();
  EXPECT_EQ(ok, 20) << "other answers:" << failures;
  EXPECT_GT(server.stats().evicted.load(), 0u);
}

TEST(HttpServerTest, FiveHundredConcurrentConnections) {
  std::string big(200000, 'x');  // larger than a socket buffer: writes must resume
  MetricsServer server("127.0.0.1", 0, [&] { return big; });
  std::atomic<int> ok{0}, busy{0}, other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 50; ++t) {
    threads.emplace_back([&] {
      std::vector<int> fds;
      for (int i = 0; i < 10; ++i) fds.push_back(Connect(server.port()));
      for (int fd : fds) SendAll(fd, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
      for (int fd : fds) {
        const std::string r = fd < 0 ? "" : ReadAll(fd);
        const int code = StatusCode(r);
        if (code == 200 && Body(r) == big) {
          ++ok;
        } else if (code == 503 || code == 408 || r.empty()) {
          // Refused while 64 were open, or made room for a newer one before its head was sent
          // (either may be reset).
          ++busy;
        } else {
          ++other;
        }
        if (fd >= 0) ::close(fd);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok + busy + other, 500);
  EXPECT_EQ(other.load(), 0);
  EXPECT_GE(ok.load(), 64);
  EXPECT_EQ(Body(Get(server.port())), big);
}

TEST(HttpServerTest, ClientThatResetsMidResponseDoesNotKillTheProcess) {
  // Without MSG_NOSIGNAL the server's write into the reset connection raises SIGPIPE, which
  // would end this test binary.
  std::string big(8 << 20, 'x');
  MetricsServer server("127.0.0.1", 0, [&] { return big; });
  for (int i = 0; i < 5; ++i) {
    const int fd = Connect(server.port());
    SendAll(fd, "GET /metrics HTTP/1.1\r\n\r\n");
    char buf[100];
    ASSERT_GT(::recv(fd, buf, sizeof buf, 0), 0);  // the response has started
    linger lg{1, 0};                               // close with RST
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    ::close(fd);
  }
  EXPECT_EQ(Body(Get(server.port())).size(), big.size());
}

TEST(HttpServerTest, PortZeroPicksAFreePortAndABusyPortIsAnError) {
  MetricsServer a("127.0.0.1", 0, [] { return std::string(kBody); });
  EXPECT_GT(a.port(), 0);
  try {
    MetricsServer b("127.0.0.1", a.port(), [] { return std::string(kBody); });
    FAIL() << "second bind on " << a.port() << " succeeded";
  } catch (const geofp8::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Address already in use"), std::string::npos) << e.what();
  }
  EXPECT_THROW(MetricsServer("no.such.host.invalid", 0, [] { return std::string(); }),
               geofp8::Error);
  MetricsServer v6("[::1]", 0, [] { return std::string(kBody); });
  EXPECT_GT(v6.port(), 0);
}

TEST(HttpServerTest, DestructorReturnsWithConnectionsOpen) {
  auto server = std::make_unique<MetricsServer>("127.0.0.1", 0, [] { return std::string(kBody); });
  const int slow = Connect(server->port());
  SendAll(slow, "GET /");
  while (server->stats().accepted.load() < 1) std::this_thread::sleep_for(milliseconds(1));
  const auto start = std::chrono::steady_clock::now();
  server.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(1000));
  EXPECT_EQ(ReadAll(slow), "");  // closed, not left hanging
  ::close(slow);
}

TEST(HttpServerTest, SplitHostPort) {
  std::string host;
  int port = -1;
  EXPECT_TRUE(SplitHostPort("127.0.0.1:9464", &host, &port));
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 9464);
  EXPECT_TRUE(SplitHostPort("[::1]:0", &host, &port));
  EXPECT_EQ(host, "[::1]");
  EXPECT_EQ(port, 0);
  EXPECT_TRUE(SplitHostPort(":80", &host, &port));
  EXPECT_EQ(host, "");
  for (const char* bad : {"", "host", "host:", "host:65536", "host:-1", "host:8o", "h:1234567"}) {
    EXPECT_FALSE(SplitHostPort(bad, &host, &port)) << bad;
  }
}

}  // namespace
}  // namespace geofp8::http
