// The job spec (docs/job-spec.md): plain structs with defaults, parsed from YAML in one place.
// Every error names the field path and the YAML line; parsing never throws.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/exchange/policy.h"
#include "kernels/geometry/factor_sketch.h"
#include "kernels/model/model.h"

namespace geofp8 {

// Limits of the spec (docs/job-spec.md). Steps are counted in int on the worker, so they stay well
// inside it; batch and sequence are bounded per field and by the attention memory they imply.
inline constexpr int64_t kMaxSteps = 1'000'000'000;
inline constexpr int kMaxBatchSize = 4096;  // sequences per rank per step
inline constexpr int kMaxSeqLen = 8192;     // tokens per sequence
// Held-out batches of 16 sequences per validation (training.eval_batches).
inline constexpr int kMaxEvalBatches = 1024;
// Attention probabilities kept for backward, per rank: about one H200's memory. The paper-scale
// example (llama-300m, batch 32 x 1024) needs 48 GiB.
inline constexpr int64_t kMaxAttentionBytes = int64_t{128} << 30;
// Longest job spec, checked before the YAML is parsed: a refused spec costs no parse. It travels
// in every Assignment beside the policy versions (coordinator.h kMaxPolicyHistoryBytes), under
// gRPC's 4 MiB message limit.
inline constexpr size_t kMaxSpecBytes = size_t{1} << 20;
// A spec's (or patch's) shape, checked in one pass over the text before parsing: flow
// collections ([ and {) nest at most kMaxSpecFlowDepth deep, and the document has at most
// kMaxSpecEntries lines and flow items. A spec with a policy of 4096 patches needs about 40,000.
inline constexpr int kMaxSpecFlowDepth = 32;
inline constexpr size_t kMaxSpecEntries = 50'000;
// Longest error message of a rejected spec or patch; the rest is "... and N more errors".
inline constexpr size_t kMaxErrorBytes = 2048;
// A `command:` job's program and arguments: at most this many entries, each at most
// kMaxCommandArgBytes, together at most kMaxCommandBytes (well inside Linux's ARG_MAX and the
// spec's own size, and short enough to show in `describe`).
inline constexpr size_t kMaxCommandArgs = 256;
inline constexpr size_t kMaxCommandArgBytes = 4096;
inline constexpr size_t kMaxCommandBytes = 32768;

// A partial LayerPolicy for the layers whose name matches `match` (exact, or a glob with * ? []).
struct LayerPatchSpec {
  std::string match;
  std::optional<Format> format;
  std::optional<Scaling> scaling;
  std::optional<uint32_t> block;
  std::optional<Rounding> rounding;
  std::optional<GeometryMode> geometry;
  std::optional<int> rank;
  std::optional<float> alpha;
  std::optional<bool> error_feedback;
  std::optional<int> refresh_interval;  // geometry refresh interval override, steps
  // Set together with `geometry` (a YAML geometry name such as lowrank+hadamard names both).
  std::optional<bool> hadamard;
  std::optional<uint32_t> hadamard_block;
};

struct ModelSpec {
  std::string preset = "llama-tiny";  // kernels/model PresetConfig name
};

struct DataSpec {
  std::string source = "synthetic";  // "synthetic" or "file"
  std::string path;                  // required when source is "file"
  uint64_t seed = 0;
};

struct TrainingSpec {
  int64_t steps = 1000;  // total optimizer steps
  int batch_size = 8;    // sequences per rank per step
  int seq_len = 128;     // tokens per sequence
  double lr = 3e-4;      // peak learning rate
  double weight_decay = 0.0;
  int64_t warmup_steps = 0;         // linear warm-up, < steps
  std::string optimizer = "adamw";  // "adamw" (the only optimizer the trainer implements)
  double grad_clip = 1.0;           // global norm clip; 0 = off
  uint64_t seed = 0;
  // Validation loss on held-out data every this many steps (and after the last step); 0: after
  // the last step only. Each validation costs eval_batches forward passes of 16 sequences,
  // split over the ranks.
  int64_t eval_every = 50;
  int eval_batches = 8;  // held-out batches of 16 sequences per validation
};

struct ExchangeSpec {
  Algorithm algorithm = Algorithm::kAuto;
  double bucket_mb = 25.0;  // bucket size cap
  int timeout_s = 60;       // per-collective timeout
};

struct PolicySpec {
  LayerPolicy defaults;                // applied to every layer first
  std::vector<LayerPatchSpec> layers;  // then each matching patch, in order
  int margin = 5;  // effective_step (a lower bound) = largest reported step + margin
};

// Bounds for the auto policy engine (DESIGN.md section 2, "auto" mode).
struct AutoPolicySpec {
  bool enabled = false;
  int probe_every = 50;            // workers probe each layer every this many steps
  double min_gain = 1.5;           // geometry on when error_without / error_with >= this
  double off_gain = 1.1;           // geometry off when the gain falls below this
  double max_cost_fraction = 0.1;  // ... and off when transform time / step time exceeds this
  GeometryMode geometry = GeometryMode::kLowRank;  // what "on" means
  int rank = 16;
  int min_interval = 25;  // refresh interval bounds the engine stays within
  int max_interval = 800;
  double drift_low = 0.05;  // drift below: double the interval
  double drift_high = 0.3;  // drift above: halve the interval
};

struct RefreshSpec {
  // How a layer's basis is estimated (kernels/exchange/policy.h). ema, the default, is what
  // geofp8-train's geometry presets ship (chosen on training trajectories, docs/benchmarks.md).
  GeometryEstimator estimator = GeometryEstimator::kFactorEma;
  // Steps between geometry refreshes: for ema, between sketch updates (1: every step); for
  // instant, between the owner's re-estimates. Unset: 1 for ema, 100 for instant.
  int interval = 1;
  bool stagger = true;         // spread owners over ranks and offsets over the interval
  FactorSketchOptions sketch;  // ema: beta, width, probes (the seed comes from training.seed)
  float adapt = 0.0f;          // ema: whitening strength follows the basis's fit (0: off)
  int power_iters = 1;         // instant: warm-started subspace iterations per refresh
  float sigma_ema = 0.0f;      // instant: sigma smoothing across refreshes
};
// The instant estimator's default interval: it re-estimates from one gradient and broadcasts.
inline constexpr int kInstantRefreshInterval = 100;

struct CheckpointSpec {
  std::string dir;    // where workers write checkpoints; empty = no checkpoints
  int64_t every = 0;  // steps between checkpoints; 0 = off
};

struct RestartSpec {
  int max_restarts = 3;  // restarts after a dead worker before the job fails
};

struct JobSpec {
  std::string name;              // required, [A-Za-z0-9._-], at most 63 characters
  int world_size = 1;            // ranks, 1..1024
  std::string backend = "gloo";  // "gloo" (CPU) or "nccl" (GPU)
  // A user program and its arguments that every rank's worker runs instead of the built-in
  // trainer (docs/job-spec.md, "Running your own script"). Empty: the built-in trainer. When
  // set, `model` and `data` are refused, `training` accepts `steps` only, and training.steps is
  // 0 unless given (the script decides when it is done).
  std::vector<std::string> command;
  // Who starts the ranks: "worker" (GeoFP8's workers run the built-in trainer or `command`) or
  // "external" (the user's launcher starts the script, torchrun, srun or a PyTorchJob, and each
  // rank attaches to an attach-only worker's hook socket; docs/launchers.md). An external job
  // takes no `command`, `model` or `data`, as a command job's script trains its own model.
  std::string launcher = "worker";
  ModelSpec model;
  DataSpec data;
  TrainingSpec training;
  ExchangeSpec exchange;
  PolicySpec policy;
  AutoPolicySpec auto_policy;
  RefreshSpec geometry_refresh;
  CheckpointSpec checkpoint;
  RestartSpec restarts;
};

// A policy patch file for `geofp8ctl policy apply -f`: {reason: ..., layers: [patch, ...]}.
// `default`, when present, replaces the default policy (fields it leaves out take the
// LayerPolicy defaults, as in a job spec's policy.default). `geofp8ctl policy get -o yaml`
// prints a version in this form, and applying it back changes nothing.
inline bool IsExternal(const JobSpec& spec) { return spec.launcher == "external"; }
// The job runs the user's own script (a `command:` or an external job), not the built-in
// trainer: its layers, steps and checkpoints are the ones the script reports.
inline bool RunsOwnScript(const JobSpec& spec) { return !spec.command.empty() || IsExternal(spec); }

struct PolicyPatchSpec {
  std::string reason;
  std::optional<LayerPolicy> defaults;
  std::vector<LayerPatchSpec> layers;
};

// Parse and validate. INVALID_ARGUMENT with "line N: spec.a.b: problem (value)"; several errors
// are joined with "; ".
absl::StatusOr<JobSpec> ParseJobSpec(std::string_view yaml);

// A policy file: the `exchange`, `policy` and `geometry_refresh` sections of a job spec and
// nothing else, with the job spec's schema, defaults and error paths (`spec.policy.layers[0]...`).
// `geofp8-train --policy FILE.yaml` takes it, and so do its presets (platform/policy/presets.h),
// so a file that trains under geofp8-train resolves to the same layer policies and refresh
// schedules as a job whose spec holds the same sections.
struct PolicyFileSpec {
  ExchangeSpec exchange;
  PolicySpec policy;
  RefreshSpec geometry_refresh;
};
absl::StatusOr<PolicyFileSpec> ParsePolicyFile(std::string_view yaml);

// geofp8-train's presets as policy files: "fp32, bf16, fp8, geofp8, nvfp4, geonvfp4, fp8-ef,
// nvfp4-ef".
std::string_view AcceptedPolicyPresets();
std::optional<std::string> PresetPolicyFile(std::string_view name);
// A spec's file paths (checkpoint.dir, data.path) name places inside the worker's --data-dir:
// "" if `path` is relative and has no ".." component, else the problem. Lexical on purpose: the
// operator may link datasets into the data directory; a spec cannot create links.
std::string DataDirPathProblem(std::string_view path);
// base/path when DataDirPathProblem(path) is empty and the result stays inside base; nullopt
// otherwise. The worker resolves every spec path through this.
std::optional<std::string> ResolveInDataDir(const std::string& base, std::string_view path);

// Offset of the first byte of `text` that is not well-formed UTF-8, or npos (geofp8ctl checks a
// spec file before sending it: protobuf strings must be UTF-8).
size_t InvalidUtf8At(std::string_view text);
absl::StatusOr<PolicyPatchSpec> ParsePolicyPatch(std::string_view yaml);
// The patch file ParsePolicyPatch reads back to `patch` (block style, every set field, in the
// order ParsePolicyPatch documents); `header` lines become leading comments.
std::string WritePolicyPatch(const PolicyPatchSpec& patch, const std::string& header = "");

// Checks one patch's values (used for patches that arrive over the API). `path` prefixes errors.
std::string ValidateLayerPatch(const LayerPatchSpec& patch, const std::string& path);

// The shared vocabulary (format.h, geometry.h, policy.h) under the names the services use.
std::optional<Format> ParseFormatName(std::string_view name);
std::optional<Scaling> ParseScalingName(std::string_view name);
std::optional<Rounding> ParseRoundingName(std::string_view name);
std::optional<GeometryMode> ParseGeometryName(std::string_view name);
std::optional<Algorithm> ParseAlgorithmName(std::string_view name);
std::string_view FormatNameOf(Format f);
std::string_view ScalingNameOf(Scaling s);
std::string_view RoundingNameOf(Rounding r);
std::string_view GeometryNameOf(GeometryMode g);
std::string_view AlgorithmNameOf(Algorithm a);
std::string_view AcceptedFormatNames();
std::string_view AcceptedScalingNames();
std::string_view AcceptedRoundingNames();
std::string_view AcceptedGeometryNames();
std::string_view AcceptedAlgorithmNames();

// True when `name` matches the layer pattern (exact or shell glob).
bool LayerMatches(std::string_view pattern, std::string_view name);
// The geometry refresh schedule (docs/job-spec.md, "Geometry refresh schedule"), the one
// algorithm the coordinator and geofp8-train use. `intervals` holds each matrix layer's refresh
// interval in layer order; the i-th of n gets owner i mod world_size and offset
// floor(i * interval / n), so refreshes spread over ranks and steps; without stagger, owner 0
// and offset 0.
std::vector<RefreshSchedule> RefreshScheduleOf(const std::vector<int>& intervals, int world_size,
                                               bool stagger);

// "" when `glob` matches a layer, else the problem, naming the model and its layer scheme:
// "matches no layer of llama-tiny (*embed*); its layers are tok_emb, layers.0.attn_norm, ...".
std::string UnmatchedGlobProblem(std::string_view glob, const std::vector<model::ParamInfo>& layers,
                                 std::string_view model);

}  // namespace geofp8
