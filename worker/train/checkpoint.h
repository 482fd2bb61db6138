// Trainer checkpoints: parameters, AdamW moments, geometry state, policy version, step and RNG
// state, written atomically (temporary file, fsync, rename) so a crash never leaves a torn one.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/exchange/exchanger.h"

namespace geofp8::train {

// Format versions: 4 (written) adds every rank's error-feedback residuals and the gradient noise
// scale's averages; 3 each layer's ema
// sketch; 2 the policy version, the run totals and each layer's pending geometry. 1 is still read
// when it holds no geometry (fp32/bf16/fp8/nvfp4 runs); a version 1 checkpoint with geometry is
// refused, since its pending refreshes were never saved and a resume from it could not continue
// exactly.
struct Checkpoint {
  std::string fingerprint;  // model shape, ranks, batch, seq, policy, data, seed: must match
  int64_t next_step = 0;    // the first step a resumed run executes
  uint64_t rng_seed = 0;    // data windows and rounding streams are pure functions of (seed, step)
  uint64_t policy_version = 0;  // the exchange policy version in force (the worker's)
  double best_val_loss = NAN;   // run totals, so a resumed run reports what an uninterrupted
  uint64_t bytes_sent = 0;      // one would (rank 0's wire bytes)
  std::vector<float> weights, m, v;
  std::vector<LayerGeometryState>
      geometry;  // Exchanger::ExportGeometry: one per parameter, or empty
  // Error feedback: Exchanger::ExportResiduals of every rank ([rank][layer]); they differ between
  // ranks. Empty when no layer feeds back, or when the writer did not gather them.
  std::vector<std::vector<LayerResidual>> residuals;
  // The gradient noise scale's moving averages (kernels/model/noise_scale.h), the same on every
  // rank; samples 0: none yet.
  double gns_grad_sq = NAN, gns_trace = NAN;
  int64_t gns_samples = 0;
};

// The checkpoint as bytes (the file's contents), and back. Parse throws geofp8::Error naming
// `name` and the problem (truncated, bad magic, bad hash, unsupported version).
std::string SerializeCheckpoint(const Checkpoint& checkpoint);
Checkpoint ParseCheckpoint(std::string_view bytes, const std::string& name);

// Writes path.tmp, fsyncs, renames over path. Throws geofp8::Error naming the path.
void SaveCheckpoint(const std::string& path, const Checkpoint& checkpoint);
// Throws geofp8::Error naming the path and problem (missing, truncated, bad magic, bad hash).
Checkpoint LoadCheckpoint(const std::string& path);

}  // namespace geofp8::train
