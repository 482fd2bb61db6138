// The per-layer policy as the API carries it (v1::Policy: a default plus glob patches, each
// version in force from its effective step): conversion from and to the job spec's types,
// resolution against a model's layers, and the refresh schedules. Used by the coordinator, the
// worker and geofp8ctl; no state, no I/O.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "geofp8/v1/geofp8.pb.h"
#include "kernels/model/model.h"
#include "platform/policy/job_spec.h"

namespace geofp8 {

// The wire enums (geofp8.proto) and the library's own: the one conversion between them. FromProto
// gives nullopt for UNSPECIFIED and for a value this build does not know.
v1::Format ToProto(Format f);
v1::Scaling ToProto(Scaling s);
v1::Rounding ToProto(Rounding r);
v1::GeometryMode ToProto(GeometryMode g);
std::optional<Format> FromProto(v1::Format f);
std::optional<Scaling> FromProto(v1::Scaling s);
std::optional<Rounding> FromProto(v1::Rounding r);
std::optional<GeometryMode> FromProto(v1::GeometryMode g);
// The canonical name of a wire value, for display ("fp8_e4m3"); "" for UNSPECIFIED and
// "unknown (N)" for a value this build does not know.
std::string NameOf(v1::Format f);
std::string NameOf(v1::Scaling s);
std::string NameOf(v1::Rounding r);
std::string NameOf(v1::GeometryMode g);

v1::LayerPolicy ToProto(const LayerPolicy& p);
v1::LayerPatch ToProto(const LayerPatchSpec& p);
// Validates names and ranges; an error names `path` and the field ("patches[0].format: ...").
absl::StatusOr<LayerPatchSpec> FromProto(const v1::LayerPatch& p, const std::string& path);

// The typed form of a resolved or default layer policy; an empty or zero field keeps the
// LayerPolicy default. Errors name `path` and the field.
absl::StatusOr<LayerPolicy> FromProto(const v1::LayerPolicy& p, const std::string& path);
// A version as the patch file `geofp8ctl policy apply -f` reads: its default and its patches.
// Applying it to a job whose latest version is `policy` changes nothing.
absl::StatusOr<PolicyPatchSpec> PatchFileOf(const v1::Policy& policy);

// "deployed", "shadow" or "unspecified": how the engine's reasons, describe and the workers'
// metric labels name a probe's basis.
const char* ProbeBasisName(v1::ProbeBasis basis);

// Version 1 of a job's policy, from its spec.
v1::Policy InitialPolicy(const std::string& job_id, const JobSpec& spec, int64_t now_ms);
v1::Policy InitialPolicy(const std::string& job_id, const PolicySpec& spec, int64_t now_ms);

struct ResolvedLayer {
  v1::LayerPolicy policy;
  int refresh_interval = 0;  // steps; 0 = the job default
};
// The default policy with every matching patch applied in order.
ResolvedLayer ResolveLayer(const v1::Policy& policy, const std::string& layer);

// The LayerPolicy of every parameter under `policy` (default plus matching patches); 1-D
// parameters always use geometry none. Errors name the layer and field.
absl::StatusOr<std::vector<LayerPolicy>> ResolveLayers(const v1::Policy& policy,
                                                       const std::vector<model::ParamInfo>& params);

// Refresh schedules for the 2-D layers of the catalog (1-D layers never use geometry), by
// RefreshScheduleOf over each layer's patched refresh_interval, else refresh.interval.
std::vector<v1::RefreshSchedule> ComputeSchedules(const std::vector<v1::LayerInfo>& catalog,
                                                  const v1::Policy& policy, int world_size,
                                                  const RefreshSpec& refresh);

// The exchanger's refresh schedule from the coordinator's: the policy's own, else the one sent
// for the catalog. Layers without geometry get an entry that never fires on a used layer.
// `*missing` tells whether a layer that uses geometry has no schedule (`*which` names one).
std::vector<RefreshSchedule> ScheduleFor(const v1::Policy& p,
                                         const std::vector<v1::RefreshSchedule>& catalog_schedule,
                                         const std::vector<model::ParamInfo>& params,
                                         const std::vector<LayerPolicy>& layer_policies,
                                         bool* missing, std::string* which);

// When coordinator policy versions take effect, the rule the built-in trainer and the Python hook
// share. `versions` holds the versions a rank has received, by version number.
//
// DueVersion: the version to put in force from the start of `step` (nullopt: the one in force
// stays), among those newer than `in_force`. `agreed` is the newest version every rank holds. A
// taken version (one a resumed attempt replays) applies exactly at its taken_step, and until the
// last of them has, nothing else does; any other version applies at the first step at or after
// its effective_step (a lower bound) at which every rank holds it (version <= agreed).
std::optional<v1::Policy> DueVersion(const std::map<uint64_t, v1::Policy>& versions,
                                     uint64_t in_force, int64_t step, uint64_t agreed);
// StartVersion: the version in force at an attempt's start step `start`: the newest taken at or
// before it, or, when none carries a taken_step (versions from an older coordinator), the newest
// effective at or before it.
std::optional<v1::Policy> StartVersion(const std::map<uint64_t, v1::Policy>& versions,
                                       int64_t start);

}  // namespace geofp8
