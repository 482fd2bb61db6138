// Presets and the YAML policy file of worker/train/exchange_policy.h.
//
// YAML schema (every key optional; rules apply in order, later ones override earlier fields):
//   algorithm: two_phase            # two_phase | allgather | fp32 | bf16
//   refresh: {interval: 20, estimator: instant, power_iters: 1, sigma_ema: 0,
//             beta: 0.9, width: 8, probes: 4, adapt: 0}   # the last four: estimator ema
//   bucket_cap_bytes: 1048576
//   default: {format: fp8_e4m3, scaling: block, block: 128, rounding: nearest,
//             geometry: none, rank: 16, alpha: 0.25}
//   layers:
//     - {match: "layers.*.mlp.*", geometry: lowrank, rank: 8}
// 1-D parameters (norm gains) always use geometry none.

#include "worker/train/exchange_policy.h"

#include <yaml-cpp/yaml.h>

#include <sstream>

#include "kernels/common/check.h"
#include "kernels/policy/job_spec.h"

namespace geofp8::train {

bool ExchangePlan::uses_geometry() const {
  for (const LayerPolicy& p : layers) {
    if (p.geometry != GeometryMode::kNone) return true;
  }
  return false;
}

std::string_view AcceptedPolicyPresets() { return "fp32, bf16, fp8, geofp8, nvfp4, geonvfp4"; }

namespace {

ExchangePlan Preset(const std::string& name, const std::vector<model::ParamInfo>& params) {
  ExchangePlan plan;
  plan.name = name;
  LayerPolicy base;  // fp8_e4m3, block 128, nearest, geometry none
  bool lowrank_matrices = false;
  if (name == "fp32") {
    plan.algorithm = Algorithm::kFp32;
    base.format = Format::kFp32;
  } else if (name == "bf16") {
    plan.algorithm = Algorithm::kBf16;
    base.format = Format::kBf16;
  } else if (name == "fp8") {
    base.format = Format::kFp8E4M3;
  } else if (name == "geofp8") {
    base.format = Format::kFp8E4M3;
    lowrank_matrices = true;
  } else if (name == "nvfp4") {
    base.format = Format::kNvfp4;
  } else if (name == "geonvfp4") {
    base.format = Format::kNvfp4;
    lowrank_matrices = true;
  } else {
    GEOFP8_FAIL("policy: unknown preset '", name, "' (accepted: ", AcceptedPolicyPresets(),
                ", or a FILE.yaml)");
  }
  if (lowrank_matrices) {
    // The estimator chosen on real trajectories (docs/benchmarks.md, "Geometry on training
    // trajectories"): a Kronecker-factor EMA refreshed every step beats a basis of one gradient
    // refreshed every 20 steps (rel_fro 0.35 against 0.71 of Euclidean at steps 40-59).
    plan.estimator = GeometryEstimator::kFactorEma;
    plan.refresh_interval = 1;
  }
  for (const model::ParamInfo& p : params) {
    LayerPolicy lp = base;
    if (lowrank_matrices && p.is_matrix()) {
      lp.geometry = GeometryMode::kLowRank;
      lp.rank = 8;
    }
    plan.layers.push_back(lp);
  }
  return plan;
}

[[noreturn]] void Bad(const std::string& field, const std::string& problem) {
  GEOFP8_FAIL(field, ": ", problem);
}

template <typename T>
T Scalar(const YAML::Node& node, const std::string& field) {
  if (!node.IsScalar()) Bad(field, "must be a scalar");
  try {
    return node.as<T>();
  } catch (const YAML::Exception&) {
    Bad(field, "cannot parse '" + node.Scalar() + "'");
  }
}

// Applies the fields present in `node` onto `p`.
void ApplyFields(const YAML::Node& node, const std::string& where, LayerPolicy* p,
                 bool allow_match) {
  if (!node.IsMap()) Bad(where, "must be a map");
  for (const auto& kv : node) {
    const std::string key = kv.first.as<std::string>();
    const std::string field = where + "." + key;
    const YAML::Node& v = kv.second;
    if (key == "match" && allow_match) continue;
    if (key == "format") {
      auto f = ParseFormat(Scalar<std::string>(v, field));
      if (!f) Bad(field, "unknown value '" + v.Scalar() + "' (accepted: " +
                             std::string(AcceptedFormats()) + ")");
      p->format = *f;
    } else if (key == "scaling") {
      auto s = ParseScaling(Scalar<std::string>(v, field));
      if (!s) Bad(field, "unknown value '" + v.Scalar() + "' (accepted: " +
                             std::string(AcceptedScalings()) + ")");
      p->scaling = *s;
    } else if (key == "rounding") {
      auto r = ParseRounding(Scalar<std::string>(v, field));
      if (!r) Bad(field, "unknown value '" + v.Scalar() + "' (accepted: " +
                             std::string(AcceptedRoundings()) + ")");
      p->rounding = *r;
    } else if (key == "geometry") {
      auto g = ParseGeometryMode(Scalar<std::string>(v, field));
      if (!g) Bad(field, "unknown value '" + v.Scalar() + "' (accepted: " +
                             std::string(AcceptedGeometryModes()) + ")");
      p->geometry = *g;
    } else if (key == "block") {
      const int64_t b = Scalar<int64_t>(v, field);
      if (b < 1 || b > (int64_t{1} << 30)) Bad(field, "must be in [1, 2^30] (" + v.Scalar() + ")");
      p->block = static_cast<uint32_t>(b);
    } else if (key == "rank") {
      const int r = Scalar<int>(v, field);
      if (r < 1) Bad(field, "must be >= 1 (" + v.Scalar() + ")");
      p->rank = r;
    } else if (key == "alpha") {
      const float a = Scalar<float>(v, field);
      if (!(a > 0.f && a <= 1.f)) Bad(field, "must be in (0, 1] (" + v.Scalar() + ")");
      p->alpha = a;
    } else if (key == "error_feedback") {
      p->error_feedback = Scalar<bool>(v, field);
    } else {
      Bad(field, "unknown key (accepted: " + std::string(allow_match ? "match, " : "") +
                     "format, scaling, block, rounding, geometry, rank, alpha, error_feedback)");
    }
  }
}

// `name` is the plan's name (the file path, or what the caller calls the text); `model`, when set,
// makes an unmatched glob's error list the model's layers (UnmatchedGlobProblem).
ExchangePlan FromYamlNode(YAML::Node root, const std::string& name,
                          const std::vector<model::ParamInfo>& params, std::string_view model) {
  ExchangePlan plan;
  plan.name = name;
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap()) Bad("policy", "top level must be a map");
  LayerPolicy base;
  for (const auto& kv : root) {
    const std::string key = kv.first.as<std::string>();
    if (key == "algorithm") {
      auto a = ParseAlgorithm(Scalar<std::string>(kv.second, "policy.algorithm"));
      if (!a) Bad("policy.algorithm", "unknown value '" + kv.second.Scalar() + "' (accepted: " +
                                          std::string(AcceptedAlgorithms()) + ")");
      plan.algorithm = *a;
    } else if (key == "refresh") {
      if (!kv.second.IsMap()) Bad("policy.refresh", "must be a map");
      for (const auto& r : kv.second) {
        const std::string k = r.first.as<std::string>();
        const std::string field = "policy.refresh." + k;
        if (k == "interval") {
          plan.refresh_interval = Scalar<int>(r.second, field);
          if (plan.refresh_interval < 1) Bad(field, "must be >= 1 (" + r.second.Scalar() + ")");
        } else if (k == "power_iters") {
          plan.power_iters = Scalar<int>(r.second, field);
          if (plan.power_iters < 1) Bad(field, "must be >= 1 (" + r.second.Scalar() + ")");
        } else if (k == "sigma_ema") {
          plan.sigma_ema = Scalar<float>(r.second, field);
          if (!(plan.sigma_ema >= 0.f && plan.sigma_ema < 1.f)) {
            Bad(field, "must be in [0, 1) (" + r.second.Scalar() + ")");
          }
        } else if (k == "estimator") {
          auto e = ParseGeometryEstimator(Scalar<std::string>(r.second, field));
          if (!e) Bad(field, "unknown value '" + r.second.Scalar() + "' (accepted: " +
                                 std::string(AcceptedGeometryEstimators()) + ")");
          plan.estimator = *e;
        } else if (k == "beta") {
          plan.sketch.beta = Scalar<float>(r.second, field);
          if (!(plan.sketch.beta >= 0.f && plan.sketch.beta < 1.f)) {
            Bad(field, "must be in [0, 1) (" + r.second.Scalar() + ")");
          }
        } else if (k == "width") {
          plan.sketch.width = Scalar<int>(r.second, field);
          if (plan.sketch.width < 1 || plan.sketch.width > 256) {
            Bad(field, "must be in [1, 256] (" + r.second.Scalar() + ")");
          }
        } else if (k == "probes") {
          plan.sketch.probes = Scalar<int>(r.second, field);
          if (plan.sketch.probes < 0 || plan.sketch.probes > 64) {
            Bad(field, "must be in [0, 64] (" + r.second.Scalar() + ")");
          }
        } else if (k == "adapt") {
          plan.adapt = Scalar<float>(r.second, field);
          if (!(plan.adapt >= 0.f && plan.adapt <= 4.f)) {
            Bad(field, "must be in [0, 4] (" + r.second.Scalar() + ")");
          }
        } else {
          Bad(field, "unknown key (accepted: interval, estimator, power_iters, sigma_ema, beta, "
                     "width, probes, adapt)");
        }
      }
    } else if (key == "bucket_cap_bytes") {
      const int64_t b = Scalar<int64_t>(kv.second, "policy.bucket_cap_bytes");
      if (b < 1) Bad("policy.bucket_cap_bytes", "must be >= 1 (" + kv.second.Scalar() + ")");
      plan.bucket_cap_bytes = static_cast<size_t>(b);
    } else if (key == "default") {
      ApplyFields(kv.second, "policy.default", &base, false);
    } else if (key != "layers") {
      Bad("policy." + key, "unknown key (accepted: algorithm, refresh, bucket_cap_bytes, "
                           "default, layers)");
    }
  }
  plan.layers.assign(params.size(), base);
  if (const YAML::Node rules = root["layers"]) {
    if (!rules.IsSequence()) Bad("policy.layers", "must be a list");
    for (size_t r = 0; r < rules.size(); ++r) {
      const std::string where = "policy.layers[" + std::to_string(r) + "]";
      if (!rules[r].IsMap()) Bad(where, "must be a map");
      if (!rules[r]["match"]) Bad(where + ".match", "missing (a glob over layer names)");
      const std::string glob = Scalar<std::string>(rules[r]["match"], where + ".match");
      int matched = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        if (!LayerMatches(glob, params[i].name)) continue;
        ApplyFields(rules[r], where, &plan.layers[i], true);
        ++matched;
      }
      if (matched == 0) {
        Bad(where + ".match", model.empty() ? "matches no layer ('" + glob + "')"
                                            : UnmatchedGlobProblem(glob, params, model));
      }
    }
  }
  return plan;
}

ExchangePlan FromYaml(const std::string& path, const std::vector<model::ParamInfo>& params) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    GEOFP8_FAIL("policy: cannot read file ", path);
  } catch (const YAML::Exception& e) {
    GEOFP8_FAIL("policy: ", path, ": YAML error at line ", e.mark.line + 1, ": ", e.msg);
  }
  return FromYamlNode(root, path, params, "");
}

// What both entry points do after parsing: 1-D parameters never use geometry; native is GPU-only.
ExchangePlan Finish(ExchangePlan plan, const std::vector<model::ParamInfo>& params) {
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].is_matrix()) plan.layers[i].geometry = GeometryMode::kNone;
  }
  if (plan.algorithm == Algorithm::kNative) {
    Bad("policy.algorithm", "native needs NCCL on a GPU; the CPU trainer accepts two_phase, "
                            "allgather, fp32, bf16 (native)");
  }
  return plan;
}

}  // namespace

ExchangePlan MakeExchangePlan(const std::string& spec,
                              const std::vector<model::ParamInfo>& params) {
  const bool file = spec.ends_with(".yaml") || spec.ends_with(".yml");
  return Finish(file ? FromYaml(spec, params) : Preset(spec, params), params);
}

ExchangePlan MakeExchangePlanFromText(std::string_view yaml, const std::string& name,
                                      const std::vector<model::ParamInfo>& params,
                                      std::string_view model) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml));
  } catch (const YAML::Exception& e) {
    GEOFP8_FAIL("policy: ", name, ": YAML error at line ", e.mark.line + 1, ": ", e.msg);
  }
  return Finish(FromYamlNode(root, name, params, model), params);
}

ExchangeOptions MakeExchangeOptions(const ExchangePlan& plan) {
  ExchangeOptions eo;
  eo.algorithm = plan.algorithm;
  eo.bucket_cap_bytes = plan.bucket_cap_bytes;
  eo.estimator = plan.estimator;
  eo.power_iters = plan.power_iters;
  eo.sigma_ema = plan.sigma_ema;
  eo.sketch = plan.sketch;
  eo.adapt = plan.adapt;
  return eo;
}

std::vector<RefreshSchedule> MakeRefreshSchedule(const ExchangePlan& plan, int ranks) {
  std::vector<RefreshSchedule> schedule;
  if (!plan.uses_geometry()) return schedule;
  int matrix = 0;
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    RefreshSchedule s;
    s.owner = static_cast<int>(i % size_t(ranks));
    s.interval = plan.refresh_interval;
    // Stagger offsets so refreshes spread over steps; the first refresh comes early because
    // layers quantize without geometry until then.
    s.offset = plan.layers[i].geometry == GeometryMode::kNone ? 0 : (matrix++ % std::min(plan.refresh_interval, 4));
    schedule.push_back(s);
  }
  return schedule;
}

}  // namespace geofp8::train
