// An exchange plan: one LayerPolicy per model parameter plus the algorithm and the geometry
// refresh cadence, from a preset name (AcceptedPolicyPresets in job_spec.h) or a YAML file with
// per-layer globs. Parsed and validated here, at the edge, for geofp8-train, the worker daemon,
// the Python hook and geofp8-bench trajectory.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kernels/exchange/exchanger.h"
#include "kernels/exchange/policy.h"
#include "kernels/model/model.h"
#include "platform/policy/job_spec.h"

namespace geofp8 {

namespace v1 {
class Policy;  // geofp8/v1/geofp8.pb.h, which PlanFrom's callers include
}  // namespace v1

// Plain struct: what the Exchanger needs besides the communicator.
struct ExchangePlan {
  std::string name;  // preset name or file path
  Algorithm algorithm = Algorithm::kAuto;
  std::vector<LayerPolicy> layers;  // one per model parameter, in params() order
  // Per parameter, a patch's refresh_interval; 0: refresh.interval. Empty: all 0.
  std::vector<int> refresh_intervals;
  // Per parameter: a matrix that can take a geometry (rows > 1 and cols > 1), the layers the
  // coordinator's refresh schedule is built over.
  std::vector<bool> matrices;
  RefreshSpec refresh;                        // estimator, its knobs, interval, stagger
  size_t bucket_cap_bytes = size_t{1} << 20;  // fp32 bytes per bucket
  bool uses_geometry() const;
};

// Builds the plan for `spec`: a preset name, or a path to a policy file (anything ending in
// .yaml/.yml): the `exchange`, `policy` and `geometry_refresh` sections of a job spec
// (docs/job-spec.md), parsed by platform/policy's ParsePolicyFile and resolved as the coordinator
// resolves a job's policy. A preset is such a file too (PresetPolicyFile). Throws geofp8::Error
// with one line naming the file, line and field on a bad file or a glob that matches no layer.
ExchangePlan MakeExchangePlan(const std::string& spec, const std::vector<model::ParamInfo>& params);

// A policy file's text (the Python hook passes a string, or a dict as JSON, which is YAML).
// `name` names the text in errors ("policy: NAME: line 1: ..."; empty: "policy: line 1: ..."),
// and `model` the model in an unmatched glob's error.
ExchangePlan MakeExchangePlanFromText(std::string_view yaml, const std::string& name,
                                      const std::vector<model::ParamInfo>& params,
                                      std::string_view model = "");

// The plan of policy version `policy` for `params` under a job spec's exchange and
// geometry_refresh sections: the one place a plan is built, for geofp8-train's --policy, the
// worker's rank attempts and the Python hook's presets, files and coordinator versions. Resolves
// each layer's policy and refuses one the engine would refuse, each error prefixed by `where`.
ExchangePlan PlanFrom(const v1::Policy& policy, const ExchangeSpec& exchange,
                      const RefreshSpec& refresh, const std::vector<model::ParamInfo>& params,
                      const std::string& name, const std::string& where = "");

// The Exchanger options the plan decides (algorithm, bucket cap, estimator and its knobs); the
// caller adds what the run decides (seed, timeout, policy version, trace).
ExchangeOptions MakeExchangeOptions(const ExchangePlan& plan);

// The geometry refresh schedule of `ranks` ranks, one entry per parameter, by the coordinator's
// algorithm (platform/policy RefreshScheduleOf). Empty when the plan uses no geometry.
std::vector<RefreshSchedule> MakeRefreshSchedule(const ExchangePlan& plan, int ranks);

}  // namespace geofp8
