// The coordinator's SQLite store opens a file written under schema 0 (format, scaling, rounding
// and geometry as names in the policy rows) and upgrades it to the wire enums, once, in place.
// The old file is made here, by hand: the old tables, and policy rows whose name fields are
// encoded exactly as the old proto wrote them (length-delimited fields 1, 2, 4, 5 of
// LayerPolicy and 2, 3, 5, 6 of LayerPatch, now reserved).
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <stdlib.h>

#include <filesystem>

#include "google/protobuf/unknown_field_set.h"
#include "platform/policy/policy.h"
#include "server/coordinator/coordinator.h"

namespace geofp8::coordinator {
namespace {

namespace fs = std::filesystem;

// The tables as schema 0 created them (user_version 0).
constexpr const char* kSchema0 = R"sql(
CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
                   idempotency_key TEXT UNIQUE, job BLOB NOT NULL);
CREATE TABLE job_events (seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL,
                         event BLOB NOT NULL);
CREATE INDEX job_events_by_job ON job_events(job_id, seq);
CREATE TABLE policies (job_id TEXT NOT NULL, version INTEGER NOT NULL, policy BLOB NOT NULL,
                       PRIMARY KEY (job_id, version));
CREATE TABLE workers (name TEXT PRIMARY KEY, generation INTEGER NOT NULL);
)sql";

template <typename M>
void AddName(M* m, int field, const std::string& name) {
  m->GetReflection()->MutableUnknownFields(m)->AddLengthDelimited(field, name);
}

// A policy row as schema 0 wrote it.
std::string OldPolicyRow(uint64_t version, const std::string& default_format,
                         const std::string& patch_geometry) {
  v1::Policy p;
  p.set_job_id("job-000001");
  p.set_version(version);
  p.set_effective_step(version == 1 ? 0 : 20);
  p.set_reason("v" + std::to_string(version));
  v1::LayerPolicy* d = p.mutable_default_policy();
  AddName(d, 1, default_format);  // format
  AddName(d, 2, "block");         // scaling
  d->set_block(32);
  AddName(d, 4, "stochastic");  // rounding
  AddName(d, 5, "diag");        // geometry
  d->set_rank(4);
  d->set_error_feedback(true);
  if (!patch_geometry.empty()) {
    v1::LayerPatch* patch = p.add_patches();
    patch->set_layer("*attn*");
    AddName(patch, 2, "nvfp4");         // format
    AddName(patch, 6, patch_geometry);  // geometry
    patch->set_rank(8);
  }
  return p.SerializeAsString();
}

class StoreMigrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "geofp8-store-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes coordinator.db under schema 0 with the given policy rows and user_version.
  void WriteOldFile(const std::vector<std::string>& policy_rows, int user_version = 0) {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open((fs::path(dir_) / "coordinator.db").c_str(), &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db, kSchema0, nullptr, nullptr, nullptr), SQLITE_OK);
    v1::Job job;
    job.set_id("job-000001");
    job.set_state(v1::JOB_CANCELLED);
    job.set_policy_version(policy_rows.size());
    Insert(db, "INSERT INTO jobs(id, job) VALUES('job-000001', ?1)", job.SerializeAsString(), 0);
    for (size_t i = 0; i < policy_rows.size(); ++i) {
      Insert(db, "INSERT INTO policies(job_id, version, policy) VALUES('job-000001', ?2, ?1)",
             policy_rows[i], int64_t(i + 1));
    }
    const std::string pragma = "PRAGMA user_version = " + std::to_string(user_version);
    ASSERT_EQ(sqlite3_exec(db, pragma.c_str(), nullptr, nullptr, nullptr), SQLITE_OK);
    sqlite3_close(db);
  }

  static void Insert(sqlite3* db, const char* sql, const std::string& blob, int64_t version) {
    sqlite3_stmt* st = nullptr;
    ASSERT_EQ(sqlite3_prepare_v2(db, sql, -1, &st, nullptr), SQLITE_OK);
    sqlite3_bind_blob(st, 1, blob.data(), int(blob.size()), SQLITE_TRANSIENT);
    if (version > 0) sqlite3_bind_int64(st, 2, version);
    EXPECT_EQ(sqlite3_step(st), SQLITE_DONE);
    sqlite3_finalize(st);
  }

  int UserVersion() {
    sqlite3* db = nullptr;
    EXPECT_EQ(sqlite3_open((fs::path(dir_) / "coordinator.db").c_str(), &db), SQLITE_OK);
    sqlite3_stmt* st = nullptr;
    sqlite3_prepare_v2(db, "PRAGMA user_version", -1, &st, nullptr);
    const int v = sqlite3_step(st) == SQLITE_ROW ? int(sqlite3_column_int64(st, 0)) : -1;
    sqlite3_finalize(st);
    sqlite3_close(db);
    return v;
  }

  std::string dir_;
};

void ExpectUpgraded(const v1::Policy& p, bool with_patch) {
  const v1::LayerPolicy& d = p.default_policy();
  EXPECT_EQ(d.scaling(), v1::SCALING_BLOCK);
  EXPECT_EQ(d.block(), 32u);
  EXPECT_EQ(d.rounding(), v1::ROUNDING_STOCHASTIC);
  EXPECT_EQ(d.geometry(), v1::GEOMETRY_DIAG);
  EXPECT_EQ(d.rank(), 4);
  EXPECT_TRUE(d.error_feedback());
  // No name is left behind as an unknown field.
  EXPECT_EQ(d.GetReflection()->GetUnknownFields(d).field_count(), 0);
  ASSERT_EQ(p.patches_size(), with_patch ? 1 : 0);
  if (with_patch) {
    const v1::LayerPatch& patch = p.patches(0);
    EXPECT_EQ(patch.layer(), "*attn*");
    EXPECT_TRUE(patch.has_format());
    EXPECT_EQ(patch.format(), v1::FORMAT_NVFP4);
    EXPECT_FALSE(patch.has_scaling());  // unset in the old row: still unset
    EXPECT_EQ(patch.geometry(), v1::GEOMETRY_LOWRANK);
    EXPECT_EQ(patch.rank(), 8);
    EXPECT_EQ(patch.GetReflection()->GetUnknownFields(patch).field_count(), 0);
  }
}

TEST_F(StoreMigrationTest, UpgradesSchemaZeroPolicyRowsOnce) {
  WriteOldFile({OldPolicyRow(1, "fp8_e4m3", ""), OldPolicyRow(2, "fp8_e5m2", "lowrank")});
  for (int open = 0; open < 2; ++open) {  // the second open finds schema 1: nothing to do
    auto store = Store::Open(dir_);
    ASSERT_TRUE(store.ok()) << store.status();
    auto snap = (*store)->Load();
    ASSERT_TRUE(snap.ok()) << snap.status();
    ASSERT_EQ(snap->jobs.size(), 1u);
    ASSERT_EQ(snap->policies.size(), 2u);
    EXPECT_EQ(snap->policies[0].default_policy().format(), v1::FORMAT_FP8_E4M3);
    ExpectUpgraded(snap->policies[0], false);
    EXPECT_EQ(snap->policies[1].default_policy().format(), v1::FORMAT_FP8_E5M2);
    ExpectUpgraded(snap->policies[1], true);
    EXPECT_EQ(snap->policies[1].effective_step(), 20);
    store->reset();
    EXPECT_EQ(UserVersion(), 1);
  }
  // The coordinator recovers the job with its policy versions readable by the policy library.
  auto store = Store::Open(dir_);
  ASSERT_TRUE(store.ok()) << store.status();
  Coordinator coordinator(store->get(), SystemClock(), CoordinatorOptions{});
  ASSERT_TRUE(coordinator.Recover().ok());
  v1::GetPolicyRequest req;
  req.set_job_id("job-000001");
  auto latest = coordinator.GetPolicy(req);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->version(), 2u);
  auto patch_file = PatchFileOf(*latest);
  ASSERT_TRUE(patch_file.ok()) << patch_file.status();
  ASSERT_TRUE(patch_file->defaults.has_value());
  EXPECT_EQ(patch_file->defaults->format, Format::kFp8E5M2);
  ASSERT_EQ(patch_file->layers.size(), 1u);
  EXPECT_EQ(patch_file->layers[0].geometry, GeometryMode::kLowRank);
}

TEST_F(StoreMigrationTest, UnknownOldNameFailsNamingTheRow) {
  WriteOldFile({OldPolicyRow(1, "fp9", "")});
  auto store = Store::Open(dir_);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(store.status().message().find("policy job-000001 v1 default: unknown name 'fp9'"),
            std::string::npos)
      << store.status();
  EXPECT_EQ(UserVersion(), 0);  // the failed migration changed nothing
}

TEST_F(StoreMigrationTest, NewerSchemaIsRefused) {
  WriteOldFile({}, /*user_version=*/7);
  auto store = Store::Open(dir_);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(store.status().message().find("schema version 7"), std::string::npos) << store.status();
}

TEST_F(StoreMigrationTest, NewFileStartsAtTheCurrentSchema) {
  auto store = Store::Open(dir_);
  ASSERT_TRUE(store.ok()) << store.status();
  store->reset();
  EXPECT_EQ(UserVersion(), 1);
}

}  // namespace
}  // namespace geofp8::coordinator
