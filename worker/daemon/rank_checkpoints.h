// A rank's checkpoint files on the worker's disk: their names, listing and pruning, and the
// bookkeeping of which of them may go (the coordinator's acknowledged recovery point, the bound
// on files kept while no Ack comes). Thread-safe: the session thread acknowledges and lists
// while the rank's thread writes.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace geofp8::worker {

// One checkpoint file per step, <dir>/<worker name>.<step>.ckpt: a rank keeps every step from
// the job's acknowledged recovery point on, so whichever step the coordinator resumes from
// after an outage is still on disk, however far the rank trained meanwhile.
std::string CheckpointFile(const std::string& dir, const std::string& worker_name, int64_t step);
// The steps of this worker's checkpoint files in `dir`, ascending.
std::vector<int64_t> ListCheckpoints(const std::string& dir, const std::string& worker_name);
// Deletes this worker's checkpoint files in `dir` whose step `remove` selects; returns how many.
int PruneCheckpoints(const std::string& dir, const std::string& worker_name,
                     const std::function<bool(int64_t step)>& remove);

class RankCheckpoints {
 public:
  // keep_unacknowledged: see JobRunnerOptions (at least 2 are kept).
  RankCheckpoints(std::string worker_name, int keep_unacknowledged);

  // The attempt's checkpoint directory, once resolved (empty: checkpoints off).
  void SetDir(const std::string& dir);
  std::string dir() const;
  std::string Path(int64_t step) const;

  // The coordinator has persisted `recovery_step` as the job's recovery point: no restart
  // resumes before it, so older files are deleted.
  void OnAcknowledged(int64_t recovery_step);
  // The steps of the files held now (none when checkpoints are off).
  std::vector<int64_t> Held() const;
  // Deletes the files past `resume_step`: an attempt the coordinator gave up on trained them.
  void PruneAfter(int64_t resume_step);

  // A rank cut off from the coordinator gets no Acks and so deletes nothing: over a long outage
  // its files would fill the disk. It keeps what a restart may resume from: the acknowledged
  // recovery point (and this attempt's resume step); the first file after it (the coordinator
  // may have persisted that report just before it went away, its Ack lost); and the newest
  // keep_unacknowledged files, of which the job resumes after an outage (the newest step every
  // rank holds: the ranks are at most one checkpoint apart). Once a stop is asked for (a lost
  // session, say; `stopping`) nothing more is deleted, so what a worker reports when it
  // registers again stays on disk.
  void BoundUnacknowledged(int64_t resume_step, bool stopping);

 private:
  const std::string worker_name_;
  const int keep_unacknowledged_;
  mutable std::mutex mu_;
  std::string dir_;  // empty: checkpoints off (or not resolved yet)
  int64_t acknowledged_ = 0;
};

}  // namespace geofp8::worker
