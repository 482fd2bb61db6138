// CUDA kernels of the block random Hadamard rotation (hadamard_cuda.h): thin entry points that
// validate, and one kernel in which each thread rotates one block with the GEOFP8_HD functions
// the CPU path and its tests use (hadamard_math.h), so the host tests cover the arithmetic.

#include <cmath>

#include "kernels/common/check.h"
#include "kernels/common/cuda_check.h"
#include "kernels/geometry/hadamard.h"
#include "kernels/geometry/hadamard_cuda.h"
#include "kernels/geometry/hadamard_math.h"

namespace geofp8::cuda {
namespace {

// Thread k < blocks rotates block k in place; thread `blocks` flips the signs of the tail.
template <bool kInverse>
__global__ void RotateBlocks(float* x, size_t n, int b, uint64_t seed, uint64_t first,
                             float scale) {
  const size_t blocks = n / size_t(b);
  const size_t k = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k < blocks) {
    float* p = x + k * size_t(b);
    if (kInverse) {
      hadamard::InverseBlock(p, b, seed, first + k * size_t(b), scale);
    } else {
      hadamard::ForwardBlock(p, b, seed, first + k * size_t(b), scale);
    }
  } else if (k == blocks) {
    hadamard::SignsOnly(x + blocks * size_t(b), int(n - blocks * size_t(b)), seed,
                        first + blocks * size_t(b));
  }
}

template <bool kInverse>
void Launch(float* x, size_t n, int block, uint64_t seed, uint64_t first, cudaStream_t stream) {
  GEOFP8_CHECK(block >= 2 && block <= kMaxHadamardBlock && (block & (block - 1)) == 0,
               "hadamard_block: must be a power of two in [2, ", kMaxHadamardBlock, "] (", block,
               ")");
  GEOFP8_CHECK(first % uint64_t(block) == 0, "hadamard: first element ", first,
               " is not a multiple of the block (", block, ")");
  if (n == 0) return;
  // The host's constant, so both sides scale by the same float.
  const float scale = float(1.0 / std::sqrt(double(block)));
  const size_t threads = n / size_t(block) + 1;
  constexpr int kThreads = 128;
  const unsigned grid = unsigned((threads + kThreads - 1) / kThreads);
  RotateBlocks<kInverse><<<grid, kThreads, 0, stream>>>(x, n, block, seed, first, scale);
  GEOFP8_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void HadamardForwardDevice(float* x, size_t n, int block, uint64_t seed, uint64_t first,
                           cudaStream_t stream) {
  Launch<false>(x, n, block, seed, first, stream);
}

void HadamardInverseDevice(float* x, size_t n, int block, uint64_t seed, uint64_t first,
                           cudaStream_t stream) {
  Launch<true>(x, n, block, seed, first, stream);
}

}  // namespace geofp8::cuda
