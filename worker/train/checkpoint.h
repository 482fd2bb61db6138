// Trainer checkpoints: parameters, AdamW moments, geometry state, step and RNG state, written
// atomically (temporary file, fsync, rename) so a crash never leaves a torn checkpoint.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace geofp8::train {

struct CheckpointLayerGeometry {
  std::vector<uint8_t> active;   // SerializeGeometry bytes; empty: identity (never refreshed)
  std::vector<uint8_t> pending;  // broadcast but not yet active; empty: none
  uint64_t pending_from = 0;
};

struct Checkpoint {
  std::string fingerprint;   // model shape, ranks, batch, seq, policy, data, seed: must match
  int64_t next_step = 0;     // the first step a resumed run executes
  uint64_t rng_seed = 0;     // data windows and rounding streams are pure functions of (seed, step)
  std::vector<float> weights, m, v;
  std::vector<CheckpointLayerGeometry> geometry;  // one per parameter, or empty
};

// Writes path.tmp, fsyncs, renames over path. Throws geofp8::Error naming the path.
void SaveCheckpoint(const std::string& path, const Checkpoint& checkpoint);
// Throws geofp8::Error naming the path and problem (missing, truncated, bad magic, bad hash).
Checkpoint LoadCheckpoint(const std::string& path);

}  // namespace geofp8::train
