// Placement (scheduler.h): first come, first served among the jobs that fit the fleet.
#include "server/coordinator/scheduler.h"

#include <algorithm>
#include <string_view>
#include <unordered_map>

namespace geofp8::coordinator {
namespace {

// Orders `idle` so that the interrupted attempt's workers keep their old ranks: they may hold
// checkpoints written while cut off from the coordinator. The other ranks (their old worker is
// gone) take the remaining idle workers in order.
std::vector<const WorkerSlot*> KeepOldRanks(const PendingJob& job,
                                            std::vector<const WorkerSlot*> idle) {
  const int world = job.world_size;
  std::vector<const WorkerSlot*> ordered(world, nullptr);
  for (size_t r = 0; r < job.interrupted_workers.size() && r < size_t(world); ++r) {
    const std::string& id = job.interrupted_workers[r];
    auto it = std::find_if(idle.begin(), idle.end(),
                           [&](const WorkerSlot* w) { return w && w->id == id; });
    if (it != idle.end()) {
      ordered[r] = *it;
      *it = nullptr;
    }
  }
  auto next = idle.begin();
  for (auto& slot : ordered) {
    while (!slot && next != idle.end()) slot = *next++;
  }
  for (; next != idle.end(); ++next) {
    if (*next) ordered.push_back(*next);
  }
  return ordered;
}

// An external job: on the workers its ranks attached to, once all have; else why it waits.
// `index`: each worker's position in `workers` by id, built once per Place.
Placement PlaceAttached(const PendingJob& job, const std::vector<WorkerSlot>& workers,
                        const std::unordered_map<std::string_view, size_t>& index,
                        std::vector<bool>& taken) {
  Placement placement;
  const int world = job.world_size;
  std::vector<size_t> at(world, workers.size());
  int attached = 0;
  std::string missing;
  for (int r = 0; r < world; ++r) {
    const std::string_view id =
        r < int(job.attached.size()) ? std::string_view(job.attached[r]) : std::string_view();
    if (auto it = index.find(id); !id.empty() && it != index.end()) {
      const WorkerSlot& w = workers[it->second];
      if (w.connected && !w.fenced && w.idle && w.attach_only && !taken[it->second]) {
        at[r] = it->second;
      }
    }
    if (at[r] < workers.size()) {
      ++attached;
    } else if (missing.size() < 64) {
      missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    } else if (missing.back() != '.') {
      missing += ", ...";
    }
  }
  if (attached < world) {
    placement.waiting = "waiting for its ranks to attach: " + std::to_string(attached) + " of " +
                        std::to_string(world) + " attached (missing rank" +
                        (world - attached > 1 ? "s " : " ") + missing +
                        "); launch the script with GEOFP8_JOB=" + job.id +
                        " beside attach-only workers (docs/launchers.md)";
    return placement;
  }
  placement.placed = true;
  for (int r = 0; r < world; ++r) {
    placement.workers.push_back(workers[at[r]].id);
    taken[at[r]] = true;
  }
  return placement;
}

}  // namespace

std::vector<Placement> Place(const std::vector<PendingJob>& jobs,
                             const std::vector<WorkerSlot>& workers, int64_t now_ms) {
  std::vector<Placement> placements(jobs.size());
  std::vector<bool> taken(workers.size(), false);
  std::unordered_map<std::string_view, size_t> index;  // by id, for external jobs only
  std::string blocked_by;  // the first job that fits the fleet but waits for busy workers
  for (size_t j = 0; j < jobs.size(); ++j) {
    const PendingJob& job = jobs[j];
    if (job.external) {
      if (index.empty()) {
        for (size_t i = 0; i < workers.size(); ++i) index.emplace(workers[i].id, i);
      }
      placements[j] = PlaceAttached(job, workers, index, taken);
      continue;
    }
    const bool needs_gpu = job.needs_gpu;
    const bool needs_commands = job.needs_commands;
    std::vector<const WorkerSlot*> idle;
    int able = 0;         // connected workers that could run a rank of this job, idle or busy
    int backing_off = 0;  // idle ones of those that flapped lately
    for (size_t i = 0; i < workers.size(); ++i) {
      const WorkerSlot& w = workers[i];
      if (!w.connected || w.fenced || w.attach_only ||
          (needs_gpu && w.device.rfind("cuda", 0) != 0) ||
          (needs_commands && !w.accepts_commands)) {
        continue;
      }
      ++able;
      if (!w.idle || taken[i]) continue;
      if (w.backoff_until_ms > now_ms) {
        ++backing_off;
        continue;
      }
      idle.push_back(&w);
    }
    // Longest-held sessions first; ties keep the workers' (id) order.
    std::stable_sort(idle.begin(), idle.end(), [](const WorkerSlot* a, const WorkerSlot* b) {
      return a->registered_ms < b->registered_ms;
    });
    const int world = job.world_size;
    std::string kind = needs_gpu ? " with a CUDA device" : "";
    if (needs_commands) kind += " that run command jobs (--allow-commands)";
    Placement& placement = placements[j];
    if (able < world) {
      // No finishing job can make room for this one: waiting for it would stall every later
      // job (head-of-line blocking), so it is passed over until enough workers connect.
      placement.waiting = "cannot be placed: needs " + std::to_string(world) + " workers" + kind +
                          ", " + std::to_string(able) + " connected" +
                          (needs_gpu ? " (backend nccl)" : "") + "; later jobs go first";
      continue;
    }
    // First come, first served among jobs that fit the fleet: one that waits for busy workers
    // blocks later ones, so large jobs are never starved by a stream of small ones.
    if (!blocked_by.empty()) {
      placement.waiting = "queued behind " + blocked_by + " (first come, first served)";
      continue;
    }
    if (static_cast<int>(idle.size()) < world) {
      placement.waiting =
          "waiting for " + std::to_string(world) + " idle workers" + kind + " (" +
          std::to_string(idle.size()) + " idle of " + std::to_string(able) +
          (backing_off ? "; " + std::to_string(backing_off) +
                             " more backing off after leaving soon after registering"
                       : std::string()) +
          ")";
      blocked_by = job.id;
      continue;
    }
    if (!job.interrupted_workers.empty()) idle = KeepOldRanks(job, std::move(idle));
    placement.placed = true;
    for (int r = 0; r < world; ++r) {
      placement.workers.push_back(idle[r]->id);
      taken[idle[r] - workers.data()] = true;
    }
  }
  return placements;
}

}  // namespace geofp8::coordinator
