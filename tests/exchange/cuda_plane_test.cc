// The exchange engine on device memory (label `gpu`; skips without a device): a StagedPlane over
// the CUDA backend (kernels/exchange/cuda_backend.h) against the host plane on the same inputs,
// ranks as threads over Gloo on one GPU, each with a stream of its own. The codec and the
// rotation are bit-identical to the host's, so every algorithm's output must be too; the lowrank
// geometry's products run on cuBLAS, so there the device outputs must agree across ranks bit for
// bit and with the host's within the format's step. With NCCL, one rank (one GPU runs one NCCL
// rank) also runs with its wire in device memory.
#include <gtest/gtest.h>

#include <cmath>

#include "geofp8/config.h"
#include "kernels/exchange/cuda_backend.h"
#include "kernels/geometry/geometry_cuda.h"
#include "tests/exchange/plane_harness.h"
#if GEOFP8_HAVE_NCCL
#include "kernels/exchange/nccl_communicator.h"
#include "kernels/exchange/store.h"
#endif

namespace geofp8 {
namespace {

using namespace geofp8::testing;

BackendFactory OnDevice0() {
  return [](int) { return std::make_unique<cuda::CudaBackend>(0); };
}

TEST(CudaPlane, EveryAlgorithmBitIdenticalToTheHost) {
  if (!cuda::HaveDevice()) GTEST_SKIP() << "no CUDA device";
  const auto layers = MixedLayers();
  for (Algorithm a :
       {Algorithm::kTwoPhase, Algorithm::kAllGather, Algorithm::kFp32, Algorithm::kBf16}) {
    for (int n : {2, 4}) {
      ExchangeOptions options;
      options.algorithm = a;
      options.seed = 11;
      options.segment_bytes = 16 << 10;
      options.bucket_cap_bytes = 24 << 10;
      const Runs runs = RunBothPlanes(OnDevice0(), {}, n, layers, options, 2);
      ExpectSame(runs, layers, std::string(AlgorithmName(a)) + " " + std::to_string(n) + " ranks");
    }
  }
}

TEST(CudaPlane, NonFiniteSkipsTheSameBuckets) {
  if (!cuda::HaveDevice()) GTEST_SKIP() << "no CUDA device";
  const auto layers = MixedLayers();
  ExchangeOptions options;
  options.bucket_cap_bytes = 24 << 10;
  const Runs runs =
      RunBothPlanes(OnDevice0(), {}, 3, layers, options, 1, {}, [](int r, uint64_t, Tensors& t) {
        if (r == 2) t[2][7] = std::nanf("");
      });
  ExpectSame(runs, layers, "two_phase with a NaN");
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(runs.results[1][r][0].skipped) << "rank " << r;
}

TEST(CudaPlane, LowRankGeometryAgreesAcrossRanksAndWithTheHost) {
  if (!cuda::HaveDevice()) GTEST_SKIP() << "no CUDA device";
  LayerPolicy lowrank;
  lowrank.geometry = GeometryMode::kLowRank;
  lowrank.rank = 8;
  const std::vector<LayerSpec> layers = {{"w", 256, 192, lowrank}};
  ExchangeOptions options;
  options.algorithm = Algorithm::kTwoPhase;
  options.estimator = GeometryEstimator::kFactorEma;
  const int steps = 4;
  const Runs runs = RunBothPlanes(OnDevice0(), {}, 4, layers, options, steps, {{0, 1, 0}});
  for (int s = 0; s < steps; ++s) {
    for (int r = 1; r < 4; ++r) {
      ASSERT_TRUE(SameBytes(runs.outputs[1][r][s][0], runs.outputs[1][0][s][0]))
          << "step " << s << ": rank " << r << " differs from rank 0 on the device";
    }
    // Against the host: the same quantization of a transform that differs in round-off, so
    // within two format steps (two_phase quantizes twice) of the output's largest value.
    const auto& d = runs.outputs[1][0][s][0];
    const auto& h = runs.outputs[0][0][s][0];
    double amax = 0, worst = 0;
    for (size_t i = 0; i < h.size(); ++i) {
      amax = std::max(amax, std::fabs(double(h[i])));
      worst = std::max(worst, std::fabs(double(d[i]) - double(h[i])));
    }
    EXPECT_LE(worst, 2 * 0.0625 * amax) << "step " << s;
  }
}

// bf16 and fp16 gradients read into the device's division and encode and written back rounded
// (grad_span.h's per-element conversions in the kernels), with a rotation and a diag geometry
// (bit-identical to the host's): the host plane's bytes.
TEST(CudaPlane, Bf16AndFp16GradientsBitIdenticalToTheHost) {
  if (!cuda::HaveDevice()) GTEST_SKIP() << "no CUDA device";
  std::vector<LayerSpec> layers = MixedLayers();
  LayerPolicy diag = Policy(Format::kNvfp4, Scaling::kBlock, 16);
  diag.geometry = GeometryMode::kDiag;
  layers.push_back({"diag.w", 32, 64, diag});
  for (Algorithm a :
       {Algorithm::kTwoPhase, Algorithm::kAllGather, Algorithm::kFp32, Algorithm::kBf16}) {
    for (GradDtype d : {GradDtype::kBf16, GradDtype::kFp16}) {
      ExchangeOptions options;
      options.algorithm = a;
      options.seed = 11;
      options.segment_bytes = 16 << 10;
      DtypeRun run;
      run.dtypes.assign(layers.size(), d);
      run.schedule.assign(layers.size(), RefreshSchedule{0, 2, 0});
      const ByteRuns runs = RunDtypes(OnDevice0(), {}, 3, layers, options, 3, run);
      ExpectSameBytes(runs, layers, std::string(AlgorithmName(a)) + " " + GradDtypeName(d));
    }
  }
}

// Reduce-scatter on the device: rows that do not divide by 3 ranks (one rank owns none of
// tiny.w), a diag geometry's row-local inverse on the device, fp32, bf16 and fp16: the host
// plane's bytes. (A lowrank geometry's inverse runs on cuBLAS: its round-off is not the host's.)
TEST(CudaPlane, ReduceScatterBitIdenticalToTheHost) {
  if (!cuda::HaveDevice()) GTEST_SKIP() << "no CUDA device";
  LayerPolicy diag = Policy(Format::kNvfp4, Scaling::kBlock, 16, Rounding::kStochastic);
  diag.geometry = GeometryMode::kDiag;
  const std::vector<LayerSpec> layers = {
      {"diag.w", 22, 64, diag},
      {"plain.w", 33, 40, Policy(Format::kFp8E5M2, Scaling::kTensor, 0)},
      {"tiny.w", 2, 30, Policy(Format::kFp8E4M3, Scaling::kBlock, 128)},
      {"bias", 5, 1, Policy(Format::kFp8E4M3, Scaling::kBlock, 128)},
  };
  for (Algorithm a : {Algorithm::kTwoPhase, Algorithm::kFp32, Algorithm::kBf16}) {
    for (GradDtype d : {GradDtype::kFp32, GradDtype::kBf16, GradDtype::kFp16}) {
      ExchangeOptions options;
      options.algorithm = a;
      options.seed = 5;
      options.segment_bytes = 8 << 10;
      options.reduce_scatter_segment_bytes = 8 << 10;
      DtypeRun run;
      run.dtypes.assign(layers.size(), d);
      run.reduce_scatter = true;
      run.schedule.assign(layers.size(), RefreshSchedule{0, 2, 0});
      const ByteRuns runs = RunDtypes(OnDevice0(), {}, 3, layers, options, 4, run);
      ExpectSameBytes(runs, layers,
                      std::string(AlgorithmName(a)) + " reduce-scatter " + GradDtypeName(d));
    }
  }
}

#if GEOFP8_HAVE_NCCL
// World size 1 through NCCL on the device wire (WireMemory::kDevice): NCCL reads and writes the
// encoded bytes in device memory, ordered with the backend's stream, and each step's run waits
// for the device once, at its end, to read the flags.
TEST(CudaPlane, DeviceWireThroughNcclBitIdenticalToTheHost) {
  if (!cuda::HaveDevice()) GTEST_SKIP() << "no CUDA device";
  const auto layers = MixedLayers();
  const DeviceComm nccl = [](Communicator&, DeviceBackend& b) {
    MemoryStore store;  // one rank: only its own unique id goes through it
    NcclOptions o;
    o.device = 0;
    o.stream = static_cast<cuda::CudaBackend&>(b).stream();
    return CreateNcclCommunicator(store, 0, 1, o);
  };
  for (Algorithm a : {Algorithm::kTwoPhase, Algorithm::kAllGather}) {
    ExchangeOptions options;
    options.algorithm = a;
    options.seed = 11;
    options.segment_bytes = 16 << 10;
    const Runs runs = RunBothPlanes(OnDevice0(), {}, 1, layers, options, 2, {}, {}, nccl);
    ExpectSame(runs, layers, std::string(AlgorithmName(a)) + " on the device wire");
  }
}
#endif

}  // namespace
}  // namespace geofp8
