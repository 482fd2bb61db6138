// The store's group commit (store.h): writes queued by Submit, a leader per batch, one
// transaction and one fsync for every write that arrived together.
#include <sqlite3.h>

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "platform/common/log.h"
#include "platform/common/status.h"
#include "server/coordinator/store.h"

namespace geofp8::coordinator {

class Store::Write {
 public:
  explicit Write(std::function<absl::Status()> fn) : fn(std::move(fn)) {}
  std::function<absl::Status()> fn;
  // Under the store's queue_mu_:
  absl::Status status;  // written by the leader before done
  bool done = false;
  bool waiting = false;  // its submitter is in Wait (a candidate to lead the next batch)
  std::condition_variable cv;
};

namespace {
// The store whose batch this thread is leading, if any.
thread_local const Store* tls_leading = nullptr;
}  // namespace

bool Store::InBatch() const { return tls_leading == this; }

Store::WriteHandle Store::Submit(std::function<absl::Status()> fn) {
  auto w = std::make_shared<Write>(std::move(fn));
  std::lock_guard<std::mutex> lock(queue_mu_);
  queue_.push_back(w);
  return w;
}

absl::Status Store::Wait(const WriteHandle& w) {
  std::unique_lock<std::mutex> lock(queue_mu_);
  w->waiting = true;
  while (!w->done) {
    if (leading_) {
      w->cv.wait(lock);
      continue;
    }
    // No commit under way, and w is not done, so it is queued: lead a batch of everything
    // queued (w included).
    leading_ = true;
    std::vector<WriteHandle> batch(queue_.begin(), queue_.end());
    queue_.clear();
    lock.unlock();
    RunBatch(batch);
    lock.lock();
    leading_ = false;
    ++stats_.commits;
    stats_.writes += batch.size();
    for (const WriteHandle& b : batch) {
      b->done = true;
      b->cv.notify_all();  // more than one caller may wait on a write (UpdatePolicy unchanged)
    }
    // The writes queued during this batch: one of their waiters leads the next.
    for (const WriteHandle& q : queue_) {
      if (q->waiting) {
        q->cv.notify_all();
        break;
      }
    }
  }
  return w->status;
}

std::optional<absl::Status> Store::Result(const WriteHandle& w) {
  std::lock_guard<std::mutex> lock(queue_mu_);
  if (!w->done) return std::nullopt;
  return w->status;
}

absl::Status Store::Transaction(const std::function<absl::Status()>& fn) {
  if (InBatch()) return Savepoint(fn);
  return Wait(Submit([&fn] { return fn(); }));
}

Store::CommitStats Store::commit_stats() {
  std::lock_guard<std::mutex> lock(queue_mu_);
  return stats_;
}

size_t Store::queued() {
  std::lock_guard<std::mutex> lock(queue_mu_);
  return queue_.size();
}

absl::Status Store::Savepoint(const std::function<absl::Status()>& fn) {
  const std::string name = "w" + std::to_string(savepoint_depth_);
  GEOFP8_RETURN_IF_ERROR(Exec("SAVEPOINT " + name));
  ++savepoint_depth_;
  const uint64_t sealed = unsealed_jobs_;
  absl::Status s = fn();
  --savepoint_depth_;
  // Autocommit again: SQLite rolled the whole transaction back itself; nothing to undo here.
  if (sqlite3_get_autocommit(db_)) return s.ok() ? Error("transaction rolled back") : s;
  if (!s.ok()) {
    unsealed_jobs_ = sealed;
    if (auto r = Exec("ROLLBACK TO " + name); !r.ok()) return r;
  }
  if (auto r = Exec("RELEASE " + name); !r.ok()) return s.ok() ? r : s;
  return s;
}

void Store::RunBatch(const std::vector<WriteHandle>& batch) {
  tls_leading = this;
  size_t first = 0;  // the first write of the open transaction
  absl::Status begin = Exec("BEGIN IMMEDIATE");
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!begin.ok()) {
      batch[i]->status = begin;
      continue;
    }
    batch[i]->status = Savepoint(batch[i]->fn);
    if (sqlite3_get_autocommit(db_)) {
      // SQLite rolled the transaction back (SQLITE_FULL or an I/O error in mid-statement): the
      // writes before this one in it are lost as well. The rest get a transaction of their own.
      for (size_t k = first; k < i; ++k) {
        if (batch[k]->status.ok()) batch[k]->status = batch[i]->status;
      }
      unsealed_jobs_ = 0;
      first = i + 1;
      begin = Exec("BEGIN IMMEDIATE");
    }
  }
  if (begin.ok()) {
    if (absl::Status commit = Exec("COMMIT"); !commit.ok()) {
      Exec("ROLLBACK").IgnoreError();
      unsealed_jobs_ = 0;
      for (size_t k = first; k < batch.size(); ++k) {
        if (batch[k]->status.ok()) batch[k]->status = commit;
      }
    }
  }
  tls_leading = nullptr;
  // After the commit: a crash between the two leaves the seal behind the database, which is
  // fine; ahead of it would look like a rollback. The database is the record, so a seal that
  // cannot be written is logged, not the callers' failure.
  if (const uint64_t sealed = std::exchange(unsealed_jobs_, 0); sealed > 0) {
    if (auto s = WriteSeal(sealed); !s.ok()) {
      log::Error("store.seal_failed").Msg(std::string(s.message()));
    }
  }
}

}  // namespace geofp8::coordinator
