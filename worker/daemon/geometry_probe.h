// Auto mode's per-layer measurement (DESIGN.md section 2): how much geometry lowers a layer's
// quantization error, judged with the basis the layer actually deploys.
#pragma once

// Why: a basis fitted to the very gradient it is tested on always looks good (on llama-small the
// fresh top-k basis of a step's own gradient gives 0.30x Euclidean's error where the basis an
// estimator can deploy gives 0.35-0.71x, and several layers do worse than Euclidean with a stale
// one: docs/benchmarks.md, "Geometry on training trajectories"). So the probe never fits a basis
// to the probed gradient:
// - a layer whose policy uses geometry is judged with the exchanger's active geometry, the one
//   it used at the probed step;
// - a layer that uses none is judged with what its estimator would have deployed at that step:
//   a shadow estimator on rank 0 fed the averaged gradients of the steps before the probe (ema:
//   a sketch restarted `window` steps before each probe; instant: the top-k basis of the
//   averaged gradient `lag` steps before it, about half a refresh interval, the mean age of an
//   instant basis).

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/exchange/exchanger.h"
#include "kernels/exchange/policy.h"
#include "kernels/geometry/factor_sketch.h"
#include "kernels/geometry/geometry.h"
#include "kernels/model/model.h"

namespace geofp8::worker {

// Plain struct, from the job spec (auto_policy, geometry_refresh, training.seed).
struct ProbeSettings {
  int probe_every = 50;                        // steps between probes (>= 1)
  GeometryMode mode = GeometryMode::kLowRank;  // what "on" means
  int rank = 16;                               // k when on
  GeometryEstimator estimator = GeometryEstimator::kFactorEma;
  FactorSketchOptions sketch;  // ema: beta, width, probes, seed
  int refresh_interval = 100;  // instant: the deployed cadence
  int power_iters = 1;         // instant: subspace iterations
  uint64_t seed = 0;
};

// Which basis a probe used.
enum class ProbeBasisKind : uint8_t { kDeployed, kShadow };

struct LayerProbe {
  uint32_t layer = 0;              // index into the parameters
  double error_without = 0.0;      // rel_fro_error of one encode/decode in Euclidean coordinates
  double error_with = 0.0;         // ... with the basis below
  double transform_seconds = 0.0;  // forward + inverse transform
  ProbeBasisKind basis = ProbeBasisKind::kDeployed;
};

// ||T^-1(decode(encode(T g))) - g|| / ||g|| for one layer under policy p (geometry T, identity
// when null). Adds the forward + inverse transform time to *seconds when non-null.
double RoundTripError(std::span<const float> g, const LayerPolicy& p, const Geometry* geometry,
                      double* seconds);

// Rank 0's prober. Not thread-safe: the job's step loop drives it.
class GeometryProbe {
 public:
  GeometryProbe(std::vector<model::ParamInfo> params, const ProbeSettings& settings);

  // Steps of the shadow window before each probe (ema), >= 1.
  int window() const { return window_; }
  // Instant: how many steps before a probe the shadow basis's gradient is taken, >= 1.
  int lag() const { return lag_; }
  bool IsProbeStep(int64_t step) const;
  // Whether the averaged gradient of `step` feeds the shadow estimators.
  bool Observes(int64_t step) const;

  // Folds step `step`'s averaged gradient (flat, params layout) into the shadow estimators of
  // the matrix layers whose policy uses no geometry. Call after the step (after Probe when it is
  // a probe step) and only where Observes(step).
  void Observe(int64_t step, std::span<const float> averaged,
               std::span<const LayerPolicy> policies);

  // Each matrix layer's local gradient of the probed step (flat, params layout), quantized with
  // and without its basis (see the header comment). A layer with no basis yet (warming up, or no
  // shadow observed) is left out.
  std::vector<LayerProbe> Probe(std::span<const float> local, std::span<const LayerPolicy> policies,
                                const Exchanger& exchanger) const;

  // The shadow basis of layer l now (identity when it has none). For tests.
  Geometry ShadowGeometry(uint32_t layer, const LayerPolicy& policy) const;

 private:
  // The shadow estimators' seed of layer l (documented for the tests' replays).
  uint64_t LayerSeed(size_t l) const { return settings_.seed ^ (0x9e3779b97f4a7c15ull * (l + 1)); }

  std::vector<model::ParamInfo> params_;
  ProbeSettings settings_;
  bool ema_ = false;  // shadow with a sketch (ema estimator, lowrank); else the instant way
  int window_ = 1, lag_ = 1;
  std::vector<FactorSketch> sketches_;         // ema shadow, per layer
  std::vector<std::vector<float>> snapshots_;  // instant shadow: the lagged averaged gradient
};

}  // namespace geofp8::worker
