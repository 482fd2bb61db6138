// The client side of a `command:` job's hook channel (docs/job-spec.md, "Running your own
// script"): a user program that the worker launched talks to the coordinator through its
// worker. It reports its layers, steps, per-layer errors and checkpoints, and receives the job's
// policy versions, each to be put in force at its effective step on every rank.
//
// Contract (the Python binding in client/python wraps exactly this):
//  - FromEnvironment() reads GEOFP8_HOOK_ADDRESS ("unix:<path>", set by the worker, or by the
//    user for an attach-only worker, where "{local_rank}" stands for LOCAL_RANK) and the
//    GEOFP8_JOB_ID / GEOFP8_ATTEMPT / RANK / WORLD_SIZE / GEOFP8_RESUME_STEP /
//    GEOFP8_CHECKPOINT_DIR variables; nullptr when GEOFP8_HOOK_ADDRESS is unset (the program
//    runs outside a GeoFP8 job, e.g. under plain torchrun). It never blocks: the channel is
//    opened in the background and reopened (with backoff) whenever it breaks, e.g. when the
//    worker restarts its hook server.
//  - Every method is thread-safe and returns quickly; none throws. Reports made while the
//    channel is down are kept when they matter (the catalog, which is re-sent on every new
//    channel; checkpoints, which queue until written) and dropped otherwise (progress, layer
//    summaries: the next one supersedes them).
//  - Policy versions: the worker sends every version of the job, oldest first, when the channel
//    opens, then each new one. PolicyDueAt(step) must be called once per step, before the step
//    runs, with non-decreasing steps. It returns the newest version with effective_step <= step
//    that is newer than the one in force, if any (so the first call, at the start or resume
//    step, returns the version in force there), puts it in force, and acknowledges it to the
//    coordinator with `step` (rank 0's ack is recorded as its taken_step). ReportStep stamps
//    the version in force on each report; the coordinator fails the attempt if a rank ran a step
//    under a superseded version, so a version must be applied exactly at the step PolicyDueAt
//    returns it.
//    PolicyAgreedAt (below) adds a per-step agreement among the ranks, so that a version that
//    reaches the ranks at different times still applies at one step on all of them.
//  - WaitForPolicy(timeout) blocks until the first version has arrived (true) or the timeout
//    passes (false); call it once before the first PolicyDueAt so that step's policy is known.
//  - A version's per-layer policies are resolved against the catalog the program sent
//    (SendCatalog); before a catalog, PolicyChange::layers is empty and the default plus the
//    patches are what there is.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "geofp8/v1/geofp8.pb.h"

namespace geofp8::hook {

// One tensor the program exchanges, named as the policy's layer globs match it.
struct LayerInfo {
  std::string name;
  int64_t rows = 0;
  int64_t cols = 1;  // 1 for 1-D tensors (they never use geometry)
};

// One layer's measurement at a step (rank 0), as v1::LayerSummary: the relative Frobenius error
// of the exchanged average against the exact fp32 average, and so on.
struct LayerReport {
  std::string layer;
  int64_t step = 0;
  double rel_fro_error = 0;
  double residual_error = 0;
  uint64_t geometry_version = 0;
  double drift = 0;
};

// A layer's policy under one version (the wire enums: format FORMAT_FP8_E4M3, geometry
// GEOMETRY_LOWRANK; platform/policy/policy.h converts them: FromProto, NameOf).
struct ResolvedLayerPolicy {
  std::string layer;
  v1::LayerPolicy policy;
  int refresh_interval = 0;  // steps; 0 = the job's geometry_refresh.interval
};

// A policy version taking effect.
struct PolicyChange {
  uint64_t version = 0;
  int64_t effective_step = 0;
  std::string reason;  // "job spec", "ctl: ...", "auto: ..."
  v1::Policy policy;   // as the coordinator sent it: default_policy, patches, refresh
  // Every catalog layer's resolved policy (empty before SendCatalog), in catalog order.
  std::vector<ResolvedLayerPolicy> layers;
  // The refresh schedules in force: the version's own, else the ones the coordinator computed
  // for the catalog.
  std::vector<v1::RefreshSchedule> refresh;
};

class HookClient {
 public:
  // nullptr when GEOFP8_HOOK_ADDRESS is unset.
  static std::unique_ptr<HookClient> FromEnvironment();
  // `address` as GEOFP8_HOOK_ADDRESS ("unix:<path>"); job fields from the environment.
  static std::unique_ptr<HookClient> Connect(const std::string& address);
  ~HookClient();  // closes the channel; queued checkpoints not yet written are lost

  // The job as the environment describes it.
  const std::string& job_id() const { return job_id_; }
  int attempt() const { return attempt_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  // 0: a fresh start. In attach mode, the welcome's (the launcher sets no GEOFP8_RESUME_STEP).
  int64_t resume_step() const;
  const std::string& checkpoint_dir() const { return checkpoint_dir_; }

  // Rank 0: the layers (sent once per channel; a later call replaces the list), and the name of
  // the model they are of, which the coordinator's messages give it ("matches no layer of
  // <model_name>"; empty: the script as the job's command line names it).
  void SendCatalog(const std::vector<LayerInfo>& layers, const std::string& model_name = "");
  // After each step: `step` is the step just completed; bytes are this rank's totals since the
  // job started (what the exchange sent, and what an fp32 ring all-reduce would have sent).
  void ReportStep(int64_t step, double loss, double tokens_per_second, uint64_t bytes_sent,
                  uint64_t bytes_baseline);
  // Rank 0: per-layer errors of a measured step.
  void ReportLayers(const std::vector<LayerReport>& layers);
  // Rank 0 of an `auto_policy` job: one probe per layer (DESIGN.md section 2), as
  // v1::ProbeResult: the layer's error quantized without and with its geometry, the transform
  // and step time. The coordinator's auto engine answers with policy versions.
  void ReportProbes(const std::vector<v1::ProbeResult>& probes);
  // A durable checkpoint from which the job can resume at `step` (the next step to run), at
  // `path`. Rank 0's report moves the job's recovery point (GEOFP8_RESUME_STEP of a restart).
  void ReportCheckpoint(int64_t step, const std::string& path);

  // After each step, with the step's timing as well (seconds the step took, of which the
  // exchange): the worker's /metrics show them (0: unknown; the time between reports stands in).
  // `val_loss`: the validation loss measured after this step, on the steps that validated; it
  // reaches describe, `get -o wide` and geofp8_worker_val_loss as the built-in trainer's does.
  void ReportStep(int64_t step, double loss, double tokens_per_second, uint64_t bytes_sent,
                  uint64_t bytes_baseline, double step_seconds, double exchange_seconds,
                  std::optional<double> val_loss = std::nullopt);

  // See the contract above.
  std::optional<PolicyChange> PolicyDueAt(int64_t step);

  // The agreed alternative to PolicyDueAt, the rule of the built-in trainer (job_runner.cc,
  // TakeDuePolicy), for a program that runs one small collective per step:
  //  - NewestHeld(): the newest version this rank holds (in force or received).
  //  - Every step, before it runs, the program agrees on `agreed` = the minimum of NewestHeld()
  //    over its ranks (e.g. a max-reduction of its complement), then calls
  //    PolicyAgreedAt(step, agreed). The first call (the attempt's start step) returns the
  //    version in force there: the newest the coordinator records as taken at or before it
  //    (Policy.taken_step), else the newest effective at or before it. Later calls return a
  //    version taken by an earlier attempt exactly at its taken_step (a resumed attempt replays
  //    the steps it redoes under the versions they first ran under), and any other version at
  //    the first step at or after its effective_step at which every rank holds it. Every rank
  //    decides from the same `agreed`, so all of them switch at the same step.
  //  - The change is put in force and acknowledged with the step it was taken at
  //    (PolicyAck.step; rank 0's ack is what the coordinator records as taken_step).
  uint64_t NewestHeld() const;
  std::optional<PolicyChange> PolicyAgreedAt(int64_t step, uint64_t agreed);
  // The worker's welcome (the job as the coordinator assigned it: job_id, attempt, rank,
  // world_size, resume_step), once the channel has opened; nullopt after `timeout`.
  // In attach mode it also returns (nullopt) once the worker refused the attach: refused() says
  // why.
  std::optional<v1::HookWelcome> WaitForWelcome(std::chrono::milliseconds timeout);
  std::string refused() const;
  // Attach mode: GEOFP8_JOB was set, so the launcher started this process and each channel opens
  // with a HookAttach (job, RANK, WORLD_SIZE, the token of GEOFP8_TOKEN_FILE or GEOFP8_TOKEN).
  // Once welcomed, a HookStop or a lost channel ends the process (docs/launchers.md, "Exit
  // codes").
  bool attach_mode() const;
  // The program is done (attach mode): its rank succeeded, or failed with `reason`. A channel
  // that closes without it is a rank that failed.
  void Finish(bool success, const std::string& reason = "");
  // The refresh schedules the coordinator computed for the catalog, once they have arrived;
  // nullopt after `timeout`. A version that uses geometry needs them (the coordinator computes
  // them when rank 0's catalog reaches it).
  std::optional<std::vector<v1::RefreshSchedule>> WaitForRefresh(std::chrono::milliseconds timeout);
  bool WaitForPolicy(std::chrono::milliseconds timeout);
  uint64_t version_in_force() const;
  bool connected() const;

  struct Impl;

 private:
  HookClient() = default;
  std::string job_id_;
  int attempt_ = 0, rank_ = 0, world_size_ = 1;
  int64_t resume_step_ = 0;
  std::string checkpoint_dir_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace geofp8::hook
