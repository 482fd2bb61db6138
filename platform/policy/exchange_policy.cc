// The exchange plan: a preset or a policy file, parsed and resolved by the policy
// library (platform/policy) exactly as the coordinator and the worker resolve a job's policy.
//
// A policy file holds the `exchange`, `policy` and `geometry_refresh` sections of a job spec
// (docs/job-spec.md), for example:
//   exchange: {algorithm: two_phase, bucket_mb: 1}
//   policy:
//     default: {format: fp8_e4m3, scaling: block, block: 128}
//     layers:
//       - {match: "layers.*.mlp.*", geometry: lowrank, rank: 8}
//   geometry_refresh: {estimator: ema, interval: 1}
// 1-D parameters (norm gains) always use geometry none.

#include "platform/policy/exchange_policy.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "geofp8/v1/geofp8.pb.h"
#include "kernels/common/check.h"
#include "platform/common/status_error.h"
#include "platform/policy/policy.h"

namespace geofp8 {

bool ExchangePlan::uses_geometry() const {
  for (const LayerPolicy& p : layers) {
    if (p.geometry != GeometryMode::kNone) return true;
  }
  return false;
}

namespace {

// A policy file longer than this is not a policy file (the job spec's own bound is 1 MiB).
constexpr std::streamsize kMaxPolicyFileBytes = 1 << 20;

std::string ReadPolicyFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) GEOFP8_FAIL("policy: cannot read file ", path);
  std::string text(static_cast<size_t>(kMaxPolicyFileBytes) + 1, '\0');
  in.read(text.data(), kMaxPolicyFileBytes + 1);
  if (in.bad()) GEOFP8_FAIL("policy: cannot read file ", path);
  text.resize(static_cast<size_t>(in.gcount()));
  if (static_cast<std::streamsize>(text.size()) > kMaxPolicyFileBytes) {
    GEOFP8_FAIL("policy: ", path, ": larger than ", kMaxPolicyFileBytes, " bytes");
  }
  return text;
}

}  // namespace

namespace {

// Parses policy-file text and resolves it against `params`. `where` prefixes every error;
// `model` names the model in an unmatched glob's error.
ExchangePlan PlanFromText(std::string_view text, const std::string& name, const std::string& where,
                          const std::vector<model::ParamInfo>& params, std::string_view model) {
  const PolicyFileSpec file = ValueOrThrow(ParsePolicyFile(text), where);
  // A patch whose glob names no parameter is a typo that would do nothing (as in a job spec).
  for (size_t i = 0; i < file.policy.layers.size(); ++i) {
    const std::string& glob = file.policy.layers[i].match;
    if (std::string problem = UnmatchedGlobProblem(glob, params, model); !problem.empty()) {
      GEOFP8_FAIL(where, "spec.policy.layers[", i, "].match: ", problem);
    }
  }
  if (file.exchange.algorithm == Algorithm::kNative) {
    GEOFP8_FAIL(where,
                "spec.exchange.algorithm: native needs NCCL on a GPU; the CPU trainer "
                "accepts two_phase, allgather, fp32, bf16 (native)");
  }

  // Resolved as the worker resolves a job's policy version 1.
  const v1::Policy policy = InitialPolicy("geofp8-train", file.policy, 0);
  return PlanFrom(policy, file.exchange, file.geometry_refresh, params, name, where);
}

}  // namespace

ExchangePlan MakeExchangePlan(const std::string& spec,
                              const std::vector<model::ParamInfo>& params) {
  const bool is_file = spec.ends_with(".yaml") || spec.ends_with(".yml");
  std::string text;
  if (is_file) {
    text = ReadPolicyFile(spec);
  } else if (auto preset = PresetPolicyFile(spec)) {
    text = *preset;
  } else {
    GEOFP8_FAIL("policy: unknown preset '", spec, "' (accepted: ", AcceptedPolicyPresets(),
                ", or a FILE.yaml)");
  }
  const std::string where = is_file ? "policy: " + spec + ": " : "policy: preset " + spec + ": ";
  return PlanFromText(text, spec, where, params, "the model");
}

ExchangePlan MakeExchangePlanFromText(std::string_view yaml, const std::string& name,
                                      const std::vector<model::ParamInfo>& params,
                                      std::string_view model) {
  return PlanFromText(yaml, name.empty() ? "policy" : name,
                      name.empty() ? "policy: " : "policy: " + name + ": ", params,
                      model.empty() ? std::string_view("the model") : model);
}

ExchangePlan MakeExchangePlanOf(const std::string& kind, const std::string& spec,
                                const std::vector<model::ParamInfo>& params,
                                std::string_view model) {
  if (kind == "preset") return MakeExchangePlan(spec, params);
  if (kind == "text") return MakeExchangePlanFromText(spec, "", params, model);
  if (kind == "file") return MakeExchangePlanFromText(ReadPolicyFile(spec), spec, params, model);
  GEOFP8_FAIL("policy kind: unknown value '", kind, "' (accepted: preset, file, text)");
}

VersionPlan PlanOfVersion(const v1::Policy& policy,
                          const std::vector<v1::RefreshSchedule>& schedules,
                          const ExchangeSpec& exchange, const RefreshSpec& refresh,
                          const std::vector<model::ParamInfo>& params) {
  VersionPlan out;
  out.version = policy.version();
  out.plan = PlanFrom(policy, exchange, refresh, params, "policy v" + std::to_string(out.version));
  if (!out.plan.uses_geometry()) return out;
  bool missing = false;
  out.schedule =
      ScheduleFor(policy, schedules, params, out.plan.layers, &missing, &out.unscheduled);
  return out;
}

VersionPlan PlanOfCoordinatorVersion(const std::string& policy_bytes,
                                     const std::vector<std::string>& refresh,
                                     const std::string& spec_yaml,
                                     const std::vector<model::ParamInfo>& params) {
  v1::Policy policy;
  GEOFP8_CHECK(policy.ParseFromString(policy_bytes), "coordinator policy: not a v1.Policy");
  const std::string what = "policy v" + std::to_string(policy.version());
  JobSpec spec;
  if (!spec_yaml.empty()) {
    spec = ValueOrThrow(ParseJobSpec(spec_yaml), "GEOFP8_JOB_SPEC: ");
  }
  GEOFP8_CHECK(spec.exchange.algorithm != Algorithm::kNative,
               "spec.exchange.algorithm: native needs NCCL on a GPU; geofp8.torch on CPU accepts "
               "two_phase, allgather, fp32, bf16 (native)");
  std::vector<v1::RefreshSchedule> schedules;
  for (const std::string& b : refresh) {
    GEOFP8_CHECK(schedules.emplace_back().ParseFromString(b), what,
                 ": a refresh schedule is not a v1.RefreshSchedule");
  }
  VersionPlan out = PlanOfVersion(policy, schedules, spec.exchange, spec.geometry_refresh, params);
  GEOFP8_CHECK(out.unscheduled.empty(), what,
               ": no geometry refresh schedule from the coordinator for layer ", out.unscheduled);
  return out;
}

ExchangePlan PlanFrom(const v1::Policy& policy, const ExchangeSpec& exchange,
                      const RefreshSpec& refresh, const std::vector<model::ParamInfo>& params,
                      const std::string& name, const std::string& where) {
  ExchangePlan plan;
  plan.name = name;
  plan.algorithm = exchange.algorithm;
  plan.bucket_cap_bytes = size_t(std::max(1.0, exchange.bucket_mb * 1024 * 1024));
  plan.layers = ValueOrThrow(ResolveLayers(policy, params), where);
  plan.refresh = refresh;
  for (size_t i = 0; i < params.size(); ++i) {
    // What the exchange engine would refuse later, refused here naming the source and layer.
    const model::ParamInfo& p = params[i];
    const LayerSpec spec{p.name, p.exchange_rows(), p.exchange_cols(), plan.layers[i]};
    if (std::string err = ValidateLayerPolicy(spec); !err.empty()) GEOFP8_FAIL(where, err);
    plan.refresh_intervals.push_back(ResolveLayer(policy, p.name).refresh_interval);
    plan.matrices.push_back(p.rows > 1 && p.cols > 1);
  }
  return plan;
}

ExchangeOptions MakeExchangeOptions(const ExchangePlan& plan) {
  ExchangeOptions eo;
  eo.algorithm = plan.algorithm;
  eo.bucket_cap_bytes = plan.bucket_cap_bytes;
  eo.estimator = plan.refresh.estimator;
  eo.power_iters = plan.refresh.power_iters;
  eo.sigma_ema = plan.refresh.sigma_ema;
  eo.sketch = plan.refresh.sketch;
  eo.adapt = plan.refresh.adapt;
  return eo;
}

std::vector<RefreshSchedule> MakeRefreshSchedule(const ExchangePlan& plan, int ranks) {
  if (!plan.uses_geometry()) return {};
  // The matrices' intervals in layer order, as the coordinator builds them from rank 0's
  // catalog (ComputeSchedules); 1-D layers never refresh and keep a default entry.
  std::vector<size_t> matrices;
  std::vector<int> intervals;
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    if (i >= plan.matrices.size() || !plan.matrices[i]) continue;
    const int patched = i < plan.refresh_intervals.size() ? plan.refresh_intervals[i] : 0;
    matrices.push_back(i);
    intervals.push_back(patched > 0 ? patched : plan.refresh.interval);
  }
  const std::vector<RefreshSchedule> staggered =
      RefreshScheduleOf(intervals, ranks, plan.refresh.stagger);
  std::vector<RefreshSchedule> schedule(plan.layers.size());
  for (RefreshSchedule& s : schedule) s.interval = plan.refresh.interval;
  for (size_t j = 0; j < matrices.size(); ++j) schedule[matrices[j]] = staggered[j];
  return schedule;
}

EnginePolicy EnginePolicyOf(const ExchangePlan& plan, std::vector<RefreshSchedule> schedule,
                            uint64_t version) {
  return EnginePolicy{plan.layers, MakeExchangeOptions(plan), std::move(schedule), version};
}

}  // namespace geofp8
