// The Session streams on gRPC's asynchronous API (server/coordinator/session_stream.h), through the
// real server on loopback: no thread is parked per open stream, messages are answered in order, a
// refused token ends the call, a shutdown ends open streams and retires every call, and (QueuedSink
// against a fake writer) a worker that stops reading its stream has it ended instead of queueing
// without bound.
#include "server/coordinator/session_stream.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/grpc_services.h"
#include "server/coordinator/metrics.h"
#include "server/coordinator/store.h"

namespace geofp8::coordinator {
namespace {

int ThreadsOfThisProcess() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

class SessionStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = Store::Open("");
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
    coordinator_ = std::make_unique<Coordinator>(store_.get(), SystemClock(), CoordinatorOptions{});
    ASSERT_TRUE(coordinator_->Recover().ok());
    metrics_ = std::make_unique<Metrics>(coordinator_.get());
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    auto server = CoordinatorServer::Start(coordinator_.get(), metrics_.get(), options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    address_ = "127.0.0.1:" + std::to_string(server_->port());
  }
  void TearDown() override {
    if (coordinator_) coordinator_->Shutdown();
    if (server_) server_->Shutdown(1000);
  }

  std::shared_ptr<grpc::Channel> Channel(const grpc::ChannelArguments& args = {}) {
    return grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args);
  }

  v1::RegisterResponse Register(v1::WorkerService::Stub* stub, const std::string& name) {
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_device("cpu");
    grpc::ClientContext ctx;
    v1::RegisterResponse resp;
    const grpc::Status st = stub->Register(&ctx, req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return resp;
  }

  static v1::WorkerMessage Beat(const v1::RegisterResponse& r, uint64_t seq) {
    v1::WorkerMessage m;
    m.set_worker_id(r.worker_id());
    m.set_generation(r.generation());
    m.set_session_secret(r.session_secret());
    m.set_seq(seq);
    m.mutable_heartbeat()->set_unix_ms(1);
    return m;
  }

  std::unique_ptr<Store> store_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<CoordinatorServer> server_;
  std::string address_;
};

struct OpenStream {
  std::unique_ptr<grpc::ClientContext> ctx = std::make_unique<grpc::ClientContext>();
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream;
};

// The synchronous server held one thread per open Session: 10,000 threads at 10,000 workers.
TEST_F(SessionStreamTest, OpenSessionsParkNoThreadEach) {
  constexpr int kWorkers = 300;
  auto channel = Channel();
  auto stub = v1::WorkerService::NewStub(channel);
  std::vector<v1::RegisterResponse> registered;
  for (int i = 0; i < kWorkers; ++i)
    registered.push_back(Register(stub.get(), "w" + std::to_string(i)));
  // One stream opened and answered first, so that the server's and the client's own threads
  // (pollers, executors) exist before the count.
  std::vector<OpenStream> streams(kWorkers);
  auto open = [&](int i) {
    streams[i].stream = stub->Session(streams[i].ctx.get());
    ASSERT_TRUE(streams[i].stream->Write(Beat(registered[i], 1)));
    v1::CoordinatorMessage ack;
    ASSERT_TRUE(streams[i].stream->Read(&ack));
    EXPECT_EQ(ack.ack().seq(), 1u);
  };
  open(0);
  const int before = ThreadsOfThisProcess();
  for (int i = 1; i < kWorkers; ++i) open(i);
  const int after = ThreadsOfThisProcess();
  EXPECT_EQ(coordinator_->GetCounts().workers_by_state[v1::WORKER_IDLE], kWorkers);
  // A thread a stream would add kWorkers - 1; the pools are fixed (8 session threads, gRPC's
  // executors sized by the cores, not the streams).
  EXPECT_LT(after - before, 64) << before << " threads before, " << after << " after";
  for (auto& s : streams) {
    s.stream->WritesDone();
    EXPECT_TRUE(s.stream->Finish().ok());
  }
}

// Heartbeats (handled on a queue's thread) and other messages (on the session pool) of one stream
// are answered in the order they were sent.
TEST_F(SessionStreamTest, MessagesOfOneStreamAreAnsweredInOrder) {
  auto stub = v1::WorkerService::NewStub(Channel());
  const v1::RegisterResponse r = Register(stub.get(), "w");
  grpc::ClientContext ctx;
  auto stream = stub->Session(&ctx);
  constexpr int kMessages = 200;
  for (int i = 1; i <= kMessages; ++i) {
    v1::WorkerMessage m = Beat(r, i);
    if (i % 3 == 0) {
      m.mutable_summaries();  // not a heartbeat: handled on the pool
      m.set_want_ack(true);
    }
    ASSERT_TRUE(stream->Write(m));
  }
  for (int i = 1; i <= kMessages; ++i) {
    v1::CoordinatorMessage ack;
    ASSERT_TRUE(stream->Read(&ack)) << "message " << i;
    EXPECT_EQ(ack.ack().seq(), static_cast<uint64_t>(i));
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// A SessionServer on a server of its own, against the fixture's coordinator: what CoordinatorServer
// does, with the calls' count and the auth check in the test's hands.
class OwnSessionServer {
 public:
  OwnSessionServer(Coordinator* c, Metrics* m, SessionServer::Authorize authorize) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues;
    for (int i = 0; i < kSessionQueues; ++i) queues.push_back(builder.AddCompletionQueue());
    sessions_ = std::make_unique<SessionServer>(&service_, std::move(queues), std::move(authorize),
                                                c, m, &pool_);
    server_ = builder.BuildAndStart();
    sessions_->Start();
  }
  ~OwnSessionServer() { Shutdown(); }
  void Shutdown() {
    if (!server_) return;
    server_->Shutdown(std::chrono::system_clock::now());
    sessions_->Stop();
    server_.reset();
  }
  std::unique_ptr<v1::WorkerService::Stub> Stub() {
    return v1::WorkerService::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                                          grpc::InsecureChannelCredentials()));
  }
  SessionServer* sessions() { return sessions_.get(); }

 private:
  SessionPool pool_{2};
  SessionServer::Service service_;
  std::unique_ptr<SessionServer> sessions_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// Open streams hold their calls until the server shuts down; its shutdown ends them (each client
// sees its stream end), and Stop returns with every call, running or only requested, retired.
TEST_F(SessionStreamTest, AShutdownEndsOpenStreamsAndRetiresEveryCall) {
  auto fixture_stub = v1::WorkerService::NewStub(Channel());
  OwnSessionServer own(coordinator_.get(), metrics_.get(),
                       [](grpc::ServerContextBase*) { return grpc::Status::OK; });
  auto stub = own.Stub();
  constexpr int kWorkers = 5;
  std::vector<OpenStream> streams(kWorkers);
  for (int i = 0; i < kWorkers; ++i) {
    const v1::RegisterResponse r = Register(fixture_stub.get(), "s" + std::to_string(i));
    streams[i].stream = stub->Session(streams[i].ctx.get());
    ASSERT_TRUE(streams[i].stream->Write(Beat(r, 1)));
    v1::CoordinatorMessage ack;
    ASSERT_TRUE(streams[i].stream->Read(&ack));
    EXPECT_EQ(ack.ack().seq(), 1u);
  }
  // Each open stream is a call, besides the calls requested ahead on every queue.
  EXPECT_GE(own.sessions()->open_calls(), kWorkers + kSessionQueues);
  own.Shutdown();
  EXPECT_EQ(own.sessions()->open_calls(), 0);
  for (auto& s : streams) {
    v1::CoordinatorMessage m;
    EXPECT_FALSE(s.stream->Read(&m));
    EXPECT_FALSE(s.stream->Finish().ok());
  }
  // The coordinator saw each stream end: the workers are disconnected, not fenced.
  auto counts = coordinator_->GetCounts();
  EXPECT_EQ(counts.workers_by_state[v1::WORKER_DISCONNECTED], kWorkers);
  EXPECT_EQ(counts.workers_by_state[v1::WORKER_DEAD], 0);
}

// A call the auth check refuses is finished with its status at once, before any read.
TEST_F(SessionStreamTest, ARefusedTokenEndsTheCallWithItsStatus) {
  OwnSessionServer own(coordinator_.get(), metrics_.get(), [](grpc::ServerContextBase*) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "authorization: wrong token");
  });
  auto stub = own.Stub();
  grpc::ClientContext ctx;
  auto stream = stub->Session(&ctx);
  v1::CoordinatorMessage m;
  EXPECT_FALSE(stream->Read(&m));
  const grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(st.error_message(), "authorization: wrong token");
}

// QueuedSink against a writer that records what it is asked to do and completes nothing until
// the test says so: the transport's buffers and flow control are out of the picture.
class FakeWriter final : public StreamWriter {
 public:
  void Write(const v1::CoordinatorMessage* message) override {
    writes.push_back(message->ack().seq());
  }
  void Close(const grpc::Status& status) override { closes.push_back(status.error_code()); }
  void Cancel() override { ++cancels; }
  std::vector<uint64_t> writes;  // the ack seq of each write started
  std::vector<grpc::StatusCode> closes;
  int cancels = 0;
};

v1::CoordinatorMessage AckOf(uint64_t seq) {
  v1::CoordinatorMessage m;
  m.mutable_ack()->set_seq(seq);
  return m;
}

TEST(QueuedSink, OneWriteInFlightTheRestInOrder) {
  FakeWriter w;
  QueuedSink sink(&w, "w");
  for (uint64_t i = 1; i <= 3; ++i) sink.Send(AckOf(i));
  EXPECT_EQ(w.writes, (std::vector<uint64_t>{1}));  // the others wait for its completion
  EXPECT_EQ(sink.queued(), 3u);
  sink.WriteDone(true);
  sink.WriteDone(true);
  EXPECT_EQ(w.writes, (std::vector<uint64_t>{1, 2, 3}));
  sink.WriteDone(true);
  EXPECT_EQ(sink.queued(), 0u);
  sink.Send(AckOf(4));  // idle again: written at once
  EXPECT_EQ(w.writes, (std::vector<uint64_t>{1, 2, 3, 4}));
  EXPECT_EQ(w.cancels, 0);
}

TEST(QueuedSink, AWorkerThatStopsReadingIsCancelledAtTheBoundAndNothingMoreIsKept) {
  FakeWriter w;
  QueuedSink sink(&w, "w");
  // The first write never completes (the worker reads nothing): up to the bound, all are kept.
  for (uint64_t i = 1; i <= kMaxQueuedMessages; ++i) sink.Send(AckOf(i));
  EXPECT_EQ(w.cancels, 0);
  EXPECT_EQ(sink.queued(), kMaxQueuedMessages);
  sink.Send(AckOf(kMaxQueuedMessages + 1));
  EXPECT_EQ(w.cancels, 1);
  for (int i = 0; i < 10; ++i) sink.Send(AckOf(1));
  EXPECT_EQ(w.cancels, 1) << "cancelled once";
  EXPECT_EQ(sink.queued(), kMaxQueuedMessages) << "nothing queued after the bound";
  EXPECT_EQ(w.writes.size(), 1u);
}

TEST(QueuedSink, CloseWaitsForTheQueueAndLaterMessagesAreDropped) {
  FakeWriter w;
  QueuedSink sink(&w, "w");
  sink.Send(AckOf(1));
  sink.Send(AckOf(2));  // e.g. the Stop of a fenced generation, queued before the stream ends
  sink.FinishWhenDrained(grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "fenced"));
  sink.Send(AckOf(3));
  EXPECT_TRUE(w.closes.empty()) << "closed with messages still waiting";
  sink.WriteDone(true);
  EXPECT_TRUE(w.closes.empty());
  sink.WriteDone(true);
  EXPECT_EQ(w.writes, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(w.closes, (std::vector<grpc::StatusCode>{grpc::StatusCode::PERMISSION_DENIED}));
}

TEST(QueuedSink, ABrokenWriteDropsTheQueueAndADetachedSinkSendsNothing) {
  FakeWriter w;
  QueuedSink sink(&w, "w");
  for (uint64_t i = 1; i <= 3; ++i) sink.Send(AckOf(i));
  sink.WriteDone(false);
  EXPECT_EQ(sink.queued(), 0u);
  EXPECT_EQ(w.writes, (std::vector<uint64_t>{1}));
  sink.Detach();
  sink.Send(AckOf(4));
  sink.End();
  EXPECT_EQ(w.writes.size(), 1u);
  EXPECT_EQ(w.cancels, 0);
}

}  // namespace
}  // namespace geofp8::coordinator
