// The exchange algorithms over one bucket: two_phase, allgather, native and the fp32/bf16
// baselines. Each rank's input is divided by AlgorithmOptions::divisor (N, so the sum is the
// average) as it is read; each layer's geometry is applied before its quantization and inverted
// after its decode here, so two_phase can pipeline the division and the transforms too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "kernels/common/uninitialized.h"
#include "kernels/exchange/communicator.h"
#include "kernels/exchange/policy.h"
#include "kernels/exchange/trace.h"
#include "kernels/geometry/geometry.h"

namespace geofp8 {

struct BucketLayer {
  uint32_t layer = 0;  // model layer index: part of the stochastic-rounding stream key
  LayerPolicy policy;  // format, scaling, block, rounding
  const Geometry* geometry = nullptr;  // applied to `in`, inverted on `out`; null: identity
  // This rank's contribution before the division. Clobbered (divided and transformed in place)
  // when the layer has a geometry or a rotation (Transformed). May be the same memory as `out`: a
  // group's inputs are all read before any of its outputs is written.
  std::span<float> in;
  std::span<float> out;  // the reduced result in gradient coordinates (same size)
  // When not null and the layer has a lowrank geometry: filled by the inverse transform with what
  // it learnt of `out` (geometry.h InverseProducts), for the factor sketch that reads it next.
  InverseProducts* products = nullptr;
  // Which bit of ExchangeBucketData's result reports a NaN or inf in this layer's input (< 64):
  // the exchanger gives each bucket of a coalesced exchange its own bit.
  uint32_t flag_bit = 0;
  // The block random Hadamard rotation after the geometry (0: none), with its signs' seed.
  uint32_t hadamard_block = 0;
  uint64_t hadamard_seed = 0;
  // Error feedback (LayerPolicy::error_feedback), each null or one float per element of `in`, in
  // the coordinates the codec sees: residual_in is added to this rank's input before its encode
  // and residual_out receives what that encode lost (input + residual - decoded); owner_in and
  // owner_out do the same for two_phase's requantization of the chunk this rank owns.
  const float* residual_in = nullptr;
  float* residual_out = nullptr;
  const float* owner_in = nullptr;
  float* owner_out = nullptr;
};

// Whether the layer is divided and transformed in place before its encode.
inline bool Transformed(const BucketLayer& l) { return l.geometry || l.hadamard_block; }

// Buffers that outlive one bucket, so a steady-state exchange allocates nothing: fresh multi-MiB
// allocations come from mmap and cost a page fault per 4 KiB on every step. Not thread-safe; one
// per Exchanger (used on its worker thread).
struct ExchangeWorkspace {
  std::vector<UninitializedVector<uint8_t>> bytes;  // per pipeline group: send, recv, mine, all
  std::vector<UninitializedVector<float>> floats;   // per pipeline group: sum accumulator
  UninitializedVector<float> divided;               // one chunk of input, divided, to encode
  UninitializedVector<float> feedback;              // error feedback: input + residual
  UninitializedVector<float> feedback_decoded;      // error feedback: what its encode decodes to
  UninitializedVector<float> flat;                  // the fp32 baseline's flattened bucket
  UninitializedVector<uint16_t> flat_bf16;          // the bf16 baseline's flattened bucket
};

struct AlgorithmOptions {
  uint64_t seed = 0;  // stochastic rounding streams (chunking.h StreamSeed)
  uint64_t step = 0;
  // Every input element is divided by this (IEEE division) before anything else touches it.
  float divisor = 1.f;
  // two_phase pipelines groups of whole layers of about this many fp32 bytes: while one group is
  // on the wire, a helper thread encodes the next and sums/decodes the previous ones.
  size_t segment_bytes = size_t{1} << 20;
  // A two_phase or allgather run whose layers total at most this many fp32 bytes runs every stage
  // on the calling thread as one group (encode, collectives, sum, decode), with no helper or
  // side-lane thread and the fewest collective rounds (one all-to-all and one all-gather): for a
  // small bucket the pipeline's thread start-ups and handoffs cost more than the overlap saves,
  // most of all on busy cores where each wakeup waits for a slice (docs/benchmarks.md, "DDP comm
  // hooks"). Every rank must use the same value. 0: never.
  size_t inline_bytes = 0;
  // Niceness added to that helper thread (Linux: its own scheduling priority). Its codec work is
  // done ahead of the wire while the threads issuing collectives are latency-bound, so where
  // exchange ranks oversubscribe the cores, a positive value lets the collectives win each
  // wakeup (docs/benchmarks.md: 4 ranks on 2 cores, 10 takes two_phase from 0.287 to 0.281 of
  // fp32). It also yields to a backward pass running alongside, which in the built-in trainer
  // measured no faster, hence 0 (the helper keeps its creator's priority) by default.
  int helper_nice = 0;
  // Timeline of this call's collectives and codec stages (trace.h); null: none.
  ExchangeTrace* trace = nullptr;
  // Reused buffers; null: the call allocates its own (tests, one-off calls).
  ExchangeWorkspace* workspace = nullptr;
  // Run on the calling thread before the first collective that moves data (the exchanger's
  // fingerprint check, as a round of its own); two_phase and allgather encode their first groups
  // meanwhile. If it throws, nothing is sent and the exception propagates. Not run when the
  // check rides in the data instead (check_record below).
  std::function<void()> before_data;
  // The same check without a round of its own, where the communicator has a bounded receive
  // (Communicator::SupportsBoundedReceive) and the algorithm is two_phase or allgather: every
  // message of the run's first data collective (group 0's all-to-all or all-gather) goes through
  // Communicator::ExchangeBounded, prefixed by the sender's `check_record` (the same size on
  // every rank), and each receive is posted at a capacity no layout of the group's layers can
  // exceed (MaxEncodedBytes of every layer's element count), so a rank that encodes differently
  // cannot overflow it. If every rank's record equals this one, the run goes on exactly as with
  // before_data; otherwise every rank sees a difference and calls `diagnose`, which must throw
  // the same error everywhere (it may issue collectives on the calling thread), and no received
  // data is used. No lane moves other data before the records are compared. The baselines (and
  // a run without layers) send the record alone in a round of their own, through the same
  // primitive with receives sized for a two_phase or allgather peer, so ranks whose policies
  // disagree on the algorithm still meet in one round and get the diagnosis. Empty: before_data.
  // The caller must know that every rank has the same layer sizes and grouping options (the
  // exchanger compares them with before_data first): capacities are derived from them.
  std::vector<uint8_t> check_record;
  std::function<void()> diagnose;
};

// Runs `algorithm` over the bucket's layers. Every rank ends with byte-identical outputs: the sum
// over ranks of the inputs, through the algorithm's quantization. Each rank notes a NaN or inf in
// a layer's input as it reads it and sets that layer's flag_bit; the result is the OR of those
// bits over ranks, the same on every rank (two_phase and allgather send the flags in the last
// group's first collective, the baselines with one small all-gather). Outputs of layers whose bit
// is set hold no meaningful values: the caller skips them, as mixed-precision loss scaling does
// after its all-reduce. Throws geofp8::Error for kNative (GPU only) or a collective failure.
uint64_t ExchangeBucketData(Communicator& comm, Algorithm algorithm,
                            const AlgorithmOptions& options, std::span<const BucketLayer> layers);

}  // namespace geofp8
