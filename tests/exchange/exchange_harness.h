// Test harness for the exchange engine: runs one Exchanger per rank (threads over Gloo TCP),
// builds deterministic inputs and checks outputs against the reference (reference.h).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/exchange/exchanger.h"
#include "tests/exchange/rank_threads.h"
#include "tests/exchange/reference.h"

namespace geofp8::testing {

using Tensors = std::vector<std::vector<float>>;  // [layer][element]

// A layer policy from its codec fields (the exchange tests' layer tables).
inline LayerPolicy Policy(Format format, Scaling scaling, uint32_t block,
                          Rounding rounding = Rounding::kNearest) {
  LayerPolicy p;
  p.format = format;
  p.scaling = scaling;
  p.block = block;
  p.rounding = rounding;
  return p;
}

// Deterministic gradient values: a hash-driven uniform in [-1, 1) times 2^e, where e varies per
// 64-element run so block scales differ across blocks.
inline float InputValue(int rank, uint32_t layer, size_t i, uint64_t step = 0) {
  uint64_t z = (static_cast<uint64_t>(rank) << 48) ^ (static_cast<uint64_t>(layer) << 32) ^ i ^
               (step * 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 33)) * 0xff51afd7ed558ccdull;
  z = (z ^ (z >> 33)) * 0xc4ceb9fe1a85ec53ull;
  z ^= z >> 33;
  const double u = static_cast<double>(z >> 11) / 9007199254740992.0 * 2.0 - 1.0;
  return static_cast<float>(std::ldexp(u, static_cast<int>((i / 64 + layer) % 8) - 4));
}

inline Tensors MakeInputs(int rank, const std::vector<LayerSpec>& layers, uint64_t step = 0) {
  Tensors t(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    t[l].resize(layers[l].count());
    for (size_t i = 0; i < t[l].size(); ++i) t[l][i] = InputValue(rank, l, i, step);
  }
  return t;
}

struct RankRun {
  std::vector<Tensors> outputs;     // [rank]
  std::vector<StepResult> results;  // [rank]
  std::vector<std::string> errors;  // [rank]
};

// One step on n ranks. `mutate(rank, layers, options, inputs)` may change one rank's view.
// `channels` 1: communicators without a side channel (one pipeline lane).
inline RankRun RunStep(int n, const std::vector<LayerSpec>& layers, const ExchangeOptions& options,
                       uint64_t step = 0,
                       const std::function<void(int, std::vector<LayerSpec>&, ExchangeOptions&,
                                                Tensors&)>& mutate = {},
                       int channels = 2) {
  RankRun run;
  run.outputs.resize(n);
  run.results.resize(n);
  run.errors = RunRanks(
      n,
      [&](Communicator& comm) {
        const int r = comm.rank();
        std::vector<LayerSpec> my_layers = layers;
        ExchangeOptions my_options = options;
        Tensors data = MakeInputs(r, layers, step);
        if (mutate) mutate(r, my_layers, my_options, data);
        Exchanger ex(comm, my_layers, my_options);
        std::vector<std::span<float>> grads;
        for (auto& t : data) grads.emplace_back(t);
        run.results[r] = ex.Exchange(step, grads);
        run.outputs[r] = std::move(data);
      },
      std::chrono::milliseconds(60000), channels);
  return run;
}

inline bool SameBytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

inline size_t FirstBitDifference(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], 4) != 0) return i;
  }
  return a.size();
}

// Checks a finished run: no errors, byte-identical across ranks, equal to the reference
// (bit-exact for the quantized algorithms) and within the format bound of the exact average.
inline void CheckRun(const RankRun& run, const std::vector<LayerSpec>& layers,
                     const ExchangeOptions& options, uint64_t step = 0) {
  const int n = static_cast<int>(run.outputs.size());
  ASSERT_EQ(JoinErrors(run.errors), "");
  for (int r = 1; r < n; ++r) {
    for (size_t l = 0; l < layers.size(); ++l) {
      ASSERT_TRUE(SameBytes(run.outputs[r][l], run.outputs[0][l]))
          << "rank " << r << " layer " << l << " differs from rank 0 at element "
          << FirstBitDifference(run.outputs[r][l], run.outputs[0][l]);
    }
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    const size_t count = layers[l].count();
    std::vector<std::vector<float>> divided(n, std::vector<float>(count));
    std::vector<double> exact(count, 0.0);
    double sum_amax = 0.0;
    for (int r = 0; r < n; ++r) {
      double amax = 0.0;
      for (size_t i = 0; i < count; ++i) {
        const float x = InputValue(r, l, i, step);
        divided[r][i] = x / static_cast<float>(n);
        exact[i] += static_cast<double>(x) / n;
        amax = std::max(amax, std::fabs(static_cast<double>(divided[r][i])));
      }
      sum_amax += amax;
    }
    const LayerPolicy& p = layers[l].policy;
    const auto& out = run.outputs[0][l];
    double rel = 0.0;
    if (options.algorithm == Algorithm::kTwoPhase || options.algorithm == Algorithm::kAllGather) {
      const auto ref = options.algorithm == Algorithm::kTwoPhase
                           ? ReferenceTwoPhase(divided, p, options.seed, step, l)
                           : ReferenceAllGather(divided, p, options.seed, step, l);
      ASSERT_TRUE(SameBytes(out, ref)) << "layer " << l << " differs from the reference at element "
                                       << FirstBitDifference(out, ref);
      rel = FormatRelStep(p.format) * (options.algorithm == Algorithm::kTwoPhase ? 2 : 1);
    } else if (options.algorithm == Algorithm::kFp32) {
      rel = n * std::ldexp(1.0, -23);
    } else {
      rel = (n + 1) * std::ldexp(1.0, -8);
    }
    double out_amax = 0.0;
    for (float v : out) out_amax = std::max(out_amax, std::fabs(static_cast<double>(v)));
    const double bound = rel * (sum_amax + out_amax) + 1e-30;
    for (size_t i = 0; i < count; ++i) {
      ASSERT_LE(std::fabs(out[i] - exact[i]), bound)
          << "layer " << l << " element " << i << ": got " << out[i] << ", exact " << exact[i];
    }
  }
}

}  // namespace geofp8::testing
