// The CUDA Hadamard rotation against the CPU one, bit for bit (both run the GEOFP8_HD block
// functions), over odd and round sizes and every codec block. Labeled `gpu`; skips without a
// CUDA device.

#include "kernels/geometry/hadamard_cuda.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/geometry/geometry_cuda.h"
#include "kernels/geometry/hadamard.h"

namespace geofp8 {
namespace {

TEST(HadamardCuda, MatchesTheHostBitForBit) {
  if (!cuda::HaveDevice()) GTEST_SKIP() << "no CUDA device";
  for (int b : {2, 16, 32, 128, 4096}) {
    for (size_t n : {size_t(0), size_t(1), size_t(5 * 160), size_t(217 * 256), size_t(b) * 3 + 5}) {
      std::vector<float> x(n);
      for (size_t i = 0; i < n; ++i) x[i] = std::sin(0.37 * double(i)) * (i % 97 == 0 ? 50 : 1);
      for (bool inverse : {false, true}) {
        std::vector<float> host = x, dev(n);
        const uint64_t first = uint64_t(b) * 7;
        if (inverse) {
          HadamardInverse(host, b, 31, first);
        } else {
          HadamardForward(host, b, 31, first);
        }
        float* d = nullptr;
        ASSERT_EQ(cudaMalloc(&d, std::max<size_t>(n, 1) * sizeof(float)), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(d, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
        if (inverse) {
          cuda::HadamardInverseDevice(d, n, b, 31, first, nullptr);
        } else {
          cuda::HadamardForwardDevice(d, n, b, 31, first, nullptr);
        }
        ASSERT_EQ(cudaMemcpy(dev.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        cudaFree(d);
        EXPECT_EQ(std::memcmp(host.data(), dev.data(), n * sizeof(float)), 0)
            << "block " << b << " n " << n << (inverse ? " inverse" : " forward");
      }
    }
  }
}

}  // namespace
}  // namespace geofp8
