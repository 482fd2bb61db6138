// The data-parallel training loop of geofp8-train: every rank runs the Llama model on its own
// shard, pushes gradients bucket by bucket into the exchange engine during the backward pass,
// clips the averaged gradient and applies AdamW, with periodic parameter checksums across ranks.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/exchange/communicator.h"
#include "kernels/exchange/exchanger.h"
#include "kernels/model/data.h"
#include "kernels/model/model.h"
#include "kernels/model/noise_scale.h"
#include "kernels/model/optimizer.h"
#include "platform/policy/exchange_policy.h"
#include "worker/train/checkpoint.h"

namespace geofp8::train {

// Everything one run needs. Plain struct with defaults; validated by ValidateTrainOptions.
struct TrainOptions {
  model::ModelConfig model;           // a preset's shape (llama-tiny by default)
  model::OptimizerOptions optimizer;  // total_steps is set to `steps` when it is 0
  int ranks = 1;                      // data-parallel world size
  int batch = 8;                      // sequences per rank per micro-batch
  // Micro-batches per optimizer step: each rank runs `accum` forward/backward passes of `batch`
  // sequences and exchanges the mean of their gradients, so the global batch is
  // ranks * accum * batch sequences while activations stay those of one micro-batch.
  int accum = 1;
  int seq = 0;                        // tokens per sequence; 0: model.seq
  int64_t steps = 100;                // total optimizer steps (a resumed run stops here too)
  uint64_t seed = 1;                  // model init, data windows, rounding streams
  std::optional<uint64_t> data_seed;  // data windows only, when set (the worker's data.seed)
  std::string data = "synthetic";     // "synthetic", "markov:SEED", or a UTF-8 file/folder
  std::string policy =
      "fp32";  // preset (fp32, bf16, fp8, geofp8, nvfp4, geonvfp4, fp8-ef, nvfp4-ef) or FILE.yaml
  int eval_every = 50;      // validation cadence in steps (and always at the end); 0: end only
  int eval_batches = 8;     // held-out batches of 16 sequences per validation
  int checksum_every = 10;  // parameter checksum cadence; 0: never
  int error_every = 0;      // per-layer exchange error cadence; 0: never
  // Weight of the past in the gradient noise scale's moving averages (kernels/model/noise_scale.h).
  double gns_beta = 0.95;
  std::string checkpoint;    // checkpoint path; empty: none
  int checkpoint_every = 0;  // steps between checkpoints (and at the end); 0: end only
  bool resume = false;       // start from `checkpoint` when it exists
  std::string dump_dir;      // --dump-grads output folder; empty: off
  // Folder for one Chrome trace per rank (rank<R>.json, written when Run ends): the exchange's
  // collectives and codec stages (ExchangeTrace) next to this rank's forward/backward, wait and
  // optimizer. Empty: off.
  std::string trace_dir;
  std::vector<std::string> dump_layers = {"*"};  // globs over parameter names
  std::vector<int64_t> dump_steps;               // steps at which to dump
  int blas_threads = 1;                          // OpenBLAS threads for the whole process
  std::chrono::milliseconds timeout{120000};     // every collective
  // Fault injection for tests: add 1e-3 to one weight of this rank after this step's update.
  int debug_perturb_rank = -1;
  int64_t debug_perturb_step = -1;
};

// "" when usable, else one line naming the field: "ranks: must be >= 1 (0)".
std::string ValidateTrainOptions(const TrainOptions& options);

// What rank 0 reports after each step.
struct StepRecord {
  int64_t step = 0;
  double loss = 0;        // training loss, mean over ranks
  double val_loss = NAN;  // NaN when not measured this step
  double lr = 0;
  double grad_norm = 0;         // of the averaged gradient, before clipping
  double step_seconds = 0;      // wall time of the whole step on rank 0
  double exchange_seconds = 0;  // exchange engine time (first submit to finish, overlaps backward)
  double wait_seconds = 0;      // time rank 0 blocked waiting for the exchange after its backward
  uint64_t bytes_sent = 0;      // rank 0's bytes on the wire this step
  bool skipped = false;         // non-finite gradient on some rank: no update
  int64_t tokens = 0;           // tokens over all ranks this step (every micro-batch)
  int refreshes = 0;            // geometry refreshes this step
  double geometry_seconds = 0;  // this rank's geometry estimation (refresh) time this step
  std::vector<double> layer_error;  // per parameter rel_fro_error, empty when not measured
  // Per parameter residual-subspace error (DESIGN.md section 6) against the basis the step used;
  // a layer without a low-rank basis projects nothing, so it equals layer_error. NaN where the
  // exact gradient has no residual energy. Empty when not measured.
  std::vector<double> residual_error;
  // Per parameter relative error of the AdamW update from the exchanged gradient against the
  // update from the exact fp32 average, both clipped as the step clips and applied to the same
  // optimizer state: the error that reaches the weights (Adam amplifies weak directions). Empty
  // when not measured.
  std::vector<double> update_error;
  // The gradient noise scale B_simple in tokens (kernels/model/noise_scale.h): from each rank's
  // own gradient (ranks x ... at accum * batch * seq tokens) and the averaged one, each term
  // smoothed over steps (TrainOptions::gns_beta). NaN when undefined: one rank, or a smoothed
  // term not positive. The same on every rank.
  double gradient_noise_scale = NAN;
  // Per parameter, the predicted ratio of the exchange's quantization noise to the SGD noise of
  // this step's global batch (QuantizationNoiseRatio with eps = layer_error and the layer's
  // rounding). NaN where the noise scale is undefined. Empty when not measured.
  std::vector<double> noise_ratio;
  StepResult exchange;  // the exchange engine's own report (buckets, refresh records)
};

// Per-step switches a driver chooses (Run derives them from TrainOptions).
struct StepControl {
  bool measure_error = false;  // layer_error/residual_error: a collective, same on every rank
  bool keep_local = false;     // keep this rank's pre-exchange gradient (local_gradient())
};

struct TrainResult {
  int64_t start_step = 0;  // 0, or the resumed step
  int64_t steps = 0;       // the step count reached
  double final_val_loss = NAN;
  double best_val_loss = NAN;
  double entropy_bound = NAN;  // of the data source, NaN when unknown
  uint64_t bytes_sent = 0;     // rank 0, whole run
  double seconds = 0;
  std::vector<float> weights;  // rank 0's final parameters
  std::vector<model::ParamInfo> params;
  uint64_t checksum = 0;  // of the final weights and moments
};

using StepCallback = std::function<void(const StepRecord&)>;

// One rank's trainer: its model, optimizer, data shard and exchange engine. Run() is the whole
// geofp8-train loop; a driver that owns the loop (the worker daemon: stop consensus, policy
// versions from the coordinator, its own checkpoint files) calls Step, SetPolicies,
// VerifyChecksum, MakeCheckpoint and Restore itself. Every call that says "collective" must be
// made by every rank in the same order.
class Trainer {
 public:
  // The exchange plan of options.policy (preset or YAML) with its staggered refresh schedule,
  // policy version 0. Throws geofp8::Error naming the field on bad options.
  Trainer(const TrainOptions& options, Communicator& comm);
  // An explicit plan (plan.layers: one policy per parameter) and refresh schedule (one entry per
  // parameter, or empty when no layer uses geometry) under `policy_version`, which every bucket's
  // fingerprint carries.
  Trainer(const TrainOptions& options, Communicator& comm, ExchangePlan plan,
          std::vector<RefreshSchedule> schedule, uint64_t policy_version);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The whole loop from step 0, or from options.checkpoint when options.resume and it exists:
  // steps, validation, checksums, checkpoints (rank 0 writes), gradient dumps. Collective.
  TrainResult Run(const StepCallback& on_step = nullptr);

  // One optimizer step (collective): policies due at `step` take effect, then batch, forward and
  // backward with buckets submitted as they fill, average, clip, AdamW, loss all-reduce. Steps
  // run in increasing order.
  StepRecord Step(int64_t step, const StepControl& control = {});

  // Switches the exchange to `policies` (one per parameter; the plan's algorithm, buckets and
  // refresh options stay) with `schedule` (as in the constructor) and `policy_version` from the
  // start of step `from_step`. Layers whose geometry mode, rank and alpha are unchanged keep
  // their active and pending geometry (a live change does not re-warm them); the others restart
  // from identity. Throws if `from_step` has already run or a policy is invalid (naming the layer
  // and field). The same call at the same step on every rank keeps them consistent.
  void SetPolicies(uint64_t from_step, std::vector<LayerPolicy> policies,
                   std::vector<RefreshSchedule> schedule, uint64_t policy_version);

  // Validation loss over options.eval_batches held-out batches, split over ranks. Collective.
  double Validate();
  // Checksum of weights and moments, compared across ranks; throws naming the first rank that
  // differs from rank 0. Collective.
  uint64_t VerifyChecksum(int64_t step);

  // Everything the trajectory depends on after `next_step` steps: weights, moments, the
  // exchange's geometry state and policy version, run totals. Fingerprint from the options.
  // Between steps only. Not collective, so of the error-feedback residuals (which differ between
  // ranks) it holds this rank's only, at its index; Run's checkpoints gather every rank's.
  Checkpoint MakeCheckpoint(int64_t next_step) const;
  // Takes a checkpoint's state in and returns its next_step. Sizes, seed, geometry shapes and
  // (under the same policy version) geometry policies must match; a checkpoint written under
  // another policy version keeps only the geometry the current policies can use, exactly as
  // SetPolicies would have. Does not check the fingerprint (Run does, drivers have their own).
  // Residuals, when the checkpoint has them, must be one set per rank; this rank takes its own
  // (an empty set, as in another rank's MakeCheckpoint, leaves it with none).
  int64_t Restore(const Checkpoint& checkpoint);

  const TrainOptions& options() const { return o_; }
  const model::Model<float>& model() const { return model_; }
  const model::AdamW& optimizer() const { return *optimizer_; }
  const Exchanger& exchanger() const { return *exchanger_; }
  const ExchangePlan& plan() const { return plan_; }
  uint64_t policy_version() const { return policy_version_; }
  // This rank's wire bytes over the whole run (a resumed run includes the checkpoint's).
  uint64_t bytes_sent() const { return bytes_sent_; }
  // This rank's gradient before the exchange at the last step run with keep_local or
  // measure_error, flat in params() layout.
  const std::vector<float>& local_gradient() const { return local_; }
  const model::GradientNoiseScale& noise_scale() const { return noise_scale_; }
  // Drift of each layer's last geometry refresh (0 before its second refresh: a cold start has
  // no previous basis, and for layers without geometry).
  const std::vector<double>& last_drift() const { return drift_; }

 private:
  void BuildExchanger(std::vector<RefreshSchedule> schedule);
  void ApplyDuePolicies(int64_t step);
  void LayerErrors(StepRecord& rec);
  void Dump(int64_t step);
  // Collective: rank 0 writes the checkpoint, with every rank's error-feedback residuals.
  void Save(int64_t next_step);
  // Collective: every rank's Exchanger::ExportResiduals, in rank order; empty when no layer
  // feeds back.
  std::vector<std::vector<LayerResidual>> GatherResiduals();
  int64_t RestoreFile();

  const TrainOptions o_;
  Communicator& comm_;
  const int rank_, ranks_, seq_;
  model::Model<float> model_;
  std::unique_ptr<model::AdamW> optimizer_;
  std::unique_ptr<model::DataSource> data_;
  ExchangePlan plan_;
  uint64_t policy_version_ = 0;
  std::unique_ptr<ExchangeTrace> trace_;  // options.trace_dir set; outlives every exchanger_
  std::unique_ptr<Exchanger> exchanger_;
  struct PolicyChange {
    std::vector<LayerPolicy> policies;
    std::vector<RefreshSchedule> schedule;
    uint64_t version = 0;
  };
  std::map<uint64_t, PolicyChange> policy_changes_;  // by from_step
  int64_t next_step_ = 0;                            // the lowest step Step may run
  std::vector<int32_t> tokens_;
  std::vector<float> accum_grads_;  // sum of the step's earlier micro-batches' gradients
  std::vector<float> local_;
  std::vector<double> drift_;
  model::GradientNoiseScale noise_scale_;
  double best_val_loss_ = NAN;  // run totals, carried by checkpoints
  uint64_t bytes_sent_ = 0;
};

// Runs ranks as threads, each with its own Gloo communicator over TCP on 127.0.0.1. Throws
// geofp8::Error naming the rank on any rank's failure. on_step runs on rank 0's thread.
TrainResult Train(const TrainOptions& options, const StepCallback& on_step = nullptr);

// Runs this process's rank over an existing communicator (ranks as processes): Trainer::Run
// after setting the BLAS threads. on_step is called on rank 0 only.
TrainResult TrainRank(const TrainOptions& options, Communicator& comm,
                      const StepCallback& on_step = nullptr);

// FNV-1a over the bytes of the buffers.
uint64_t Checksum(std::initializer_list<std::span<const float>> buffers);

}  // namespace geofp8::train
