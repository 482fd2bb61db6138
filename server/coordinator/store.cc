// SQLite-backed store. Rows hold serialized protos plus the few columns that need an index or a
// uniqueness constraint (the idempotency key).
#include "server/coordinator/store.h"

#include <sqlite3.h>

#include <filesystem>
#include <unordered_map>

#include "google/protobuf/unknown_field_set.h"
#include "kernels/policy/policy.h"

namespace geofp8::coordinator {
namespace {

// A prepared statement that finalizes itself.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) { rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr); }
  ~Stmt() { sqlite3_finalize(stmt_); }
  bool ok() const { return rc_ == SQLITE_OK; }
  sqlite3_stmt* get() { return stmt_; }
  void Text(int i, const std::string& s) {
    sqlite3_bind_text(stmt_, i, s.data(), static_cast<int>(s.size()), SQLITE_TRANSIENT);
  }
  void Blob(int i, const std::string& s) {
    sqlite3_bind_blob(stmt_, i, s.data(), static_cast<int>(s.size()), SQLITE_TRANSIENT);
  }
  void Int(int i, int64_t v) { sqlite3_bind_int64(stmt_, i, v); }
  void Null(int i) { sqlite3_bind_null(stmt_, i); }
  int Step() { return sqlite3_step(stmt_); }
  std::string ColumnBlob(int i) {
    const void* p = sqlite3_column_blob(stmt_, i);
    int n = sqlite3_column_bytes(stmt_, i);
    return p ? std::string(static_cast<const char*>(p), n) : std::string();
  }

 private:
  sqlite3_stmt* stmt_ = nullptr;
  int rc_;
};

constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE,
  idempotency_key TEXT UNIQUE,
  job BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS job_events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT NOT NULL,
  event BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS job_events_by_job ON job_events(job_id, seq);
CREATE TABLE IF NOT EXISTS policies (
  job_id TEXT NOT NULL,
  version INTEGER NOT NULL,
  policy BLOB NOT NULL,
  PRIMARY KEY (job_id, version)
);
CREATE TABLE IF NOT EXISTS workers (
  name TEXT PRIMARY KEY,
  generation INTEGER NOT NULL
);
)sql";

// PRAGMA user_version of the file. 0: the first layout, in which LayerPolicy and LayerPatch
// carried format, scaling, rounding and geometry as their names (strings); 1: as enums.
constexpr int kSchemaVersion = 1;

// Schema 0's name fields, now reserved: they parse into the message's unknown fields.
struct LegacyFields {
  int format, scaling, rounding, geometry;
};
constexpr LegacyFields kLegacyLayerPolicy{1, 2, 4, 5};
constexpr LegacyFields kLegacyLayerPatch{2, 3, 5, 6};

// Moves the schema-0 names of `m` (a LayerPolicy or LayerPatch) into its enum fields, with the
// policy library's parsers. Returns whether anything changed; an unknown name is data loss.
template <typename M>
absl::StatusOr<bool> UpgradeNames(M& m, const LegacyFields& legacy, const std::string& where) {
  google::protobuf::UnknownFieldSet* unknown = m.GetReflection()->MutableUnknownFields(&m);
  bool changed = false;
  for (int i = 0; i < unknown->field_count(); ++i) {
    const google::protobuf::UnknownField& f = unknown->field(i);
    if (f.type() != google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) continue;
    const std::string& name = f.length_delimited();
    bool known = true;
    if (f.number() == legacy.format) {
      auto v = ParseFormatName(name);
      if ((known = v.has_value())) m.set_format(ToProto(*v));
    } else if (f.number() == legacy.scaling) {
      auto v = ParseScalingName(name);
      if ((known = v.has_value())) m.set_scaling(ToProto(*v));
    } else if (f.number() == legacy.rounding) {
      auto v = ParseRoundingName(name);
      if ((known = v.has_value())) m.set_rounding(ToProto(*v));
    } else if (f.number() == legacy.geometry) {
      auto v = ParseGeometryName(name);
      if ((known = v.has_value())) m.set_geometry(ToProto(*v));
    } else {
      continue;
    }
    if (!known) {
      return absl::DataLossError("store: " + where + ": unknown name '" + name + "' in field " +
                                 std::to_string(f.number()) + " of a schema-0 row");
    }
    changed = true;
  }
  for (int n : {legacy.format, legacy.scaling, legacy.rounding, legacy.geometry}) {
    unknown->DeleteByNumber(n);
  }
  return changed;
}

// A policy row written under schema 0, in schema 1's form; false when it had no names.
absl::StatusOr<bool> UpgradePolicy(v1::Policy& p) {
  const std::string where = "policy " + p.job_id() + " v" + std::to_string(p.version());
  auto changed = UpgradeNames(*p.mutable_default_policy(), kLegacyLayerPolicy, where + " default");
  if (!changed.ok()) return changed.status();
  bool any = *changed;
  for (int i = 0; i < p.patches_size(); ++i) {
    auto c = UpgradeNames(*p.mutable_patches(i), kLegacyLayerPatch,
                          where + " patches[" + std::to_string(i) + "]");
    if (!c.ok()) return c.status();
    any = any || *c;
  }
  return any;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& data_dir) {
  std::string path = ":memory:";
  if (!data_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(data_dir, ec);
    if (ec) {
      return absl::FailedPreconditionError("--data-dir: cannot create " + data_dir + ": " +
                                           ec.message());
    }
    path = (std::filesystem::path(data_dir) / "coordinator.db").string();
  }
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr) !=
      SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return absl::FailedPreconditionError("--data-dir: cannot open " + path + ": " + msg);
  }
  std::unique_ptr<Store> store(new Store(db));
  sqlite3_busy_timeout(db, 5000);
  // WAL with synchronous=FULL: a commit is on disk before the RPC that caused it returns.
  if (!data_dir.empty()) {
    if (auto s = store->Exec("PRAGMA journal_mode=WAL"); !s.ok()) return s;
  }
  if (auto s = store->Exec("PRAGMA synchronous=FULL"); !s.ok()) return s;
  if (auto s = store->Exec(kSchema); !s.ok()) return s;
  if (auto s = store->Migrate(); !s.ok()) return s;
  return store;
}

absl::StatusOr<int> Store::SchemaVersion() {
  Stmt st(db_, "PRAGMA user_version");
  if (!st.ok() || st.Step() != SQLITE_ROW) return Error("read schema version");
  return static_cast<int>(sqlite3_column_int64(st.get(), 0));
}

absl::Status Store::Migrate() {
  auto version = SchemaVersion();
  if (!version.ok()) return version.status();
  if (*version > kSchemaVersion) {
    return absl::FailedPreconditionError(
        "store: coordinator.db has schema version " + std::to_string(*version) +
        ", newer than this coordinator's " + std::to_string(kSchemaVersion) +
        " (a newer coordinator wrote it)");
  }
  if (*version == kSchemaVersion) return absl::OkStatus();
  // Schema 0 -> 1: policy rows carry the wire enums instead of names. One transaction: a
  // coordinator that dies midway finds the file as it was.
  return Transaction([&]() -> absl::Status {
    std::vector<v1::Policy> upgraded;
    {
      Stmt st(db_, "SELECT policy FROM policies");
      if (!st.ok()) return Error("prepare migrate policies");
      int rc;
      while ((rc = st.Step()) == SQLITE_ROW) {
        v1::Policy p;
        if (!p.ParseFromString(st.ColumnBlob(0))) {
          return absl::DataLossError("store: bad policy row");
        }
        auto changed = UpgradePolicy(p);
        if (!changed.ok()) return changed.status();
        if (*changed) upgraded.push_back(std::move(p));
      }
      if (rc != SQLITE_DONE) return Error("migrate policies");
    }
    for (const v1::Policy& p : upgraded) {
      if (auto s = PutPolicy(p); !s.ok()) return s;
    }
    return Exec("PRAGMA user_version = " + std::to_string(kSchemaVersion));
  });
}

Store::~Store() { sqlite3_close(db_); }

namespace {

// A status the client can act on: a full disk is RESOURCE_EXHAUSTED and an I/O error or a busy
// database UNAVAILABLE (both clear once the operator frees space or the disk recovers, and the
// caller may retry); anything else is a bug, INTERNAL.
absl::Status StoreStatus(int code, const std::string& what, const std::string& msg) {
  const std::string text = "store: " + what + ": " + msg;
  switch (code & 0xff) {  // the primary result code of an extended one
    case SQLITE_FULL:
      return absl::ResourceExhaustedError(
          text +
          " (the coordinator's --data-dir is out of space; nothing was recorded; retry "
          "once space is freed)");
    case SQLITE_IOERR:
    case SQLITE_CANTOPEN:
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
    case SQLITE_READONLY:
      return absl::UnavailableError(text +
                                    " (the coordinator's --data-dir cannot be written "
                                    "now; nothing was recorded; retry later)");
    default:
      return absl::InternalError(text);
  }
}

}  // namespace

absl::Status Store::Error(const std::string& what) const {
  return StoreStatus(sqlite3_extended_errcode(db_), what, sqlite3_errmsg(db_));
}

absl::Status Store::Exec(const std::string& sql) {
  char* err = nullptr;
  const int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err);
  if (rc != SQLITE_OK) {
    std::string msg = err ? err : "unknown error";
    sqlite3_free(err);
    return StoreStatus(rc, sql.substr(0, 40), msg);
  }
  return absl::OkStatus();
}

absl::Status Store::Transaction(const std::function<absl::Status()>& fn) {
  std::unique_lock<std::mutex> lock(mu_);
  if (auto s = Exec("BEGIN IMMEDIATE"); !s.ok()) return s;
  in_transaction_ = true;
  lock.unlock();
  absl::Status status = fn();
  lock.lock();
  in_transaction_ = false;
  if (!status.ok()) {
    Exec("ROLLBACK").IgnoreError();
    return status;
  }
  if (auto s = Exec("COMMIT"); !s.ok()) {
    Exec("ROLLBACK").IgnoreError();
    return s;
  }
  return absl::OkStatus();
}

absl::Status Store::PutJob(const v1::Job& job) {
  std::lock_guard<std::mutex> lock(mu_);
  v1::Job row = job;
  row.clear_events();
  Stmt st(db_,
          "INSERT INTO jobs(id, idempotency_key, job) VALUES(?1, ?2, ?3) "
          "ON CONFLICT(id) DO UPDATE SET job = excluded.job");
  if (!st.ok()) return Error("prepare put job");
  st.Text(1, row.id());
  if (row.idempotency_key().empty()) {
    st.Null(2);
  } else {
    st.Text(2, row.idempotency_key());
  }
  st.Blob(3, row.SerializeAsString());
  if (st.Step() != SQLITE_DONE) return Error("put job " + row.id());
  return absl::OkStatus();
}

absl::Status Store::AppendEvent(const std::string& job_id, const v1::JobEvent& event) {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt st(db_, "INSERT INTO job_events(job_id, event) VALUES(?1, ?2)");
  if (!st.ok()) return Error("prepare append event");
  st.Text(1, job_id);
  st.Blob(2, event.SerializeAsString());
  if (st.Step() != SQLITE_DONE) return Error("append event " + job_id);
  return absl::OkStatus();
}

absl::Status Store::PutPolicy(const v1::Policy& policy) {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt st(db_, "INSERT OR REPLACE INTO policies(job_id, version, policy) VALUES(?1, ?2, ?3)");
  if (!st.ok()) return Error("prepare put policy");
  st.Text(1, policy.job_id());
  st.Int(2, static_cast<int64_t>(policy.version()));
  st.Blob(3, policy.SerializeAsString());
  if (st.Step() != SQLITE_DONE) return Error("put policy " + policy.job_id());
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Store::NextGeneration(const std::string& worker_name) {
  std::lock_guard<std::mutex> lock(mu_);
  Stmt st(db_,
          "INSERT INTO workers(name, generation) VALUES(?1, 1) "
          "ON CONFLICT(name) DO UPDATE SET generation = generation + 1 RETURNING generation");
  if (!st.ok()) return Error("prepare next generation");
  st.Text(1, worker_name);
  if (st.Step() != SQLITE_ROW) return Error("next generation " + worker_name);
  uint64_t gen = static_cast<uint64_t>(sqlite3_column_int64(st.get(), 0));
  st.Step();
  return gen;
}

absl::StatusOr<Store::Snapshot> Store::Load() {
  std::lock_guard<std::mutex> lock(mu_);
  Snapshot snap;
  std::unordered_map<std::string, size_t> index;
  {
    Stmt st(db_, "SELECT job FROM jobs ORDER BY seq");
    if (!st.ok()) return Error("prepare load jobs");
    int rc;
    while ((rc = st.Step()) == SQLITE_ROW) {
      v1::Job job;
      if (!job.ParseFromString(st.ColumnBlob(0))) return absl::DataLossError("store: bad job row");
      index[job.id()] = snap.jobs.size();
      snap.jobs.push_back(std::move(job));
    }
    if (rc != SQLITE_DONE) return Error("load jobs");
  }
  {
    Stmt st(db_, "SELECT job_id, event FROM job_events ORDER BY seq");
    if (!st.ok()) return Error("prepare load events");
    int rc;
    while ((rc = st.Step()) == SQLITE_ROW) {
      std::string id(reinterpret_cast<const char*>(sqlite3_column_text(st.get(), 0)));
      auto it = index.find(id);
      if (it == index.end()) continue;
      if (!snap.jobs[it->second].add_events()->ParseFromString(st.ColumnBlob(1))) {
        return absl::DataLossError("store: bad event row of " + id);
      }
    }
    if (rc != SQLITE_DONE) return Error("load events");
  }
  {
    Stmt st(db_, "SELECT policy FROM policies ORDER BY job_id, version");
    if (!st.ok()) return Error("prepare load policies");
    int rc;
    while ((rc = st.Step()) == SQLITE_ROW) {
      v1::Policy p;
      if (!p.ParseFromString(st.ColumnBlob(0))) return absl::DataLossError("store: bad policy row");
      snap.policies.push_back(std::move(p));
    }
    if (rc != SQLITE_DONE) return Error("load policies");
  }
  return snap;
}

}  // namespace geofp8::coordinator
