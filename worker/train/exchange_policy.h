// The trainer's exchange policy: one LayerPolicy per model parameter plus the algorithm and the
// geometry refresh cadence, from a preset name (fp32, bf16, fp8, geofp8, nvfp4, geonvfp4) or a
// YAML file with per-layer globs. Parsed and validated here, at the edge.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kernels/exchange/exchanger.h"
#include "kernels/exchange/policy.h"
#include "kernels/model/model.h"

namespace geofp8::train {

// Plain struct: what the Exchanger needs besides the communicator.
struct ExchangePlan {
  std::string name;                       // preset name or file path
  Algorithm algorithm = Algorithm::kTwoPhase;
  std::vector<LayerPolicy> layers;        // one per model parameter, in params() order
  int refresh_interval = 20;              // steps between geometry refreshes of a layer
  GeometryEstimator estimator = GeometryEstimator::kInstant;
  int power_iters = 1;                    // instant: subspace iterations per refresh
  float sigma_ema = 0.f;                  // instant: sigma smoothing across refreshes
  FactorSketchOptions sketch;             // ema: beta, width, probes (seed comes from the run)
  float adapt = 0.0f;                     // ema: whitening strength follows the basis's fit
  size_t bucket_cap_bytes = size_t{1} << 20;  // fp32 bytes per bucket
  bool uses_geometry() const;
};

// "fp32, bf16, fp8, geofp8, nvfp4, geonvfp4"
std::string_view AcceptedPolicyPresets();

// Builds the plan for `spec`: a preset name, or a path to a YAML file (anything ending in
// .yaml/.yml). Throws geofp8::Error with one line naming the field ("policy.layers[1].format:
// unknown value 'fp9' (accepted: ...)") on a bad file.
ExchangePlan MakeExchangePlan(const std::string& spec, const std::vector<model::ParamInfo>& params);

// The same YAML schema as MakeExchangePlan's file, from text (the Python hook passes a string or
// a dict as JSON, which is YAML). `name` names the text in errors. With `model` set, a glob that
// matches no parameter is reported by UnmatchedGlobProblem, listing the model's layers.
ExchangePlan MakeExchangePlanFromText(std::string_view yaml, const std::string& name,
                                      const std::vector<model::ParamInfo>& params,
                                      std::string_view model = "");

// The Exchanger options the plan decides (algorithm, bucket cap, estimator and its knobs); the
// caller adds what the run decides (seed, timeout, policy version, trace).
ExchangeOptions MakeExchangeOptions(const ExchangePlan& plan);

// Geometry refresh schedule: owner = layer % ranks (spreads the work), offsets staggered over
// the interval. Empty when the plan uses no geometry.
std::vector<RefreshSchedule> MakeRefreshSchedule(const ExchangePlan& plan, int ranks);

}  // namespace geofp8::train
