// GEOFP8_HD marks per-element math shared by the CPU path and the CUDA kernels.
// Under nvcc it expands to __host__ __device__; under a plain C++ compiler to nothing.
#pragma once

#if defined(__CUDACC__)
#define GEOFP8_HD __host__ __device__ __forceinline__
#else
#define GEOFP8_HD inline
#endif
