// GPU tests of the geometry's CUDA path against the CPU reference (same signature, same math),
// over odd and round shapes. Labeled `gpu`; each test skips when no CUDA device is present.
#include "kernels/geometry/geometry_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/geometry/geometry.h"
#include "kernels/geometry/synthetic.h"

namespace geofp8 {
namespace {

double RelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

class GeometryCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::HaveDevice()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cublasCreate(&handle_), CUBLAS_STATUS_SUCCESS);
  }
  void TearDown() override {
    if (handle_) cublasDestroy(handle_);
  }
  // Runs T or T^-1 on the device and returns the result.
  std::vector<float> OnDevice(const Geometry& g, const std::vector<float>& x, bool inverse) {
    float* d = nullptr;
    const size_t bytes = std::max<size_t>(1, x.size()) * sizeof(float);
    EXPECT_EQ(cudaMalloc(&d, bytes), cudaSuccess);
    if (!x.empty()) cudaMemcpy(d, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice);
    cuda::DeviceGeometry dg(g);
    if (inverse) {
      dg.Invert(d, nullptr, handle_);
    } else {
      dg.Apply(d, nullptr, handle_);
    }
    std::vector<float> out(x.size());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (!x.empty()) cudaMemcpy(out.data(), d, x.size() * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(d);
    return out;
  }
  cublasHandle_t handle_ = nullptr;
};

TEST_F(GeometryCudaTest, MatchesCpuReferenceOverShapesAndModes) {
  struct Shape { int64_t m, n; };
  for (Shape s : {Shape{1, 37}, Shape{37, 1}, Shape{5, 160}, Shape{217, 256}, Shape{512, 384}}) {
    const std::vector<float> g =
        MakeSyntheticGradient({SyntheticFamily::kSpectral, s.m, s.n, 1.5, 3, 0.0});
    for (GeometryMode mode : {GeometryMode::kNone, GeometryMode::kDiag, GeometryMode::kLowRank}) {
      GeometryOptions o;
      o.mode = mode;
      o.rank = 16;
      const Geometry geo = EstimateGeometry(g, s.m, s.n, o, nullptr).geometry;
      std::vector<float> cpu = g;
      ApplyGeometry(geo, cpu);
      const std::vector<float> gpu = OnDevice(geo, g, false);
      EXPECT_LT(RelDiff(gpu, cpu), 1e-5) << s.m << "x" << s.n << " " << GeometryModeName(mode);
      std::vector<float> cpu_inv = cpu;
      InvertGeometry(geo, cpu_inv);
      const std::vector<float> gpu_inv = OnDevice(geo, cpu, true);
      EXPECT_LT(RelDiff(gpu_inv, cpu_inv), 1e-4) << s.m << "x" << s.n << " " << GeometryModeName(mode);
      EXPECT_LT(RelDiff(gpu_inv, g), 1e-3) << "round trip on the device";
    }
  }
}

}  // namespace
}  // namespace geofp8
