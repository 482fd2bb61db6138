// The data-parallel training loop of geofp8-train: every rank runs the Llama model on its own
// shard, pushes gradients bucket by bucket into the exchange engine during the backward pass,
// clips the averaged gradient and applies AdamW, with periodic parameter checksums across ranks.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/exchange/communicator.h"
#include "kernels/model/model.h"
#include "kernels/model/optimizer.h"

namespace geofp8::train {

// Everything one run needs. Plain struct with defaults; validated by ValidateTrainOptions.
struct TrainOptions {
  model::ModelConfig model;            // a preset's shape (llama-tiny by default)
  model::OptimizerOptions optimizer;   // total_steps is set to `steps` when it is 0
  int ranks = 1;                       // data-parallel world size
  int batch = 8;                       // sequences per rank per step
  int seq = 0;                         // tokens per sequence; 0: model.seq
  int64_t steps = 100;                 // total optimizer steps (a resumed run stops here too)
  uint64_t seed = 1;                   // model init, data windows, rounding streams
  std::string data = "synthetic";      // "synthetic", "markov:SEED", or a UTF-8 file/folder
  std::string policy = "fp32";         // preset (fp32, bf16, fp8, geofp8, nvfp4, geonvfp4) or FILE.yaml
  int eval_every = 50;                 // validation cadence in steps (and always at the end); 0: end only
  int eval_batches = 8;                // held-out batches of 16 sequences per validation
  int checksum_every = 10;             // parameter checksum cadence; 0: never
  int error_every = 0;                 // per-layer exchange error cadence; 0: never
  std::string checkpoint;              // checkpoint path; empty: none
  int checkpoint_every = 0;            // steps between checkpoints (and at the end); 0: end only
  bool resume = false;                 // start from `checkpoint` when it exists
  std::string dump_dir;                // --dump-grads output folder; empty: off
  std::vector<std::string> dump_layers = {"*"};  // globs over parameter names
  std::vector<int64_t> dump_steps;     // steps at which to dump
  int blas_threads = 1;                // OpenBLAS threads for the whole process
  std::chrono::milliseconds timeout{120000};  // every collective
  // Fault injection for tests: add 1e-3 to one weight of this rank after this step's update.
  int debug_perturb_rank = -1;
  int64_t debug_perturb_step = -1;
};

// "" when usable, else one line naming the field: "ranks: must be >= 1 (0)".
std::string ValidateTrainOptions(const TrainOptions& options);

// What rank 0 reports after each step.
struct StepRecord {
  int64_t step = 0;
  double loss = 0;              // training loss, mean over ranks
  double val_loss = NAN;        // NaN when not measured this step
  double lr = 0;
  double grad_norm = 0;         // of the averaged gradient, before clipping
  double step_seconds = 0;      // wall time of the whole step on rank 0
  double exchange_seconds = 0;  // exchange engine time (first submit to finish, overlaps backward)
  double wait_seconds = 0;      // time rank 0 blocked waiting for the exchange after its backward
  uint64_t bytes_sent = 0;      // rank 0's bytes on the wire this step
  bool skipped = false;         // non-finite gradient on some rank: no update
  int64_t tokens = 0;           // tokens over all ranks this step
  int refreshes = 0;            // geometry refreshes this step
  std::vector<double> layer_error;  // per parameter rel_fro_error, empty when not measured
};

struct TrainResult {
  int64_t start_step = 0;       // 0, or the resumed step
  int64_t steps = 0;            // the step count reached
  double final_val_loss = NAN;
  double best_val_loss = NAN;
  double entropy_bound = NAN;   // of the data source, NaN when unknown
  uint64_t bytes_sent = 0;      // rank 0, whole run
  double seconds = 0;
  std::vector<float> weights;   // rank 0's final parameters
  std::vector<model::ParamInfo> params;
  uint64_t checksum = 0;        // of the final weights and moments
};

using StepCallback = std::function<void(const StepRecord&)>;

// Runs ranks as threads, each with its own Gloo communicator over TCP on 127.0.0.1. Throws
// geofp8::Error naming the rank on any rank's failure. on_step runs on rank 0's thread.
TrainResult Train(const TrainOptions& options, const StepCallback& on_step = nullptr);

// Runs this process's rank over an existing communicator (ranks as processes). on_step is called
// on rank 0 only.
TrainResult TrainRank(const TrainOptions& options, Communicator& comm,
                      const StepCallback& on_step = nullptr);

// FNV-1a over the bytes of the buffers.
uint64_t Checksum(std::initializer_list<std::span<const float>> buffers);

}  // namespace geofp8::train
