// geofp8-bench model: one rank's compute per training step (forward+backward, clip, AdamW) on a
// preset, in GFLOP/s against a same-run sgemm of the model's own largest linear layer.
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench/registry.h"
#include "kernels/model/model.h"
#include "kernels/model/ops.h"
#include "kernels/model/optimizer.h"

namespace geofp8 {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

template <typename Fn>
double MedianSeconds(int reps, Fn&& fn) {
  fn();  // warm-up: first-touch of buffers, BLAS workspace
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  return Median(t);
}

int RunModelBench(int argc, char** argv) {
  const std::string prog = "geofp8-bench model";
  CLI::App app{"geofp8-bench model: one rank's step compute against same-run sgemm", "model"};
  std::string preset = "llama-small";
  int batch = 2, seq = 0, reps = 21, threads = 1;
  app.add_option("--preset", preset, "model preset")->capture_default_str();
  app.add_option("--batch", batch, "sequences per step")->capture_default_str();
  app.add_option("--seq", seq, "tokens per sequence; 0: the preset's context")
      ->capture_default_str();
  app.add_option("--reps", reps, "timed repetitions (median)")->capture_default_str();
  app.add_option("--blas-threads", threads, "OpenBLAS threads")->capture_default_str();
  if (int rc = bench::ParseFlags(app, argc, argv); rc >= 0) return rc;
  auto config = model::PresetConfig(preset);
  if (!config) {
    bench::UsageError(prog, "preset",
                      "unknown preset, accepted: " + std::string(model::AcceptedPresets()), preset);
  }
  if (seq == 0) seq = config->seq;
  if (batch < 1) bench::UsageError(prog, "batch", "must be >= 1", std::to_string(batch));
  if (seq < 1 || seq > config->seq) {
    bench::UsageError(prog, "seq", "must be in [1, " + std::to_string(config->seq) + "]",
                      std::to_string(seq));
  }
  if (reps < 1) bench::UsageError(prog, "reps", "must be >= 1", std::to_string(reps));
  if (threads < 1) bench::UsageError(prog, "blas-threads", "must be >= 1", std::to_string(threads));
  model::SetBlasThreads(threads);

  model::Model<float> m(*config);
  m.Init(1);
  std::mt19937 rng(7);
  std::vector<int32_t> tokens(size_t(batch) * (seq + 1));
  for (auto& t : tokens) t = int32_t(rng() % uint32_t(config->vocab));
  model::OptimizerOptions oo;
  model::AdamW adam(oo, m.params());

  const double fwd_bwd = MedianSeconds(reps, [&] { m.ForwardBackward(tokens, batch, seq); });
  const double fwd = MedianSeconds(reps, [&] { m.Loss(tokens, batch, seq); });
  int64_t step = 0;
  const double opt = MedianSeconds(reps, [&] {
    model::ClipGradNorm(m.grads(), oo.clip_norm);
    adam.Step(m.weights(), m.grads(), step++);
  });

  // FLOP of one forward+backward as issued: every weight product three times (y, dx, dW), and six
  // seq x seq x head_dim products per head for attention (2 forward, 4 backward), causal half
  // included because the GEMMs compute it.
  const double rows = double(batch) * seq, d = config->dim, f = config->ffn, v = config->vocab;
  const double matrix_params = config->layers * (4 * d * d + 3 * d * f) + v * d;
  const double attention = config->layers * 2.0 * batch * seq * seq * d;  // one product, all heads
  const double flop = 6 * rows * matrix_params + 6 * attention;

  // Reference: the model's largest linear layer (rows x d times d x ffn), same threads.
  const int M = int(rows), K = int(d), N = int(std::max(f, v));
  std::vector<float> A(size_t(M) * K, 0.5f), B(size_t(K) * N, 0.25f), C(size_t(M) * N);
  const double gemm = MedianSeconds(reps, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.f, A.data(), K, B.data(), K,
                0.f, C.data(), N);
  });
  const double gemm_gflops = 2.0 * M * N * K / gemm / 1e9, model_gflops = flop / fwd_bwd / 1e9;

  std::printf(
      "model bench: %s (%lld params), batch %d x seq %d = %d tokens, %d BLAS thread(s), "
      "OpenBLAS core %s, median of %d\n",
      preset.c_str(), static_cast<long long>(model::ParameterCount(*config)), batch, seq, M,
      threads, model::BlasCoreName().c_str(), reps);
  std::printf("%-26s %10s %10s\n", "phase", "ms", "GFLOP/s");
  std::printf("%-26s %10.3f %10s\n", "forward (loss only)", fwd * 1e3, "");
  std::printf("%-26s %10.3f %10.2f\n", "forward+backward", fwd_bwd * 1e3, model_gflops);
  std::printf("%-26s %10.3f %10s\n", "clip + AdamW", opt * 1e3, "");
  std::printf(
      "%-26s %10.3f %10.2f\n",
      ("sgemm " + std::to_string(M) + "x" + std::to_string(N) + "x" + std::to_string(K)).c_str(),
      gemm * 1e3, gemm_gflops);
  std::printf("forward+backward at %.2f of the sgemm's GFLOP/s; %.2f GFLOP per step\n",
              model_gflops / gemm_gflops, flop / 1e9);
  return 0;
}

}  // namespace

GEOFP8_REGISTER_BENCH("model", "trainer model step (fwd+bwd, AdamW) GFLOP/s vs same-run sgemm",
                      RunModelBench);

}  // namespace geofp8
