// CUDA path of the block random Hadamard rotation: the same map as HadamardForward and
// HadamardInverse (hadamard.h) on a device buffer, through the same GEOFP8_HD block functions.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace geofp8::cuda {

// In place on x[0..n) (device memory), elements [first, first + n) of a tensor; `first` a
// multiple of `block`, `block` a power of two in [2, 4096]. Bit-identical to the host functions.
// Throws geofp8::Error on bad arguments or a failed launch.
void HadamardForwardDevice(float* x, size_t n, int block, uint64_t seed, uint64_t first,
                           cudaStream_t stream);
void HadamardInverseDevice(float* x, size_t n, int block, uint64_t seed, uint64_t first,
                           cudaStream_t stream);

}  // namespace geofp8::cuda
