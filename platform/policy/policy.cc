#include "platform/policy/policy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>

#include "platform/common/status.h"

namespace geofp8 {
namespace {
std::string JoinErrors(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : sep) + item;
  return out;
}
// One row per value: the library's enum and the wire's.
constexpr std::pair<Format, v1::Format> kFormats[] = {
    {Format::kFp32, v1::FORMAT_FP32},        {Format::kBf16, v1::FORMAT_BF16},
    {Format::kFp8E4M3, v1::FORMAT_FP8_E4M3}, {Format::kFp8E5M2, v1::FORMAT_FP8_E5M2},
    {Format::kMxfp8, v1::FORMAT_MXFP8},      {Format::kNvfp4, v1::FORMAT_NVFP4}};
constexpr std::pair<Scaling, v1::Scaling> kScalings[] = {{Scaling::kNone, v1::SCALING_NONE},
                                                         {Scaling::kTensor, v1::SCALING_TENSOR},
                                                         {Scaling::kBlock, v1::SCALING_BLOCK}};
constexpr std::pair<Rounding, v1::Rounding> kRoundings[] = {
    {Rounding::kNearest, v1::ROUNDING_NEAREST}, {Rounding::kStochastic, v1::ROUNDING_STOCHASTIC}};
constexpr std::pair<GeometryMode, v1::GeometryMode> kGeometries[] = {
    {GeometryMode::kNone, v1::GEOMETRY_NONE},
    {GeometryMode::kDiag, v1::GEOMETRY_DIAG},
    {GeometryMode::kLowRank, v1::GEOMETRY_LOWRANK}};

template <typename Typed, typename Wire, size_t N>
Wire WireOf(const std::pair<Typed, Wire> (&table)[N], Typed t) {
  for (const auto& [typed, wire] : table) {
    if (typed == t) return wire;
  }
  return Wire(0);  // UNSPECIFIED; every library value has a row
}

template <typename Typed, typename Wire, size_t N>
std::optional<Typed> TypedOf(const std::pair<Typed, Wire> (&table)[N], Wire w) {
  for (const auto& [typed, wire] : table) {
    if (wire == w) return typed;
  }
  return std::nullopt;
}

// "" for UNSPECIFIED (0), "unknown (N)" for a value without a row.
template <typename Typed>
std::string DisplayName(int wire, const std::optional<Typed>& typed,
                        std::string_view (*name)(Typed)) {
  if (typed) return std::string(name(*typed));
  return wire == 0 ? std::string() : "unknown (" + std::to_string(wire) + ")";
}

}  // namespace

v1::Format ToProto(Format f) { return WireOf(kFormats, f); }
v1::Scaling ToProto(Scaling s) { return WireOf(kScalings, s); }
v1::Rounding ToProto(Rounding r) { return WireOf(kRoundings, r); }
v1::GeometryMode ToProto(GeometryMode g) { return WireOf(kGeometries, g); }
std::optional<Format> FromProto(v1::Format f) { return TypedOf(kFormats, f); }
std::optional<Scaling> FromProto(v1::Scaling s) { return TypedOf(kScalings, s); }
std::optional<Rounding> FromProto(v1::Rounding r) { return TypedOf(kRoundings, r); }
std::optional<GeometryMode> FromProto(v1::GeometryMode g) { return TypedOf(kGeometries, g); }
std::string NameOf(v1::Format f) { return DisplayName(f, FromProto(f), FormatNameOf); }
std::string NameOf(v1::Scaling s) { return DisplayName(s, FromProto(s), ScalingNameOf); }
std::string NameOf(v1::Rounding r) { return DisplayName(r, FromProto(r), RoundingNameOf); }
std::string NameOf(v1::GeometryMode g) { return DisplayName(g, FromProto(g), GeometryNameOf); }

v1::LayerPolicy ToProto(const LayerPolicy& p) {
  v1::LayerPolicy out;
  out.set_format(ToProto(p.format));
  out.set_scaling(ToProto(p.scaling));
  out.set_block(p.block);
  out.set_rounding(ToProto(p.rounding));
  out.set_geometry(ToProto(p.geometry));
  out.set_rank(p.rank);
  out.set_alpha(p.alpha);
  out.set_error_feedback(p.error_feedback);
  out.set_hadamard(p.hadamard);
  out.set_hadamard_block(p.hadamard_block);
  return out;
}

v1::LayerPatch ToProto(const LayerPatchSpec& p) {
  v1::LayerPatch out;
  out.set_layer(p.match);
  if (p.format) out.set_format(ToProto(*p.format));
  if (p.scaling) out.set_scaling(ToProto(*p.scaling));
  if (p.block) out.set_block(*p.block);
  if (p.rounding) out.set_rounding(ToProto(*p.rounding));
  if (p.geometry) out.set_geometry(ToProto(*p.geometry));
  if (p.rank) out.set_rank(*p.rank);
  if (p.alpha) out.set_alpha(*p.alpha);
  if (p.error_feedback) out.set_error_feedback(*p.error_feedback);
  if (p.refresh_interval) out.set_refresh_interval(*p.refresh_interval);
  // A geometry names the whole transform: a patch that sets one sets the rotation too.
  if (p.hadamard || p.geometry) out.set_hadamard(p.hadamard.value_or(false));
  if (p.hadamard_block) out.set_hadamard_block(*p.hadamard_block);
  return out;
}

absl::StatusOr<LayerPatchSpec> FromProto(const v1::LayerPatch& p, const std::string& path) {
  LayerPatchSpec out;
  std::vector<std::string> errors;
  out.match = p.layer();
  // An enum value this build does not know (a newer client) is an error naming the field.
  auto typed = [&](bool has, auto value, const char* field, std::string_view accepted, auto* dst) {
    if (!has) return;
    auto v = FromProto(value);
    if (!v) {
      errors.push_back(path + "." + field + ": unknown value (" + std::to_string(int(value)) +
                       "); accepted: " + std::string(accepted));
    } else {
      *dst = *v;
    }
  };
  typed(p.has_format(), p.format(), "format", AcceptedFormatNames(), &out.format);
  typed(p.has_scaling(), p.scaling(), "scaling", AcceptedScalingNames(), &out.scaling);
  typed(p.has_rounding(), p.rounding(), "rounding", AcceptedRoundingNames(), &out.rounding);
  typed(p.has_geometry(), p.geometry(), "geometry", AcceptedGeometryNames(), &out.geometry);
  if (p.has_block()) out.block = p.block();
  if (p.has_rank()) out.rank = p.rank();
  if (p.has_alpha()) out.alpha = p.alpha();
  if (p.has_error_feedback()) out.error_feedback = p.error_feedback();
  if (p.has_refresh_interval()) out.refresh_interval = p.refresh_interval();
  if (p.has_hadamard()) out.hadamard = p.hadamard();
  if (p.has_hadamard_block()) out.hadamard_block = p.hadamard_block();
  if (std::string e = ValidateLayerPatch(out, path); !e.empty()) errors.push_back(e);
  if (!errors.empty()) return absl::InvalidArgumentError(JoinErrors(errors, "; "));
  return out;
}

const char* ProbeBasisName(v1::ProbeBasis basis) {
  switch (basis) {
    case v1::PROBE_BASIS_DEPLOYED:
      return "deployed";
    case v1::PROBE_BASIS_SHADOW:
      return "shadow";
    default:
      return "unspecified";
  }
}

v1::Policy InitialPolicy(const std::string& job_id, const JobSpec& spec, int64_t now_ms) {
  return InitialPolicy(job_id, spec.policy, now_ms);
}

v1::Policy InitialPolicy(const std::string& job_id, const PolicySpec& spec, int64_t now_ms) {
  v1::Policy p;
  p.set_job_id(job_id);
  p.set_version(1);
  p.set_effective_step(0);
  *p.mutable_default_policy() = ToProto(spec.defaults);
  for (const auto& patch : spec.layers) *p.add_patches() = ToProto(patch);
  p.set_reason("job spec");
  p.set_author("spec");
  p.set_created_unix_ms(now_ms);
  p.set_taken_step(0);  // in force from the first step on every rank
  return p;
}

ResolvedLayer ResolveLayer(const v1::Policy& policy, const std::string& layer) {
  ResolvedLayer r;
  r.policy = policy.default_policy();
  for (const auto& p : policy.patches()) {
    if (!LayerMatches(p.layer(), layer)) continue;
    if (p.has_format()) r.policy.set_format(p.format());
    if (p.has_scaling()) r.policy.set_scaling(p.scaling());
    if (p.has_block()) r.policy.set_block(p.block());
    if (p.has_rounding()) r.policy.set_rounding(p.rounding());
    if (p.has_geometry()) r.policy.set_geometry(p.geometry());
    if (p.has_rank()) r.policy.set_rank(p.rank());
    if (p.has_alpha()) r.policy.set_alpha(p.alpha());
    if (p.has_error_feedback()) r.policy.set_error_feedback(p.error_feedback());
    if (p.has_refresh_interval()) r.refresh_interval = p.refresh_interval();
    if (p.has_hadamard()) r.policy.set_hadamard(p.hadamard());
    if (p.has_hadamard_block()) r.policy.set_hadamard_block(p.hadamard_block());
  }
  return r;
}

std::vector<v1::RefreshSchedule> ComputeSchedules(const std::vector<v1::LayerInfo>& catalog,
                                                  const v1::Policy& policy, int world_size,
                                                  const RefreshSpec& refresh) {
  std::vector<const v1::LayerInfo*> matrices;
  std::vector<int> intervals;
  for (const auto& l : catalog) {
    if (l.rows() <= 1 || l.cols() <= 1) continue;
    const int patched = ResolveLayer(policy, l.name()).refresh_interval;
    matrices.push_back(&l);
    intervals.push_back(patched > 0 ? patched : refresh.interval);
  }
  const std::vector<RefreshSchedule> schedule =
      RefreshScheduleOf(intervals, world_size, refresh.stagger);
  std::vector<v1::RefreshSchedule> out;
  for (size_t i = 0; i < matrices.size(); ++i) {
    v1::RefreshSchedule s;
    s.set_layer(matrices[i]->name());
    s.set_interval(schedule[i].interval);
    s.set_owner(schedule[i].owner);
    s.set_offset(schedule[i].offset);
    out.push_back(std::move(s));
  }
  return out;
}

absl::StatusOr<LayerPolicy> FromProto(const v1::LayerPolicy& lp, const std::string& path) {
  LayerPolicy r;
  // UNSPECIFIED or zero keeps the LayerPolicy default (proto3 cannot tell unset from zero);
  // format has no default. A value this build does not know is an error naming the field.
  if (lp.format() == v1::FORMAT_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        path + ".format: unspecified (accepted: " + std::string(AcceptedFormatNames()) + ")");
  }
  std::string bad;
  auto take = [&](auto wire, const char* field, auto* dst) {
    if (int(wire) == 0 || !bad.empty()) return;
    auto v = FromProto(wire);
    if (v) {
      *dst = *v;
    } else {
      bad = path + "." + field + ": unknown value (" + std::to_string(int(wire)) + ")";
    }
  };
  take(lp.format(), "format", &r.format);
  take(lp.scaling(), "scaling", &r.scaling);
  take(lp.rounding(), "rounding", &r.rounding);
  take(lp.geometry(), "geometry", &r.geometry);
  if (!bad.empty()) return absl::InvalidArgumentError(bad);
  if (lp.block() > 0) r.block = lp.block();
  if (lp.rank() > 0) r.rank = lp.rank();
  if (lp.alpha() > 0) r.alpha = lp.alpha();
  r.error_feedback = lp.error_feedback();
  r.hadamard = lp.hadamard();
  r.hadamard_block = lp.hadamard_block();
  return r;
}

absl::StatusOr<PolicyPatchSpec> PatchFileOf(const v1::Policy& policy) {
  PolicyPatchSpec out;
  out.reason = policy.reason();
  GEOFP8_ASSIGN_OR_RETURN(out.defaults, FromProto(policy.default_policy(), "default"));
  for (int i = 0; i < policy.patches_size(); ++i) {
    GEOFP8_ASSIGN_OR_RETURN(auto patch,
                            FromProto(policy.patches(i), "patches[" + std::to_string(i) + "]"));
    out.layers.push_back(std::move(patch));
  }
  return out;
}

absl::StatusOr<std::vector<LayerPolicy>> ResolveLayers(
    const v1::Policy& policy, const std::vector<model::ParamInfo>& params) {
  std::vector<LayerPolicy> out;
  for (const auto& p : params) {
    GEOFP8_ASSIGN_OR_RETURN(LayerPolicy r, FromProto(ResolveLayer(policy, p.name).policy,
                                                     "policy v" + std::to_string(policy.version()) +
                                                         ": layer " + p.name));
    if (!p.is_matrix()) {  // DESIGN.md section 2: 1-D tensors are never transformed
      r.geometry = GeometryMode::kNone;
      r.hadamard = false;
    }
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<RefreshSchedule> ScheduleFor(const v1::Policy& p,
                                         const std::vector<v1::RefreshSchedule>& catalog_schedule,
                                         const std::vector<model::ParamInfo>& params,
                                         const std::vector<LayerPolicy>& layer_policies,
                                         bool* missing, std::string* which) {
  std::map<std::string, v1::RefreshSchedule> by_layer;
  for (const auto& s : catalog_schedule) by_layer[s.layer()] = s;
  for (const auto& s : p.refresh()) by_layer[s.layer()] = s;
  std::vector<RefreshSchedule> out;
  *missing = false;
  for (size_t l = 0; l < params.size(); ++l) {
    RefreshSchedule rs;
    rs.owner = 0;
    rs.interval = std::numeric_limits<int>::max();
    rs.offset = 0;
    auto it = by_layer.find(params[l].name);
    if (it != by_layer.end()) {
      rs.owner = it->second.owner();
      rs.interval = std::max(1, it->second.interval());
      rs.offset = std::max(0, it->second.offset());
    } else if (layer_policies.size() > l && layer_policies[l].geometry != GeometryMode::kNone) {
      *missing = true;
      *which = params[l].name;
    }
    out.push_back(rs);
  }
  return out;
}

std::optional<v1::Policy> DueVersion(const std::map<uint64_t, v1::Policy>& versions,
                                     uint64_t in_force, int64_t step, uint64_t agreed) {
  std::optional<v1::Policy> due;
  bool replaying = false;
  for (const auto& [v, p] : versions) {
    if (v <= in_force || !p.has_taken_step()) continue;
    if (p.taken_step() <= step) {
      due = p;
    } else {
      replaying = true;
    }
  }
  if (replaying) return due;
  for (const auto& [v, p] : versions) {
    if (v <= in_force || v > agreed || p.has_taken_step() || (due && v < due->version())) {
      continue;
    }
    if (p.effective_step() <= step) due = p;
  }
  return due;
}

std::optional<v1::Policy> StartVersion(const std::map<uint64_t, v1::Policy>& versions,
                                       int64_t start) {
  std::optional<v1::Policy> taken, legacy;
  for (const auto& [v, p] : versions) {
    if (p.has_taken_step() && p.taken_step() <= start) taken = p;
    if (!p.has_taken_step() && p.effective_step() <= start) legacy = p;
  }
  return taken ? taken : legacy;
}

}  // namespace geofp8
