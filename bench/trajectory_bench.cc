// geofp8-bench trajectory: the geometry an exchange policy actually deploys, judged step by step on
// a training trajectory dumped by `geofp8-train --dump-grads`, against Euclidean at the same bytes.
//
// Every rank of the dumped run is a thread here with its own real Exchanger over loopback Gloo,
// fed that rank's dumped local gradient at each step, so the estimator, its schedule, warm starts,
// owner broadcasts, activation delay and the codec are exactly those of training. Three exchanges
// per policy and step: the policy itself (the deployed geometry), its Euclidean twin (the same
// plan with geometry none: same format, scaling, algorithm, hence the same bytes), and the fresh
// bound (the policy's transform with a basis estimated on this very step's exact average, which no
// deployment can have). Errors are measured against the dump's exact fp32 average.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bench/dump.h"
#include "bench/ranks.h"
#include "bench/registry.h"
#include "bench/summed_error.h"
#include "kernels/common/check.h"
#include "kernels/exchange/exchanger.h"
#include "kernels/geometry/analysis.h"
#include "kernels/model/ops.h"
#include "platform/policy/exchange_policy.h"

namespace geofp8::bench {
namespace {

constexpr const char* kProg = "geofp8-bench trajectory";

struct Args {
  std::string dir;
  int64_t first = -1, last = -1;  // --steps A-B (inclusive)
  int warmup = 0;                 // leading steps that only feed the estimators
  std::vector<std::string> policies;
  int band_k = 8;  // k of the band edges
  std::string csv;
  uint64_t seed = 1;
};

[[noreturn]] void Usage(const std::string& field, const std::string& problem,
                        const std::string& value) {
  UsageError(kProg, field, problem, value);
}

int64_t ParseInt64(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end || errno != 0 || v < lo || v > hi) {
    Usage(flag, "must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
          text);
  }
  return v;
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  std::string steps;
  CLI::App app{
      "Per layer and policy: geometric mean over the measured steps of the deployed (and fresh) "
      "error divided by the Euclidean twin's error on the same step, for rel_fro_error, the "
      "worst band error and the residual-subspace error (basis of the step).",
      "trajectory"};
  app.add_option("DIR", a.dir,
                 "a `geofp8-train --dump-grads DIR --dump-steps A-B` folder (step_A .. step_B, "
                 "each with every rank's local gradient)");
  app.add_option("--steps", steps,
                 "A-B: consecutive steps to replay; the first W (--warmup) only feed the "
                 "estimators");
  app.add_option("--warmup", a.warmup, "leading steps that only feed the estimators")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  app.add_option("--policy", a.policies,
                 "a geofp8-train policy (preset or FILE.yaml); repeatable; default geofp8");
  app.add_option("--band-k", a.band_k, "k of the band edges [0,k) [k,4k) [4k,r/2) [r/2,r)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--csv", a.csv, "one row per (policy, variant, layer, step) with every error");
  if (int rc = ParseFlags(app, argc, argv); rc >= 0) std::exit(rc);
  if (!steps.empty()) {
    const size_t dash = steps.find('-', 1);
    if (dash == std::string::npos) Usage("--steps", "expected a range A-B", steps);
    a.first = ParseInt64("--steps", steps.substr(0, dash), 0, int64_t{1} << 40);
    a.last = ParseInt64("--steps", steps.substr(dash + 1), a.first, a.first + 100000);
  }
  if (a.dir.empty()) Usage("DIR", "missing (a --dump-grads folder)", "");
  if (a.first < 0) Usage("--steps", "missing (e.g. --steps 40-59)", "");
  if (a.warmup > a.last - a.first) {
    Usage("--warmup",
          "leaves no step to measure in " + std::to_string(a.first) + "-" + std::to_string(a.last),
          std::to_string(a.warmup));
  }
  if (a.policies.empty()) a.policies = {"geofp8"};
  return a;
}

// The dump's layers, checked to agree across every step of the range.
struct Trajectory {
  std::vector<DumpedLayer> layers;
  std::vector<model::ParamInfo> params;
  int ranks = 0;
};

std::string StepDir(const Args& a, int64_t step) { return a.dir + "/step_" + std::to_string(step); }

Trajectory ReadTrajectory(const Args& a) {
  Trajectory t;
  for (int64_t step = a.first; step <= a.last; ++step) {
    const std::string dir = StepDir(a, step);
    if (!std::filesystem::is_directory(dir)) {
      Usage("DIR", "step " + std::to_string(step) + " is missing from the trajectory", dir);
    }
    std::vector<DumpedLayer> layers = ReadDump(kProg, dir, "DIR");
    if (step == a.first) {
      t.layers = layers;
      t.ranks = int(layers.front().per_rank.size());
      if (t.ranks < 1) Usage("DIR", "shapes.json names no per-rank files", dir + "/shapes.json");
      int64_t offset = 0;
      for (const DumpedLayer& l : layers) {
        if (int(l.per_rank.size()) != t.ranks) {
          Usage("DIR",
                "layer " + l.name + " has " + std::to_string(l.per_rank.size()) +
                    " per-rank files, others " + std::to_string(t.ranks),
                dir + "/shapes.json");
        }
        t.params.push_back({l.name, offset, l.rows, l.cols});
        offset += l.rows * l.cols;
      }
    }
    bool same = layers.size() == t.layers.size();
    for (size_t i = 0; same && i < layers.size(); ++i) {
      same = layers[i].name == t.layers[i].name && layers[i].rows == t.layers[i].rows &&
             layers[i].cols == t.layers[i].cols &&
             layers[i].per_rank.size() == t.layers[i].per_rank.size();
    }
    if (!same) {
      Usage("DIR", "layers or shapes differ from step " + std::to_string(a.first),
            dir + "/shapes.json");
    }
    // Every file is read and checked here, on the main thread, before any rank starts: a bad
    // file found by one rank thread mid-replay would leave the others waiting in a collective.
    for (const DumpedLayer& l : layers) {
      ReadMatrix(kProg, dir, l.name, l.avg, l.rows, l.cols, "DIR");
      for (const std::string& f : l.per_rank)
        ReadMatrix(kProg, dir, l.name, f, l.rows, l.cols, "DIR");
    }
  }
  return t;
}

// One policy under test, as every rank builds it.
struct Variant {
  std::string policy;  // as given
  std::string kind;    // deployed, euclid, fresh
  ExchangePlan plan;
  std::vector<RefreshSchedule> schedule;
};

std::vector<Variant> MakeVariants(const Args& a, const Trajectory& t) {
  std::vector<Variant> out;
  for (const std::string& p : a.policies) {
    ExchangePlan plan;
    try {
      plan = MakeExchangePlan(p, t.params);
    } catch (const Error& e) {
      Usage("--policy", e.what(), p);
    }
    // A rotation alone (geometry: hadamard) transforms the gradient too: its twin drops it.
    const bool rotates = std::any_of(plan.layers.begin(), plan.layers.end(),
                                     [](const LayerPolicy& lp) { return lp.hadamard; });
    if (!plan.uses_geometry() && !rotates) {
      Usage("--policy", "uses no geometry: nothing to judge", p);
    }
    ExchangePlan euclid = plan;
    for (LayerPolicy& lp : euclid.layers) {
      lp.geometry = GeometryMode::kNone;
      lp.hadamard = false;  // the twin quantizes the gradient itself: no transform at all
    }
    out.push_back({p, "deployed", plan, MakeRefreshSchedule(plan, t.ranks)});
    out.push_back({p, "euclid", euclid, {}});
    out.push_back({p, "fresh", plan, {}});
  }
  return out;
}

// Per (variant, layer, measured step) on rank 0.
struct Sample {
  double rel = 0, worst = 0, residual = NAN;
  bool worst_defined = false;
};

struct Results {
  // [variant][layer][measured step]
  std::vector<std::vector<std::vector<Sample>>> samples;
  std::vector<std::vector<SummedError>> summed;       // [variant][layer], over the measured steps
  std::vector<std::vector<double>> refresh_seconds;   // [variant][measured step]: estimator time
  std::vector<std::vector<double>> exchange_seconds;  // [variant][measured step]
};

double GeoMean(const std::vector<double>& x) {
  if (x.empty()) return NAN;
  double s = 0;
  for (double v : x) s += std::log(std::max(v, 1e-300));
  return std::exp(s / double(x.size()));
}

double Median(std::vector<double> x) {
  if (x.empty()) return NAN;
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

Results Replay(const Args& a, const Trajectory& t, const std::vector<Variant>& variants,
               Communicator& comm) {
  const int rank = comm.rank();
  const size_t L = t.layers.size();
  Results res;
  res.samples.assign(variants.size(), std::vector<std::vector<Sample>>(L));
  res.summed.assign(variants.size(), std::vector<SummedError>(L));
  res.refresh_seconds.assign(variants.size(), {});
  res.exchange_seconds.assign(variants.size(), {});
  std::vector<std::unique_ptr<Exchanger>> ex;
  for (const Variant& v : variants) {
    std::vector<LayerSpec> specs;
    for (size_t l = 0; l < L; ++l) {
      specs.push_back({t.layers[l].name, t.layers[l].rows, t.layers[l].cols, v.plan.layers[l]});
    }
    ExchangeOptions eo = MakeExchangeOptions(v.plan);
    eo.seed = a.seed;
    ex.push_back(std::make_unique<Exchanger>(comm, std::move(specs), eo, v.schedule));
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t step = a.first; step <= a.last; ++step) {
    const std::string dir = StepDir(a, step);
    const bool measure = step >= a.first + a.warmup;
    std::vector<std::vector<float>> local(L), avg(L);
    for (size_t l = 0; l < L; ++l) {
      const DumpedLayer& d = t.layers[l];
      local[l] = ReadMatrix(kProg, dir, d.name, d.per_rank[rank], d.rows, d.cols, "DIR");
      avg[l] = ReadMatrix(kProg, dir, d.name, d.avg, d.rows, d.cols, "DIR");
    }
    std::vector<std::optional<SpectralReference>> refs(L);
    for (size_t vi = 0; vi < variants.size(); ++vi) {
      const Variant& v = variants[vi];
      if (v.kind == "fresh") {
        if (!measure) continue;
        // The bound: the policy's transform on a basis of this step's own exact average.
        std::vector<LayerGeometryState> state(L);
        for (size_t l = 0; l < L; ++l) {
          const LayerPolicy& lp = v.plan.layers[l];
          if (lp.geometry == GeometryMode::kNone || t.layers[l].rows < 2 || t.layers[l].cols < 2) {
            continue;
          }
          GeometryOptions go;
          go.mode = lp.geometry;
          go.rank = lp.rank;
          go.alpha = lp.alpha;
          go.power_iters = 4;
          go.seed = a.seed + l;
          Geometry g =
              EstimateGeometry(avg[l], t.layers[l].rows, t.layers[l].cols, go, nullptr).geometry;
          g.version = uint64_t(step - a.first) + 1;
          state[l].active = SerializeGeometry(g);
        }
        ex[vi]->ImportGeometry(state);
      }
      std::vector<std::vector<float>> work = local;
      std::vector<std::span<float>> grads;
      for (auto& w : work) grads.emplace_back(w);
      const StepResult r = ex[vi]->Exchange(uint64_t(step), grads);
      if (!measure) continue;
      double refresh = 0;
      for (const RefreshRecord& rr : r.refreshes) refresh += rr.seconds;
      res.refresh_seconds[vi].push_back(refresh);
      res.exchange_seconds[vi].push_back(r.seconds);
      if (rank != 0) continue;
      for (size_t l = 0; l < L; ++l) {
        const DumpedLayer& d = t.layers[l];
        const size_t base = vi - (v.kind == "deployed" ? 0 : v.kind == "euclid" ? 1 : 2);
        const LayerPolicy& deployed = variants[base].plan.layers[l];
        if (d.rows < 2 || d.cols < 2 ||
            (deployed.geometry == GeometryMode::kNone && !deployed.hadamard)) {
          continue;
        }
        if (!refs[l]) refs[l] = ComputeSpectralReference(avg[l], d.rows, d.cols);
        Sample s;
        s.rel = RelFroError(avg[l], work[l]);
        const BandErrors be = ComputeBandErrors(*refs[l], avg[l], work[l], a.band_k);
        s.worst = be.worst_band_error;
        s.worst_defined = std::any_of(be.bands.begin(), be.bands.end(),
                                      [](const BandError& b) { return b.defined; });
        // The residual-subspace error against the deployed policy's basis of this step, for
        // every variant alike (the deployed exchanger is the one before this in the list).
        const Exchanger& basis_of = *ex[base];
        const Geometry& g = basis_of.active_geometry(uint32_t(l));
        if (g.mode == GeometryMode::kLowRank && !g.is_identity()) {
          s.residual =
              ResidualSubspaceError(avg[l], work[l], d.rows, d.cols, g.U, g.V, g.k).value_or(NAN);
        }
        res.samples[vi][l].push_back(s);
        res.summed[vi][l].Add(work[l], avg[l]);
      }
    }
    if (rank == 0) {
      std::fprintf(stderr, "  [%6.1fs] step %lld%s\n",
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                   static_cast<long long>(step), measure ? "" : " (warm-up)");
    }
  }
  return res;
}

void Print(const Args& a, const Trajectory& t, const std::vector<Variant>& variants,
           const Results& res) {
  const size_t L = t.layers.size();
  std::FILE* csv = nullptr;
  if (!a.csv.empty()) {
    csv = std::fopen(a.csv.c_str(), "w");
    if (!csv) Usage("--csv", std::string("cannot write: ") + std::strerror(errno), a.csv);
    std::fprintf(csv, "policy,variant,layer,step,rel_fro_error,worst_band_error,residual_error\n");
  }
  std::printf("### Trajectory %s, steps %lld-%lld (%d warm-up), %d ranks, band k = %d\n\n",
              a.dir.c_str(), static_cast<long long>(a.first), static_cast<long long>(a.last),
              a.warmup, t.ranks, a.band_k);
  std::printf(
      "Each ratio: geometric mean over the measured steps of the variant's error divided "
      "by the Euclidean twin's on the same step (< 1: the geometry helps).\n\n");
  for (size_t vi = 0; vi < variants.size(); vi += 3) {
    const Variant& dep = variants[vi];
    std::printf("#### %s\n\n", dep.policy.c_str());
    std::printf(
        "| layer | shape | euclid rel_fro | deployed rel_fro | deployed worst | fresh "
        "rel_fro | fresh worst | deployed residual | steps deployed worse (rel) | summed "
        "rel_fro, deployed / euclid | summed coherence, euclid | summed coherence, deployed |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::vector<double> all[2][2];  // [deployed, fresh][rel, worst]: per-layer geomeans
    std::vector<double> residual_all;
    std::vector<double> summed_all, coherence_all[2];  // [euclid, deployed]
    double along_sum[2] = {0, 0};
    double along_max[2] = {0, 0};  // largest |along| of a layer
    int worse_rel = 0, worse_worst = 0, layers = 0;
    double max_rel = 0, max_worst = 0;
    for (size_t l = 0; l < L; ++l) {
      const auto& e = res.samples[vi + 1][l];
      if (e.empty()) continue;
      ++layers;
      double ratio[2][2];
      double residual = NAN;
      int steps_worse = 0;
      std::vector<double> euclid_rel;
      for (size_t s = 0; s < e.size(); ++s) euclid_rel.push_back(e[s].rel);
      for (int which = 0; which < 2; ++which) {
        const auto& x = res.samples[vi + (which == 0 ? 0 : 2)][l];
        std::vector<double> rel, worst, resid;
        for (size_t s = 0; s < x.size(); ++s) {
          rel.push_back(x[s].rel / e[s].rel);
          if (x[s].worst_defined && e[s].worst > 0) worst.push_back(x[s].worst / e[s].worst);
          if (which == 0 && std::isfinite(x[s].residual) && std::isfinite(e[s].residual) &&
              e[s].residual > 0) {
            resid.push_back(x[s].residual / e[s].residual);
          }
          if (which == 0 && x[s].rel > e[s].rel) ++steps_worse;
        }
        ratio[which][0] = GeoMean(rel);
        ratio[which][1] = GeoMean(worst);
        all[which][0].push_back(ratio[which][0]);
        if (!worst.empty()) all[which][1].push_back(ratio[which][1]);
        if (which == 0 && !resid.empty()) {
          residual = GeoMean(resid);
          residual_all.push_back(residual);
        }
      }
      if (ratio[0][0] > 1) ++worse_rel;
      if (ratio[0][1] > 1) ++worse_worst;
      max_rel = std::max(max_rel, ratio[0][0]);
      max_worst = std::max(max_worst, ratio[0][1]);
      const SummedError& acc_dep = res.summed[vi][l];
      const SummedError& acc_euc = res.summed[vi + 1][l];
      const double summed = acc_dep.RelFro() / acc_euc.RelFro();
      const double coherence[2] = {acc_euc.Coherence(), acc_dep.Coherence()};
      summed_all.push_back(summed);
      coherence_all[0].push_back(coherence[0]);
      coherence_all[1].push_back(coherence[1]);
      for (int which = 0; which < 2; ++which) {
        const double along = (which == 0 ? acc_euc : acc_dep).Along();
        along_sum[which] += along;
        along_max[which] = std::max(along_max[which], std::abs(along));
      }
      std::printf(
          "| %s | %lldx%lld | %.4f | %.3f | %.3f | %.3f | %.3f | %.3f | %d/%zu | %.3f | %.2f | "
          "%.2f |\n",
          t.layers[l].name.c_str(), static_cast<long long>(t.layers[l].rows),
          static_cast<long long>(t.layers[l].cols), GeoMean(euclid_rel), ratio[0][0], ratio[0][1],
          ratio[1][0], ratio[1][1], residual, steps_worse, e.size(), summed, coherence[0],
          coherence[1]);
      if (csv) {
        for (int which = 0; which < 3; ++which) {
          const auto& x = res.samples[vi + which][l];
          for (size_t s = 0; s < x.size(); ++s) {
            std::fprintf(csv, "%s,%s,%s,%lld,%.6g,%.6g,%.6g\n", dep.policy.c_str(),
                         variants[vi + which].kind.c_str(), t.layers[l].name.c_str(),
                         static_cast<long long>(a.first + a.warmup + int64_t(s)), x[s].rel,
                         x[s].worst_defined ? x[s].worst : NAN, x[s].residual);
          }
        }
      }
    }
    std::printf(
        "\n**%s**: over %d layers, deployed rel_fro %.3f and worst band %.3f of Euclidean "
        "(geometric mean over layers); fresh bound %.3f and %.3f; residual-subspace %.3f. "
        "Layers worse than Euclidean: %d (rel_fro), %d (worst band); largest layer ratios "
        "%.2f, %.2f.\n",
        dep.policy.c_str(), layers, GeoMean(all[0][0]), GeoMean(all[0][1]), GeoMean(all[1][0]),
        GeoMean(all[1][1]), GeoMean(residual_all), worse_rel, worse_worst, max_rel, max_worst);
    const int measured = int(a.last - a.first + 1 - a.warmup);
    std::printf(
        "Summed over the %d measured steps (what momentum and the weights integrate): deployed "
        "rel_fro %.3f of Euclidean's; coherence ||sum e||^2 / sum ||e||^2 (1: independent "
        "errors, %d: one error repeated) Euclidean %.2f, deployed %.2f (geometric means over "
        "layers). Error along the summed gradient, <sum e, sum g> / ||sum g||^2 (mean over "
        "layers; largest |value| of a layer): Euclidean %+.2e (%.1e), deployed %+.2e (%.1e).\n",
        measured, GeoMean(summed_all), measured, GeoMean(coherence_all[0]),
        GeoMean(coherence_all[1]), along_sum[0] / std::max(layers, 1), along_max[0],
        along_sum[1] / std::max(layers, 1), along_max[1]);
    std::printf(
        "Exchange seconds per step (median over measured steps, rank 0, ranks share this "
        "machine's cores): deployed %.4f, euclid %.4f; estimator %.4f s per step.\n\n",
        Median(res.exchange_seconds[vi]), Median(res.exchange_seconds[vi + 1]),
        Median(res.refresh_seconds[vi]));
  }
  if (csv) std::fclose(csv);
}

int Run(int argc, char** argv) {
  const Args a = ParseArgs(argc, argv);
  const Trajectory t = ReadTrajectory(a);
  const std::vector<Variant> variants = MakeVariants(a, t);
  model::SetBlasThreads(1);  // ranks are threads: each runs its own single-threaded BLAS
  std::mutex mu;
  Results results;
  GlooOptions go;
  return RunRanks<int>(
      kProg, t.ranks, -1, "", go,
      [&](Communicator& comm) {
        Results r = Replay(a, t, variants, comm);
        if (comm.rank() == 0) {
          std::lock_guard<std::mutex> lock(mu);
          results = std::move(r);
        }
        return std::vector<int>{};
      },
      [&](const std::vector<int>&, bool) { Print(a, t, variants, results); });
}

GEOFP8_REGISTER_BENCH("trajectory",
                      "deployed geometry vs Euclidean at the same bytes on a dumped training "
                      "trajectory",
                      Run);

}  // namespace
}  // namespace geofp8::bench
