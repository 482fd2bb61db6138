// The gRPC rendezvous store against a real geofp8-coordinator on 127.0.0.1: set/get/wait/add,
// timeouts that name the key, per-job and per-attempt scoping, auth, and a Gloo rendezvous.
#include "worker/daemon/grpc_store.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "kernels/common/check.h"
#include "kernels/exchange/gloo_communicator.h"
#include "tests/worker/coordinator_process.h"

namespace geofp8::worker {
namespace {

using std::chrono::milliseconds;
using testing::CoordinatorProcess;

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

ConnectionOptions Opts(const std::string& address, const std::string& token,
                       const std::string& tls_ca) {
  ConnectionOptions o;
  o.address = address;
  o.token = token;
  o.tls_ca = tls_ca;
  return o;
}

class GrpcStoreTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { coordinator_ = new CoordinatorProcess(); }
  static void TearDownTestSuite() {
    delete coordinator_;
    coordinator_ = nullptr;
  }
  std::shared_ptr<Connection> Connect(const std::string& token = "") {
    auto c = Connection::Open(Opts(coordinator_->address(), token, ""));
    EXPECT_TRUE(c.ok()) << c.status();
    return *c;
  }
  static CoordinatorProcess* coordinator_;
};
CoordinatorProcess* GrpcStoreTest::coordinator_ = nullptr;

TEST_F(GrpcStoreTest, SetThenGetReturnsBinaryValue) {
  GrpcStore store(Connect(), "job-a", "job-a/0/");
  std::vector<uint8_t> value = {0, 1, 2, 255, 0, 7};
  store.Set("k", value);
  EXPECT_EQ(store.Get("k", milliseconds(1000)), value);
  store.Set("k", Bytes("replaced"));
  EXPECT_EQ(store.Get("k", milliseconds(1000)), Bytes("replaced"));
}

TEST_F(GrpcStoreTest, GetWaitsForAKeySetLater) {
  GrpcStore reader(Connect(), "job-b", "job-b/0/");
  GrpcStore writer(Connect(), "job-b", "job-b/0/");
  // Ordered by events, not by elapsed time: the key is written only after the reader has asked
  // for it once and seen it missing, and Get must return the value written after that.
  ASSERT_THROW(reader.Get("late", milliseconds(1)), Error);
  std::atomic<bool> setting{false};
  std::thread t([&] {
    std::this_thread::sleep_for(milliseconds(300));  // lets the reader block first (not asserted)
    setting = true;
    writer.Set("late", Bytes("here"));
  });
  // A generous timeout: a Get that never saw the later Set throws instead of hanging the test.
  EXPECT_EQ(reader.Get("late", milliseconds(60000)), Bytes("here"));
  EXPECT_TRUE(setting.load()) << "Get returned before the key was written";
  t.join();
}

TEST_F(GrpcStoreTest, GetTimeoutNamesTheKeyAndHonoursTheTimeout) {
  GrpcStore store(Connect(), "job-c", "job-c/0/");
  const auto start = std::chrono::steady_clock::now();
  try {
    store.Get("never", milliseconds(400));
    FAIL() << "Get of a missing key returned";
  } catch (const StoreTimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("'job-c/0/never'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
  // The lower bound is the property (it must not give up early; 50 ms allow for the two
  // processes' timers) and load only lengthens the wait; the upper bound only says the timeout
  // is honoured at all, not how promptly.
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, milliseconds(350));
  EXPECT_LT(took, milliseconds(60000));
}

TEST_F(GrpcStoreTest, WaitReturnsWhenAllKeysExistAndTimesOutOtherwise) {
  GrpcStore store(Connect(), "job-d", "job-d/0/");
  store.Set("x", Bytes("1"));
  EXPECT_THROW(store.Wait({"x", "y"}, milliseconds(300)), StoreTimeoutError);
  std::thread t([&] {
    std::this_thread::sleep_for(milliseconds(200));
    store.Set("y", Bytes("2"));
  });
  EXPECT_NO_THROW(store.Wait({"x", "y"}, milliseconds(10000)));
  t.join();
  EXPECT_NO_THROW(store.Wait({}, milliseconds(1)));
}

TEST_F(GrpcStoreTest, AddIsAtomicAcrossClients) {
  constexpr int kThreads = 4, kAdds = 25;
  std::vector<std::thread> threads;
  std::atomic<int64_t> max_seen{0};
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      GrpcStore store(Connect(), "job-e", "job-e/0/");
      for (int j = 0; j < kAdds; ++j) {
        const int64_t v = store.Add("counter", 1);
        int64_t m = max_seen.load();
        while (v > m && !max_seen.compare_exchange_weak(m, v)) {
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  GrpcStore store(Connect(), "job-e", "job-e/0/");
  EXPECT_EQ(max_seen.load(), kThreads * kAdds);
  EXPECT_EQ(store.Add("counter", -5), kThreads * kAdds - 5);
  // Counters read back through Get as decimal text (what gloo and ParseStoreInt expect).
  EXPECT_EQ(ParseStoreInt(store.Get("counter", milliseconds(100))), kThreads * kAdds - 5);
}

TEST_F(GrpcStoreTest, AttemptsAndJobsDoNotSeeEachOthersKeys) {
  GrpcStore attempt0(Connect(), "job-f", "job-f/0/");
  GrpcStore attempt1(Connect(), "job-f", "job-f/1/");
  GrpcStore other_job(Connect(), "job-g", "job-f/0/");
  attempt0.Set("rank0/addr", Bytes("stale"));
  EXPECT_THROW(attempt1.Get("rank0/addr", milliseconds(200)), Error);
  EXPECT_THROW(other_job.Get("rank0/addr", milliseconds(200)), Error);
  attempt1.Set("rank0/addr", Bytes("fresh"));
  EXPECT_EQ(attempt1.Get("rank0/addr", milliseconds(100)), Bytes("fresh"));
  EXPECT_EQ(attempt0.Get("rank0/addr", milliseconds(100)), Bytes("stale"));
}

// Gloo's full-mesh rendezvous through the coordinator, then a sum that must be exact.
TEST_F(GrpcStoreTest, GlooRendezvousThroughTheCoordinator) {
  for (int size : {1, 3}) {
    std::vector<std::thread> threads;
    std::vector<std::vector<float>> data(size);
    std::vector<std::string> errors(size);
    for (int r = 0; r < size; ++r) {
      threads.emplace_back([&, r] {
        try {
          GrpcStore store(Connect(), "job-gloo" + std::to_string(size), "job-gloo/0/");
          GlooOptions o;
          o.timeout = milliseconds(20000);
          auto comm = CreateGlooCommunicator(store, r, size, o);
          data[r] = {float(r + 1), float(10 * r), 0.5f};
          comm->AllReduceSum(data[r]);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    const float sum1 = float(size * (size + 1) / 2), sum10 = float(10 * size * (size - 1) / 2);
    for (int r = 0; r < size; ++r) {
      ASSERT_EQ(errors[r], "") << "rank " << r;
      EXPECT_EQ(data[r], (std::vector<float>{sum1, sum10, 0.5f * size})) << "rank " << r;
    }
  }
}

TEST(GrpcStoreNoServerTest, UnreachableCoordinatorFailsNamingTheAddress) {
  // A port nobody listens on: bind, read the port, close.
  auto c = Connection::Open(Opts("127.0.0.1:1", "", ""));
  ASSERT_TRUE(c.ok());
  GrpcStore store(*c, "job", "job/0/");
  store.set_rpc_timeout(milliseconds(500));
  try {
    store.Set("k", Bytes("v"));
    FAIL() << "Set reached nobody and returned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'job/0/k'"), std::string::npos) << e.what();
  }
}

TEST(GrpcStoreAuthTest, TokenIsSentAndAWrongOneIsRejected) {
  testing::TempDir dir("geofp8-token");
  const std::string token_file = dir.path() + "/token";
  std::ofstream(token_file) << "s3cret\n";
  CoordinatorProcess coordinator({"--token-file", token_file});
  auto good = Connection::Open(Opts(coordinator.address(), "s3cret", ""));
  auto bad = Connection::Open(Opts(coordinator.address(), "wrong", ""));
  ASSERT_TRUE(good.ok() && bad.ok());
  GrpcStore ok_store(*good, "job", "job/0/");
  ok_store.Set("k", Bytes("v"));
  EXPECT_EQ(ok_store.Get("k", milliseconds(100)), Bytes("v"));
  GrpcStore bad_store(*bad, "job", "job/0/");
  try {
    bad_store.Set("k", Bytes("x"));
    FAIL() << "a wrong token was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("UNAUTHENTICATED"), std::string::npos) << e.what();
  }
}

// TLS: server-authenticated, then mutual (the coordinator requires a client certificate).
TEST(GrpcStoreTlsTest, ServerAndMutualTls) {
  testing::TempDir dir("geofp8-certs");
  const std::string d = dir.path();
  auto sh = [&](const std::string& cmd) {
    return std::system(("cd " + d + " && " + cmd + " >/dev/null 2>&1").c_str());
  };
  ASSERT_EQ(sh("openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 "
               "-subj /CN=geofp8-test-ca"),
            0);
  for (const std::string name : {"server", "client"}) {
    ASSERT_EQ(sh("openssl req -newkey rsa:2048 -nodes -keyout " + name + ".key -out " + name +
                 ".csr -subj /CN=" + name),
              0);
    std::ofstream(d + "/" + name + ".ext") << "subjectAltName=IP:127.0.0.1,DNS:localhost\n";
    ASSERT_EQ(sh("openssl x509 -req -in " + name +
                 ".csr -CA ca.pem -CAkey ca.key "
                 "-CAcreateserial -out " +
                 name + ".pem -days 2 -extfile " + name + ".ext"),
              0);
  }
  {
    CoordinatorProcess tls({"--tls-cert", d + "/server.pem", "--tls-key", d + "/server.key"});
    auto c = Connection::Open(Opts(tls.address(), "", d + "/ca.pem"));
    ASSERT_TRUE(c.ok()) << c.status();
    GrpcStore store(*c, "job", "job/0/");
    store.Set("k", Bytes("over tls"));
    EXPECT_EQ(store.Get("k", milliseconds(1000)), Bytes("over tls"));
  }
  CoordinatorProcess mtls({"--tls-cert", d + "/server.pem", "--tls-key", d + "/server.key",
                           "--tls-client-ca", d + "/ca.pem"});
  ConnectionOptions with_cert = Opts(mtls.address(), "", d + "/ca.pem");
  with_cert.tls_cert = d + "/client.pem";
  with_cert.tls_key = d + "/client.key";
  auto c = Connection::Open(with_cert);
  ASSERT_TRUE(c.ok()) << c.status();
  GrpcStore store(*c, "job", "job/0/");
  store.Set("k", Bytes("mutual"));
  EXPECT_EQ(store.Get("k", milliseconds(1000)), Bytes("mutual"));
  auto no_cert = Connection::Open(Opts(mtls.address(), "", d + "/ca.pem"));
  ASSERT_TRUE(no_cert.ok());
  GrpcStore refused(*no_cert, "job", "job/0/");
  refused.set_rpc_timeout(milliseconds(1000));
  EXPECT_THROW(refused.Set("k", Bytes("x")), Error);
}

TEST(ConnectionTest, BadFlagsAreNamed) {
  auto c = Connection::Open(Opts("nohostport", "", ""));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("--coordinator"), std::string::npos);
  auto t = Connection::Open(Opts("127.0.0.1:1", "", "/nonexistent/ca.pem"));
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("--tls-ca"), std::string::npos);
  ConnectionOptions half = Opts("127.0.0.1:1", "", "/nonexistent/ca.pem");
  half.tls_cert = "/nonexistent/c.pem";
  auto h = Connection::Open(half);
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("--tls-cert/--tls-key"), std::string::npos);
}

}  // namespace
}  // namespace geofp8::worker
