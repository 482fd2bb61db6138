// Per-layer compression policy and exchange algorithm choices: the vocabulary shared by the
// exchange engine, the trainer, the coordinator's job spec and the proto API.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "kernels/codec/codec.h"
#include "kernels/geometry/geometry.h"

namespace geofp8 {

enum class Algorithm : uint8_t {
  kTwoPhase = 0,   // quantize, all-to-all, dequantize+sum fp32, requantize, all-gather
  kAllGather = 1,  // quantize once, all-gather, sum locally
  kNative = 2,     // NCCL >= 2.24 FP8 all-reduce (GPU only)
  kFp32 = 3,       // backend's plain fp32 all-reduce (baseline)
  kBf16 = 4,       // backend's plain bf16 all-reduce (baseline)
  // The default: allgather where it moves no more bytes than two_phase, else two_phase
  // (ResolveAlgorithm). Never on the wire: the Exchanger resolves it before its first step.
  kAuto = 5,
};
// "two_phase", "allgather", "native", "fp32", "bf16", "auto"
std::string_view AlgorithmName(Algorithm a);
std::optional<Algorithm> ParseAlgorithm(std::string_view name);
std::string_view AcceptedAlgorithms();

// The algorithm `a` runs as among `ranks` ranks: kAuto becomes allgather for at most 2 ranks and
// two_phase otherwise, anything else itself. At 2 ranks each rank sends its whole quantized
// bucket once either way (two_phase: half in its all-to-all, half in its all-gather), so
// allgather moves the same bytes in one collective round instead of two and never requantizes
// a partial sum; from 3 ranks on it moves (N - 1) / (2 (N - 1) / N) = N / 2 times two_phase's.
Algorithm ResolveAlgorithm(Algorithm a, int ranks);

// How one layer's gradient travels. Plain struct with defaults (DESIGN.md section 2 table).
struct LayerPolicy {
  Format format = Format::kFp8E4M3;
  Scaling scaling = Scaling::kBlock;
  uint32_t block = 128;
  Rounding rounding = Rounding::kNearest;
  GeometryMode geometry = GeometryMode::kNone;
  int rank = 16;                // k for kLowRank
  float alpha = 0.25f;          // whitening exponent
  bool error_feedback = false;  // optional extension, off by default
  // Block random Hadamard rotation of the flattened gradient after the geometry (before it, on
  // the way back), kernels/geometry/hadamard.h: spreads an outlier over its scale block.
  bool hadamard = false;
  // Elements per rotation block: a power of two dividing the codec's scale block; 0: the codec's
  // scale block itself (16 nvfp4, 32 mxfp8, `block` for block scaling, 128 without one).
  uint32_t hadamard_block = 0;
};

// The rotation block `p` uses (0 when it does not rotate): hadamard_block, or its default.
uint32_t EffectiveHadamardBlock(const LayerPolicy& p);

// How a layer's geometry is estimated from the post-exchange averaged gradient.
enum class GeometryEstimator : uint8_t {
  // The owner rank takes the top-k singular subspace of the last averaged gradient (subspace
  // iteration, warm-started) and broadcasts it: the basis of one gradient.
  kInstant = 0,
  // Every rank folds the averaged gradient into a Kronecker-factor EMA sketch
  // (kernels/geometry/factor_sketch.h) and derives the same geometry from it bit for bit: the
  // persistent anisotropy, with no broadcast.
  kFactorEma = 1,
};
std::string_view GeometryEstimatorName(GeometryEstimator e);  // "instant", "ema"
std::optional<GeometryEstimator> ParseGeometryEstimator(std::string_view name);
std::string_view AcceptedGeometryEstimators();

// Per-layer geometry refresh: at steps where (step - offset) % interval == 0 and step >= offset
// the layer's geometry is re-estimated (instant: by the owner rank; ema: by every rank, which
// also folds that step's gradient into the sketch).
struct RefreshSchedule {
  int owner = 0;
  int interval = 100;
  int offset = 0;
};

}  // namespace geofp8
