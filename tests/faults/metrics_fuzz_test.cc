// HTTP fuzzing of the real daemons' /metrics ports: methods, paths, garbage and mutated requests,
// slow clients and 500 concurrent connections. The process must survive and keep answering.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/http_client.h"
#include "tests/worker/coordinator_process.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// The metrics port printed by either daemon ("metrics on http://HOST:PORT/metrics").
int PrintedMetricsPort(ChildProcess& p) {
  if (!p.WaitFor("/metrics\n", seconds(20))) return -1;
  const std::string out = p.output();
  const size_t at = out.find("metrics on http://");
  const size_t colon = out.find(':', at + 18);
  return std::stoi(out.substr(colon + 1));
}

// Sends `request`, half-closes (so an incomplete head ends at once instead of at the server's
// read deadline), and returns the whole response.
std::string SendAndHalfClose(int port, const std::string& request) {
  const int fd = HttpConnect(port);
  if (fd < 0) return "connect failed";
  HttpSend(fd, request);
  ::shutdown(fd, SHUT_WR);
  std::string out = HttpReadAll(fd);
  ::close(fd);
  return out;
}

struct FuzzCounts {
  std::map<int, int> by_status;  // -1: the connection closed without a response
  int requests = 0;
};

// Runs every phase against `port` of `proc`; `metric` must appear in each /metrics body.
void Fuzz(ChildProcess& proc, int port, const std::string& metric) {
  auto scrape_ok = [&] {
    const std::string r = HttpExchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    return HttpStatus(r) == 200 && HttpBody(r).find(metric) != std::string::npos;
  };
  ASSERT_TRUE(scrape_ok()) << proc.output();
  FuzzCounts counts;
  const std::set<int> allowed = {200, 400, 404, 405, 431, 505};
  auto record = [&](const std::string& what, const std::string& response, bool may_drop) {
    const int status = HttpStatus(response);
    ++counts.requests;
    ++counts.by_status[status];
    if (status == -1) {
      EXPECT_TRUE(may_drop && response.empty()) << what << " -> " << response.substr(0, 200);
    } else {
      EXPECT_TRUE(allowed.count(status)) << what << " -> " << status;
    }
  };

  // 1. Methods x paths.
  const std::vector<std::string> methods = {"GET",
                                            "HEAD",
                                            "POST",
                                            "PUT",
                                            "DELETE",
                                            "TRACE",
                                            "OPTIONS",
                                            "PATCH",
                                            "get",
                                            "CONNECT",
                                            std::string(5000, 'G')};
  const std::vector<std::string> paths = {"/",
                                          "/metrics",
                                          "/metrics/",
                                          "/metrics?a=b&c",
                                          "/%00",
                                          "/../../etc/passwd",
                                          "*",
                                          "//metrics",
                                          "http://x/metrics",
                                          "/metrics#frag",
                                          "/\xff\xfe",
                                          "/" + std::string(3000, 'a'),
                                          "/" + std::string(20000, 'b')};
  for (const auto& m : methods) {
    for (const auto& p : paths) {
      record(m + " " + p.substr(0, 40),
             SendAndHalfClose(port, m + " " + p + " HTTP/1.1\r\nHost: x\r\n\r\n"), false);
    }
  }
  ASSERT_TRUE(proc.running()) << proc.output();

  // 2. Garbage bytes and 3. mutated valid requests, sent in random pieces.
  std::mt19937 rng(20261201);
  const std::string valid = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n";
  for (int i = 0; i < 400; ++i) {
    std::string req;
    if (i % 2 == 0) {
      req.resize(std::uniform_int_distribution<size_t>(1, i % 10 == 0 ? 20000 : 300)(rng));
      for (char& c : req) c = char(rng());
      if (i % 4 == 0) req += "\r\n\r\n";
    } else {
      req = valid;
      const int edits = std::uniform_int_distribution<int>(1, 6)(rng);
      for (int e = 0; e < edits && !req.empty(); ++e) {
        const size_t at = std::uniform_int_distribution<size_t>(0, req.size() - 1)(rng);
        switch (rng() % 3) {
          case 0:
            req[at] = char(rng());
            break;
          case 1:
            req.erase(at, 1);
            break;
          default:
            req.insert(at, 1, char(rng()));
            break;
        }
      }
    }
    const int fd = HttpConnect(port);
    ASSERT_GE(fd, 0) << "connect failed after " << counts.requests << " requests";
    for (size_t off = 0; off < req.size();) {
      const size_t n = std::min(req.size() - off, size_t(1 + rng() % 64));
      HttpSend(fd, req.substr(off, n));
      off += n;
    }
    ::shutdown(fd, SHUT_WR);
    record("fuzz #" + std::to_string(i), HttpReadAll(fd), /*may_drop=*/true);
    ::close(fd);
  }
  ASSERT_TRUE(proc.running()) << proc.output();
  ASSERT_TRUE(scrape_ok());

  // 4. Slow clients holding partial heads do not delay a scrape.
  std::vector<int> slow;
  for (int i = 0; i < 30; ++i) {
    slow.push_back(HttpConnect(port));
    HttpSend(slow.back(), "GET /metrics HTTP/1.1\r\nHo");
  }
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(scrape_ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, milliseconds(1000));
  for (int fd : slow) ::close(fd);

  // 5. 500 concurrent connections.
  std::atomic<int> ok{0}, busy{0}, bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 50; ++t) {
    threads.emplace_back([&] {
      std::vector<int> fds;
      for (int i = 0; i < 10; ++i) fds.push_back(HttpConnect(port));
      for (int fd : fds) HttpSend(fd, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
      for (int fd : fds) {
        const std::string r = fd < 0 ? "" : HttpReadAll(fd);
        const int status = HttpStatus(r);
        if (status == 200 && HttpBody(r).find(metric) != std::string::npos) {
          ++ok;
        } else if (status == 503 || status == 408 || r.empty()) {
          ++busy;  // refused, or made room for a newer connection before its head arrived
        } else {
          ++bad;
        }
        if (fd >= 0) ::close(fd);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GE(ok.load(), 64);
  ASSERT_TRUE(proc.running()) << proc.output();
  EXPECT_TRUE(scrape_ok());

  std::string summary;
  for (const auto& [status, n] : counts.by_status) {
    summary += " " + std::to_string(status) + ":" + std::to_string(n);
  }
  std::printf("fuzz: %d requests, by status%s; 500 concurrent: %d ok, %d refused\n",
              counts.requests, summary.c_str(), ok.load(), busy.load());
}

TEST(MetricsFuzzTest, CoordinatorSurvivesAndKeepsAnswering) {
  TempDir dir("geofp8-fuzz");
  ChildProcess coordinator({GEOFP8_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--metrics-listen",
                            "127.0.0.1:0", "--data-dir", dir.path()});
  const int port = PrintedMetricsPort(coordinator);
  ASSERT_GT(port, 0) << coordinator.output();
  Fuzz(coordinator, port, "geofp8_jobs{state=\"pending\"}");
  coordinator.Kill(SIGTERM);
  EXPECT_EQ(coordinator.Wait(seconds(20)), 0) << coordinator.output();
}

TEST(MetricsFuzzTest, WorkerSurvivesAndKeepsAnswering) {
  CoordinatorProcess coordinator;
  WorkerProcess worker(coordinator.address(), "fuzzed");
  const int port = PrintedMetricsPort(worker.process());
  ASSERT_GT(port, 0) << worker.process().output();
  Fuzz(worker.process(), port, "geofp8_worker_assigned");
  worker.process().Kill(SIGTERM);
  EXPECT_EQ(worker.process().Wait(seconds(20)), 0) << worker.process().output();
}

}  // namespace
}  // namespace geofp8::testing
