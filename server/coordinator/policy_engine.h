// The coordinator's auto policy engine (DESIGN.md section 2, "auto" mode): turns workers' probe
// results into policy patches. The policy itself (conversion, resolution, schedules) is
// platform/policy/policy.h.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "geofp8/v1/geofp8.pb.h"
#include "platform/policy/job_spec.h"
#include "platform/policy/policy.h"

namespace geofp8::coordinator {

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

}  // namespace geofp8::coordinator
