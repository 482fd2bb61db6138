// geofp8-train: trains a Llama-style model data-parallel through the compressed gradient
// exchange, standalone (ranks as threads, or as processes over Gloo on loopback).

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>

#include "kernels/common/check.h"
#include "kernels/exchange/gloo_communicator.h"
#include "kernels/exchange/store.h"
#include "kernels/model/data.h"
#include "kernels/model/model.h"
#include "kernels/model/ops.h"
#include "platform/policy/exchange_policy.h"
#include "platform/policy/job_spec.h"
#include "worker/train/trainer.h"

namespace {

using geofp8::train::StepRecord;
using geofp8::train::TrainOptions;

constexpr const char* kProgram = "geofp8-train";

int UsageError(const std::string& message) {
  std::cerr << kProgram << ": error: " << message << "\n";
  return 2;
}

std::string Duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const long s = long(seconds + 0.5);
  std::ostringstream os;
  if (s >= 3600)
    os << s / 3600 << "h" << (s % 3600) / 60 << "m";
  else if (s >= 60)
    os << s / 60 << "m" << s % 60 << "s";
  else
    os << s << "s";
  return os.str();
}

std::string Num(double v, int precision = 4) {
  if (std::isnan(v)) return "";
  std::ostringstream os;
  os << std::setprecision(precision) << std::fixed << v;
  return os.str();
}

// Empty for an undefined (non-finite) value, else 6 significant digits: the noise scale and the
// noise ratios span many decades.
std::string Sci(double v) {
  if (!std::isfinite(v)) return "";
  std::ostringstream os;
  os << std::setprecision(6) << v;
  return os.str();
}

// Seconds rank 0 spent estimating geometries this step (ema: every rank runs its own sketch
// updates; instant: the owner's estimate, reported to every rank).
// Rank 0's per-step sink: CSV rows, and a progress bar on a tty or periodic log lines otherwise.
class Reporter {
 public:
  Reporter(const TrainOptions& o, const std::vector<geofp8::model::ParamInfo>& params,
           const std::string& csv_path, bool quiet)
      : o_(o), params_(params), tty_(isatty(STDERR_FILENO) == 1), quiet_(quiet) {
    if (!csv_path.empty()) {
      csv_.open(csv_path);
      if (!csv_) throw geofp8::Error("csv: cannot open " + csv_path);
      csv_ << "step,loss,val_loss,lr,grad_norm,step_s,exchange_s,wait_s,bytes_sent,skipped,tokens,"
              "refreshes,geometry_s,max_layer_err,gns";
      if (o.error_every > 0) {
        for (const auto& p : params) csv_ << ",err:" << p.name;
        for (const auto& p : params) csv_ << ",res:" << p.name;
        for (const auto& p : params) csv_ << ",upd:" << p.name;
        for (const auto& p : params) csv_ << ",qnr:" << p.name;
      }
      csv_ << "\n";
    }
    log_every_ = std::max<int64_t>(1, o.steps / 20);
    start_ = std::chrono::steady_clock::now();
  }

  void operator()(const StepRecord& r) {
    if (first_step_ < 0) first_step_ = r.step;
    tokens_ += r.tokens;
    if (csv_.is_open()) {
      double worst = NAN;
      for (double e : r.layer_error) worst = std::isnan(worst) ? e : std::max(worst, e);
      csv_ << r.step << "," << Num(r.loss, 6) << "," << Num(r.val_loss, 6) << "," << Num(r.lr, 8)
           << "," << Num(r.grad_norm, 6) << "," << Num(r.step_seconds, 6) << ","
           << Num(r.exchange_seconds, 6) << "," << Num(r.wait_seconds, 6) << "," << r.bytes_sent
           << "," << (r.skipped ? 1 : 0) << "," << r.tokens << "," << r.refreshes << ","
           << Num(r.geometry_seconds, 6) << "," << (std::isnan(worst) ? "" : Num(worst, 8)) << ","
           << Sci(r.gradient_noise_scale);
      if (o_.error_every > 0) {
        for (size_t i = 0; i < params_.size(); ++i) {
          csv_ << "," << (r.layer_error.empty() ? "" : Num(r.layer_error[i], 8));
        }
        for (size_t i = 0; i < params_.size(); ++i) {
          // NaN (no residual energy) is written as an empty cell, like an unmeasured step.
          const bool have = i < r.residual_error.size() && !std::isnan(r.residual_error[i]);
          csv_ << "," << (have ? Num(r.residual_error[i], 8) : "");
        }
        for (size_t i = 0; i < params_.size(); ++i) {
          csv_ << "," << (r.update_error.empty() ? "" : Num(r.update_error[i], 8));
        }
        for (size_t i = 0; i < params_.size(); ++i) {
          csv_ << "," << (i < r.noise_ratio.size() ? Sci(r.noise_ratio[i]) : "");
        }
      }
      csv_ << "\n";
    }
    if (!std::isnan(r.val_loss)) last_val_ = r.val_loss;
    if (quiet_) return;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    const int64_t done = r.step + 1 - first_step_, total = o_.steps - first_step_;
    const double tok_s = tokens_ / std::max(elapsed, 1e-9);
    const double eta = elapsed / std::max<int64_t>(done, 1) * double(total - done);
    std::ostringstream line;
    line << "step " << r.step + 1 << "/" << o_.steps << "  loss " << Num(r.loss)
         << (std::isnan(last_val_) ? "" : "  val " + Num(last_val_)) << "  "
         << Num(tok_s / 1000.0, 1) << "k tok/s  ETA " << Duration(eta);
    if (tty_) {
      const int width = 24, filled = int(double(r.step + 1) / double(o_.steps) * width);
      std::cerr << "\r[" << std::string(filled, '#') << std::string(width - filled, '.') << "] "
                << line.str() << "    " << (r.step + 1 == o_.steps ? "\n" : "") << std::flush;
    } else if ((r.step + 1) % log_every_ == 0 || r.step + 1 == o_.steps || done == 1) {
      std::cerr << kProgram << ": " << line.str() << "\n";
    }
  }

 private:
  const TrainOptions& o_;
  std::vector<geofp8::model::ParamInfo> params_;
  bool tty_, quiet_;
  std::ofstream csv_;
  int64_t log_every_ = 1, first_step_ = -1, tokens_ = 0;
  double last_val_ = NAN;
  std::chrono::steady_clock::time_point start_;
};

void PrintSummary(const TrainOptions& o, const geofp8::train::TrainResult& r) {
  const double steps = double(r.steps - r.start_step);
  std::printf("policy %s  ranks %d  steps %lld..%lld  final_val_loss %.4f  best_val_loss %.4f\n",
              o.policy.c_str(), o.ranks, (long long)r.start_step, (long long)r.steps,
              r.final_val_loss, r.best_val_loss);
  std::printf("bytes_on_wire_rank0 %llu  mean_step_s %.4f  wall_s %.1f",
              (unsigned long long)r.bytes_sent, r.seconds / std::max(steps, 1.0), r.seconds);
  if (!std::isnan(r.entropy_bound)) std::printf("  entropy_bound %.4f", r.entropy_bound);
  std::printf("  checksum %016llx\n", (unsigned long long)r.checksum);
}

// Ranks as processes: fork one child per rank; they meet through a FileStore on local disk.
int RunProcesses(const TrainOptions& o, const std::string& csv, bool quiet) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("geofp8-train-" + std::to_string(getpid()));
  fs::create_directories(dir);
  std::vector<pid_t> children;
  for (int r = 0; r < o.ranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::cerr << kProgram << ": error: fork failed for rank " << r << "\n";
      return 1;
    }
    if (pid == 0) {
      int code = 0;
      try {
        geofp8::FileStore store(dir.string());
        geofp8::GlooOptions go;
        go.timeout = o.timeout;
        auto comm = geofp8::CreateGlooCommunicator(store, r, o.ranks, go);
        geofp8::model::Model<float> shape(o.model);
        std::unique_ptr<Reporter> reporter;
        if (r == 0) reporter = std::make_unique<Reporter>(o, shape.params(), csv, quiet);
        auto result = geofp8::train::TrainRank(o, *comm, [&](const StepRecord& rec) {
          if (reporter) (*reporter)(rec);
        });
        if (r == 0) PrintSummary(o, result);
      } catch (const std::exception& e) {
        std::cerr << kProgram << ": error: rank " << r << ": " << e.what() << "\n";
        code = 1;
      }
      std::fflush(stdout);
      _exit(code);
    }
    children.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  return failed ? 1 : 0;
}

// The defaults of this command that differ from a job spec's (platform/policy/job_spec.h, which
// the worker daemon turns into the same TrainOptions): here they are the benchmarks' (the
// commands docs/benchmarks.md quotes rely on them), in a spec a small first job's. Built from
// both sets of defaults, so the help cannot drift from either.
std::string SpecDefaultsFooter(const TrainOptions& t, const std::string& preset) {
  const geofp8::JobSpec j;
  auto num = [](double v) {
    std::ostringstream os;
    os << v;
    return os.str();
  };
  std::vector<std::array<std::string, 3>> rows;  // flag and its default, spec field, its default
  auto row = [&](const std::string& flag, const std::string& ours, const std::string& field,
                 const std::string& theirs) {
    if (ours != theirs) rows.push_back({flag + " " + ours, field, theirs});
  };
  row("--preset", preset, "model.preset", j.model.preset);
  row("--steps", std::to_string(t.steps), "training.steps", std::to_string(j.training.steps));
  row("--seq", std::to_string(t.seq) + (t.seq == 0 ? " (the preset's context)" : ""),
      "training.seq_len", std::to_string(j.training.seq_len));
  row("--batch", std::to_string(t.batch), "training.batch_size",
      std::to_string(j.training.batch_size));
  row("--lr", num(t.optimizer.lr), "training.lr", num(j.training.lr));
  row("--warmup", std::to_string(t.optimizer.warmup_steps), "training.warmup_steps",
      std::to_string(j.training.warmup_steps));
  row("--weight-decay", num(t.optimizer.weight_decay), "training.weight_decay",
      num(j.training.weight_decay));
  row("--clip", num(t.optimizer.clip_norm), "training.grad_clip", num(j.training.grad_clip));
  row("--seed", std::to_string(t.seed), "training.seed, data.seed",
      std::to_string(j.training.seed) +
          (j.data.seed == j.training.seed ? "" : ", " + std::to_string(j.data.seed)));
  row("--eval-every", std::to_string(t.eval_every), "training.eval_every",
      std::to_string(j.training.eval_every));
  row("--eval-batches", std::to_string(t.eval_batches), "training.eval_batches",
      std::to_string(j.training.eval_batches));
  row("--policy", t.policy, "policy.default",
      std::string(geofp8::FormatNameOf(j.policy.defaults.format)) + ", " +
          std::string(geofp8::ScalingNameOf(j.policy.defaults.scaling)) + " " +
          std::to_string(j.policy.defaults.block) + ", geometry " +
          std::string(geofp8::GeometryNameOf(j.policy.defaults.geometry)));
  std::ostringstream os;
  os << "Defaults that differ from a job spec's (docs/job-spec.md; the worker daemon trains a\n"
        "spec's job with this trainer): to run a job's training here, pass the spec's values.\n";
  size_t w = 0;
  for (const auto& r : rows) w = std::max(w, r[0].size());
  for (const auto& r : rows) {
    os << "  " << std::left << std::setw(int(w)) << r[0] << "  spec: " << r[1] << " " << r[2]
       << "\n";
  }
  return os.str();
}

}  // namespace

int main(int argc, char** argv) {
  // OpenBLAS reads OPENBLAS_CORETYPE only when it loads, before main: when it fell back to
  // generic kernels on this CPU, run again once with the right kernels named (see
  // PreferredBlasCore). The variable is then set, so this cannot loop.
  std::string blas_warning;
  geofp8::model::ReexecWithPreferredBlasCore(argv, &blas_warning);
  // Ranks as processes talk over Gloo, which writes without MSG_NOSIGNAL: a rank that dies would
  // otherwise end its peers by SIGPIPE, with no error printed, instead of failing their exchange.
  signal(SIGPIPE, SIG_IGN);
  if (!blas_warning.empty()) std::cerr << kProgram << ": warning: " << blas_warning << "\n";
  CLI::App app{"Train a Llama-style model data-parallel through the GeoFP8 gradient exchange"};
  TrainOptions o;
  std::string preset = "llama-small", csv, launcher = "threads";
  int dim = 0, layers = 0, heads = 0, ffn = 0;
  bool quiet = false;
  int64_t timeout_ms = o.timeout.count();
  std::string dump_layers = "*", dump_steps;
  app.add_option("--preset", preset,
                 "model preset: llama-tiny, llama-small, llama-300m, llama-600m")
      ->capture_default_str();
  app.add_option("--dim", dim, "override the preset's width");
  app.add_option("--layers", layers, "override the preset's layer count");
  app.add_option("--heads", heads, "override the preset's head count");
  app.add_option("--ffn", ffn, "override the preset's SwiGLU width");
  app.add_option("--ranks", o.ranks, "data-parallel ranks")->capture_default_str();
  app.add_option("--launcher", launcher, "threads or processes")->capture_default_str();
  app.add_option("--steps", o.steps, "optimizer steps")->capture_default_str();
  app.add_option("--batch", o.batch, "sequences per rank per micro-batch")->capture_default_str();
  app.add_option("--accum", o.accum,
                 "micro-batches per step: each rank averages the gradients of N micro-batches "
                 "before the exchange (global batch ranks x N x batch sequences, activations of "
                 "one micro-batch)")
      ->capture_default_str();
  app.add_option("--seq", o.seq, "tokens per sequence (0: the preset's context)")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed of init, data and rounding")->capture_default_str();
  app.add_option("--policy", o.policy,
                 "exchange policy: fp32, bf16, fp8, geofp8, nvfp4, geonvfp4, fp8-ef, nvfp4-ef, or "
                 "FILE.yaml")
      ->capture_default_str();
  app.add_option("--data", o.data, "synthetic, markov:SEED, or a UTF-8 text file or folder")
      ->capture_default_str();
  app.add_option("--csv", csv, "write one row per step to this CSV file");
  app.add_option("--lr", o.optimizer.lr, "peak learning rate")->capture_default_str();
  app.add_option("--min-lr", o.optimizer.min_lr, "final learning rate")->capture_default_str();
  app.add_option("--warmup", o.optimizer.warmup_steps, "warmup steps")->capture_default_str();
  app.add_option("--weight-decay", o.optimizer.weight_decay, "AdamW decoupled weight decay")
      ->capture_default_str();
  app.add_option("--clip", o.optimizer.clip_norm, "global gradient norm cap (0: off)")
      ->capture_default_str();
  app.add_option("--eval-every", o.eval_every, "validation cadence in steps")
      ->capture_default_str();
  app.add_option("--eval-batches", o.eval_batches, "held-out batches of 16 sequences")
      ->capture_default_str();
  app.add_option("--checksum-every", o.checksum_every, "parameter checksum cadence (0: off)")
      ->capture_default_str();
  app.add_option("--error-every", o.error_every,
                 "per-layer exchange error cadence, extra fp32 all-reduce (0: off)")
      ->capture_default_str();
  app.add_option("--gns-beta", o.gns_beta,
                 "moving-average weight of the past for the gradient noise scale (CSV column gns)")
      ->capture_default_str();
  app.add_option("--checkpoint", o.checkpoint, "checkpoint file");
  app.add_option("--checkpoint-every", o.checkpoint_every, "checkpoint cadence in steps");
  app.add_flag("--resume", o.resume, "continue from --checkpoint when it exists");
  app.add_option("--dump-grads", o.dump_dir,
                 "folder for gradient dumps (raw float32 + shapes.json)");
  app.add_option("--dump-layers", dump_layers, "comma-separated globs of layers to dump")
      ->capture_default_str();
  app.add_option("--dump-steps", dump_steps,
                 "comma-separated steps or ranges to dump, e.g. 0,100,40-59");
  app.add_option("--trace", o.trace_dir,
                 "folder for rank<R>.json, a Chrome trace of every step's compute and exchange "
                 "(scripts/exchange_timeline.py)");
  app.add_option("--blas-threads", o.blas_threads, "OpenBLAS threads per process")
      ->capture_default_str();
  app.add_option("--timeout-ms", timeout_ms, "collective timeout")->capture_default_str();
  app.add_flag("--quiet", quiet, "no progress output");
  app.footer(SpecDefaultsFooter(o, preset));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    return UsageError(e.what());
  }

  auto config = geofp8::model::PresetConfig(preset);
  if (!config) {
    return UsageError("preset: unknown value '" + preset +
                      "' (accepted: " + std::string(geofp8::model::AcceptedPresets()) + ")");
  }
  if (dim) config->dim = dim;
  if (layers) config->layers = layers;
  if (heads) config->heads = heads;
  if (ffn) config->ffn = ffn;
  o.model = *config;
  o.optimizer.total_steps = 0;  // follow --steps
  o.timeout = std::chrono::milliseconds(timeout_ms);
  o.dump_layers.clear();
  std::stringstream dl(dump_layers);
  for (std::string g; std::getline(dl, g, ',');) {
    if (!g.empty()) o.dump_layers.push_back(g);
  }
  std::stringstream ds(dump_steps);
  for (std::string s; std::getline(ds, s, ',');) {
    // A step or an inclusive range "first-last" (a trajectory for `geofp8-bench geometry`).
    char* end = nullptr;
    const long long first = std::strtoll(s.c_str(), &end, 10);
    long long last = first;
    if (!s.empty() && *end == '-' && end[1] != 0) last = std::strtoll(end + 1, &end, 10);
    if (s.empty() || *end != 0 || first < 0 || last < first) {
      return UsageError("dump-steps: bad step or range (" + s + "); e.g. 0,100,40-59");
    }
    if (last - first >= 100000) {
      return UsageError("dump-steps: range longer than 100000 steps (" + s + ")");
    }
    for (long long v = first; v <= last; ++v) o.dump_steps.push_back(v);
  }
  if (launcher != "threads" && launcher != "processes") {
    return UsageError("launcher: unknown value '" + launcher + "' (accepted: threads, processes)");
  }
  if (std::string err = geofp8::train::ValidateTrainOptions(o); !err.empty())
    return UsageError(err);
  try {
    // Reject a bad policy or data source before starting any rank.
    geofp8::model::Model<float> shape(o.model);
    geofp8::MakeExchangePlan(o.policy, shape.params());
    geofp8::model::MakeDataSource(o.data, o.seed);
  } catch (const geofp8::Error& e) {
    return UsageError(e.what());  // the message alone: the core's location is e.where()
  }
  std::cerr << kProgram << ": " << preset << " (" << geofp8::model::ParameterCount(o.model)
            << " params), " << o.ranks << " ranks as " << launcher << ", policy " << o.policy
            << ", data " << geofp8::model::MakeDataSource(o.data, o.seed)->Describe()
            << ", OpenBLAS core " << geofp8::model::BlasCoreName() << " x" << o.blas_threads
            << " thread(s) per process\n";
  if (launcher == "processes") return RunProcesses(o, csv, quiet);
  try {
    geofp8::model::Model<float> shape(o.model);
    Reporter reporter(o, shape.params(), csv, quiet);
    auto result = geofp8::train::Train(o, [&](const StepRecord& r) { reporter(r); });
    PrintSummary(o, result);
  } catch (const std::exception& e) {
    std::cerr << kProgram << ": error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
