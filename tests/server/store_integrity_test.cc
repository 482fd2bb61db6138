// Issue #31 item 4: a store that notices. coordinator.db is checked at open against its seal
// (coordinator.seal: identity and job-id high-water mark), so a truncated, replaced, rolled-back
// or damaged database is refused with what is missing, and job ids never repeat, not even after
// --accept-store-loss.
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "server/coordinator/coordinator.h"

namespace geofp8::coordinator {
namespace {

namespace fs = std::filesystem;

class StoreIntegrityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "geofp8-seal-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir = tmpl;
  }
  void TearDown() override { fs::remove_all(dir); }

  // Opens the store in `d` and issues `jobs` job numbers, each with its job row, as the
  // coordinator's SubmitJob does (one transaction each). Returns the last number.
  uint64_t IssueJobs(const std::string& d, int jobs) {
    auto store = Store::Open(d);
    EXPECT_TRUE(store.ok()) << store.status();
    if (!store.ok()) return 0;
    uint64_t last = 0;
    for (int i = 0; i < jobs; ++i) {
      EXPECT_TRUE((*store)
                      ->Transaction([&]() -> absl::Status {
                        auto n = (*store)->NextJobNumber();
                        if (!n.ok()) return n.status();
                        last = *n;
                        v1::Job job;
                        job.set_id("job-" + std::to_string(*n));
                        return (*store)->PutJob(job);
                      })
                      .ok());
    }
    return last;
  }
  std::string Db() const { return (fs::path(dir) / "coordinator.db").string(); }
  // Everything of the database: the file and its WAL, as a backup tool would copy them.
  void CopyDb(const std::string& from_dir, const std::string& to_dir) {
    for (const char* f : {"coordinator.db", "coordinator.db-wal", "coordinator.db-shm"}) {
      std::error_code ec;
      fs::remove(fs::path(to_dir) / f, ec);
      if (fs::exists(fs::path(from_dir) / f)) {
        fs::copy_file(fs::path(from_dir) / f, fs::path(to_dir) / f);
      }
    }
  }
  std::string dir;
};

TEST_F(StoreIntegrityTest, AFreshStoreIsSealedAndReopens) {
  EXPECT_EQ(IssueJobs(dir, 3), 3u);
  std::ifstream seal(fs::path(dir) / "coordinator.seal");
  std::string text((std::istreambuf_iterator<char>(seal)), {});
  EXPECT_NE(text.find("jobs_issued=3\n"), std::string::npos) << text;
  auto store = Store::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->store_id().size(), 32u);
  EXPECT_NE(text.find("store_id=" + (*store)->store_id()), std::string::npos) << text;
  auto next = (*store)->NextJobNumber();
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(*next, 4u);
}

TEST_F(StoreIntegrityTest, ATruncatedDatabaseIsRefusedAndIdsNeverRepeat) {
  IssueJobs(dir, 2);
  for (const char* f : {"coordinator.db-wal", "coordinator.db-shm"}) fs::remove(fs::path(dir) / f);
  fs::resize_file(Db(), 0);  // truncate -s 0
  auto refused = Store::Open(dir);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_NE(refused.status().message().find("has no store identity"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("issued 2 job ids"), std::string::npos);
  EXPECT_NE(refused.status().message().find("--accept-store-loss"), std::string::npos);
  // Refused again, and nothing was changed by the refusal.
  EXPECT_EQ(Store::Open(dir).status().code(), absl::StatusCode::kDataLoss);

  StoreOptions accept;
  accept.accept_loss = true;
  auto store = Store::Open(dir, accept);
  ASSERT_TRUE(store.ok()) << store.status();
  auto next = (*store)->NextJobNumber();
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(*next, 3u) << "job-000001 and job-000002 were issued once: never again";
}

TEST_F(StoreIntegrityTest, ARolledBackDatabaseIsRefused) {
  IssueJobs(dir, 1);
  const std::string backup = dir + "/backup";
  fs::create_directories(backup);
  {
    auto store = Store::Open(dir);  // a clean close checkpoints the WAL into the file
    ASSERT_TRUE(store.ok());
  }
  CopyDb(dir, backup);
  IssueJobs(dir, 2);  // job 2 and 3 acknowledged
  CopyDb(backup, dir);
  auto refused = Store::Open(dir);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_NE(refused.status().message().find("rolled back, and job-2 to job-3 are missing"),
            std::string::npos)
      << refused.status();
}

TEST_F(StoreIntegrityTest, AnotherStoresDatabaseIsRefused) {
  const std::string other = dir + "/other";
  IssueJobs(other, 5);
  IssueJobs(dir, 1);
  CopyDb(other, dir);
  auto refused = Store::Open(dir);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_NE(refused.status().message().find("the database was replaced"), std::string::npos)
      << refused.status();
}

TEST_F(StoreIntegrityTest, ADamagedDatabaseFailsItsIntegrityCheck) {
  IssueJobs(dir, 20);
  {
    auto store = Store::Open(dir);
    ASSERT_TRUE(store.ok());
  }
  // Garbage over the b-tree header of every page after the first (SQLite's default page size
  // is 4096 bytes): the schema still reads, the tables do not.
  const auto size = fs::file_size(Db());
  ASSERT_GT(size, 8192u);
  std::fstream f(Db(), std::ios::in | std::ios::out | std::ios::binary);
  const std::string junk(64, '\x5a');
  for (std::uintmax_t page = 4096; page < size; page += 4096) {
    f.seekp(std::streamoff(page));
    f.write(junk.data(), junk.size());
  }
  f.close();
  auto refused = Store::Open(dir);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_NE(refused.status().message().find("integrity check"), std::string::npos)
      << refused.status();
}

TEST_F(StoreIntegrityTest, ADamagedSealIsRefusedNotIgnored) {
  IssueJobs(dir, 1);
  std::ofstream(fs::path(dir) / "coordinator.seal") << "store_id=zz\n";
  auto refused = Store::Open(dir);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_NE(refused.status().message().find("coordinator.seal is damaged"), std::string::npos)
      << refused.status();
}

// Issue #41: with CREATE TABLE IF NOT EXISTS, a dropped table came back empty and its jobs were
// served as if there had never been any.
TEST_F(StoreIntegrityTest, ADroppedTableIsRefusedByName) {
  IssueJobs(dir, 3);
  for (const char* table : {"jobs", "job_events", "policies", "workers"}) {
    const std::string copy = dir + "/" + table;
    fs::create_directories(copy);
    CopyDb(dir, copy);
    fs::copy_file(fs::path(dir) / "coordinator.seal", fs::path(copy) / "coordinator.seal");
    {
      sqlite3* db = nullptr;
      ASSERT_EQ(sqlite3_open((fs::path(copy) / "coordinator.db").c_str(), &db), SQLITE_OK);
      const std::string drop = std::string("DROP TABLE ") + table;
      EXPECT_EQ(sqlite3_exec(db, drop.c_str(), nullptr, nullptr, nullptr), SQLITE_OK) << table;
      sqlite3_close(db);
    }
    auto refused = Store::Open(copy);
    ASSERT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << table;
    EXPECT_NE(refused.status().message().find(std::string("no '") + table + "' table"),
              std::string::npos)
        << refused.status();
    // Accepted, it is created empty, and the store opens.
    StoreOptions accept;
    accept.accept_loss = true;
    EXPECT_TRUE(Store::Open(copy, accept).ok()) << table;
  }
  // The untouched store still opens with its 3 jobs.
  auto store = Store::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  auto snapshot = (*store)->Load();
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  EXPECT_EQ(snapshot->jobs.size(), 3u);
}

}  // namespace
}  // namespace geofp8::coordinator
