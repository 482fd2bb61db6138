// Placement: which idle workers run which pending jobs. A pure function over the pending jobs
// and the workers, with no store, clock or stream, so that its rules can be tested directly.
#pragma once

#include <string>
#include <vector>

#include "server/coordinator/worker_registry.h"

namespace geofp8::coordinator {

// What placement needs to know of a pending job.
struct PendingJob {
  std::string id;
  int world_size = 0;
  bool needs_gpu = false;       // backend nccl: only workers with a CUDA device
  bool needs_commands = false;  // a `command:` job: only workers started with --allow-commands
  // By rank, the workers of the attempt that was interrupted (a coordinator restart, a lost
  // worker), empty if none: they go first, each to its old rank where it can.
  std::vector<std::string> interrupted_workers;
  // `launcher: external`: the ranks are placed where they attached, never by the scheduler.
  // `attached` holds, by rank, the worker each rank attached to ("" for a rank not attached).
  bool external = false;
  std::vector<std::string> attached;
};

// A job's placement: the worker ids of ranks 0..world_size-1, or why it waits.
struct Placement {
  bool placed = false;
  std::vector<std::string> workers;  // by rank, when placed
  std::string waiting;               // Job.scheduling when it waits
};

// One placement per job, in order. Jobs are considered first come, first served: a job that
// fits the fleet but waits for busy workers holds back every later job, so that a large job is
// never starved by a stream of small ones; a job the connected workers can never hold (too few
// of them able) is passed over. The workers a placement takes are no longer idle for later jobs.
// Among idle workers, those that have held their session longest go first (a worker that just
// registered may be flapping), and those backing off at `now_ms` (WorkerSlot.backoff_until_ms)
// are not taken, though they count as able. Attach-only workers take no job but the external
// ones, and an external job is placed once each of its ranks has attached to an idle, connected
// attach-only worker, on those workers; it holds back no other job.
std::vector<Placement> Place(const std::vector<PendingJob>& jobs,
                             const std::vector<WorkerSlot>& workers, int64_t now_ms = 0);

}  // namespace geofp8::coordinator
