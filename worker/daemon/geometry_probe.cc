#include "worker/daemon/geometry_probe.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "kernels/codec/codec.h"
#include "kernels/common/check.h"

namespace geofp8::worker {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

double RoundTripError(std::span<const float> g, const LayerPolicy& p, const Geometry* geometry,
                      double* seconds) {
  std::vector<float> x(g.begin(), g.end());
  double transform = 0.0;
  if (geometry) {
    const auto t0 = Clock::now();
    ApplyGeometry(*geometry, x);
    transform += Since(t0);
  }
  if (p.format != Format::kFp32) {
    CodecOptions o;
    o.format = p.format;
    o.scaling = p.scaling;
    o.block = p.block;
    std::vector<uint8_t> buf(EncodedBytes(o, x.size()));
    Encode(x, o, buf);
    Decode(buf, x);
  }
  if (geometry) {
    const auto t0 = Clock::now();
    InvertGeometry(*geometry, x);
    transform += Since(t0);
  }
  if (seconds) *seconds += transform;
  double e2 = 0, g2 = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = double(x[i]) - g[i];
    e2 += d * d;
    g2 += double(g[i]) * g[i];
  }
  return g2 > 0 ? std::sqrt(e2 / g2) : std::sqrt(e2);
}

GeometryProbe::GeometryProbe(std::vector<model::ParamInfo> params, const ProbeSettings& settings)
    : params_(std::move(params)),
      settings_(settings),
      // The sketch yields low-rank bases only; a diag "on" is shadowed the instant way.
      ema_(settings.estimator == GeometryEstimator::kFactorEma &&
           settings.mode == GeometryMode::kLowRank) {
  GEOFP8_CHECK(settings_.probe_every >= 1, "auto_policy.probe_every: must be >= 1 (",
               settings_.probe_every, ")");
  const int every = settings_.probe_every;
  // Two time constants of the EMA hold 1 - beta^(2 / (1 - beta)) ~ 88% of its weight.
  const double beta = settings_.sketch.beta;
  const int memory = beta < 1.0 ? int(std::ceil(2.0 / (1.0 - beta))) : every;
  window_ = std::clamp(memory, 1, every);
  lag_ = std::clamp(settings_.refresh_interval / 2, 1, every);
  sketches_.resize(params_.size());
  snapshots_.resize(params_.size());
}

bool GeometryProbe::IsProbeStep(int64_t step) const {
  return step > 0 && step % settings_.probe_every == 0;
}

bool GeometryProbe::Observes(int64_t step) const {
  const int64_t every = settings_.probe_every;
  if (ema_) return step % every >= every - window_;
  return (step + lag_) % every == 0;
}

void GeometryProbe::Observe(int64_t step, std::span<const float> averaged,
                            std::span<const LayerPolicy> policies) {
  GEOFP8_CHECK(policies.size() == params_.size(), "probe: ", policies.size(), " policies for ",
               params_.size(), " layers");
  const int64_t every = settings_.probe_every;
  const bool restart = step % every == (every - window_) % every;  // a window's first step
  for (size_t l = 0; l < params_.size(); ++l) {
    const model::ParamInfo& p = params_[l];
    if (!p.is_matrix()) continue;
    if (policies[l].geometry != GeometryMode::kNone) {  // deployed: nothing to shadow
      sketches_[l] = FactorSketch{};
      snapshots_[l].clear();
      continue;
    }
    std::span<const float> g = averaged.subspan(p.offset, size_t(p.size()));
    if (!ema_) {
      snapshots_[l].assign(g.begin(), g.end());
      continue;
    }
    if (restart) sketches_[l] = FactorSketch{};
    FactorSketchOptions o = settings_.sketch;
    o.width = std::max(o.width, settings_.rank);
    o.seed = LayerSeed(l);
    UpdateFactorSketch(sketches_[l], g, p.rows, p.cols, settings_.rank, o);
  }
}

Geometry GeometryProbe::ShadowGeometry(uint32_t l, const LayerPolicy& policy) const {
  const model::ParamInfo& p = params_.at(l);
  if (ema_) {
    if (sketches_[l].updates == 0) return Geometry{};
    SketchGeometryOptions go;
    go.rank = settings_.rank;
    go.alpha = policy.alpha;
    return GeometryFromSketch(sketches_[l], go, 1);
  }
  if (snapshots_[l].empty()) return Geometry{};
  GeometryOptions go;
  go.mode = settings_.mode;
  go.rank = settings_.rank;
  go.alpha = policy.alpha;
  go.power_iters = settings_.power_iters;
  go.seed = LayerSeed(l);
  return EstimateGeometry(snapshots_[l], p.rows, p.cols, go, nullptr).geometry;
}

std::vector<LayerProbe> GeometryProbe::Probe(std::span<const float> local,
                                             std::span<const LayerPolicy> policies,
                                             const Exchanger& exchanger) const {
  GEOFP8_CHECK(policies.size() == params_.size(), "probe: ", policies.size(), " policies for ",
               params_.size(), " layers");
  std::vector<LayerProbe> out;
  for (uint32_t l = 0; l < params_.size(); ++l) {
    const model::ParamInfo& p = params_[l];
    if (!p.is_matrix()) continue;
    LayerProbe r;
    r.layer = l;
    Geometry shadow;
    const Geometry* basis = nullptr;
    if (policies[l].geometry != GeometryMode::kNone) {
      basis = &exchanger.active_geometry(l);
      r.basis = ProbeBasisKind::kDeployed;
    } else {
      shadow = ShadowGeometry(l, policies[l]);
      basis = &shadow;
      r.basis = ProbeBasisKind::kShadow;
    }
    if (basis->is_identity()) continue;  // warming up: nothing to judge yet
    std::span<const float> g = local.subspan(p.offset, size_t(p.size()));
    r.error_without = RoundTripError(g, policies[l], nullptr, nullptr);
    r.error_with = RoundTripError(g, policies[l], basis, &r.transform_seconds);
    out.push_back(r);
  }
  return out;
}

}  // namespace geofp8::worker
