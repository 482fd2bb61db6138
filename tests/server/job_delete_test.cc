// Issue #29 item 6: DeleteJob removes a finished job with its events and policy versions, durably
// and without reissuing its id; names are unique among unfinished jobs.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <set>
#include <thread>

#include "server/coordinator/coordinator.h"
#include "tests/server/coordinator_harness.h"

namespace geofp8::coordinator {
namespace {

namespace fs = std::filesystem;

class JobDeleteTest : public CoordinatorHarness {
 protected:
  void TearDown() override {
    coordinator.reset();
    store.reset();
    if (!dir.empty()) fs::remove_all(dir);
  }
  // A fresh data directory, opened.
  void OpenTempDir() {
    std::string tmpl = (fs::temp_directory_path() / "geofp8-delete-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir = tmpl;
    Open(dir);
  }
  absl::StatusOr<v1::SubmitJobResponse> TrySubmit(const std::string& yaml,
                                                  const std::string& key = "") {
    v1::SubmitJobRequest req;
    req.set_spec_yaml(yaml);
    req.set_idempotency_key(key);
    return coordinator->SubmitJob(req);
  }
  absl::StatusOr<v1::DeleteJobResponse> Delete(const std::string& id) {
    v1::DeleteJobRequest req;
    req.set_job_id(id);
    return coordinator->DeleteJob(req);
  }
  void Cancel(const std::string& id) {
    v1::CancelJobRequest req;
    req.set_job_id(id);
    auto r = coordinator->CancelJob(req);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  absl::StatusCode GetCode(const std::string& id) {
    v1::GetJobRequest req;
    req.set_job_id(id);
    return coordinator->GetJob(req).status().code();
  }
  std::vector<std::string> ListedIds() {
    auto r = coordinator->ListJobs(v1::ListJobsRequest());
    EXPECT_TRUE(r.ok()) << r.status();
    std::vector<std::string> ids;
    if (r.ok()) {
      for (const auto& j : r->jobs()) ids.push_back(j.id());
    }
    return ids;
  }
  std::string dir;
};

TEST_F(JobDeleteTest, AnUnfinishedJobIsRefusedNamingItAndItsState) {
  const std::string id = Submit("name: live\nworld_size: 1\n");
  auto r = Delete(id);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("job " + id + " (live) is PENDING"), std::string::npos)
      << r.status();
  EXPECT_EQ(GetCode(id), absl::StatusCode::kOk);
  Worker a = Join("a");  // now SCHEDULED: refused as well
  ASSERT_EQ(Get(id).state(), v1::JOB_SCHEDULED);
  r = Delete(id);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("is SCHEDULED"), std::string::npos) << r.status();
  EXPECT_EQ(Delete("job-404").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Delete("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(JobDeleteTest, ASucceededJobIsDeleted) {
  const std::string id = Submit("name: s\nworld_size: 1\n");
  Worker a = Join("a");
  v1::WorkerMessage done;
  done.mutable_finished()->set_success(true);
  ASSERT_TRUE(Send(a, done).ok());
  ASSERT_EQ(Get(id).state(), v1::JOB_SUCCEEDED);
  auto r = Delete(id);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->job().id(), id);
  EXPECT_EQ(r->job().state(), v1::JOB_SUCCEEDED);
  EXPECT_EQ(GetCode(id), absl::StatusCode::kNotFound);
  EXPECT_EQ(Delete(id).status().code(), absl::StatusCode::kNotFound);  // once only
  // The worker is free for the next job.
  const std::string next = Submit("name: s\nworld_size: 1\n");
  EXPECT_EQ(Get(next).state(), v1::JOB_SCHEDULED);
}

TEST_F(JobDeleteTest, NamesAreUniqueAmongUnfinishedJobs) {
  const std::string spec = "name: train\nworld_size: 1\n";
  const std::string first = Submit(spec, "k1");
  auto dup = TrySubmit(spec);
  ASSERT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists) << dup.status();
  EXPECT_NE(dup.status().message().find("job " + first + " (PENDING) is already named train"),
            std::string::npos)
      << dup.status();
  // A retry of the accepted submission (same key and spec) is still answered with the job.
  auto retry = TrySubmit(spec, "k1");
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_FALSE(retry->created());
  EXPECT_EQ(retry->job().id(), first);
  EXPECT_EQ(ListedIds().size(), 1u);  // nothing was created by the refusal
  // Another name is fine; once the first is finished, its name is free again.
  Submit("name: other\nworld_size: 1\n");
  Cancel(first);
  const std::string second = Submit(spec);
  EXPECT_NE(second, first);
  EXPECT_EQ(Get(second).name(), "train");
}

TEST_F(JobDeleteTest, TheDeleteIsDurableAndIdsNeverRepeat) {
  OpenTempDir();
  const std::string keep = Submit("name: keep\nworld_size: 1\n");
  const std::string gone = Submit("name: gone\nworld_size: 1\n", "key-gone");
  v1::UpdatePolicyRequest update;
  update.set_job_id(gone);
  update.add_patches()->set_layer("*");
  update.mutable_patches(0)->set_format(v1::FORMAT_BF16);
  ASSERT_TRUE(coordinator->UpdatePolicy(update).ok());  // a second version to delete
  Cancel(gone);
  Cancel(keep);
  const auto before = coordinator->GetCounts();
  ASSERT_TRUE(Delete(gone).ok());
  const auto after = coordinator->GetCounts();
  EXPECT_EQ(after.jobs_by_state.at(v1::JOB_CANCELLED),
            before.jobs_by_state.at(v1::JOB_CANCELLED) - 1);
  EXPECT_EQ(after.deleted_by_state.at(v1::JOB_CANCELLED), 1);

  Open(dir);  // a coordinator restart: the seal still matches (Open asserts it)
  EXPECT_EQ(GetCode(gone), absl::StatusCode::kNotFound);
  EXPECT_EQ(GetCode(keep), absl::StatusCode::kOk);
  EXPECT_EQ(ListedIds(), std::vector<std::string>{keep});
  v1::ListPolicyVersionsRequest versions;
  versions.set_job_id(gone);
  EXPECT_EQ(coordinator->ListPolicyVersions(versions).status().code(), absl::StatusCode::kNotFound);
  // The deleted job's totals stay in the counters (geofp8_jobs_total never goes down).
  EXPECT_EQ(coordinator->GetCounts().deleted_by_state.at(v1::JOB_CANCELLED), 1);
  // Nothing of the job is left in the store.
  auto snap = store->Load();
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_EQ(snap->jobs.size(), 1u);
  EXPECT_EQ(snap->jobs[0].id(), keep);
  for (const auto& p : snap->policies) EXPECT_EQ(p.job_id(), keep);
  EXPECT_EQ(snap->deleted.by_state.at(v1::JOB_CANCELLED), 1);

  // The newest id was the deleted one; the next job still gets a new id, before and after
  // another restart, and the key of the deleted job makes a new job.
  auto again = TrySubmit("name: gone\nworld_size: 1\n", "key-gone");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->created());
  EXPECT_EQ(again->job().id(), "job-000003");
  Cancel(again->job().id());
  ASSERT_TRUE(Delete(again->job().id()).ok());
  Open(dir);
  EXPECT_EQ(Submit("name: gone\nworld_size: 1\n"), "job-000004");
  EXPECT_EQ(coordinator->GetCounts().deleted_by_state.at(v1::JOB_CANCELLED), 2);
}

TEST_F(JobDeleteTest, StoreDeleteRemovesEveryRecordOfTheJobOnly) {
  OpenTempDir();
  coordinator.reset();
  for (const char* id : {"job-000001", "job-000002"}) {
    ASSERT_TRUE(store
                    ->Transaction([&]() -> absl::Status {
                      auto n = store->NextJobNumber();
                      if (!n.ok()) return n.status();
                      v1::Job job;
                      job.set_id(id);
                      job.set_state(v1::JOB_FAILED);
                      job.set_restarts(3);
                      if (auto s = store->PutJob(job); !s.ok()) return s;
                      v1::JobEvent e;
                      e.set_message(id);
                      if (auto s = store->AppendEvent(id, e); !s.ok()) return s;
                      v1::Policy p;
                      p.set_job_id(id);
                      p.set_version(1);
                      return store->PutPolicy(p);
                    })
                    .ok());
  }
  v1::Job two;
  two.set_id("job-000002");
  two.set_state(v1::JOB_FAILED);
  two.set_restarts(3);
  ASSERT_TRUE(store->DeleteJob(two).ok());
  EXPECT_EQ(store->DeleteJob(two).code(), absl::StatusCode::kNotFound);
  store.reset();
  auto reopened = Store::Open(dir);  // the seal says 2 ids were issued; the database agrees
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  auto snap = (*reopened)->Load();
  ASSERT_TRUE(snap.ok()) << snap.status();
  ASSERT_EQ(snap->jobs.size(), 1u);
  EXPECT_EQ(snap->jobs[0].id(), "job-000001");
  ASSERT_EQ(snap->jobs[0].events_size(), 1);
  ASSERT_EQ(snap->policies.size(), 1u);
  EXPECT_EQ(snap->policies[0].job_id(), "job-000001");
  EXPECT_EQ(snap->deleted.by_state.at(v1::JOB_FAILED), 1);
  EXPECT_EQ(snap->deleted.restarts, 3);
  auto n = (*reopened)->NextJobNumber();
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 3u);
}

TEST_F(JobDeleteTest, AWatcherOfADeletedJobGetsNotFound) {
  const std::string id = Submit("name: w\nworld_size: 1\n");
  Cancel(id);
  WatchCursor cursor;
  auto first = coordinator->WatchNext(id, &cursor, 10);
  ASSERT_TRUE(first.ok() && first->has_value());
  absl::Status watched;
  std::thread watcher([&] { watched = coordinator->WatchNext(id, &cursor, 5000).status(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(Delete(id).ok());
  watcher.join();
  EXPECT_EQ(watched.code(), absl::StatusCode::kNotFound) << watched;
  // Woken by the delete, not by its 5 s timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
}

// Issue #40 item 5: `geofp8ctl delete job NAME` twice must not reach an older job of the name.
TEST_F(JobDeleteTest, ADeleteByNameReachesOnlyTheNewestJobOfThatNameEver) {
  OpenTempDir();
  const std::string older = Submit("name: twice\nworld_size: 1\n");
  Cancel(older);
  const std::string newer = Submit("name: twice\nworld_size: 1\n");
  Cancel(newer);
  auto by_name = [&](const std::string& name) {
    v1::DeleteJobRequest req;
    req.set_name(name);
    return coordinator->DeleteJob(req);
  };
  auto first = by_name("twice");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->job().id(), newer);
  // The second delete by name is refused, naming the deleted job and the older one's id.
  auto second = by_name("twice");
  ASSERT_EQ(second.status().code(), absl::StatusCode::kNotFound) << second.status();
  EXPECT_NE(second.status().message().find("the newest job of this name, " + newer +
                                           ", was deleted already; an older one, " + older +
                                           ", is deleted only by its id"),
            std::string::npos)
      << second.status();
  EXPECT_EQ(GetCode(older), absl::StatusCode::kOk);
  // So after a coordinator restart (the record is in the store).
  Open(dir);
  EXPECT_EQ(by_name("twice").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(GetCode(older), absl::StatusCode::kOk);
  // Deleting the older one by id does not make it the name's newest deleted job.
  ASSERT_TRUE(Delete(older).ok());
  Open(dir);
  auto third = by_name("twice");
  EXPECT_NE(third.status().message().find(newer + ", was deleted already"), std::string::npos)
      << third.status();
  // A new job of the name is the newest again, and a delete by name reaches it.
  const std::string newest = Submit("name: twice\nworld_size: 1\n");
  Cancel(newest);
  auto fourth = by_name("twice");
  ASSERT_TRUE(fourth.ok()) << fourth.status();
  EXPECT_EQ(fourth->job().id(), newest);
  // Unknown names, and a request naming both, are refused.
  EXPECT_EQ(by_name("never").status().code(), absl::StatusCode::kNotFound);
  v1::DeleteJobRequest both;
  both.set_job_id(newest);
  both.set_name("twice");
  EXPECT_EQ(coordinator->DeleteJob(both).status().code(), absl::StatusCode::kInvalidArgument);
}

// Issue #41 item 1: listings are paged, by count and by bytes, so no answer passes gRPC's 4 MiB
// whatever is stored, including oversized idempotency keys a store holds from before the bounds.
TEST_F(JobDeleteTest, ListingsArePagedWhateverTheStoreHolds) {
  OpenTempDir();
  for (int i = 0; i < 5; ++i) Submit("name: big" + std::to_string(i) + "\nworld_size: 1\n");
  for (int i = 0; i < 150; ++i) Submit("name: small" + std::to_string(i) + "\nworld_size: 1\n");
  // Five jobs as an older coordinator stored them: 1 MiB idempotency keys (ListJobs was 5.2 MB).
  {
    auto snap = store->Load();
    ASSERT_TRUE(snap.ok()) << snap.status();
    for (int i = 0; i < 5; ++i) {
      v1::Job job = snap->jobs[i];
      job.clear_events();
      job.set_idempotency_key(std::string(size_t{1} << 20, 'k') + std::to_string(i));
      ASSERT_TRUE(store->PutJob(job).ok());
    }
  }
  Open(dir);
  auto all_pages = [&](v1::ListJobsRequest req) {
    std::vector<std::string> ids;
    int pages = 0;
    do {
      auto page = coordinator->ListJobs(req);
      EXPECT_TRUE(page.ok()) << page.status();
      if (!page.ok()) break;
      EXPECT_LT(page->ByteSizeLong(), size_t{4} << 20);
      EXPECT_GT(page->jobs_size(), 0);
      for (const auto& j : page->jobs()) ids.push_back(j.id());
      req.set_page_token(page->next_page_token());
      ++pages;
    } while (!req.page_token().empty() && pages < 1000);
    return std::make_pair(ids, pages);
  };
  auto [ids, pages] = all_pages(v1::ListJobsRequest());
  ASSERT_EQ(ids.size(), 155u);
  EXPECT_EQ(ids.front(), "job-000155");  // newest first, each once
  EXPECT_EQ(ids.back(), "job-000001");
  EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()).size(), 155u);
  EXPECT_EQ(pages, 2 + 5);  // 100 and 50 small ones; the 1 MiB ones one a page
  v1::ListJobsRequest small;
  small.set_page_size(7);
  EXPECT_EQ(all_pages(small).second, 150 / 7 + 1 + 5);
  // The name filter (how geofp8ctl resolves a name), states, and refused values.
  v1::ListJobsRequest named;
  named.set_name("small17");
  named.set_page_size(1);
  auto one = coordinator->ListJobs(named);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ(one->jobs_size(), 1);
  EXPECT_EQ(one->jobs(0).name(), "small17");
  EXPECT_TRUE(one->next_page_token().empty());
  v1::ListJobsRequest bad;
  bad.set_page_size(1001);
  EXPECT_NE(coordinator->ListJobs(bad).status().message().find("page_size: must be in [0, 1000]"),
            std::string::npos);
  bad.set_page_size(0);
  bad.set_page_token("x");
  EXPECT_NE(coordinator->ListJobs(bad).status().message().find("page_token: not a token"),
            std::string::npos);
  bad.clear_page_token();
  bad.add_states(v1::JOB_STATE_UNSPECIFIED);
  EXPECT_NE(coordinator->ListJobs(bad).status().message().find("states[0]: JOB_STATE_UNSPECIFIED"),
            std::string::npos);
  // Workers too, in id order.
  for (int i = 0; i < 5; ++i) Join("w" + std::to_string(i));
  v1::ListWorkersRequest wreq;
  wreq.set_page_size(2);
  std::vector<std::string> workers;
  do {
    auto page = coordinator->ListWorkers(wreq);
    ASSERT_TRUE(page.ok()) << page.status();
    for (const auto& w : page->workers()) workers.push_back(w.id());
    wreq.set_page_token(page->next_page_token());
  } while (!wreq.page_token().empty());
  EXPECT_EQ(workers, (std::vector<std::string>{"w0", "w1", "w2", "w3", "w4"}));
}

}  // namespace
}  // namespace geofp8::coordinator
