// geofp8._geofp8.HookClient: the Python binding of worker/hook/hook_client.h (a `command:` job's
// channel to the coordinator through its worker), and the exchange plan of a coordinator policy
// version for the Engine (geofp8_module.cc). geofp8.torch drives both; see docs/pytorch.md.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "kernels/exchange/exchanger.h"
#include "kernels/model/model.h"
#include "platform/policy/exchange_policy.h"

namespace geofp8::python {

// Registers HookClient in `m`.
void BindHookClient(pybind11::module_& m);

// The plan of a coordinator policy version for the layers `params`, resolved as the worker's
// built-in trainer resolves it (job_runner.cc: ResolveLayers, the job spec's exchange and
// geometry_refresh sections, the coordinator's refresh schedules by layer name).
//   policy:    a serialized v1::Policy (HookClient's change["policy"])
//   refresh:   serialized v1::RefreshSchedule, the schedules in force (change["refresh"])
//   spec_yaml: the job's spec (GEOFP8_JOB_SPEC); empty: the spec's defaults
// `schedule` is empty when no layer uses geometry. Throws geofp8::Error naming the version and
// the field or layer.
struct CoordinatorPlan {
  ExchangePlan plan;
  std::vector<RefreshSchedule> schedule;
  uint64_t version = 0;
};
CoordinatorPlan PlanFromCoordinator(const std::string& policy,
                                    const std::vector<std::string>& refresh,
                                    const std::string& spec_yaml,
                                    const std::vector<model::ParamInfo>& params);

}  // namespace geofp8::python
