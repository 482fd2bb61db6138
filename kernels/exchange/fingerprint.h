// Bucket fingerprints: before any payload is used, ranks compare one small fixed-size record for
// the buckets that move together (policy version, step, algorithm, a digest of every bucket's
// layers): one max-reduction per run, however many buckets it holds, or, on a communicator with a
// bounded receive (Gloo) once the run's layout has passed that check, no round of its own: the
// record rides in the run's first data round (the fp32/bf16 baselines exchange it alone). A
// mismatch is diagnosed with further gathers of per-bucket and per-layer records and reported
// naming the rank and the layer, on every rank.
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
  uint32_t layer = 0;                                           // index in the model's layer list
  uint8_t format = 0, scaling = 0, rounding = 0, geometry = 0;  // effective geometry mode
  uint32_t block = 0;
  int32_t rank_k = 0;
  float alpha = 0.f;
  int64_t rows = 0, cols = 0;
  uint64_t geometry_version = 0;  // active version (0: identity)
  // GeometryDigest of the active geometry (0: identity): ranks that derive their geometry
  // themselves (the ema estimator) prove here that they hold the same transform.
  uint64_t geometry_digest = 0;
  uint32_t hadamard_block = 0;  // the rotation block (0: no rotation)
  uint32_t error_feedback = 0;  // 1: the layer adds its residuals (LayerPolicy::error_feedback)
};
static_assert(sizeof(LayerRecord) == 60);

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

// What the ranks compare first: the buckets [first_bucket, first_bucket + bucket_count) of one
// run, with `digest` over their BucketRecords (each holding its layers' digest).
struct RunRecord {
  uint64_t policy_version = 0;
  uint64_t step = 0;
  uint64_t digest = 0;  // FNV-1a of the bucket records, in bucket order
  uint32_t first_bucket = 0;
  uint32_t bucket_count = 0;
  uint32_t algorithm = 0;
  uint32_t reserved = 0;  // 0
};
static_assert(sizeof(RunRecord) == 40);
#pragma pack(pop)

// One bucket as this rank will exchange it: its header (layer_count and digest are filled in by
// CheckFingerprints) and its layers in bucket order.
struct BucketFingerprint {
  BucketRecord header;
  std::vector<LayerRecord> layers;
};

// 64-bit FNV-1a of `bytes` bytes, continuing from `h` (chain calls to hash several pieces).
uint64_t Fnv1a(const void* data, size_t bytes, uint64_t h = 0xcbf29ce484222325ull);

uint64_t LayerDigest(std::span<const LayerRecord> layers);

// Compares every rank's RunRecord of `buckets` (one small max-reduction when the ranks agree,
// Communicator::MaxReduceWords). Throws
// geofp8::Error naming the first disagreeing rank and layer (compared with the value most ranks
// hold) if anything differs; the same error is raised on every rank. The buckets must all have
// the same policy_version, step and algorithm. `layer_names[i]` names layer index i for the
// message (may be empty).
void CheckFingerprints(Communicator& comm, std::span<const BucketFingerprint> buckets,
                       std::span<const std::string> layer_names);

// The record CheckFingerprints compares, for a caller that carries it itself: where the
// communicator has a bounded receive, the exchange sends it in its first data round
// (AlgorithmOptions::check_record) instead of the separate max-reduction. `headers`, when given,
// receives the buckets' records with layer_count and digest filled in.
RunRecord MakeRunRecord(std::span<const BucketFingerprint> buckets,
                        std::vector<BucketRecord>* headers = nullptr);

// The collective half of CheckFingerprints, for when some rank's RunRecord differs and every rank
// knows it: gathers the run, bucket and layer records and throws the error naming the first
// disagreeing rank and layer, the same on every rank. Every rank must call it; it always throws
// (a generic mismatch error if the records turn out equal).
[[noreturn]] void DiagnoseFingerprints(Communicator& comm,
                                       std::span<const BucketFingerprint> buckets,
                                       std::span<const std::string> layer_names);

}  // namespace geofp8
