// Test helper for the coordinator's handler tests: a fake clock, session sinks that keep what
// they are sent, and a fixture with a Coordinator over an in-memory (or temp-dir) SQLite store
// and the calls every such test makes (submit, get, a worker that registers and opens its
// session, its messages).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "server/coordinator/coordinator.h"

namespace geofp8::coordinator {

class FakeClock : public Clock {
 public:
  int64_t now = 1'000'000;
  int64_t NowMs() override { return now; }
};

class FakeSink : public SessionSink {
 public:
  void Send(const v1::CoordinatorMessage& m) override {
    std::lock_guard<std::mutex> lock(mu);
    messages.push_back(m);
  }
  std::vector<v1::CoordinatorMessage> Take(v1::CoordinatorMessage::BodyCase kind) {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<v1::CoordinatorMessage> out;
    for (const auto& m : messages) {
      if (m.body_case() == kind) out.push_back(m);
    }
    return out;
  }
  std::vector<v1::Assignment> Assignments() {
    std::vector<v1::Assignment> out;
    for (const auto& m : Take(v1::CoordinatorMessage::kAssignment)) out.push_back(m.assignment());
    return out;
  }
  std::mutex mu;
  std::vector<v1::CoordinatorMessage> messages;
};

// A registered worker with its session open.
struct Worker {
  std::string id;
  uint64_t generation = 0;
  std::string secret;  // RegisterResponse.session_secret
  std::shared_ptr<FakeSink> sink = std::make_shared<FakeSink>();
};

class CoordinatorHarness : public ::testing::Test {
 protected:
  void SetUp() override { Open(""); }
  // A fresh Coordinator over the store in `dir` ("": in memory), recovered from it.
  void Open(const std::string& dir) {
    coordinator.reset();
    auto s = Store::Open(dir);
    ASSERT_TRUE(s.ok()) << s.status();
    store = std::move(*s);
    coordinator = std::make_unique<Coordinator>(store.get(), &clock, options);
    ASSERT_TRUE(coordinator->Recover().ok());
  }
  std::string Submit(const std::string& yaml, const std::string& key = "") {
    v1::SubmitJobRequest req;
    req.set_spec_yaml(yaml);
    req.set_idempotency_key(key);
    auto r = coordinator->SubmitJob(req);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->job().id() : "";
  }
  v1::Job Get(const std::string& id) {
    v1::GetJobRequest req;
    req.set_job_id(id);
    auto r = coordinator->GetJob(req);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : v1::Job();
  }
  // Registers `req` and opens the new generation's session with its secret.
  Worker Attach(const v1::RegisterRequest& req) {
    auto r = coordinator->Register(req);
    EXPECT_TRUE(r.ok()) << r.status();
    Worker w;
    if (!r.ok()) return w;
    w.id = r->worker_id();
    w.generation = r->generation();
    w.secret = r->session_secret();
    EXPECT_TRUE(coordinator->OpenSession(w.id, w.generation, w.secret, w.sink).ok());
    return w;
  }
  Worker Join(const std::string& name) {
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_device("cpu");
    return Attach(req);
  }
  absl::Status Send(const Worker& w, v1::WorkerMessage m) {
    m.set_worker_id(w.id);
    m.set_generation(w.generation);
    return coordinator->HandleWorkerMessage(m);
  }
  absl::Status Heartbeat(const Worker& w, uint64_t seq = 0) {
    v1::WorkerMessage m;
    m.set_seq(seq);
    m.mutable_heartbeat()->set_unix_ms(clock.now);
    return Send(w, m);
  }

  FakeClock clock;
  // What Open gives the Coordinator; a test may change it and Open again.
  CoordinatorOptions options = [] {
    CoordinatorOptions o;
    o.heartbeat_timeout_ms = 1000;
    return o;
  }();
  std::unique_ptr<Store> store;
  std::unique_ptr<Coordinator> coordinator;
};

}  // namespace geofp8::coordinator
