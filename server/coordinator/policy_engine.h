// Pure policy logic of the coordinator: spec <-> proto conversion, resolving a layer's policy
// from the default plus glob patches, staggered refresh schedules, and the auto policy engine.
#pragma once

#include <string>
#include <vector>

#include "geofp8/v1/geofp8.pb.h"
#include "server/coordinator/job_spec.h"

namespace geofp8 {

v1::LayerPolicy ToProto(const LayerPolicy& p);
v1::LayerPatch ToProto(const LayerPatchSpec& p);
// Validates names and ranges; an error names `path` and the field ("patches[0].format: ...").
absl::StatusOr<LayerPatchSpec> FromProto(const v1::LayerPatch& p, const std::string& path);

// Version 1 of a job's policy, from its spec.
v1::Policy InitialPolicy(const std::string& job_id, const JobSpec& spec, int64_t now_ms);

struct ResolvedLayer {
  v1::LayerPolicy policy;
  int refresh_interval = 0;  // steps; 0 = the job default
};
// The default policy with every matching patch applied in order.
ResolvedLayer ResolveLayer(const v1::Policy& policy, const std::string& layer);

// Refresh schedules for the 2-D layers of the catalog (1-D layers never use geometry). Owners go
// round-robin over ranks; with stagger, offsets spread evenly over each layer's interval so that
// refreshes land on different steps.
std::vector<v1::RefreshSchedule> ComputeSchedules(const std::vector<v1::LayerInfo>& catalog,
                                                  const v1::Policy& policy, int world_size,
                                                  const RefreshSpec& refresh);

// One auto-engine decision: a patch for one layer and why.
struct AutoDecision {
  v1::LayerPatch patch;
  std::string reason;
};
// Turns probe results into decisions within the spec's bounds:
// - geometry on when gain = error_without / error_with >= min_gain and the transform's share
//   of the step <= max_cost_fraction; off when gain < off_gain or the cost exceeds the bound.
//   The gain is judged with the basis the layer deploys (or, while off, would deploy: the probe's
//   `basis`), so a layer whose deployed geometry does not beat Euclidean turns it off;
// - instant estimator only: refresh interval doubled when drift < drift_low, halved when
//   drift > drift_high, clamped to [min_interval, max_interval] (an ema sketch's basis moves
//   smoothly by construction, and its interval is its feeding cadence).
// Layers whose state would not change get no decision; a probe without a gain (error_with 0)
// is ignored.
std::vector<AutoDecision> DecideAuto(const AutoPolicySpec& bounds, const RefreshSpec& refresh,
                                     const v1::Policy& current,
                                     const std::vector<v1::ProbeResult>& probes);

// "deployed", "shadow" or "unspecified".
std::string_view ProbeBasisName(v1::ProbeBasis basis);

}  // namespace geofp8
