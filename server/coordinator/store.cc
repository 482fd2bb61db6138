// SQLite-backed store. Rows hold serialized protos plus the few columns that need an index or a
// uniqueness constraint (the idempotency key).
#include "server/coordinator/store.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "google/protobuf/unknown_field_set.h"
#include "platform/common/log.h"
#include "platform/common/status.h"
#include "platform/policy/policy.h"
#include "server/coordinator/secrets.h"

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
CREATE TABLE IF NOT EXISTS meta (
  key TEXT PRIMARY KEY,
  value TEXT NOT NULL
);
)sql";

constexpr const char* kSealName = "coordinator.seal";

// What coordinator.seal says. Absent: no seal file.
struct Seal {
  std::string store_id;
  uint64_t jobs_issued = 0;
};

absl::StatusOr<std::optional<Seal>> ReadSeal(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec) && !ec) return std::optional<Seal>();
  std::ifstream in(path);
  if (!in) {
    return absl::FailedPreconditionError("store: cannot read " + path + ": " +
                                         std::strerror(errno));
  }
  Seal seal;
  bool has_jobs = false;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t eq = line.find('=');
    const std::string key = line.substr(0, eq),
                      value = eq == std::string::npos ? "" : line.substr(eq + 1);
    if (key == "store_id") {
      seal.store_id = value;
    } else if (key == "jobs_issued") {
      char* end = nullptr;
      errno = 0;
      seal.jobs_issued = std::strtoull(value.c_str(), &end, 10);
      has_jobs = !value.empty() && *end == 0 && errno == 0 && value[0] != '-';
    }
  }
  if (seal.store_id.size() != 32 || !has_jobs) {
    return absl::DataLossError("store: " + path +
                               " is damaged (expected store_id=<32 hex digits> and "
                               "jobs_issued=<N>); restore it, or start with --accept-store-loss");
  }
  return std::optional<Seal>(seal);
}

// Writes path atomically and durably: a temporary file, fsync, rename, fsync of the directory.
absl::Status WriteFileDurably(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError("store: cannot write " + tmp + ": " + std::strerror(errno));
  }
  const bool ok = ::write(fd, text.data(), text.size()) == ssize_t(text.size()) && ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return absl::UnavailableError("store: cannot write " + path + ": " +
                                  std::strerror(ok ? errno : err));
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

// The number in a job id "job-000042" (0 for any other form).
uint64_t JobNumber(const std::string& id) {
  if (id.rfind("job-", 0) != 0 || id.size() == 4) return 0;
  uint64_t n = 0;
  for (size_t i = 4; i < id.size(); ++i) {
    if (id[i] < '0' || id[i] > '9') return 0;
    n = n * 10 + uint64_t(id[i] - '0');
  }
  return n;
}

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

absl::StatusOr<std::unique_ptr<Store>> Store::Open(const std::string& data_dir,
                                                   const StoreOptions& options) {
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
  if (!data_dir.empty()) {
    // Before anything writes to it: a damaged file is refused as it is.
    Stmt check(db, "PRAGMA quick_check");
    int rc = check.ok() ? check.Step() : sqlite3_errcode(db);
    std::string first = rc == SQLITE_ROW
                            ? reinterpret_cast<const char*>(sqlite3_column_text(check.get(), 0))
                            : sqlite3_errmsg(db);
    if (rc != SQLITE_ROW || first != "ok") {
      return absl::DataLossError("store: " + path + " fails its integrity check (" + first +
                                 "); restore it from a backup, or move it away to start an "
                                 "empty store");
    }
  }
  // WAL with synchronous=FULL: a commit is on disk before the RPC that caused it returns.
  if (!data_dir.empty()) {
    if (auto s = store->Exec("PRAGMA journal_mode=WAL"); !s.ok()) return s;
  }
  if (auto s = store->Exec("PRAGMA synchronous=FULL"); !s.ok()) return s;
  if (!data_dir.empty()) {
    if (auto s = store->CheckTables(path, options); !s.ok()) return s;
  }
  if (auto s = store->Exec(kSchema); !s.ok()) return s;
  if (auto s = store->Migrate(); !s.ok()) return s;
  if (!data_dir.empty()) {
    if (auto s = store->CheckIntegrity(data_dir, options); !s.ok()) return s;
  }
  return store;
}

absl::Status Store::CheckTables(const std::string& path, const StoreOptions& options) {
  std::set<std::string> tables;
  Stmt st(db_, "SELECT name FROM sqlite_master WHERE type = 'table'");
  if (!st.ok()) return Error("prepare list tables");
  int rc;
  while ((rc = st.Step()) == SQLITE_ROW) {
    tables.insert(reinterpret_cast<const char*>(sqlite3_column_text(st.get(), 0)));
  }
  if (rc != SQLITE_DONE) return Error("list tables");
  if (tables.empty()) return absl::OkStatus();  // a new file: the schema creates them all
  // Every layout since the first has these four (meta came later and is created when absent).
  // CREATE TABLE IF NOT EXISTS would make a dropped one anew, and the jobs it held would be
  // served as if there had never been any.
  for (const char* table : {"jobs", "job_events", "policies", "workers"}) {
    if (tables.count(table)) continue;
    const std::string problem = path + " has no '" + table + "' table: it was dropped";
    if (!options.accept_loss) {
      return absl::DataLossError("store: " + problem +
                                 ". Restore the database from a backup, or start with "
                                 "--accept-store-loss to create it empty");
    }
    log::Warn("store.loss_accepted")
        .F("table", table)
        .Msg(problem + "; created empty (--accept-store-loss)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Store::GetMeta(const std::string& key) {
  Stmt st(db_, "SELECT value FROM meta WHERE key = ?1");
  if (!st.ok()) return Error("prepare get meta");
  st.Text(1, key);
  const int rc = st.Step();
  if (rc == SQLITE_DONE) return std::string();
  if (rc != SQLITE_ROW) return Error("get meta " + key);
  return std::string(reinterpret_cast<const char*>(sqlite3_column_text(st.get(), 0)));
}

absl::Status Store::SetMeta(const std::string& key, const std::string& value) {
  Stmt st(db_, "INSERT OR REPLACE INTO meta(key, value) VALUES(?1, ?2)");
  if (!st.ok()) return Error("prepare set meta");
  st.Text(1, key);
  st.Text(2, value);
  if (st.Step() != SQLITE_DONE) return Error("set meta " + key);
  return absl::OkStatus();
}

absl::Status Store::WriteSeal(uint64_t jobs_issued) {
  return WriteFileDurably(
      seal_path_,
      "# GeoFP8 coordinator store seal: the identity of coordinator.db beside it and how many\n"
      "# job ids it has issued. The coordinator refuses a database that does not match.\n"
      "store_id=" +
          store_id_ + "\njobs_issued=" + std::to_string(jobs_issued) + "\n");
}

absl::Status Store::CheckIntegrity(const std::string& data_dir, const StoreOptions& options) {
  seal_path_ = (std::filesystem::path(data_dir) / kSealName).string();
  const std::string db_path = (std::filesystem::path(data_dir) / "coordinator.db").string();
  auto seal = ReadSeal(seal_path_);
  if (!seal.ok()) {
    if (!options.accept_loss) return seal.status();
    log::Warn("store.loss_accepted").Msg(std::string(seal.status().message()));
    seal = std::optional<Seal>();
  }
  auto id = GetMeta("store_id");
  if (!id.ok()) return id.status();
  auto issued_text = GetMeta("jobs_issued");
  if (!issued_text.ok()) return issued_text.status();
  // A database older than the seal counts the job ids it has (they were job-<count>).
  uint64_t issued = issued_text->empty() ? 0 : std::strtoull(issued_text->c_str(), nullptr, 10);
  if (issued_text->empty()) {
    Stmt st(db_, "SELECT id FROM jobs");
    if (!st.ok()) return Error("prepare count jobs");
    while (st.Step() == SQLITE_ROW) {
      issued = std::max(issued,
                        JobNumber(reinterpret_cast<const char*>(sqlite3_column_text(st.get(), 0))));
    }
  }
  std::string problem;
  if (seal->has_value()) {
    const Seal& s = **seal;
    const std::string had = "coordinator.seal says store " + s.store_id + " issued " +
                            std::to_string(s.jobs_issued) + " job ids";
    if (id->empty()) {
      problem = db_path + " has no store identity, but " + had +
                ": the database was truncated or replaced";
    } else if (*id != s.store_id) {
      problem = db_path + " is store " + *id + ", but " + had + ": the database was replaced";
    } else if (issued < s.jobs_issued) {
      problem = db_path + " has issued " + std::to_string(issued) + " job ids, but " + had +
                ": it was rolled back, and job-" + std::to_string(issued + 1) + " to job-" +
                std::to_string(s.jobs_issued) + " are missing";
    }
    if (!problem.empty() && !options.accept_loss) {
      return absl::DataLossError("store: " + problem +
                                 ". Restore the database from a backup, or start with "
                                 "--accept-store-loss to serve what it holds (job ids continue "
                                 "after job-" +
                                 std::to_string(s.jobs_issued) + ")");
    }
    if (!problem.empty()) {
      log::Warn("store.loss_accepted")
          .F("data_dir", data_dir)
          .Msg(problem + " (--accept-store-loss)");
    }
    store_id_ = s.store_id;
    issued = std::max(issued, s.jobs_issued);
  } else {
    store_id_ = id->empty() ? RandomSecret() : *id;
    if (!id->empty()) {
      log::Warn("store.sealed")
          .F("data_dir", data_dir)
          .Msg("no " + std::string(kSealName) + " beside store " + store_id_ +
               "; writing a new one");
    }
  }
  // Written only when something changed, so that a coordinator still starts on a full disk.
  if (*id != store_id_) {
    if (auto s = SetMeta("store_id", store_id_); !s.ok()) return s;
  }
  if (*issued_text != std::to_string(issued)) {
    if (auto s = SetMeta("jobs_issued", std::to_string(issued)); !s.ok()) return s;
  }
  if (!seal->has_value() || (**seal).store_id != store_id_ || (**seal).jobs_issued != issued) {
    if (auto s = WriteSeal(issued); !s.ok()) {
      log::Error("store.seal_failed").Msg(std::string(s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Store::NextJobNumber() {
  if (!InBatch()) return AsWrite([&] { return NextJobNumber(); });
  Stmt st(db_,
          "INSERT INTO meta(key, value) VALUES('jobs_issued', '1') ON CONFLICT(key) DO UPDATE "
          "SET value = CAST(value AS INTEGER) + 1 RETURNING CAST(value AS INTEGER)");
  if (!st.ok()) return Error("prepare next job number");
  if (st.Step() != SQLITE_ROW) return Error("next job number");
  const uint64_t n = static_cast<uint64_t>(sqlite3_column_int64(st.get(), 0));
  st.Step();
  // Sealed once the batch commits (RunBatch); a savepoint rolled back takes this back too.
  if (!seal_path_.empty()) unsealed_jobs_ = n;
  return n;
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
  absl::Status s;
  switch (code & 0xff) {  // the primary result code of an extended one
    case SQLITE_FULL:
      s = absl::ResourceExhaustedError(
          text +
          " (the coordinator's --data-dir is out of space; nothing was recorded; retry "
          "once space is freed)");
      break;
    case SQLITE_IOERR:
    case SQLITE_CANTOPEN:
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
    case SQLITE_READONLY:
      s = absl::UnavailableError(text +
                                 " (the coordinator's --data-dir cannot be written "
                                 "now; nothing was recorded; retry later)");
      break;
    default:
      return absl::InternalError(text);
  }
  // By type, not by text: the server is up but cannot record (geofp8ctl exits 7, not 4).
  s.SetPayload(kStoreUnwritablePayload, absl::Cord("1"));
  return s;
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

// ------------------------------------------------------------------------------------------
// A write method called outside a closure is a Transaction of its own (group commit, in
// store_commit.cc).

template <typename F>
auto Store::AsWrite(F f) -> decltype(f()) {
  if (InBatch()) return f();
  std::optional<decltype(f())> result;
  absl::Status s = Transaction([&] {
    result.emplace(f());
    return ::geofp8::internal::StatusOf(*result);
  });
  if (!s.ok()) return s;  // the closure's error, or the batch's when its commit failed
  return *std::move(result);
}

// ------------------------------------------------------------------------------------------
// Writes: each runs in the leader's transaction (a Transaction of its own when called outside a
// closure).

absl::Status Store::PutJob(const v1::Job& job) {
  if (!InBatch()) return AsWrite([&] { return PutJob(job); });
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
  if (!InBatch()) return AsWrite([&] { return AppendEvent(job_id, event); });
  Stmt st(db_, "INSERT INTO job_events(job_id, event) VALUES(?1, ?2)");
  if (!st.ok()) return Error("prepare append event");
  st.Text(1, job_id);
  st.Blob(2, event.SerializeAsString());
  if (st.Step() != SQLITE_DONE) return Error("append event " + job_id);
  return absl::OkStatus();
}

absl::Status Store::PutPolicy(const v1::Policy& policy) {
  if (!InBatch()) return AsWrite([&] { return PutPolicy(policy); });
  Stmt st(db_, "INSERT OR REPLACE INTO policies(job_id, version, policy) VALUES(?1, ?2, ?3)");
  if (!st.ok()) return Error("prepare put policy");
  st.Text(1, policy.job_id());
  st.Int(2, static_cast<int64_t>(policy.version()));
  st.Blob(3, policy.SerializeAsString());
  if (st.Step() != SQLITE_DONE) return Error("put policy " + policy.job_id());
  return absl::OkStatus();
}

absl::Status Store::PutNextPolicy(const v1::Policy& policy) {
  if (!InBatch()) return AsWrite([&] { return PutNextPolicy(policy); });
  if (policy.version() > 1) {
    Stmt st(db_, "SELECT 1 FROM policies WHERE job_id = ?1 AND version = ?2");
    if (!st.ok()) return Error("prepare find policy");
    st.Text(1, policy.job_id());
    st.Int(2, static_cast<int64_t>(policy.version() - 1));
    const int rc = st.Step();
    if (rc == SQLITE_DONE) {
      absl::Status s = absl::UnavailableError(
          "store: policy v" + std::to_string(policy.version()) + " of job " + policy.job_id() +
          " not recorded: v" + std::to_string(policy.version() - 1) +
          ", which it was made from, failed to record; nothing was recorded; retry");
      s.SetPayload(kStoreUnwritablePayload, absl::Cord("1"));
      return s;
    }
    if (rc != SQLITE_ROW) return Error("find policy " + policy.job_id());
  }
  return PutPolicy(policy);
}

namespace {
// meta keys of the deleted-job totals: "deleted.<state number>" and "deleted.restarts".
constexpr char kDeletedPrefix[] = "deleted.";
constexpr char kDeletedRestartsKey[] = "deleted.restarts";
// meta key of a name's newest deleted job: "deleted-name:<name>" = its id.
constexpr char kDeletedNamePrefix[] = "deleted-name:";
}  // namespace

absl::Status Store::DeleteJob(const v1::Job& job, bool newest_of_name) {
  return Transaction([&]() -> absl::Status {
    {
      Stmt st(db_, "DELETE FROM jobs WHERE id = ?1");
      if (!st.ok()) return Error("prepare delete job");
      st.Text(1, job.id());
      if (st.Step() != SQLITE_DONE) return Error("delete job " + job.id());
      if (sqlite3_changes(db_) == 0) {
        return absl::NotFoundError("store: job " + job.id() + " has no row");
      }
    }
    for (const char* sql :
         {"DELETE FROM job_events WHERE job_id = ?1", "DELETE FROM policies WHERE job_id = ?1"}) {
      Stmt st(db_, sql);
      if (!st.ok()) return Error("prepare delete job records");
      st.Text(1, job.id());
      if (st.Step() != SQLITE_DONE) return Error("delete records of job " + job.id());
    }
    const std::pair<std::string, int64_t> adds[] = {
        {kDeletedPrefix + std::to_string(static_cast<int>(job.state())), 1},
        {kDeletedRestartsKey, job.restarts()}};
    for (const auto& [key, delta] : adds) {
      Stmt st(db_,
              "INSERT INTO meta(key, value) VALUES(?1, CAST(?2 AS TEXT)) ON CONFLICT(key) DO "
              "UPDATE SET value = CAST(CAST(value AS INTEGER) + ?2 AS TEXT)");
      if (!st.ok()) return Error("prepare count deleted job");
      st.Text(1, key);
      st.Int(2, delta);
      if (st.Step() != SQLITE_DONE) return Error("count deleted job " + job.id());
    }
    if (newest_of_name) {
      Stmt st(db_, "INSERT OR REPLACE INTO meta(key, value) VALUES(?1, ?2)");
      if (!st.ok()) return Error("prepare record deleted name");
      st.Text(1, kDeletedNamePrefix + job.name());
      st.Text(2, job.id());
      if (st.Step() != SQLITE_DONE) return Error("record deleted name of job " + job.id());
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<uint64_t> Store::NextGeneration(const std::string& worker_name) {
  if (!InBatch()) return AsWrite([&] { return NextGeneration(worker_name); });
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
  // Read-only, but on the leader's thread like every other use of the handle.
  if (!InBatch()) return AsWrite([&] { return Load(); });
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
  {
    Stmt st(db_, "SELECT key, CAST(value AS INTEGER) FROM meta WHERE key LIKE 'deleted.%'");
    if (!st.ok()) return Error("prepare load deleted totals");
    int rc;
    while ((rc = st.Step()) == SQLITE_ROW) {
      const std::string key(reinterpret_cast<const char*>(sqlite3_column_text(st.get(), 0)));
      const int64_t value = sqlite3_column_int64(st.get(), 1);
      if (key == kDeletedRestartsKey) {
        snap.deleted.restarts = value;
      } else {
        snap.deleted.by_state[std::atoi(key.c_str() + std::strlen(kDeletedPrefix))] = value;
      }
    }
    if (rc != SQLITE_DONE) return Error("load deleted totals");
  }
  {
    Stmt st(db_, "SELECT key, value FROM meta WHERE substr(key, 1, ?1) = ?2");
    if (!st.ok()) return Error("prepare load deleted names");
    const size_t prefix = std::strlen(kDeletedNamePrefix);
    st.Int(1, static_cast<int64_t>(prefix));
    st.Text(2, kDeletedNamePrefix);
    int rc;
    while ((rc = st.Step()) == SQLITE_ROW) {
      const std::string key(reinterpret_cast<const char*>(sqlite3_column_text(st.get(), 0)));
      snap.deleted_names[key.substr(prefix)] =
          reinterpret_cast<const char*>(sqlite3_column_text(st.get(), 1));
    }
    if (rc != SQLITE_DONE) return Error("load deleted names");
  }
  return snap;
}

}  // namespace geofp8::coordinator
