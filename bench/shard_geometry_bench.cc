// geofp8-bench shard_geometry: the lowrank geometry under FSDP's dim-0 sharding (reduce-scatter
// mode) against the same geometry on the DDP path (all-reduce), on the same per-rank gradients:
// each path's relative exchange error with the geometry over its own without (relF / Euclidean),
// and the bytes the sharded inverse adds (the k x n all-reduce of U^T D) over the layer's own.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/dump.h"
#include "bench/ranks.h"
#include "bench/registry.h"
#include "kernels/exchange/algorithms.h"
#include "kernels/exchange/chunking.h"
#include "kernels/exchange/gloo_communicator.h"
#include "kernels/exchange/store.h"
#include "kernels/geometry/geometry.h"
#include "kernels/geometry/synthetic.h"

namespace geofp8 {
namespace {

constexpr const char* kProg = "geofp8-bench shard_geometry";

// One case: every rank's gradient of one m x n layer, and the geometry fitted on their average
// (as the refresh fits it on the averaged gradient the exchange returns).
struct Case {
  std::string name;
  int64_t m = 0, n = 0;
  std::vector<std::vector<float>> per_rank;
  std::vector<double> avg;  // the exact average, fp64
};

// The arms, each with and without the geometry: reduce-scatter (FSDP2's path), and the two
// all-reduce algorithms of the DDP path (auto picks allgather at 2 ranks, two_phase above).
enum Arm { kReduceScatter = 0, kAllGather = 1, kTwoPhase = 2, kArms = 3 };

struct Sums {
  double err2[kArms][2] = {}, ref2 = 0;  // [arm][geometry], over this rank's rows
  uint64_t bytes[kArms][2] = {};         // this rank's bytes sent
};

// One exchange of `c` on this rank; adds the squared error of this rank's rows to `s`.
void RunArm(Communicator& comm, const Case& c, const LayerPolicy& policy, const Geometry* geometry,
            Arm arm, Sums& s) {
  const int n = comm.size(), r = comm.rank();
  const size_t count = static_cast<size_t>(c.m * c.n);
  const ChunkRange mine = RowChunkOf(count, c.n, n, r);
  std::vector<float> in = c.per_rank[static_cast<size_t>(r)];
  std::vector<float> out(arm == kReduceScatter ? mine.size() : count);
  BucketLayer l;
  l.layer = 0;
  l.policy = policy;
  l.in = in;
  l.out = out;
  l.cols = c.n;
  l.geometry = geometry && !geometry->is_identity() ? geometry : nullptr;
  AlgorithmOptions ao;
  ao.seed = 7;
  ao.divisor = static_cast<float>(n);
  ao.reduce_scatter = arm == kReduceScatter;
  const uint64_t before = comm.stats().bytes_sent;
  const Algorithm alg = arm == kAllGather ? Algorithm::kAllGather : Algorithm::kTwoPhase;
  if (ExchangeBucketData(comm, alg, ao, std::span(&l, 1)) != 0) {
    GEOFP8_FAIL(c.name, ": a non-finite value in the exchange");
  }
  const int g = geometry ? 1 : 0;
  s.bytes[arm][g] += comm.stats().bytes_sent - before;
  const size_t at = arm == kReduceScatter ? 0 : mine.begin;
  for (size_t k = 0; k < mine.size(); ++k) {
    const double d = double(out[at + k]) - c.avg[mine.begin + k];
    s.err2[arm][g] += d * d;
  }
}

struct Row {
  std::string name, format;
  int64_t m = 0, n = 0;
  double ratio[kArms] = {};    // relF with the geometry / relF without, per arm
  double rel_geo[kArms] = {};  // relF with the geometry
  double extra_bytes = 0;      // reduce-scatter: (bytes with - bytes without) / bytes without
};

int RunShardGeometryBench(int argc, char** argv) {
  CLI::App app{
      "geofp8-bench shard_geometry: lowrank geometry under reduce-scatter vs the all-reduce path",
      "shard_geometry"};
  int ranks = 4, k = 8, seeds = 3;
  double noise = 1.0, decay = 1.0;
  std::vector<std::string> shapes = {"1536x1536", "4096x1536", "1536x4096"};
  std::vector<std::string> formats = {"fp8_e4m3", "nvfp4"};
  std::string grads;
  app.add_option("--ranks", ranks, "N: data-parallel ranks (threads over loopback Gloo)")
      ->capture_default_str()
      ->check(CLI::Range(2, 64));
  app.add_option("--rank", k, "k of the lowrank geometry")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app.add_option("--seeds", seeds, "synthetic cases per shape")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  app.add_option("--noise", noise,
                 "synthetic: each rank's own part, relative to the shared one (||E_r|| / ||S||)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--decay", decay, "synthetic: spectrum i^-p of both parts")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 8.0));
  app.add_option("--shapes", shapes, "synthetic layer shapes MxN (rows are FSDP's dim 0)")
      ->capture_default_str();
  app.add_option("--formats", formats, "codec formats")->capture_default_str();
  app.add_option("--grads", grads,
                 "a geofp8-train --dump-grads step folder with every rank's gradient: its "
                 "matrices instead of the synthetic cases (--ranks is then the dump's)");
  if (int rc = bench::ParseFlags(app, argc, argv); rc >= 0) return rc;

  std::vector<LayerPolicy> policies;
  for (const auto& name : formats) {
    const auto f = ParseFormat(name);
    if (!f) bench::UsageError(kProg, "--formats", "unknown format", name);
    LayerPolicy p;
    p.format = *f;
    policies.push_back(p);
  }
  std::vector<Case> cases;
  if (!grads.empty()) {
    for (const auto& d : bench::ReadDump(kProg, grads, "--grads")) {
      if (d.rows < 2 || d.cols < 2) continue;  // 1-D: no geometry
      if (d.per_rank.size() < 2) {
        bench::UsageError(kProg, "--grads",
                          "layer " + d.name + " has no per-rank gradients (dump at >= 2 ranks)",
                          grads);
      }
      Case c;
      c.name = d.name;
      c.m = d.rows;
      c.n = d.cols;
      for (const auto& f : d.per_rank) {
        c.per_rank.push_back(bench::ReadMatrix(kProg, grads, d.name, f, d.rows, d.cols, "--grads"));
      }
      cases.push_back(std::move(c));
    }
    ranks = static_cast<int>(cases.empty() ? 0 : cases.front().per_rank.size());
    if (cases.empty()) bench::UsageError(kProg, "--grads", "no 2-D layer in the dump", grads);
  } else {
    for (const auto& shape : shapes) {
      long long m = 0, n = 0;
      char tail = 0;
      if (std::sscanf(shape.c_str(), "%lldx%lld%c", &m, &n, &tail) != 2 || m < 2 || n < 2 ||
          m > 16384 || n > 16384) {
        bench::UsageError(kProg, "--shapes", "expected MxN with 2 <= M, N <= 16384", shape);
      }
      for (int s = 1; s <= seeds; ++s) {
        // A shared anisotropic part (what every rank's batch agrees on) plus each rank's own,
        // with singular bases of its own: Kronecker-structured, as a layer's gradient is.
        Case c;
        c.name = shape + "/seed" + std::to_string(s);
        c.m = m;
        c.n = n;
        SyntheticSpec spec{SyntheticFamily::kKronecker, m, n, decay, uint64_t(s), 0.0};
        const std::vector<float> shared = MakeSyntheticGradient(spec);
        for (int r = 0; r < ranks; ++r) {
          spec.seed = 1000 * uint64_t(s) + uint64_t(r) + 1;
          std::vector<float> g = MakeSyntheticGradient(spec);
          for (size_t i = 0; i < g.size(); ++i) {
            g[i] = shared[i] + static_cast<float>(noise) * g[i];
          }
          c.per_rank.push_back(std::move(g));
        }
        cases.push_back(std::move(c));
      }
    }
  }
  std::vector<Geometry> geometry;
  for (Case& c : cases) {
    c.avg.assign(static_cast<size_t>(c.m * c.n), 0.0);
    for (const auto& g : c.per_rank) {
      for (size_t i = 0; i < g.size(); ++i) c.avg[i] += g[i];
    }
    for (double& v : c.avg) v /= double(c.per_rank.size());
    GeometryOptions o;
    o.rank = k;
    const std::vector<float> avg(c.avg.begin(), c.avg.end());
    geometry.push_back(EstimateGeometry(avg, c.m, c.n, o, nullptr).geometry);
  }

  if (grads.empty()) {
    std::printf(
        "%s: %d ranks, lowrank k=%d fitted on the exact average; synthetic kron cases, "
        "decay %.2f, each rank's own part %.2f of the shared one\n",
        kProg, ranks, k, decay, noise);
  } else {
    std::printf("%s: %d ranks, lowrank k=%d fitted on the exact average; the gradients of %s\n",
                kProg, ranks, k, grads.c_str());
  }
  GlooOptions go;
  const auto run = [&](Communicator& comm) {
    std::vector<Row> rows;
    for (const LayerPolicy& p : policies) {
      for (size_t i = 0; i < cases.size(); ++i) {
        Sums s;
        for (int arm = 0; arm < kArms; ++arm) {
          RunArm(comm, cases[i], p, nullptr, Arm(arm), s);
          RunArm(comm, cases[i], p, &geometry[i], Arm(arm), s);
        }
        // Every rank's rows: the errors summed over ranks in one small all-reduce.
        const ChunkRange mine =
            RowChunkOf(cases[i].avg.size(), cases[i].n, comm.size(), comm.rank());
        for (size_t q = 0; q < mine.size(); ++q) {
          s.ref2 += cases[i].avg[mine.begin + q] * cases[i].avg[mine.begin + q];
        }
        std::vector<float> sums = {float(s.ref2)};
        for (int arm = 0; arm < kArms; ++arm) {
          sums.push_back(float(s.err2[arm][0]));
          sums.push_back(float(s.err2[arm][1]));
        }
        comm.AllReduceSum(sums);
        Row row;
        row.name = cases[i].name;
        row.format = std::string(FormatName(p.format));
        row.m = cases[i].m;
        row.n = cases[i].n;
        for (int arm = 0; arm < kArms; ++arm) {
          const double none = std::sqrt(double(sums[1 + 2 * arm]) / double(sums[0]));
          const double lr = std::sqrt(double(sums[2 + 2 * arm]) / double(sums[0]));
          row.rel_geo[arm] = lr;
          row.ratio[arm] = lr / none;
        }
        row.extra_bytes =
            double(s.bytes[kReduceScatter][1]) / double(s.bytes[kReduceScatter][0]) - 1.0;
        rows.push_back(row);
      }
    }
    return rows;
  };
  const auto print = [&](const std::vector<Row>& rows, bool) {
    // relF: the geometry's relative error per path; ratio: over the same path without it.
    std::printf("%-28s %-9s %8s %8s %8s %8s %8s %8s %8s %8s %8s\n", "case", "format", "relF rs",
                "relF ag", "relF 2ph", "ratio rs", "ratio ag", "ratio 2ph", "rs-ag", "rs-2ph",
                "extra B");
    for (const auto& r : rows) {
      std::printf("%-28s %-9s %8.5f %8.5f %8.5f %8.4f %8.4f %8.4f %+8.4f %+8.4f %7.2f%%\n",
                  r.name.c_str(), r.format.c_str(), r.rel_geo[kReduceScatter],
                  r.rel_geo[kAllGather], r.rel_geo[kTwoPhase], r.ratio[kReduceScatter],
                  r.ratio[kAllGather], r.ratio[kTwoPhase],
                  r.ratio[kReduceScatter] - r.ratio[kAllGather],
                  r.ratio[kReduceScatter] - r.ratio[kTwoPhase], 100.0 * r.extra_bytes);
    }
  };
  return bench::RunRanks<Row>(kProg, ranks, -1, "", go, run, print);
}

}  // namespace
}  // namespace geofp8

namespace {
int ShardGeometryBenchMain(int argc, char** argv) {
  return geofp8::RunShardGeometryBench(argc, argv);
}
}  // namespace
GEOFP8_REGISTER_BENCH("shard_geometry",
                      "lowrank geometry under reduce-scatter vs all-reduce: relF ratios, bytes",
                      ShardGeometryBenchMain);
