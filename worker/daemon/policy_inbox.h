// The policy versions of one rank's attempt that are not in force yet, and the version in force:
// the session thread offers versions and the catalog's refresh schedule as they arrive; the
// rank's thread takes the version due at each step boundary. Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "geofp8/v1/geofp8.pb.h"
#include "kernels/exchange/policy.h"
#include "kernels/model/model.h"
#include "worker/daemon/connection.h"

namespace geofp8::worker {

class PolicyInbox {
 public:
  // The assignment's own refresh schedule, if it carries one, is the catalog's.
  explicit PolicyInbox(const v1::Assignment& assignment);

  // Registers every policy version of the job the coordinator knows, so a resumed attempt
  // applies the one in force at its start step and queues the later ones: the assignment's
  // history, or (an older coordinator) the versions listed over `connection`.
  void LoadVersions(const v1::Assignment& assignment, Connection& connection);

  // A version from the session; ignored when already held or not newer than the one in force.
  void Offer(const v1::Policy& policy);
  // The catalog's schedule (taken once, before the first step).
  void OfferRefresh(const v1::RefreshSchedules& refresh);
  // Wakes WaitForInitialSchedule (a stop was asked for).
  void Interrupt();

  // The version to put in force from the start of `step` (nullopt: the one in force stays),
  // removing it and every older queued version. `agreed` is the newest version that every rank
  // holds (Control). A taken version (one a resumed attempt replays) applies exactly at its
  // taken_step, and until the last of them has, nothing else does. Any other version applies at
  // the first step at or after its effective_step (a lower bound) at which every rank holds it.
  // Every rank decides with the same `agreed` and the same queued versions up to it (versions
  // reach a rank in order), so all of them switch at the same step, and none has passed it.
  std::optional<v1::Policy> TakeDue(int64_t step, uint64_t agreed);
  // The version in force at the start step of the attempt: the newest taken at or before it
  // (for a job from an older coordinator, whose versions carry no taken_step, the newest
  // effective at or before it). When the resumed checkpoint was written under a newer version
  // that the coordinator never heard was taken (rank 0's report was lost in a coordinator
  // outage), that one: it was in force at the step before. It and the queued versions before it
  // are removed.
  std::optional<v1::Policy> TakeStart(int64_t start, uint64_t written_under);
  // The newest version this rank holds, in force or queued.
  uint64_t NewestHeld() const;

  // `version` is in force; it was put in force at step `taken` (earlier than now for the version
  // a resumed attempt starts under).
  void SetInForce(uint64_t version, int64_t taken);
  uint64_t in_force() const;
  // (version, taken step) of every version this attempt put in force, in order. A re-registering
  // worker reports them: a version taken just before a coordinator outage is then recorded even
  // though rank 0's ack was lost with the coordinator's generation.
  std::vector<std::pair<uint64_t, int64_t>> Taken() const;

  // The catalog's schedule received so far (empty: none yet).
  std::vector<v1::RefreshSchedule> InitialSchedule() const;
  // Waits up to `timeout` for the catalog's schedule or an Interrupt.
  void WaitForInitialSchedule(std::chrono::milliseconds timeout);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, v1::Policy> queued_;  // by version, not yet in force
  uint64_t in_force_ = 0;
  std::vector<std::pair<uint64_t, int64_t>> taken_;
  std::vector<v1::RefreshSchedule> initial_schedule_;
  bool interrupted_ = false;
};

}  // namespace geofp8::worker
