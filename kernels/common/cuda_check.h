// GEOFP8_CUDA_CHECK: a CUDA runtime call that fails throws geofp8::Error naming the call and
// CUDA's message. For .cu and host .cc files that include <cuda_runtime.h> themselves.
#pragma once

#include "kernels/common/check.h"

#define GEOFP8_CUDA_CHECK(expr)                                                    \
  do {                                                                             \
    const cudaError_t geofp8_err_ = (expr);                                        \
    GEOFP8_CHECK(geofp8_err_ == cudaSuccess,                                       \
                 "CUDA call " #expr " failed: ", cudaGetErrorString(geofp8_err_)); \
  } while (0)
