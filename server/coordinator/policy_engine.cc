// The auto policy engine: probe results in, policy patches out; no state, no I/O.
#include "server/coordinator/policy_engine.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_join.h"

namespace geofp8::coordinator {
std::vector<AutoDecision> DecideAuto(const AutoPolicySpec& bounds, const RefreshSpec& refresh,
                                     const v1::Policy& current,
                                     const std::vector<v1::ProbeResult>& probes) {
  const int default_interval = refresh.interval;
  const bool tune_interval = refresh.estimator == GeometryEstimator::kInstant;
  std::vector<AutoDecision> out;
  for (const auto& probe : probes) {
    if (probe.layer().empty() || !(probe.error_with() > 0)) continue;
    ResolvedLayer r = ResolveLayer(current, probe.layer());
    const bool on = r.policy.geometry() != v1::GEOMETRY_NONE;
    const double gain = probe.error_with() > 0 ? probe.error_without() / probe.error_with() : 0.0;
    const double cost =
        probe.step_seconds() > 0 ? probe.transform_seconds() / probe.step_seconds() : 0.0;
    v1::LayerPatch patch;
    patch.set_layer(probe.layer());
    std::vector<std::string> why;
    char buf[200];
    if (!on && gain >= bounds.min_gain && cost <= bounds.max_cost_fraction) {
      patch.set_geometry(ToProto(bounds.geometry));
      patch.set_rank(bounds.rank);
      std::snprintf(buf, sizeof buf,
                    "geometry %s on: gain %.3g >= %.3g (%s basis), cost %.3g <= %.3g",
                    NameOf(patch.geometry()).c_str(), gain, bounds.min_gain,
                    ProbeBasisName(probe.basis()), cost, bounds.max_cost_fraction);
      why.push_back(buf);
    } else if (on && (gain < bounds.off_gain || cost > bounds.max_cost_fraction)) {
      patch.set_geometry(v1::GEOMETRY_NONE);
      if (gain < bounds.off_gain) {
        std::snprintf(buf, sizeof buf, "geometry off: gain %.3g < %.3g (%s basis)", gain,
                      bounds.off_gain, ProbeBasisName(probe.basis()));
      } else {
        std::snprintf(buf, sizeof buf, "geometry off: cost %.3g > %.3g", cost,
                      bounds.max_cost_fraction);
      }
      why.push_back(buf);
    }
    const bool geometry_after = patch.has_geometry() ? patch.geometry() != v1::GEOMETRY_NONE : on;
    if (tune_interval && geometry_after && probe.drift() > 0) {  // 0: no refresh measured yet
      const int interval = r.refresh_interval > 0 ? r.refresh_interval : default_interval;
      int next = interval;
      if (probe.drift() < bounds.drift_low) next = std::min(bounds.max_interval, interval * 2);
      if (probe.drift() > bounds.drift_high) next = std::max(bounds.min_interval, interval / 2);
      next = std::clamp(next, bounds.min_interval, bounds.max_interval);
      if (next != interval) {
        patch.set_refresh_interval(next);
        std::snprintf(buf, sizeof buf, "refresh interval %d -> %d: drift %.3g %s %.3g", interval,
                      next, probe.drift(), next > interval ? "<" : ">",
                      next > interval ? bounds.drift_low : bounds.drift_high);
        why.push_back(buf);
      }
    }
    if (why.empty()) continue;
    out.push_back({std::move(patch), probe.layer() + ": " + absl::StrJoin(why, ", ")});
  }
  return out;
}

}  // namespace geofp8::coordinator
