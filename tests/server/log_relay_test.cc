// `geofp8ctl logs` at the coordinator (issue #29 item 5): StreamLogs pulls a rank's output from
// the worker that ran it, chunk by chunk, follows it until the rank ends, refuses what it cannot
// serve with errors naming the job, rank, attempt or worker, and takes log answers only from the
// session the read went to.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "server/coordinator/coordinator.h"
#include "tests/server/coordinator_harness.h"

namespace geofp8::coordinator {
namespace {

constexpr char kCommandJob[] = "name: c\nworld_size: 2\ncommand: [python3, train.py]\n";

// A worker's session that answers each LogRead from `files` (by "rank<R>.out"/".err"), as the
// worker daemon does, or keeps it unanswered when `answer` is off.
class FileSink : public FakeSink {
 public:
  void Send(const v1::CoordinatorMessage& m) override {
    FakeSink::Send(m);
    if (!m.has_log_read() || !answer) return;
    const v1::LogRead& r = m.log_read();
    v1::WorkerMessage reply;
    reply.set_worker_id(worker_id);
    reply.set_generation(generation);
    v1::LogData* d = reply.mutable_log_data();
    d->set_request_id(r.request_id());
    std::lock_guard<std::mutex> lock(files_mu);
    // Attempt 0's files by their names, a later attempt's under "<attempt>/".
    auto it =
        files.find((r.attempt() ? std::to_string(r.attempt()) + "/" : "") + "rank" +
                   std::to_string(r.rank()) + (r.stream() == v1::LOG_STDERR ? ".err" : ".out"));
    if (it == files.end()) {
      d->set_missing(true);
      d->set_eof(true);
    } else {
      const std::string& f = it->second;
      const size_t at = std::min<size_t>(r.offset(), f.size());
      const std::string piece = f.substr(at, std::min<size_t>(r.max_bytes(), f.size() - at));
      d->set_offset(static_cast<int64_t>(at));
      d->set_data(piece);
      d->set_eof(at + piece.size() == f.size());
    }
    (void)coordinator->HandleWorkerMessage(reply);
  }
  // The log reads sent since the last call.
  std::vector<v1::LogRead> TakeReads() {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<v1::LogRead> out;
    for (const auto& m : messages) {
      if (m.has_log_read()) out.push_back(m.log_read());
    }
    messages.clear();
    return out;
  }
  void Append(const std::string& file, const std::string& text) {
    std::lock_guard<std::mutex> lock(files_mu);
    files[file] += text;
  }
  Coordinator* coordinator = nullptr;
  std::string worker_id;
  uint64_t generation = 0;
  std::atomic<bool> answer{true};
  std::mutex files_mu;
  std::map<std::string, std::string> files;
};

class LogRelayTest : public CoordinatorHarness {
 protected:
  void SetUp() override {
    CoordinatorHarness::SetUp();
    CoordinatorOptions options;
    options.heartbeat_timeout_ms = 1000;
    options.log_poll_ms = 20;
    options.log_read_timeout_ms = 300;
    coordinator = std::make_unique<Coordinator>(store.get(), &clock, options);
    ASSERT_TRUE(coordinator->Recover().ok());
  }
  // A command-running worker whose session answers from its files.
  std::shared_ptr<FileSink> Runner(const std::string& name, Worker* out = nullptr) {
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_device("cpu");
    req.set_accepts_commands(true);
    auto r = coordinator->Register(req);
    EXPECT_TRUE(r.ok()) << r.status();
    auto sink = std::make_shared<FileSink>();
    sink->coordinator = coordinator.get();
    sink->worker_id = r->worker_id();
    sink->generation = r->generation();
    EXPECT_TRUE(
        coordinator->OpenSession(r->worker_id(), r->generation(), r->session_secret(), sink).ok());
    if (out) {
      out->id = r->worker_id();
      out->generation = r->generation();
      out->secret = r->session_secret();
    }
    return sink;
  }
  // StreamLogs' chunks, concatenated, and its status.
  absl::Status Read(const v1::LogsRequest& req, std::string* text,
                    std::vector<v1::LogsChunk>* chunks = nullptr) {
    return coordinator->StreamLogs(
        req,
        [&](const v1::LogsChunk& c) {
          *text += c.data();
          if (chunks) chunks->push_back(c);
          return true;
        },
        [] { return false; });
  }
  v1::LogsRequest Request(const std::string& job, int rank = 0) {
    v1::LogsRequest req;
    req.set_job_id(job);
    req.set_rank(rank);
    return req;
  }
  void Finish(const Worker& w, const std::string& job, int attempt) {
    v1::WorkerMessage m;
    m.mutable_finished()->set_success(true);
    m.mutable_finished()->set_job_id(job);
    m.mutable_finished()->set_attempt(attempt);
    ASSERT_TRUE(Send(w, m).ok());
  }
};

TEST_F(LogRelayTest, ReadsTheRankOutputFromItsWorkerInBoundedChunks) {
  auto a = Runner("a");
  auto b = Runner("b");
  const std::string id = Submit(kCommandJob);
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  const std::string rank1_worker = Get(id).ranks(1).worker_id();
  FileSink* holder = rank1_worker == "a" ? a.get() : b.get();
  std::string big;
  for (int i = 0; big.size() < 150'000; ++i) big += "line " + std::to_string(i) + "\n";
  holder->Append("rank1.out", big);
  holder->Append("rank1.err", "oops\n");
  std::string text;
  std::vector<v1::LogsChunk> chunks;
  ASSERT_TRUE(Read(Request(id, 1), &text, &chunks).ok());
  EXPECT_EQ(text, big);
  ASSERT_EQ(chunks.size(), 3u);  // 64 KiB, 64 KiB, the rest
  for (const auto& c : chunks) {
    EXPECT_LE(c.data().size(), size_t{64} << 10);
    EXPECT_EQ(c.worker_id(), rank1_worker);
  }
  // Every read went to rank 1's worker, naming the job, attempt and rank.
  for (const auto& m : holder->Take(v1::CoordinatorMessage::kLogRead)) {
    EXPECT_EQ(m.log_read().job_id(), id);
    EXPECT_EQ(m.log_read().attempt(), 0);
    EXPECT_EQ(m.log_read().rank(), 1);
  }
  FileSink* other = holder == a.get() ? b.get() : a.get();
  EXPECT_TRUE(other->Take(v1::CoordinatorMessage::kLogRead).empty());
  v1::LogsRequest err = Request(id, 1);
  err.set_stream(v1::LOG_STDERR);
  text.clear();
  ASSERT_TRUE(Read(err, &text).ok());
  EXPECT_EQ(text, "oops\n");
}

TEST_F(LogRelayTest, RefusesWhatItCannotServeNamingWhy) {
  std::string text;
  EXPECT_EQ(Read(Request("j-nope"), &text).code(), absl::StatusCode::kNotFound);

  auto sink = Runner("a");
  Runner("b");
  const std::string builtin = Submit("name: t\nworld_size: 1\ntraining: {steps: 5}\n");
  absl::Status s = Read(Request(builtin), &text);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("job " + builtin + " runs the built-in trainer"), std::string::npos)
      << s;

  const std::string id = Submit(kCommandJob);
  s = Read(Request(id, 2), &text);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("rank: job " + id + " has ranks 0..1 (2)"), std::string::npos) << s;
  v1::LogsRequest later = Request(id);
  later.set_attempt(3);
  s = Read(later, &text);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("attempt: job " + id + " has attempts 0..0 (3)"), std::string::npos)
      << s;

  // Pending (the built-in job holds one of the two workers): not placed yet.
  ASSERT_EQ(Get(id).state(), v1::JOB_PENDING);
  s = Read(Request(id), &text);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("job " + id +
                             " (PENDING): no attempt of it was placed on workers since this "
                             "coordinator started"),
            std::string::npos)
      << s;
  Runner("c");
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  // Nothing written yet while the rank runs: nothing to show, no error.
  s = Read(Request(id), &text);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(text, "");
}

TEST_F(LogRelayTest, NamesTheWorkerThatIsNotConnectedOrHasNoFile) {
  Worker wa, wb;
  auto a = Runner("a", &wa);
  auto b = Runner("b", &wb);
  const std::string id = Submit(kCommandJob);
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  const std::string w0 = Get(id).ranks(0).worker_id();
  // The job ends; rank 0's worker never wrote its file (replaced, data dir cleaned).
  Finish(w0 == "a" ? wa : wb, id, 0);
  Finish(w0 == "a" ? wb : wa, id, 0);
  ASSERT_EQ(Get(id).state(), v1::JOB_SUCCEEDED);
  std::string text;
  absl::Status s = Read(Request(id), &text);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(
      s.message().find("worker " + w0 + " has no rank0.out of rank 0 of job " + id + " attempt 0"),
      std::string::npos)
      << s;
  // Its session closes: the worker is named as not connected.
  coordinator->CloseSession(w0, w0 == "a" ? wa.generation : wb.generation, w0 == "a" ? a : b);
  s = Read(Request(id), &text);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("worker " + w0 + ", which ran rank 0 of job " + id +
                             " attempt 0, is not connected"),
            std::string::npos)
      << s;
}

// A restarted job: the newest attempt by default, an earlier one with its number, each read from
// the worker that ran it.
TEST_F(LogRelayTest, ReadsTheNewestAttemptUnlessOneIsNamed) {
  Worker wa;
  auto a = Runner("a", &wa);
  const std::string id = Submit("name: c\nworld_size: 1\ncommand: [python3, train.py]\n");
  ASSERT_EQ(Get(id).ranks(0).worker_id(), "a");
  a->Append("rank0.out", "attempt 0\n");
  a->Append("1/rank0.out", "attempt 1\n");
  v1::WorkerMessage crashed;
  crashed.mutable_finished()->set_success(false);
  crashed.mutable_finished()->set_restartable(true);
  crashed.mutable_finished()->set_job_id(id);
  crashed.mutable_finished()->set_attempt(0);
  ASSERT_TRUE(Send(wa, crashed).ok());
  ASSERT_EQ(Get(id).attempt(), 1);
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  a->TakeReads();
  std::string text;
  ASSERT_TRUE(Read(Request(id), &text).ok());
  EXPECT_EQ(text, "attempt 1\n");
  for (const auto& r : a->TakeReads()) EXPECT_EQ(r.attempt(), 1);
  v1::LogsRequest first = Request(id);
  first.set_attempt(0);
  text.clear();
  ASSERT_TRUE(Read(first, &text).ok());
  EXPECT_EQ(text, "attempt 0\n");
  for (const auto& r : a->TakeReads()) EXPECT_EQ(r.attempt(), 0);
}

// -f: output written after the call started arrives, and the stream ends once the rank has
// finished and everything it wrote was sent.
TEST_F(LogRelayTest, FollowStreamsNewOutputAndEndsWhenTheRankFinishes) {
  Worker w;
  auto sink = Runner("a", &w);
  const std::string id = Submit("name: c\nworld_size: 1\ncommand: [python3, train.py]\n");
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  sink->Append("rank0.out", "first\n");
  v1::LogsRequest req = Request(id);
  req.set_follow(true);
  std::mutex mu;
  std::string text;
  std::atomic<bool> ended{false};
  absl::Status status;
  std::thread reader([&] {
    status = coordinator->StreamLogs(
        req,
        [&](const v1::LogsChunk& c) {
          std::lock_guard<std::mutex> lock(mu);
          text += c.data();
          return true;
        },
        [] { return false; });
    ended = true;
  });
  auto wait_for = [&](const std::string& want) {
    for (int i = 0; i < 500; ++i) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (text == want) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  };
  EXPECT_TRUE(wait_for("first\n"));
  sink->Append("rank0.out", "second\n");
  EXPECT_TRUE(wait_for("first\nsecond\n"));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(ended.load());  // still following the running rank
  sink->Append("rank0.out", "last\n");
  Finish(w, id, 0);
  reader.join();
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(text, "first\nsecond\nlast\n");
}

// Only the session a read was sent to can answer it: another worker's answer with the same
// request id is refused and counted, and the reader still gets the right worker's data.
TEST_F(LogRelayTest, AnswersFromAnotherWorkersSessionAreRefused) {
  auto a = Runner("a");
  Worker wm;
  auto mallory = Runner("mallory", &wm);
  const std::string id = Submit("name: c\nworld_size: 1\ncommand: [python3, train.py]\n");
  ASSERT_EQ(Get(id).ranks(0).worker_id(), "a");
  a->Append("rank0.out", "genuine\n");
  a->answer = false;
  std::string text;
  absl::Status status;
  std::thread reader([&] { status = Read(Request(id), &text); });
  uint64_t request_id = 0;
  for (int i = 0; i < 500 && request_id == 0; ++i) {
    auto reads = a->Take(v1::CoordinatorMessage::kLogRead);
    if (!reads.empty()) request_id = reads.back().log_read().request_id();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_NE(request_id, 0u);
  v1::WorkerMessage forged;
  forged.mutable_log_data()->set_request_id(request_id);
  forged.mutable_log_data()->set_data("forged\n");
  forged.mutable_log_data()->set_eof(true);
  ASSERT_TRUE(Send(wm, forged).ok());
  EXPECT_EQ(coordinator->GetCounts().refused_log_data, 1u);
  reader.join();
  // Unanswered by its worker, the read timed out naming it; the forged bytes were never shown.
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  EXPECT_NE(status.message().find("worker a: did not answer"), std::string::npos) << status;
  EXPECT_EQ(text, "");
  a->answer = true;
  ASSERT_TRUE(Read(Request(id), &text).ok());
  EXPECT_EQ(text, "genuine\n");
}

// A worker serves at most LogRelay::kMaxStreamsPerWorker log streams at once.
TEST_F(LogRelayTest, BoundsTheLogStreamsOfOneWorker) {
  auto a = Runner("a");
  const std::string id = Submit("name: c\nworld_size: 1\ncommand: [python3, train.py]\n");
  a->Append("rank0.out", "x\n");
  v1::LogsRequest req = Request(id);
  req.set_follow(true);
  std::atomic<bool> stop{false};
  std::atomic<int> started{0};
  std::vector<std::thread> readers;
  for (int i = 0; i < LogRelay::kMaxStreamsPerWorker; ++i) {
    readers.emplace_back([&] {
      (void)coordinator->StreamLogs(
          req,
          [&](const v1::LogsChunk&) {
            ++started;
            return true;
          },
          [&] { return stop.load(); });
    });
  }
  for (int i = 0; i < 500 && started < LogRelay::kMaxStreamsPerWorker; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(started.load(), LogRelay::kMaxStreamsPerWorker);
  std::string text;
  absl::Status s = Read(Request(id), &text);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("worker a already serves 8 log streams"), std::string::npos) << s;
  stop = true;
  for (auto& t : readers) t.join();
  // The slots are given back when the streams end.
  EXPECT_TRUE(Read(Request(id), &text).ok());
  EXPECT_EQ(text, "x\n");
}

}  // namespace
}  // namespace geofp8::coordinator
