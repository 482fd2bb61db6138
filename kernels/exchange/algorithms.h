// The exchange algorithms over one bucket: two_phase, allgather and the fp32/bf16 baselines.
// Input and output are in place, already pre-divided by N and moved into geometry coordinates;
// the engine (exchanger.h) does that, the fingerprint check and the skip decision around them.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/exchange/communicator.h"
#include "kernels/exchange/policy.h"

namespace geofp8 {

struct BucketLayer {
  uint32_t layer = 0;      // model layer index: part of the stochastic-rounding stream key
  LayerPolicy policy;      // format, scaling, block, rounding (geometry is applied outside)
  std::span<float> data;   // this rank's contribution in, the reduced result out
};

// Runs `algorithm` over the bucket's layers. Every rank ends with byte-identical data: the sum
// over ranks of the inputs, through the algorithm's quantization. Throws geofp8::Error for
// kNative (GPU only) or a collective failure.
void ExchangeBucketData(Communicator& comm, Algorithm algorithm, uint64_t seed, uint64_t step,
                        std::span<const BucketLayer> layers);

}  // namespace geofp8
