#include "worker/daemon/rank_attempt.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>
#include <thread>

#include "kernels/common/check.h"
#include "kernels/exchange/exchanger.h"
#include "kernels/exchange/gloo_communicator.h"
#include "kernels/model/ops.h"
#include "kernels/model/optimizer.h"
#include "platform/common/status_error.h"
#include "platform/policy/policy.h"
#include "worker/daemon/log.h"

namespace geofp8::worker {

using std::chrono::milliseconds;

// The cosine schedule ends at this fraction of the peak learning rate (geofp8-train's defaults:
// 3e-3 -> 3e-4).
constexpr float kMinLrFraction = 0.1f;
// Reported tokens/s is an EMA over steps with this decay (about 5 steps of memory).
constexpr double kThroughputDecay = 0.8;

train::TrainOptions TrainOptionsFor(const JobSpec& spec, int world,
                                    const JobRunnerOptions& options) {
  GEOFP8_CHECK(spec.backend == "gloo",
               "backend: the worker's built-in trainer runs on CPU only, over gloo (", spec.backend,
               "); run an NCCL job as a command: job on --device cuda workers");
  GEOFP8_CHECK(spec.training.optimizer == "adamw",
               "training.optimizer: the worker's trainer implements adamw only (",
               spec.training.optimizer, ")");
  GEOFP8_CHECK(spec.data.source == "synthetic" || spec.data.source == "file",
               "data.source: unknown (", spec.data.source, ")");
  train::TrainOptions to;
  to.model = ValueOrThrow(ModelConfigFor(spec));
  to.optimizer.lr = float(spec.training.lr);
  to.optimizer.min_lr = to.optimizer.lr * kMinLrFraction;
  to.optimizer.warmup_steps = int(spec.training.warmup_steps);
  to.optimizer.total_steps = int(std::max<int64_t>(spec.training.steps, 1));
  to.optimizer.weight_decay = float(spec.training.weight_decay);
  to.optimizer.clip_norm = float(spec.training.grad_clip);
  if (std::string err = model::ValidateOptimizerOptions(to.optimizer); !err.empty()) {
    GEOFP8_FAIL("training: ", err);
  }
  to.ranks = world;
  to.batch = spec.training.batch_size;
  to.seq = spec.training.seq_len;
  to.steps = spec.training.steps;
  to.seed = spec.training.seed;
  to.data_seed = spec.data.seed;
  to.data = "synthetic";
  if (spec.data.source == "file") {
    const auto inside = ResolveInDataDir(options.data_dir, spec.data.path);
    GEOFP8_CHECK(inside.has_value(), "data.path: must stay inside the data directory ",
                 options.data_dir, " (", spec.data.path, ")");
    to.data = *inside;
  }
  to.policy = "coordinator";  // the versions come from the coordinator (SetPolicies)
  to.eval_every = 0;          // the loop owns validation, checksums and checkpoints
  to.eval_batches = spec.training.eval_batches;
  to.checksum_every = 0;
  to.blas_threads = options.blas_threads;
  to.timeout = milliseconds(int64_t(spec.exchange.timeout_s) * 1000);
  if (std::string err = train::ValidateTrainOptions(to); !err.empty()) {
    GEOFP8_FAIL("training: ", err);
  }
  return to;
}

RankAttempt::RankAttempt(AttemptContext ctx) : ctx_(std::move(ctx)), a_(ctx_.assignment) {}

RankAttempt::~RankAttempt() {
  // Before comm_ goes: the watchdog must not abort a destroyed communicator.
  ctx_.stop.SetCommunicator(nullptr);
}

RankAttempt::Agreed RankAttempt::Control() {
  uint64_t words[2] = {kRun, ~ctx_.inbox.NewestHeld()};
  if (ctx_.stop.requested()) words[0] = kStop;
  comm_->MaxReduceWords(words);
  return {ControlWord(words[0]), ~words[1]};
}

VersionPlan RankAttempt::Resolve(const v1::Policy& p) {
  VersionPlan v = PlanOfVersion(p, ctx_.inbox.InitialSchedule(), spec_.exchange,
                                spec_.geometry_refresh, params_);
  if (!v.unscheduled.empty()) {
    // The schedule follows rank 0's layer catalog; wait for it (same answer on every rank).
    ctx_.inbox.WaitForInitialSchedule(ctx_.options.schedule_wait);
    v = PlanOfVersion(p, ctx_.inbox.InitialSchedule(), spec_.exchange, spec_.geometry_refresh,
                      params_);
    GEOFP8_CHECK(v.unscheduled.empty(), "policy v", p.version(),
                 ": no geometry refresh schedule for layer ", v.unscheduled, " arrived within ",
                 ctx_.options.schedule_wait.count(), " ms");
  }
  layer_policies_ = v.plan.layers;
  schedule_ = v.schedule;
  return v;
}

void RankAttempt::Apply(const v1::Policy& p, int64_t step) {
  VersionPlan v = Resolve(p);
  trainer_->SetPolicies(uint64_t(step), std::move(v.plan.layers), std::move(v.schedule),
                        p.version());
  Announce(p, step, step);
}

void RankAttempt::Announce(const v1::Policy& p, int64_t step, int64_t taken) {
  policy_ = p;
  ctx_.inbox.SetInForce(p.version(), taken);
  ctx_.reporter.PolicyInForce(p, step, taken);
}

std::string RankAttempt::ResolveCheckpointDir() const {
  if (spec_.checkpoint.dir.empty() || spec_.checkpoint.every <= 0) return "";
  // The spec was validated by the coordinator and again by ParseJobSpec here; this is the
  // last check before writing, so a spec can never make a worker write outside --data-dir.
  const auto inside = ResolveInDataDir(ctx_.options.data_dir, spec_.checkpoint.dir);
  GEOFP8_CHECK(inside.has_value(), "checkpoint.dir: must stay inside the data directory ",
               ctx_.options.data_dir, " (", spec_.checkpoint.dir, ")");
  std::filesystem::path dir = *inside;
  dir /= a_.job_id();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  GEOFP8_CHECK(!ec, "checkpoint.dir: cannot create ", dir.string(), ": ", ec.message());
  return dir.string();
}

std::string RankAttempt::Fingerprint() const {
  const model::ModelConfig& m = model_config_;
  std::ostringstream os;
  os << "job=" << a_.job_id() << " model=" << m.vocab << "/" << m.dim << "/" << m.layers << "/"
     << m.heads << "/" << m.ffn << "/" << m.seq << " world=" << world_
     << " batch=" << spec_.training.batch_size << " seq=" << spec_.training.seq_len
     << " seed=" << spec_.training.seed;
  return os.str();
}

void RankAttempt::SaveCheckpoint(int64_t next_step) {
  train::Checkpoint c = trainer_->MakeCheckpoint(next_step);
  c.fingerprint = Fingerprint();
  const std::string path = ctx_.checkpoints.Path(next_step);
  try {
    // Written to <path>.tmp, fsynced and renamed: a failure leaves no partial file under the
    // final name, and every file written before stays.
    train::SaveCheckpoint(path, c);
  } catch (const std::exception& e) {
    // A full or failing disk (ENOSPC, EIO) loses this checkpoint only: it is not reported, so
    // the job's recovery point stays at the last one written, and training goes on; the next
    // interval tries again. Failing the rank instead would fail the job for a condition that
    // the operator can clear without it.
    std::error_code ec;
    std::filesystem::remove(path + ".tmp", ec);  // give back what the partial write took
    ctx_.reporter.CheckpointFailed(next_step, e.what());
    return;
  }
  ctx_.reporter.CheckpointWritten(next_step, path);
  ctx_.checkpoints.BoundUnacknowledged(a_.resume_step(), ctx_.stop.requested());
}

train::Checkpoint RankAttempt::FetchCheckpoint(int64_t resume_step) {
  const size_t weights =
      params_.empty() ? 0 : size_t(params_.back().offset + params_.back().size());
  bool have = false;
  train::Checkpoint c;
  const std::string path = checkpoint_dir_.empty() ? "" : ctx_.checkpoints.Path(resume_step);
  if (!path.empty() && std::filesystem::exists(path)) {
    try {
      c = train::LoadCheckpoint(path);
      have = c.next_step == resume_step && c.fingerprint == Fingerprint() &&
             c.weights.size() == weights;
    } catch (const std::exception& e) {
      Log("job " + a_.job_id() + ": ignoring checkpoint " + path + ": " + e.what());
    }
  }
  // Steps past the resume point were trained by an attempt the coordinator gave up on (cut
  // off, say): this attempt writes its own.
  ctx_.checkpoints.PruneAfter(resume_step);
  const uint32_t holder = comm_->MaxReduce(have ? uint32_t(rank_ + 1) : 0u);
  GEOFP8_CHECK(holder > 0, "resume: no rank holds a checkpoint at step ", resume_step,
               " (looked for ", path.empty() ? "<checkpoints off>" : path, " on every worker)");
  const int root = int(holder) - 1;
  std::string bytes = rank_ == root ? train::SerializeCheckpoint(c) : std::string();
  uint64_t size = bytes.size();
  comm_->Broadcast({reinterpret_cast<uint8_t*>(&size), sizeof size}, root);
  bytes.resize(size);
  comm_->Broadcast({reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()}, root);
  if (rank_ != root)
    c = train::ParseCheckpoint(bytes, "rank " + std::to_string(root) + "'s checkpoint");
  Log("job " + a_.job_id() + " rank " + std::to_string(rank_) + ": resumed at step " +
      std::to_string(resume_step) + " from rank " + std::to_string(root) +
      "'s checkpoint (policy v" + std::to_string(c.policy_version) + ")");
  return c;
}

// Rendezvous through the coordinator, under this attempt's key prefix.
void RankAttempt::Connect(const train::TrainOptions& to) {
  store_ = std::make_unique<GrpcStore>(ctx_.connection, a_.job_id(), a_.rendezvous_prefix());
  GlooOptions go;
  go.hostname = ctx_.options.advertise_host;
  go.prefix = "gloo";
  go.timeout = to.timeout;
  comm_ = CreateGlooCommunicator(*store_, rank_, world_, go);
  comm_->set_timeout(go.timeout);
  ctx_.stop.SetCommunicator(comm_.get());
  Log("job " + a_.job_id() + " attempt " + std::to_string(a_.attempt()) + ": rank " +
      std::to_string(rank_) + "/" + std::to_string(world_) + " connected over gloo");
}

void RankAttempt::Begin(const train::TrainOptions& to, int64_t start) {
  policy_.set_version(0);
  std::optional<train::Checkpoint> resumed;
  if (start > 0) resumed = FetchCheckpoint(start);
  std::optional<v1::Policy> first =
      ctx_.inbox.TakeStart(start, resumed ? resumed->policy_version : 0);
  GEOFP8_CHECK(first.has_value(), "policy: no version in force at step ", start);
  {
    VersionPlan v = Resolve(*first);
    trainer_ = std::make_unique<train::Trainer>(to, *comm_, std::move(v.plan),
                                                std::move(v.schedule), first->version());
  }
  if (spec_.auto_policy.enabled && rank_ == 0) {
    ProbeSettings ps;
    ps.probe_every = spec_.auto_policy.probe_every;
    ps.mode = spec_.auto_policy.geometry;
    ps.rank = spec_.auto_policy.rank;
    ps.estimator = spec_.geometry_refresh.estimator;
    ps.sketch = spec_.geometry_refresh.sketch;
    ps.refresh_interval = spec_.geometry_refresh.interval;
    ps.seed = spec_.training.seed;
    prober_ = std::make_unique<GeometryProbe>(params_, ps);
  }
  if (resumed) trainer_->Restore(*resumed);
  Announce(*first, start, first->has_taken_step() ? first->taken_step() : start);
}

bool RankAttempt::Step(int64_t step, int64_t steps, double baseline_per_step, JobOutcome& out) {
  const Agreed agreed = Control();
  const ControlWord control = agreed.control;
  if (control != kRun) {
    const std::string stop_reason = ctx_.stop.reason();
    out.stopped = true;
    out.reason =
        control == kAbort ? "aborted at step " + std::to_string(step) + ": another rank failed"
        : !stop_reason.empty()
            ? "stopped at step " + std::to_string(step) + ": " + stop_reason
            : "stopped at step " + std::to_string(step) + " (another rank was told to stop)";
    out.steps = step;
    return false;
  }
  if (std::optional<v1::Policy> due = ctx_.inbox.TakeDue(step, agreed.policy_version)) {
    Apply(*due, step);
  }

  train::StepControl sc;
  sc.measure_error = ctx_.options.summary_every > 0 && step % ctx_.options.summary_every == 0;
  const bool probe = prober_ && prober_->IsProbeStep(step);
  sc.keep_local = probe;
  const train::StepRecord rec = trainer_->Step(step, sc);
  if (sc.measure_error) ctx_.reporter.Summaries(rec, params_, *trainer_);
  if (probe) {
    ctx_.reporter.Probes(
        step, prober_->Probe(trainer_->local_gradient(), layer_policies_, trainer_->exchanger()),
        params_, *trainer_, last_step_seconds_);
  }
  // The gradient buffers hold the step's averaged (clipped) gradient now.
  if (prober_ && prober_->Observes(step)) {
    prober_->Observe(step, trainer_->model().grads(), layer_policies_);
  }
  last_step_seconds_ = rec.step_seconds;
  const double tps = rec.step_seconds > 0 ? double(rec.tokens) / rec.step_seconds : 0;
  tokens_per_second_ = tokens_per_second_ == 0
                           ? tps
                           : kThroughputDecay * tokens_per_second_ + (1 - kThroughputDecay) * tps;
  GEOFP8_CHECK(std::isfinite(rec.loss) || rec.skipped, "loss is not finite at step ", step);

  ctx_.reporter.StepMetrics(step, rec, tokens_per_second_, params_, layer_policies_, schedule_,
                            *trainer_);
  const bool last = step + 1 == steps;
  // Validation is collective: every rank runs the same loop, so all take this branch.
  double val_loss = NAN;
  if (last || (spec_.training.eval_every > 0 && (step + 1) % spec_.training.eval_every == 0)) {
    val_loss = trainer_->Validate();
  }
  ctx_.reporter.Progress(step, steps, rec.loss, tokens_per_second_, trainer_->bytes_sent(),
                         uint64_t(baseline_per_step * double(step + 1)), policy_.version(),
                         val_loss, rec.gradient_noise_scale);

  if (last || (ctx_.options.checksum_every > 0 && (step + 1) % ctx_.options.checksum_every == 0)) {
    const uint64_t checksum = trainer_->VerifyChecksum(step);
    if (last) out.checksum = checksum;
  }
  if (!checkpoint_dir_.empty() && (last || (step + 1) % spec_.checkpoint.every == 0)) {
    SaveCheckpoint(step + 1);
  }
  if (ctx_.options.debug_step_delay.count() > 0) {
    std::this_thread::sleep_for(ctx_.options.debug_step_delay);
  }
  return true;
}

JobOutcome RankAttempt::Run() {
  JobOutcome out;
  rank_ = a_.rank();
  world_ = a_.world_size();
  spec_ = ValueOrThrow(ParseJobSpec(a_.spec_yaml()), "spec: ");
  const train::TrainOptions to = TrainOptionsFor(spec_, world_, ctx_.options);
  model_config_ = to.model;
  params_ = model::Model<float>(model_config_).params();
  model::SetBlasThreads(ctx_.options.blas_threads);
  checkpoint_dir_ = ResolveCheckpointDir();
  ctx_.checkpoints.SetDir(checkpoint_dir_);
  ctx_.inbox.LoadVersions(a_, *ctx_.connection);

  Connect(to);
  if (rank_ == 0) ctx_.reporter.Catalog(params_);

  const int64_t start = a_.resume_step() > 0 ? a_.resume_step() : 0;
  Begin(to, start);

  const int64_t steps = spec_.training.steps;
  const double baseline_per_step =
      world_ > 1 ? 2.0 * (world_ - 1) / world_ * 4.0 * double(trainer_->model().weights().size())
                 : 0.0;
  for (int64_t step = start; step < steps; ++step) {
    if (!Step(step, steps, baseline_per_step, out)) return out;
  }
  out.success = true;
  out.steps = steps;
  out.policy_version = policy_.version();
  if (start == steps) out.checksum = trainer_->VerifyChecksum(steps - 1);
  out.reason =
      "completed " + std::to_string(steps) + " steps; checksum " + HexChecksum(out.checksum);
  return out;
}

}  // namespace geofp8::worker
