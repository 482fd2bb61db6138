// Each layer's exchange state, owned apart from any bucket layout: the geometry in force and the
// one waiting to take over, the factor sketch, the error-feedback residuals and the step's
// inverse-transform products. A LayerStateTable keys it by the model's layer id
// (ExchangeOptions::layer_ids), so Exchangers over different groupings of the same layers (DDP's
// buckets, which DDP rebuilds after its first step; FSDP2's parameter groups; the trainer's own)
// read and write one state per layer, and nothing is carried over by hand when a grouping changes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "kernels/geometry/factor_sketch.h"
#include "kernels/geometry/geometry.h"

namespace geofp8 {

// One layer's error-feedback residuals on this rank (LayerPolicy::error_feedback), in the
// coordinates the codec sees (divided by N, transformed): what this rank's own quantization lost
// at its last applied step, and, two_phase, what its requantization of the chunk it owns lost.
// They differ between ranks, so a checkpoint keeps one set per rank. Empty vectors: zero.
struct LayerResidual {
  uint64_t geometry_version = 0;  // the active geometry they were taken under
  std::vector<float> local;       // one per element of the layer
  std::vector<float> owner;       // one per element; only this rank's two_phase chunk is used
};

struct LayerState {
  Geometry active;            // in use now (version 0: identity)
  Geometry pending;           // broadcast, waits for activation
  uint64_t pending_from = 0;  // step at which pending becomes active
  bool has_pending = false;
  uint64_t active_digest = 0;  // GeometryDigest(active), compared across ranks every step
  FactorSketch sketch;         // estimator kFactorEma: the same on every rank
  InverseProducts products;    // kFactorEma: this step's inverse transform's, for the sketch
  // Error feedback: the residuals of the last applied step, and this step's new ones, which the
  // step's end keeps only when the step is not skipped.
  LayerResidual residual, next_residual;

  // Back to identity: no geometry, no sketch (a layer whose policy no longer fits its state).
  void ResetGeometry();
};

// Layer id -> state. Entries are created on first use and never move, so an Exchanger may hold
// pointers to them for its lifetime. Thread-compatible: the caller runs at most one Exchanger
// over a given layer at a time (geofp8.torch's engine runs one bucket at a time).
class LayerStateTable {
 public:
  LayerState& at(uint32_t layer_id);
  const LayerState* find(uint32_t layer_id) const;
  // Drops every layer's state (a new model).
  void clear() { states_.clear(); }
  // Drops every layer's error-feedback residuals (a policy change: they were taken in the old
  // policy's coordinates and formats).
  void DropResiduals();
  size_t size() const { return states_.size(); }

 private:
  std::map<uint32_t, std::unique_ptr<LayerState>> states_;
};

}  // namespace geofp8
