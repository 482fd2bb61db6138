// NCCL backend of the Communicator (built when GEOFP8_HAVE_NCCL): the unique id travels through
// the same geofp8::Store as Gloo's rendezvous; host spans are staged through device memory, and
// the byte collectives move device spans (a device plane's wire) where they lie.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/exchange/communicator.h"
#include "kernels/exchange/store.h"

namespace geofp8 {

struct NcclOptions {
  // CUDA device of this rank; -1 picks rank % device count.
  int device = -1;
  // Keys are written under "<prefix>/..." so several groups can share one store.
  std::string prefix = "geofp8-nccl";
  // Rendezvous and collective timeout: a collective not finished by then aborts the communicator.
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
  // The engine's stream (a cudaStream_t as an integer: cuda::CudaBackend::stream()) that writes
  // and reads the device spans given to the byte collectives: each waits, on the device, for the
  // work issued on it before the call. 0: none; device spans are then refused.
  uintptr_t stream = 0;
};

// Number of CUDA devices visible (0 when there is no driver or no GPU): tests skip on 0.
int CudaDeviceCount();

// Throws geofp8::Error on a bad argument, a store timeout, or a CUDA/NCCL failure.
std::unique_ptr<Communicator> CreateNcclCommunicator(Store& store, int rank, int size,
                                                     const NcclOptions& options = {});

}  // namespace geofp8
