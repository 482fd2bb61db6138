// The coordinator's policy side of each job: its policy versions (made, compacted, bounded,
// taken), the layer catalog rank 0 reports and the refresh schedules computed from it, the
// per-layer summaries and probe results, and the auto policy engine's decisions on probes.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "geofp8/v1/geofp8.pb.h"
#include "server/coordinator/job_table.h"
#include "server/coordinator/session.h"
#include "server/coordinator/store.h"
#include "server/coordinator/worker_registry.h"

namespace geofp8::coordinator {

// Bounds on policy updates: patches in one UpdatePolicy, and patches a version may hold after
// compaction (a version travels whole in every Policy message and Assignment).
inline constexpr int kMaxPatchesPerUpdate = 256;
inline constexpr int kMaxPatchesPerVersion = 4096;
// Bytes of policy versions one Assignment may carry in `policy` and `policy_history`: the latest
// version, and every version from the one in force at the job's recovery point on (those a
// resumed rank can need). UpdatePolicy refuses a version that would take them past this, so an
// Assignment stays deliverable: with the spec (kMaxSpecBytes) and its peers it is under
// kMaxAssignmentBytes. The versions before the recovery point drop out as checkpoints pass.
inline constexpr size_t kMaxPolicyHistoryBytes = size_t{2} << 20;
// gRPC's default limit on a received message (4 MiB), less room for the CoordinatorMessage
// around the Assignment. An Assignment over it (only from a store written before the bound
// above) fails its job with the reason instead of looping on every worker.
inline constexpr size_t kMaxAssignmentBytes = (size_t{4} << 20) - (size_t{64} << 10);
// ListPolicyVersions pages: page_size 0 means kDefaultPolicyPageSize, at most
// kMaxPolicyPageSize; a page also ends before kMaxPolicyPageBytes (it holds at least one
// version, and a version is at most kMaxPolicyHistoryBytes).
inline constexpr int kDefaultPolicyPageSize = 100;
inline constexpr int kMaxPolicyPageSize = 1000;
inline constexpr size_t kMaxPolicyPageBytes = size_t{1} << 20;

// A policy version whose write is submitted but not yet published (PolicyBook::Publish).
struct StagedPolicy {
  v1::Policy policy;
  v1::JobEvent event;                          // recorded with it
  std::vector<v1::RefreshSchedule> schedules;  // JobPolicies::schedules once published
  Store::WriteHandle write;
  size_t field_bytes = 0;  // FieldBytes(policy): a staged version does not change
};

// A durable version's FieldBytes, as of the taken step it had when they were counted: taken_step
// is the only field of a version that changes once it is durable (PolicyBook::OnPolicyAck,
// RecordReportedTaken), so the count is redone only when that differs.
struct VersionBytes {
  int64_t taken_step = -1;  // -1: none
  size_t bytes = 0;         // 0: not counted yet
};

// A job's policy state.
struct JobPolicies {
  std::vector<v1::Policy> versions;  // versions[v - 1] is version v; durable ones only
  // Versions after versions.back() whose writes are submitted and not yet published, in
  // version order (see "Durability" in coordinator.h).
  std::deque<StagedPolicy> staged;
  // versions[i]'s bytes in an Assignment, for the history bound: counting them again on every
  // update made an update's cost grow with the job's version count (issue #30: 500 versions
  // took 0.8 ms of each update under the coordinator's lock). Sized lazily.
  std::vector<VersionBytes> bytes;
  std::vector<v1::LayerInfo> catalog;
  std::string model_name;  // the catalog's (LayerCatalog.model_name); may be empty
  std::vector<v1::RefreshSchedule> schedules;
  std::map<std::string, v1::LayerSummary> layers;  // latest summary per layer
};

// An UpdatePolicy request, checked and in canonical form (PolicyBook::ParseUpdate).
struct PolicyUpdate {
  std::vector<v1::LayerPatch> patches;
  std::optional<v1::LayerPolicy> default_policy;
};

// Locking: none of its own; every call runs under the coordinator's mutex. It writes the job's
// record (policy_version, events) through the JobTable, and sends to ranks through the registry.
class PolicyBook {
 public:
  PolicyBook(Store* store, Clock* clock, JobTable* jobs, WorkerRegistry* workers);

  // The stored versions of jobs the JobTable holds (others are dropped), in version order.
  void Load(std::vector<v1::Policy>& stored);
  // Policy v1 of a new job, put to the store (inside the job's transaction); Add makes it known
  // once that transaction committed.
  absl::Status PutFirst(const v1::Job& job, const JobSpec& spec, int64_t now, v1::Policy* first);
  void Add(const std::string& job_id, v1::Policy first);
  void Erase(const std::string& job_id) { by_job_.erase(job_id); }
  // The newest durable version's number, 0 if the job has none.
  uint64_t LatestVersion(const std::string& job_id) const;
  // The job's policy state (created empty if unknown).
  JobPolicies& Of(const std::string& job_id) { return by_job_[job_id]; }

  absl::StatusOr<v1::Policy> Get(const JobRec& rec, uint64_t version);
  // ListPolicyVersions: the page size a request asks for (checked), and the page.
  static absl::StatusOr<size_t> PageSize(const v1::ListPolicyVersionsRequest& request);
  absl::StatusOr<v1::ListPolicyVersionsResponse> ListVersions(const JobRec& rec,
                                                              const std::string& page_token,
                                                              size_t page_size);
  // What UpdatePolicy checks before taking the lock: the patches and default policy, typed.
  static absl::StatusOr<PolicyUpdate> ParseUpdate(const v1::UpdatePolicyRequest& request);
  // Stages the update's version (its write submitted, *write; null when nothing is written):
  // the caller waits for it without the coordinator's mutex, then calls Publish.
  absl::StatusOr<v1::UpdatePolicyResponse> Update(JobRec& rec, const PolicyUpdate& update,
                                                  const std::string& reason,
                                                  Store::WriteHandle* write);
  // Moves the durable prefix of the job's staged versions to its versions, in order, and queues
  // them to the ranks; drops every staged version from the first failed one on.
  void Publish(JobRec& rec, Outbox& out);

  // Rank reports (rank 0's catalog and acks; any rank's summaries and probes).
  void OnCatalog(JobRec& rec, const v1::LayerCatalog& catalog, Outbox& out);
  void OnSummaries(JobRec& rec, const v1::LayerSummaries& summaries);
  absl::Status OnProbes(JobRec& rec, const v1::ProbeResults& results, Outbox& out);
  absl::Status OnPolicyAck(JobRec& rec, const v1::PolicyAck& pa);

  // Versions rank 0 of the interrupted attempt reported taken when it registered again (its
  // PolicyAcks were lost with its generation) are recorded before the job resumes, so that the
  // resumed ranks start under, and replay, the versions that attempt ran under.
  void RecordReportedTaken(JobRec& rec);
  // A rank whose stream broke may have missed versions sent meanwhile: those not yet taken, in
  // order, to `sink`.
  void ResendUntaken(const std::string& job_id, const std::shared_ptr<SessionSink>& sink,
                     Outbox& out);
  // The Assignment's `policy` and `policy_history` for an attempt resuming at resume_step.
  void FillAssignment(const std::string& job_id, v1::Assignment* base);
  // The per-layer summaries, for a snapshot with details.
  void AddLayers(const std::string& job_id, v1::Job* job) const;

  uint64_t policy_updates() const { return policy_updates_; }
  uint64_t auto_policy_updates() const { return auto_policy_updates_; }

 private:
  // The latest version (durable or staged) with `patches` appended (and `default_policy` in
  // place of its default, when given), compacted, staged with its write submitted (*write).
  // When that equals the latest version, no version is made: *unchanged is set and the latest
  // version is returned, with *write the staged one's write (null when it is durable).
  absl::StatusOr<v1::Policy> StagePolicyVersion(
      JobRec& rec, const std::vector<v1::LayerPatch>& patches, const std::string& reason,
      const std::string& author, Store::WriteHandle* write,
      const v1::LayerPolicy* default_policy = nullptr, bool* unchanged = nullptr);
  // StagePolicyVersion, then waits for the write under the coordinator's mutex and publishes:
  // durable when it returns OK.
  absl::StatusOr<v1::Policy> AddPolicyVersion(JobRec& rec,
                                              const std::vector<v1::LayerPatch>& patches,
                                              const std::string& reason, const std::string& author,
                                              Outbox& out);

  Store* store_;
  Clock* clock_;
  JobTable* jobs_;
  WorkerRegistry* workers_;
  std::map<std::string, JobPolicies> by_job_;
  uint64_t policy_updates_ = 0;  // versions created after v1 (user and auto)
  uint64_t auto_policy_updates_ = 0;
};

}  // namespace geofp8::coordinator
