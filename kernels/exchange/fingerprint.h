// Bucket fingerprints: before any payload moves, ranks all-gather one small fixed-size record per
// bucket (policy version, step, algorithm, layer digest). A mismatch is diagnosed with a second
// gather of per-layer records and reported naming the rank and the layer, on every rank.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/exchange/communicator.h"
#include "kernels/exchange/policy.h"

namespace geofp8 {

#pragma pack(push, 1)
// One layer as the exchange will treat it at this step.
struct LayerRecord {
  uint32_t layer = 0;  // index in the model's layer list
  uint8_t format = 0, scaling = 0, rounding = 0, geometry = 0;  // effective geometry mode
  uint32_t block = 0;
  int32_t rank_k = 0;
  float alpha = 0.f;
  int64_t rows = 0, cols = 0;
  uint64_t geometry_version = 0;  // active version (0: identity)
};
static_assert(sizeof(LayerRecord) == 44);

struct BucketRecord {
  uint64_t policy_version = 0;
  uint64_t step = 0;
  uint64_t digest = 0;  // FNV-1a of the layer records
  uint32_t bucket = 0;
  uint32_t layer_count = 0;
  uint32_t algorithm = 0;
  uint32_t reserved = 0;  // 0
};
static_assert(sizeof(BucketRecord) == 40);
#pragma pack(pop)

uint64_t LayerDigest(std::span<const LayerRecord> layers);

// Gathers every rank's record. Throws geofp8::Error naming the first disagreeing rank and layer
// (compared with the value most ranks hold) if any record differs; the same error is raised on
// every rank. `layer_names[i]` names layer index i for the message (may be empty).
void CheckFingerprints(Communicator& comm, BucketRecord record,
                           std::span<const LayerRecord> layers,
                           std::span<const std::string> layer_names);

}  // namespace geofp8
