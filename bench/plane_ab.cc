// bench/plane_ab.sh's program: ExchangeBucketData (fp8_e4m3 block 128, 16 layers of 256 Ki floats,
// 2 ranks as threads over Gloo) timed per call, median over reps; compiled against two trees.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "kernels/exchange/algorithms.h"
#include "kernels/exchange/gloo_communicator.h"
#include "kernels/exchange/store.h"

using namespace geofp8;

int main(int argc, char** argv) {
  const int N = 2;
  const int reps = argc > 1 ? std::atoi(argv[1]) : 30;
  const Algorithm algo = argc > 2 && std::string(argv[2]) == "allgather" ? Algorithm::kAllGather
                                                                         : Algorithm::kTwoPhase;
  const size_t inline_bytes = argc > 3 ? std::atol(argv[3]) : 0;
  const size_t layer = 256 * 1024, L = 16;  // 16 MiB fp32 per rank
  MemoryStore store;
  std::vector<double> med(N);
  std::vector<std::thread> th;
  for (int r = 0; r < N; ++r) {
    th.emplace_back([&, r] {
      GlooOptions go;
      go.prefix = "ab";
      auto comm = CreateGlooCommunicator(store, r, N, go);
      std::vector<std::vector<float>> g(L, std::vector<float>(layer));
      ExchangeWorkspace ws;
      std::vector<double> t;
      for (int k = 0; k < reps + 2; ++k) {
        for (size_t l = 0; l < L; ++l)
          for (size_t i = 0; i < layer; ++i) g[l][i] = float((i * 7 + l + r) % 1000) * 1e-3f - 0.5f;
        std::vector<BucketLayer> bl(L);
        for (size_t l = 0; l < L; ++l) {
          bl[l].layer = l;
          bl[l].policy.format = Format::kFp8E4M3;
          bl[l].policy.scaling = Scaling::kBlock;
          bl[l].policy.block = 128;
          bl[l].in = g[l];
          bl[l].out = g[l];
        }
        AlgorithmOptions ao;
        ao.step = k;
        ao.divisor = 2;
        ao.workspace = &ws;
        ao.inline_bytes = inline_bytes;
        const auto a = std::chrono::steady_clock::now();
        ExchangeBucketData(*comm, algo, ao, bl);
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
        if (k >= 2) t.push_back(s);
      }
      std::sort(t.begin(), t.end());
      med[r] = t[t.size() / 2];
    });
  }
  for (auto& x : th) x.join();
  std::printf("%.6f\n", std::max(med[0], med[1]));
}
