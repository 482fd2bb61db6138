// The CUDA/NCCL path of geofp8.torch: averages a DDP bucket that lives in device memory over the
// ranks with the CUDA codec kernels (kernels/codec/codec_cuda.h) and an NCCL communicator
// bootstrapped from torch's c10d store, on the caller's CUDA stream (torch's current stream, passed
// as an integer handle so this module needs no libtorch headers).
//
// Compiled when the build has CUDA and NCCL (GEOFP8_HAVE_CUDA && GEOFP8_HAVE_NCCL); this header has
// no CUDA types, so the pybind11 source includes it either way.
//
// Per bucket, the `allgather` algorithm of kernels/exchange/algorithms.cc, with the same stream
// keys: every layer is divided by N (IEEE division), encoded once (phase 1, chunk 0), the
// encoded bucket is all-gathered, and every rank decode-accumulates the N parts in rank order, so
// every rank ends with the same bits. `fp32` runs one NCCL all-reduce of the divided bucket. A
// small max-reduce in the same NCCL group carries the non-finite flag and the fingerprint (step,
// policy version, bucket layout): a mismatch is an error, a non-finite gradient on any rank skips
// the bucket on every rank (filled with NaN). Geometry is not run on this path (SetPolicy rejects
// it).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/exchange/policy.h"
#include "kernels/exchange/store.h"

namespace geofp8::python {

struct CudaLayer {
  uint32_t id = 0;     // the model's layer index: keys the stochastic-rounding stream
  int64_t offset = 0;  // floats from the bucket's start
  int64_t count = 0;
  LayerPolicy policy;
};

struct CudaResult {
  bool skipped = false;
  uint64_t bytes_sent = 0;  // this rank's payload on the wire, the control words included
  double seconds = 0.0;
};

class CudaExchange {
 public:
  // Collective: rank 0 creates the ncclUniqueId and sets it in `store` under "nccl_unique_id";
  // the others get it (waiting up to `timeout`). device < 0: rank % device count.
  CudaExchange(Store& store, int rank, int size, int device, std::chrono::milliseconds timeout);
  ~CudaExchange();
  CudaExchange(const CudaExchange&) = delete;
  CudaExchange& operator=(const CudaExchange&) = delete;

  int device() const;

  // Averages layers of the float32 device buffer bucket[0..numel) in place on `stream` (a
  // cudaStream_t as an integer; 0: the legacy default stream). Returns when the result is on the
  // device (the stream is synchronized). Throws geofp8::Error naming the field on bad input, and
  // on an NCCL/CUDA failure or timeout (the communicator is then broken).
  CudaResult Exchange(uint64_t step, uint64_t seed, uint64_t fingerprint, Algorithm algorithm,
                      uintptr_t bucket, int64_t numel, const std::vector<CudaLayer>& layers,
                      uintptr_t stream);

  // The minimum of `value` over the ranks: one ncclAllReduce (ncclMin) of one word on `stream`,
  // waited for against the timeout. The per-step policy agreement of a coordinator-managed job
  // (geofp8.torch's agree_min), as the Gloo engine's one-word max-reduce of ~value.
  uint64_t MinOverRanks(uint64_t value, uintptr_t stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace geofp8::python
