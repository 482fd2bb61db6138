// Group commit (issue #30): writes that arrive together share one transaction and one fsync, each
// caller gets its own result, a failed commit fails all of its batch, and what was acknowledged
// survives a reopen; and the coordinator's Register and UpdatePolicy wait for the disk without
// holding the coordinator, showing nothing before it is durable.
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/temp_dir.h"
#include "tests/server/coordinator_harness.h"

namespace geofp8::coordinator {
namespace {

using std::chrono::seconds;

using ::geofp8::testing::TempDir;

// Leads a batch whose one write blocks until Release: the writes submitted meanwhile queue up
// behind it and form the next batch, whatever the machine's speed.
class HeldBatch {
 public:
  explicit HeldBatch(Store* store) {
    thread_ = std::thread([this, store] {
      store
          ->Transaction([this] {
            std::unique_lock<std::mutex> lock(mu_);
            entered_ = true;
            cv_.notify_all();
            cv_.wait(lock, [this] { return released_; });
            return absl::OkStatus();
          })
          .IgnoreError();
    });
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return entered_; });
  }
  ~HeldBatch() { Release(); }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      released_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false, released_ = false;
  std::thread thread_;
};

// Whether `n` writes are queued within `timeout`.
bool WaitQueued(Store* store, size_t n, seconds timeout = seconds(10)) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (store->queued() < n) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Files of this process may not grow past `bytes` (writes past it fail with EFBIG, which SQLite
// reports as a write error): a full disk without mounting one. Restored on destruction.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::signal(SIGXFSZ, SIG_IGN);
    ::getrlimit(RLIMIT_FSIZE, &old_);
    rlimit lim = old_;
    lim.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &lim);
  }
  ~FileSizeLimit() { ::setrlimit(RLIMIT_FSIZE, &old_); }

 private:
  rlimit old_{};
};

// A limit just above what the store's files hold now, so that a batch of a few hundred KiB fails.
rlim_t JustAbove(const std::string& dir) {
  uintmax_t largest = 0;
  for (const char* name : {"coordinator.db", "coordinator.db-wal"}) {
    std::error_code ec;
    const uintmax_t size = std::filesystem::file_size(std::filesystem::path(dir) / name, ec);
    if (!ec) largest = std::max(largest, size);
  }
  return static_cast<rlim_t>(largest + (64 << 10));
}

v1::Job JobRow(const std::string& id, size_t spec_bytes = 0) {
  v1::Job job;
  job.set_id(id);
  job.set_spec_yaml(std::string(spec_bytes, 'x'));
  return job;
}

std::set<std::string> JobIds(Store* store) {
  auto snap = store->Load();
  EXPECT_TRUE(snap.ok()) << snap.status();
  std::set<std::string> ids;
  if (snap.ok()) {
    for (const auto& j : snap->jobs) ids.insert(j.id());
  }
  return ids;
}

// Commits since `base` (Open commits its schema upgrade of a new file).
uint64_t CommitsSince(Store* store, const Store::CommitStats& base) {
  return store->commit_stats().commits - base.commits;
}

std::unique_ptr<Store> OpenStore(const std::string& dir) {
  auto s = Store::Open(dir);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

TEST(StoreGroupCommit, WritesQueuedDuringACommitShareTheNextOne) {
  auto store = OpenStore("");
  ASSERT_TRUE(store);
  const Store::CommitStats base = store->commit_stats();
  constexpr int kWriters = 16;
  std::vector<absl::StatusOr<uint64_t>> gens(kWriters, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  {
    HeldBatch held(store.get());
    for (int i = 0; i < kWriters; ++i) {
      threads.emplace_back(
          [&, i] { gens[i] = store->NextGeneration("w" + std::to_string(i % 4)); });
    }
    ASSERT_TRUE(WaitQueued(store.get(), kWriters));
  }
  for (auto& t : threads) t.join();
  // The held batch, then one for all sixteen.
  EXPECT_EQ(CommitsSince(store.get(), base), 2u);
  EXPECT_EQ(store->commit_stats().writes - base.writes, kWriters + 1u);
  std::map<std::string, std::set<uint64_t>> by_name;
  for (int i = 0; i < kWriters; ++i) {
    ASSERT_TRUE(gens[i].ok()) << gens[i].status();
    by_name["w" + std::to_string(i % 4)].insert(*gens[i]);
  }
  for (const auto& [name, g] : by_name) EXPECT_EQ(g, (std::set<uint64_t>{1, 2, 3, 4})) << name;
  // A lone writer commits on its own, at once.
  ASSERT_TRUE(store->PutJob(JobRow("alone")).ok());
  EXPECT_EQ(CommitsSince(store.get(), base), 3u);
  EXPECT_EQ(store->queued(), 0u);
}

TEST(StoreGroupCommit, EveryCallerWaitingOnOneWriteIsWoken) {
  // UpdatePolicy answers an unchanged update with the staged version's write: two waiters.
  auto store = OpenStore("");
  ASSERT_TRUE(store);
  Store::WriteHandle w;
  std::vector<std::thread> threads;
  std::atomic<int> woken{0};
  {
    HeldBatch held(store.get());
    w = store->Submit([&] { return store->PutJob(JobRow("shared")); });
    for (int i = 0; i < 2; ++i) {
      threads.emplace_back([&] {
        if (store->Wait(w).ok()) ++woken;
      });
    }
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(woken.load(), 2);
}

TEST(StoreGroupCommit, AFailingWriteRollsBackOnlyItself) {
  auto store = OpenStore("");
  ASSERT_TRUE(store);
  const Store::CommitStats base = store->commit_stats();
  absl::Status b, c, d;
  std::vector<std::thread> threads;
  {
    HeldBatch held(store.get());
    threads.emplace_back([&] { b = store->PutJob(JobRow("b")); });
    ASSERT_TRUE(WaitQueued(store.get(), 1));
    threads.emplace_back([&] {
      c = store->Transaction([&] {
        EXPECT_TRUE(store->PutJob(JobRow("c")).ok());
        return absl::InvalidArgumentError("c refuses");
      });
    });
    ASSERT_TRUE(WaitQueued(store.get(), 2));
    threads.emplace_back([&] { d = store->PutJob(JobRow("d")); });
    ASSERT_TRUE(WaitQueued(store.get(), 3));
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(CommitsSince(store.get(), base), 2u);  // the held one; b, c and d in one
  EXPECT_TRUE(b.ok()) << b;
  EXPECT_EQ(c, absl::InvalidArgumentError("c refuses"));
  EXPECT_TRUE(d.ok()) << d;
  EXPECT_EQ(JobIds(store.get()), (std::set<std::string>{"b", "d"}));
}

TEST(StoreGroupCommit, AVersionIsNeverWrittenWithoutTheOneBefore) {
  auto store = OpenStore("");
  ASSERT_TRUE(store);
  auto version = [](uint64_t v) {
    v1::Policy p;
    p.set_job_id("job-000001");
    p.set_version(v);
    return p;
  };
  ASSERT_TRUE(store->PutNextPolicy(version(1)).ok());
  // v2 is written and then its write fails; v3, in the same transaction, finds no v2.
  absl::Status v2, v3;
  std::vector<std::thread> threads;
  {
    HeldBatch held(store.get());
    threads.emplace_back([&] {
      v2 = store->Transaction([&] {
        EXPECT_TRUE(store->PutNextPolicy(version(2)).ok());
        return absl::InternalError("event refused");
      });
    });
    ASSERT_TRUE(WaitQueued(store.get(), 1));
    threads.emplace_back([&] { v3 = store->PutNextPolicy(version(3)); });
    ASSERT_TRUE(WaitQueued(store.get(), 2));
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(v2.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(v3.code(), absl::StatusCode::kUnavailable) << v3;
  EXPECT_TRUE(v3.GetPayload(kStoreUnwritablePayload).has_value()) << v3;
  EXPECT_NE(v3.message().find("v2, which it was made from"), std::string::npos) << v3;
  auto snap = store->Load();
  ASSERT_TRUE(snap.ok());
  ASSERT_EQ(snap->policies.size(), 1u);
  EXPECT_EQ(snap->policies[0].version(), 1u);
  EXPECT_FALSE(store->PutNextPolicy(version(5)).ok());
  EXPECT_TRUE(store->PutNextPolicy(version(2)).ok());
  EXPECT_TRUE(store->PutNextPolicy(version(3)).ok());
}

TEST(StoreGroupCommit, ACommitThatFailsFailsEveryWriteOfItsBatch) {
  TempDir dir("geofp8-gcommit");
  auto store = OpenStore(dir.path());
  ASSERT_TRUE(store);
  ASSERT_TRUE(store->PutJob(JobRow("before")).ok());
  const Store::CommitStats base = store->commit_stats();
  constexpr int kWriters = 4;
  std::vector<absl::Status> results(kWriters);
  std::vector<std::thread> threads;
  {
    HeldBatch held(store.get());
    for (int i = 0; i < kWriters; ++i) {
      threads.emplace_back([&, i] {
        results[i] = store->PutJob(JobRow("big-" + std::to_string(i), size_t{256} << 10));
      });
    }
    ASSERT_TRUE(WaitQueued(store.get(), kWriters));
    FileSizeLimit full(JustAbove(dir.path()));
    held.Release();
    for (auto& t : threads) t.join();
  }
  EXPECT_EQ(CommitsSince(store.get(), base), 2u);  // the held one, the four
  for (int i = 0; i < kWriters; ++i) {
    EXPECT_FALSE(results[i].ok()) << i;
    EXPECT_TRUE(results[i].GetPayload(kStoreUnwritablePayload).has_value()) << results[i];
    EXPECT_EQ(results[i], results[0]) << "one store error for the whole batch";
  }
  // The disk has room again: the store writes, and a reopen shows none of the failed batch.
  ASSERT_TRUE(store->PutJob(JobRow("after")).ok());
  store.reset();
  store = OpenStore(dir.path());
  ASSERT_TRUE(store);
  EXPECT_EQ(JobIds(store.get()), (std::set<std::string>{"before", "after"}));
}

TEST(StoreGroupCommit, EveryAcknowledgedWriteSurvivesAReopen) {
  TempDir dir("geofp8-gcommit");
  auto store = OpenStore(dir.path());
  ASSERT_TRUE(store);
  const Store::CommitStats base = store->commit_stats();
  constexpr int kThreads = 8, kEach = 25;
  std::atomic<int> acknowledged{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        if (!store->PutJob(JobRow("t" + std::to_string(t) + "-" + std::to_string(i))).ok()) return;
        if (!store->NextGeneration("t" + std::to_string(t)).ok()) return;
        ++acknowledged;
      }
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_EQ(acknowledged.load(), kThreads * kEach);
  const Store::CommitStats stats = store->commit_stats();
  EXPECT_EQ(stats.writes - base.writes, 2u * kThreads * kEach);
  store.reset();
  store = OpenStore(dir.path());
  ASSERT_TRUE(store);
  EXPECT_EQ(JobIds(store.get()).size(), size_t{kThreads * kEach});
  for (int t = 0; t < kThreads; ++t) {
    auto next = store->NextGeneration("t" + std::to_string(t));
    ASSERT_TRUE(next.ok());
    EXPECT_EQ(*next, kEach + 1u) << "every generation handed out is on disk";
  }
}

// --- The coordinator over the store

class CoordinatorGroupCommit : public CoordinatorHarness {
 protected:
  absl::StatusOr<v1::RegisterResponse> Register(const std::string& name) {
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_device("cpu");
    return coordinator->Register(req);
  }
  absl::StatusOr<v1::UpdatePolicyResponse> Update(const std::string& job, int i) {
    v1::UpdatePolicyRequest req;
    req.set_job_id(job);
    auto* p = req.add_patches();
    p->set_layer(std::string(1 + i, '*'));  // distinct patterns that all match
    p->set_format(v1::FORMAT_NVFP4);
    return coordinator->UpdatePolicy(req);
  }
  std::vector<uint64_t> Versions(const std::string& job) {
    v1::ListPolicyVersionsRequest req;
    req.set_job_id(job);
    auto r = coordinator->ListPolicyVersions(req);
    EXPECT_TRUE(r.ok()) << r.status();
    std::vector<uint64_t> v;
    if (r.ok()) {
      for (const auto& p : r->policies()) v.push_back(p.version());
    }
    return v;
  }
  uint64_t Latest(const std::string& job) {
    v1::GetPolicyRequest req;
    req.set_job_id(job);
    auto r = coordinator->GetPolicy(req);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->version() : 0;
  }
};

TEST_F(CoordinatorGroupCommit, RegistrationsWaitForTheDiskTogetherAndShowNothingBefore) {
  const Store::CommitStats base = store->commit_stats();
  constexpr int kWorkers = 16;
  std::vector<absl::StatusOr<v1::RegisterResponse>> responses(kWorkers,
                                                              absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  {
    HeldBatch held(store.get());
    for (int i = 0; i < kWorkers; ++i) {
      threads.emplace_back([&, i] { responses[i] = Register("w" + std::to_string(i)); });
    }
    // Every registration is waiting for the disk at once: none holds the coordinator meanwhile.
    EXPECT_TRUE(WaitQueued(store.get(), kWorkers));
    EXPECT_EQ(coordinator->ListWorkers().workers_size(), 0) << "a generation not yet durable";
  }
  for (auto& t : threads) t.join();
  for (const auto& r : responses) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->generation(), 1u);
  }
  EXPECT_EQ(coordinator->ListWorkers().workers_size(), kWorkers);
  EXPECT_EQ(CommitsSince(store.get(), base), 2u);  // the held batch, then all sixteen
}

TEST_F(CoordinatorGroupCommit, OfTwoRacingRegistrationsTheHigherGenerationIsCurrent) {
  for (int round = 0; round < 20; ++round) {
    const std::string name = "x" + std::to_string(round);
    absl::StatusOr<v1::RegisterResponse> a = absl::UnknownError(""), b = absl::UnknownError("");
    std::thread ta, tb;
    {
      HeldBatch held(store.get());
      const size_t before = store->queued();
      ta = std::thread([&] { a = Register(name); });
      ASSERT_TRUE(WaitQueued(store.get(), before + 1));
      tb = std::thread([&] { b = Register(name); });
      ASSERT_TRUE(WaitQueued(store.get(), before + 2));
    }
    ta.join();
    tb.join();
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(a->generation(), 1u);  // submitted first, so committed first
    ASSERT_EQ(b->generation(), 2u);
    auto sink = std::make_shared<FakeSink>();
    const absl::Status stale = coordinator->OpenSession(name, 1, a->session_secret(), sink);
    EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << round << ": " << stale;
    EXPECT_TRUE(coordinator->OpenSession(name, 2, b->session_secret(), sink).ok()) << round;
  }
}

TEST_F(CoordinatorGroupCommit, PolicyVersionsAreShownOnlyOnceDurableAndStayDense) {
  TempDir dir("geofp8-gcommit");
  Open(dir.path());
  const std::string job = Submit("name: gc\nworld_size: 1\n");
  constexpr int kUpdates = 8;
  std::vector<absl::StatusOr<v1::UpdatePolicyResponse>> responses(kUpdates,
                                                                  absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  {
    HeldBatch held(store.get());
    for (int i = 0; i < kUpdates; ++i) {
      threads.emplace_back([&, i] { responses[i] = Update(job, i); });
    }
    EXPECT_TRUE(WaitQueued(store.get(), kUpdates));
    // Staged, not durable: no reader sees them.
    EXPECT_EQ(Latest(job), 1u);
    EXPECT_EQ(Versions(job), std::vector<uint64_t>{1});
    EXPECT_EQ(Get(job).policy_version(), 1u);
  }
  for (auto& t : threads) t.join();
  std::set<uint64_t> acked;
  for (const auto& r : responses) {
    ASSERT_TRUE(r.ok()) << r.status();
    acked.insert(r->policy().version());
  }
  EXPECT_EQ(acked, (std::set<uint64_t>{2, 3, 4, 5, 6, 7, 8, 9}));
  const std::vector<uint64_t> all = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  EXPECT_EQ(Versions(job), all);
  EXPECT_EQ(Get(job).policy_version(), 9u);
  Open(dir.path());  // every acknowledged version is on disk
  EXPECT_EQ(Versions(job), all);
  EXPECT_EQ(Get(job).policy_version(), 9u);
}

TEST_F(CoordinatorGroupCommit, AFailedPolicyWriteLeavesNoVersionBehind) {
  TempDir dir("geofp8-gcommit");
  Open(dir.path());
  // A long spec makes every version's job row large enough to overrun the limit below.
  const std::string job =
      Submit("name: gc\nworld_size: 1\n# " + std::string(size_t{200} << 10, 'x') + "\n");
  std::vector<absl::StatusOr<v1::UpdatePolicyResponse>> responses(2, absl::UnknownError(""));
  std::vector<std::thread> threads;
  {
    HeldBatch held(store.get());
    for (int i = 0; i < 2; ++i) threads.emplace_back([&, i] { responses[i] = Update(job, i); });
    ASSERT_TRUE(WaitQueued(store.get(), 2));
    FileSizeLimit full(JustAbove(dir.path()));
    held.Release();
    for (auto& t : threads) t.join();
  }
  for (const auto& r : responses) {
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(r.status().GetPayload(kStoreUnwritablePayload).has_value()) << r.status();
  }
  EXPECT_EQ(Versions(job), std::vector<uint64_t>{1});
  EXPECT_EQ(Get(job).policy_version(), 1u);
  // Space again: the next version takes the failed one's number.
  auto next = Update(job, 5);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->policy().version(), 2u);
  Open(dir.path());
  EXPECT_EQ(Versions(job), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(Get(job).policy_version(), 2u);
}

}  // namespace
}  // namespace geofp8::coordinator
