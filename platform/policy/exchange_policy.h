// An exchange plan: one LayerPolicy per model parameter plus the algorithm and the geometry
// refresh cadence, from a preset name (AcceptedPolicyPresets in job_spec.h) or a YAML file with
// per-layer globs. Parsed and validated here, at the edge, for geofp8-train, the worker daemon,
// the Python hook and geofp8-bench trajectory; and the plans of coordinator policy versions for the
// worker's rank attempts and the Python hook.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/exchange/engine.h"
#include "kernels/exchange/exchanger.h"
#include "kernels/exchange/policy.h"
#include "kernels/model/model.h"
#include "platform/policy/job_spec.h"

namespace geofp8 {

namespace v1 {
class Policy;           // geofp8/v1/geofp8.pb.h, which PlanFrom's callers include
class RefreshSchedule;  // the same
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

// A policy as geofp8.torch names it: kind "preset" (MakeExchangePlan: a name, or a FILE.yaml),
// "file" (a policy file at path `spec`, whatever its name) or "text" (YAML; errors "policy: line
// 1: ..."). `model` names the model in an unmatched glob's error of a file or text.
ExchangePlan MakeExchangePlanOf(const std::string& kind, const std::string& spec,
                                const std::vector<model::ParamInfo>& params,
                                std::string_view model = "");

// A coordinator policy version resolved for a rank (PlanFrom) with the geometry refresh schedule
// it runs under: the worker's rank attempts and the Python hook's coordinator versions.
struct VersionPlan {
  ExchangePlan plan;                      // named "policy v<version>"
  std::vector<RefreshSchedule> schedule;  // one per parameter; empty when no layer uses geometry
  std::string unscheduled;  // a layer that uses geometry but has no schedule yet; empty: none
  uint64_t version = 0;
};
// `schedules`: the coordinator's for the layer catalog; the version's own (policy.refresh) win
// (ScheduleFor).
VersionPlan PlanOfVersion(const v1::Policy& policy,
                          const std::vector<v1::RefreshSchedule>& schedules,
                          const ExchangeSpec& exchange, const RefreshSpec& refresh,
                          const std::vector<model::ParamInfo>& params);

// PlanOfVersion for the Python hook, from what its HookClient hands over:
//   policy:    a serialized v1::Policy (the change's "policy")
//   refresh:   serialized v1::RefreshSchedule, the schedules in force (the change's "refresh")
//   spec_yaml: the job's spec (GEOFP8_JOB_SPEC); empty: the spec's defaults
// A layer that uses geometry without a schedule is an error, as is algorithm native (no NCCL on
// the CPU path). Errors name the version and the field or layer.
VersionPlan PlanOfCoordinatorVersion(const std::string& policy,
                                     const std::vector<std::string>& refresh,
                                     const std::string& spec_yaml,
                                     const std::vector<model::ParamInfo>& params);

// The Exchanger options the plan decides (algorithm, bucket cap, estimator and its knobs); the
// caller adds what the run decides (seed, timeout, policy version, trace).
ExchangeOptions MakeExchangeOptions(const ExchangePlan& plan);

// The geometry refresh schedule of `ranks` ranks, one entry per parameter, by the coordinator's
// algorithm (platform/policy RefreshScheduleOf). Empty when the plan uses no geometry.
std::vector<RefreshSchedule> MakeRefreshSchedule(const ExchangePlan& plan, int ranks);

// What ExchangeEngine::SetPolicy takes: the plan's layers and options, under `schedule`.
EnginePolicy EnginePolicyOf(const ExchangePlan& plan, std::vector<RefreshSchedule> schedule,
                            uint64_t version);

}  // namespace geofp8
