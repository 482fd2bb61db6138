// NCCL backend of the Communicator (built when GEOFP8_HAVE_NCCL): the unique id travels through
// the same geofp8::Store as Gloo's rendezvous; host spans are staged through device memory.
#pragma once

#include <chrono>
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
};

// Number of CUDA devices visible (0 when there is no driver or no GPU): tests skip on 0.
int CudaDeviceCount();

// Throws geofp8::Error on a bad argument, a store timeout, or a CUDA/NCCL failure.
std::unique_ptr<Communicator> CreateNcclCommunicator(Store& store, int rank, int size,
                                                     const NcclOptions& options = {});

}  // namespace geofp8
