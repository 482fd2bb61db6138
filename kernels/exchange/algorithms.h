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
#include "kernels/exchange/data_plane.h"
#include "kernels/exchange/policy.h"
#include "kernels/exchange/trace.h"
#include "kernels/geometry/geometry.h"

namespace geofp8 {

// Buffers that outlive one bucket, so a steady-state exchange allocates nothing: fresh multi-MiB
// allocations come from mmap and cost a page fault per 4 KiB on every step. Not thread-safe; one
// per Exchanger (used on its worker thread).
struct ExchangeWorkspace {
  std::vector<UninitializedVector<uint8_t>> bytes;  // per pipeline group: send, recv, mine, all
  HostPlane host;                                   // the plane of runs that name none
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
  // Where the layers' floats live and what runs the codec on them (data_plane.h). Null: the
  // workspace's HostPlane.
  DataPlane* plane = nullptr;
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
  // Reduce-scatter instead of all-reduce: two_phase's first half over FSDP's dim-0 chunks
  // (BucketLayer::cols; chunking.h RowChunkOf). Each rank transforms, divides and encodes (with
  // its error feedback, as two_phase does) chunk j of every layer for rank j; one all-to-all;
  // the owner decodes the N contributions, sums them in rank order in fp32 into `out` (its rows
  // only) and inverts the geometry there: diag's inverse is row-local, lowrank's needs U^T D
  // summed over every owner, one fp32 all-reduce of k x n per such layer after the pipeline
  // (geometry.h InvertGeometryRows). No requantization, no all-gather. Any algorithm but native:
  // the compressed ones run this, fp32 and bf16 the same with each layer sent in that format (an
  // exact sum in rank order). The block Hadamard rotation mixes rows across shards: refused.
  // Host planes only.
  bool reduce_scatter = false;
};

// Throws geofp8::Error, naming both, unless `comm` can move `plane`'s wire: a device wire
// (DataPlane::device_wire) needs a communicator that TakesDeviceSpans.
void CheckWire(const Communicator& comm, const DataPlane& plane);

// Runs `algorithm` over the bucket's layers. Every rank ends with byte-identical outputs: the sum
// over ranks of the inputs, through the algorithm's quantization (reduce_scatter: each rank its
// own rows of that sum). Each rank notes a NaN or inf in
// a layer's input as it reads it and sets that layer's flag_bit; the result is the OR of those
// bits over ranks, the same on every rank (two_phase and allgather send the flags in the last
// group's first collective, the baselines with one small all-gather). Outputs of layers whose bit
// is set hold no meaningful values: the caller skips them, as mixed-precision loss scaling does
// after its all-reduce. Throws geofp8::Error for kNative (GPU only) or a collective failure.
uint64_t ExchangeBucketData(Communicator& comm, Algorithm algorithm,
                            const AlgorithmOptions& options, std::span<const BucketLayer> layers);

}  // namespace geofp8
