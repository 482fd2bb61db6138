// One rank's training loop under the coordinator (see job_runner.h). Per step:
//   control consensus (stop / abort) -> policy version due at this step (Trainer::SetPolicies)
//   -> Trainer::Step (batch, forward+backward with buckets into the exchange engine, average,
//   clip, AdamW, loss all-reduce) -> progress, metrics, summaries, probes, checksum, checkpoint.

#include "worker/daemon/job_runner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include "kernels/codec/codec.h"
#include "kernels/common/check.h"
#include "kernels/exchange/exchanger.h"
#include "kernels/exchange/gloo_communicator.h"
#include "kernels/geometry/geometry.h"
#include "kernels/model/ops.h"
#include "kernels/model/optimizer.h"
#include "kernels/policy/policy.h"
#include "worker/daemon/geometry_probe.h"
#include "worker/daemon/grpc_store.h"
#include "worker/daemon/log.h"
#include "worker/train/checkpoint.h"
#include "worker/train/trainer.h"

namespace geofp8::worker {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// The cosine schedule ends at this fraction of the peak learning rate (geofp8-train's defaults:
// 3e-3 -> 3e-4).
constexpr float kMinLrFraction = 0.1f;
// Reported tokens/s is an EMA over steps with this decay (about 5 steps of memory).
constexpr double kThroughputDecay = 0.8;

absl::StatusOr<model::ModelConfig> ModelConfigFor(const JobSpec& spec) {
  std::optional<model::ModelConfig> mc = model::PresetConfig(spec.model.preset);
  if (!mc) {
    return absl::InvalidArgumentError("model.preset: unknown preset '" + spec.model.preset +
                                      "' (accepted: " + std::string(model::AcceptedPresets()) +
                                      ")");
  }
  // The preset's context length is a default; the job's sequence length wins when longer.
  mc->seq = std::max(mc->seq, spec.training.seq_len);
  if (std::string err = model::ValidateModelConfig(*mc); !err.empty()) {
    return absl::InvalidArgumentError(err);
  }
  return *mc;
}

std::string CheckpointFile(const std::string& dir, const std::string& worker_name, int64_t step) {
  return (std::filesystem::path(dir) / (worker_name + "." + std::to_string(step) + ".ckpt"))
      .string();
}

namespace {

// The step of a file named <worker_name>.<step>.ckpt; -1 for any other name.
int64_t CheckpointStepOf(const std::string& file, const std::string& worker_name) {
  const std::string prefix = worker_name + ".", suffix = ".ckpt";
  if (file.size() <= prefix.size() + suffix.size() || file.compare(0, prefix.size(), prefix) != 0 ||
      file.compare(file.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return -1;
  }
  const std::string digits =
      file.substr(prefix.size(), file.size() - prefix.size() - suffix.size());
  if (digits.empty() || digits.size() > 18 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    return -1;
  }
  return std::stoll(digits);
}

}  // namespace

int PruneCheckpoints(const std::string& dir, const std::string& worker_name,
                     const std::function<bool(int64_t step)>& remove) {
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const int64_t step = CheckpointStepOf(entry.path().filename().string(), worker_name);
    if (step >= 0 && remove(step) && std::filesystem::remove(entry.path(), ec)) ++removed;
  }
  return removed;
}

std::vector<int64_t> ListCheckpoints(const std::string& dir, const std::string& worker_name) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const int64_t step = CheckpointStepOf(entry.path().filename().string(), worker_name);
    if (step >= 0) steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

namespace {

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Encoded size of a layer under its policy, to attribute a bucket's wire bytes to its layers.
double EncodedWeight(const LayerPolicy& p, int64_t count) {
  if (p.format == Format::kFp32) return 4.0 * double(count);
  if (p.format == Format::kBf16) return 2.0 * double(count);
  CodecOptions o;
  o.format = p.format;
  o.scaling = p.scaling;
  o.block = p.block;
  try {
    return double(EncodedBytes(o, size_t(count)));
  } catch (const std::exception&) {
    return double(count);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

struct JobRunner::Impl {
  JobRunner& r;
  const v1::Assignment& a;
  JobSpec spec;
  model::ModelConfig model_config;
  std::vector<model::ParamInfo> params;  // the model's parameters, in exchange layer order
  std::unique_ptr<GrpcStore> store;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<train::Trainer> trainer;  // model, optimizer, data, exchange engine
  std::unique_ptr<GeometryProbe> prober;    // rank 0 of an auto_policy job
  std::vector<LayerPolicy> layer_policies;  // of the version in force (for metrics and probes)
  std::vector<RefreshSchedule> schedule;    // of the version in force; empty: no geometry
  v1::Policy policy;                        // in force
  std::string checkpoint_dir;               // <checkpoint.dir>/<job id>; empty: checkpoints off
  double last_step_seconds = 0;
  int rank = 0, world = 1, seq = 0;
  double tokens_per_second = 0;

  explicit Impl(JobRunner& runner) : r(runner), a(runner.assignment_) {}
  ~Impl() {
    std::lock_guard<std::mutex> lock(r.mu_);
    r.comm_ = nullptr;  // before comm goes: the watchdog must not abort a destroyed communicator
  }

  void Send(v1::WorkerMessage m, bool reliable) { r.send_(std::move(m), reliable); }

  // Registers every policy version of the job the coordinator knows, so a resumed attempt
  // applies the one in force at its start step and queues the later ones.
  void LoadPolicyVersions() {
    // The assignment carries the version in force at the resume step and every later one.
    if (a.policy_history_size() > 0) {
      std::lock_guard<std::mutex> lock(r.mu_);
      for (const auto& p : a.policy_history()) r.policies_.emplace(p.version(), p);
      r.policies_.emplace(a.policy().version(), a.policy());
      return;
    }
    // An assignment without history (an older coordinator): ask for the versions.
    auto stub = v1::PolicyService::NewStub(r.connection_->channel());
    v1::ListPolicyVersionsRequest req;
    req.set_job_id(a.job_id());
    v1::ListPolicyVersionsResponse resp;
    grpc::Status s =
        stub->ListPolicyVersions(r.connection_->Context(milliseconds(10000)).get(), req, &resp);
    std::lock_guard<std::mutex> lock(r.mu_);
    if (s.ok()) {
      for (const auto& p : resp.policies()) r.policies_.emplace(p.version(), p);
    } else {
      Log("job " + a.job_id() + ": listing policy versions failed (" + DescribeStatus(s) +
          "); using the assignment's policy v" + std::to_string(a.policy().version()));
    }
    r.policies_.emplace(a.policy().version(), a.policy());
  }

  // The version to put in force from the start of `step` (nullopt: the one in force stays),
  // removing it and every older queued version. `agreed` is the newest version that every rank
  // holds (Control). A taken version (one a resumed attempt replays) applies exactly at its
  // taken_step, and until the last of them has, nothing else does. Any other version applies at
  // the first step at or after its effective_step (a lower bound) at which every rank holds it.
  // Every rank decides with the same `agreed` and the same queued versions up to it (versions
  // reach a rank in order), so all of them switch at the same step, and none has passed it.
  std::optional<v1::Policy> TakeDuePolicy(int64_t step, uint64_t agreed) {
    std::lock_guard<std::mutex> lock(r.mu_);
    const uint64_t in_force = policy.version();
    std::optional<v1::Policy> due;
    bool replaying = false;
    for (const auto& [v, p] : r.policies_) {
      if (v <= in_force || !p.has_taken_step()) continue;
      if (p.taken_step() <= step) {
        due = p;
      } else {
        replaying = true;
      }
    }
    if (!replaying) {
      for (const auto& [v, p] : r.policies_) {
        if (v <= in_force || v > agreed || p.has_taken_step() || (due && v < due->version())) {
          continue;
        }
        if (p.effective_step() <= step) due = p;
      }
    }
    const uint64_t drop = due ? due->version() : in_force;
    r.policies_.erase(r.policies_.begin(), r.policies_.upper_bound(drop));
    return due;
  }

  // The version in force at the start step of the attempt: the newest taken at or before it
  // (for a job from an older coordinator, whose versions carry no taken_step, the newest
  // effective at or before it). When the resumed checkpoint was written under a newer version
  // that the coordinator never heard was taken (rank 0's report was lost in a coordinator
  // outage), that one: it was in force at the step before. It and the queued versions before it
  // are removed.
  std::optional<v1::Policy> TakeStartPolicy(int64_t start, uint64_t written_under) {
    std::lock_guard<std::mutex> lock(r.mu_);
    std::optional<v1::Policy> first, legacy;
    for (const auto& [v, p] : r.policies_) {
      if (p.has_taken_step() && p.taken_step() <= start) first = p;
      if (!p.has_taken_step() && p.effective_step() <= start) legacy = p;
    }
    if (!first) first = legacy;
    if (auto it = r.policies_.find(written_under); first && written_under > first->version() &&
                                                   it != r.policies_.end() &&
                                                   !it->second.has_taken_step()) {
      first = it->second;
    }
    if (first) r.policies_.erase(r.policies_.begin(), r.policies_.upper_bound(first->version()));
    return first;
  }

  // The newest version this rank holds, in force or queued.
  uint64_t NewestHeld() {
    std::lock_guard<std::mutex> lock(r.mu_);
    return std::max(policy.version(), r.policies_.empty() ? 0 : r.policies_.rbegin()->first);
  }

  // Schedule for the exchanger: the policy's own, else the one sent for the catalog. Layers
  // without geometry get an entry that never fires on a used layer.
  std::vector<RefreshSchedule> ScheduleFor(const v1::Policy& p, bool* missing, std::string* which) {
    std::map<std::string, v1::RefreshSchedule> by_layer;
    {
      std::lock_guard<std::mutex> lock(r.mu_);
      for (const auto& s : r.initial_schedule_) by_layer[s.layer()] = s;
    }
    for (const auto& s : p.refresh()) by_layer[s.layer()] = s;
    std::vector<RefreshSchedule> out;
    *missing = false;
    for (size_t l = 0; l < params.size(); ++l) {
      RefreshSchedule rs;
      rs.owner = 0;
      rs.interval = std::numeric_limits<int>::max();
      rs.offset = 0;
      auto it = by_layer.find(params[l].name);
      if (it != by_layer.end()) {
        rs.owner = it->second.owner();
        rs.interval = std::max(1, it->second.interval());
        rs.offset = std::max(0, it->second.offset());
      } else if (layer_policies.size() > l && layer_policies[l].geometry != GeometryMode::kNone) {
        *missing = true;
        *which = params[l].name;
      }
      out.push_back(rs);
    }
    return out;
  }

  bool UsesGeometry() const {
    for (const auto& p : layer_policies) {
      if (p.geometry != GeometryMode::kNone) return true;
    }
    return false;
  }

  // Every layer's policy under `p` and the refresh schedule (empty when no layer uses geometry),
  // kept as the ones in force: Apply hands them to the trainer for the step about to run.
  std::vector<RefreshSchedule> Resolve(const v1::Policy& p) {
    auto resolved = ResolveLayers(p, params);
    GEOFP8_CHECK(resolved.ok(), std::string(resolved.status().message()));
    layer_policies = *resolved;
    schedule.clear();
    if (UsesGeometry()) {
      bool missing = false;
      std::string which;
      schedule = ScheduleFor(p, &missing, &which);
      if (missing) {
        // The schedule follows rank 0's layer catalog; wait for it (same answer on every rank).
        std::unique_lock<std::mutex> lock(r.mu_);
        r.cv_.wait_for(lock, r.options_.schedule_wait,
                       [&] { return !r.initial_schedule_.empty() || !r.stop_reason_.empty(); });
        lock.unlock();
        schedule = ScheduleFor(p, &missing, &which);
        GEOFP8_CHECK(!missing, "policy v", p.version(), ": no geometry refresh schedule for layer ",
                     which, " arrived within ", r.options_.schedule_wait.count(), " ms");
      }
    }
    return schedule;
  }

  // Puts `p` in force from `step`: the trainer switches its exchange at that step boundary,
  // keeping the geometry of layers whose mode and rank stay (Trainer::SetPolicies).
  void Apply(const v1::Policy& p, int64_t step) {
    std::vector<RefreshSchedule> schedule = Resolve(p);
    trainer->SetPolicies(uint64_t(step), layer_policies, std::move(schedule), p.version());
    Announce(p, step, step);
  }

  // `taken` is the step the version was put in force at: `step` for a switch now, earlier for
  // the version a resumed attempt starts under. Rank 0's report is what the coordinator records
  // (reliable: a resumed attempt replays by it).
  void Announce(const v1::Policy& p, int64_t step, int64_t taken) {
    policy = p;
    r.version_in_force_ = p.version();
    if (r.metrics_) r.metrics_->PolicyVersion(p.version());
    Log("job " + a.job_id() + " rank " + std::to_string(rank) + ": policy v" +
        std::to_string(p.version()) + " in force from step " + std::to_string(step) + " (" +
        p.reason() + ")");
    v1::WorkerMessage ack;
    ack.mutable_policy_ack()->set_version(p.version());
    ack.mutable_policy_ack()->set_step(taken);
    ack.mutable_policy_ack()->set_job_id(a.job_id());
    ack.mutable_policy_ack()->set_attempt(a.attempt());
    Send(std::move(ack), rank == 0);
  }

  std::string ResolveCheckpointDir() const {
    if (spec.checkpoint.dir.empty() || spec.checkpoint.every <= 0) return "";
    // The spec was validated by the coordinator and again by ParseJobSpec here; this is the
    // last check before writing, so a spec can never make a worker write outside --data-dir.
    const auto inside = ResolveInDataDir(r.options_.data_dir, spec.checkpoint.dir);
    GEOFP8_CHECK(inside.has_value(), "checkpoint.dir: must stay inside the data directory ",
                 r.options_.data_dir, " (", spec.checkpoint.dir, ")");
    std::filesystem::path dir = *inside;
    dir /= a.job_id();
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    GEOFP8_CHECK(!ec, "checkpoint.dir: cannot create ", dir.string(), ": ", ec.message());
    return dir.string();
  }

  std::string CheckpointPath(int64_t step) const {
    return CheckpointFile(checkpoint_dir, r.options_.worker_name, step);
  }

  std::string Fingerprint() const {
    const model::ModelConfig& m = model_config;
    std::ostringstream os;
    os << "job=" << a.job_id() << " model=" << m.vocab << "/" << m.dim << "/" << m.layers << "/"
       << m.heads << "/" << m.ffn << "/" << m.seq << " world=" << world
       << " batch=" << spec.training.batch_size << " seq=" << seq << " seed=" << spec.training.seed;
    return os.str();
  }

  void SaveCheckpoint(int64_t next_step) {
    train::Checkpoint c = trainer->MakeCheckpoint(next_step);
    c.fingerprint = Fingerprint();
    train::SaveCheckpoint(CheckpointPath(next_step), c);
    if (r.metrics_) r.metrics_->Checkpoint(next_step);
    // Every rank reports: rank 0's report moves the job's recovery point, and the Ack to each
    // rank says where that point is, below which the rank deletes its older files.
    v1::WorkerMessage m;
    m.mutable_checkpoint()->set_step(next_step);
    m.mutable_checkpoint()->set_path(CheckpointPath(next_step));
    m.mutable_checkpoint()->set_job_id(a.job_id());
    m.mutable_checkpoint()->set_attempt(a.attempt());
    Send(std::move(m), true);
    BoundUnacknowledged();
  }

  // A rank cut off from the coordinator gets no Acks and so deletes nothing: over a long outage
  // its files would fill the disk. It keeps what a restart may resume from: the acknowledged
  // recovery point (and this attempt's resume step); the first file after it (the coordinator
  // may have persisted that report just before it went away, its Ack lost); and the newest
  // keep_unacknowledged files, of which the job resumes after an outage (the newest step every
  // rank holds: the ranks are at most one checkpoint apart). Once a stop is asked for (a lost
  // session, say) nothing more is deleted, so what a worker reports when it registers again
  // stays on disk.
  void BoundUnacknowledged() {
    int64_t floor = 0;
    {
      std::lock_guard<std::mutex> lock(r.mu_);
      if (!r.stop_reason_.empty()) return;
      floor = std::max(r.acknowledged_checkpoint_, a.resume_step());
    }
    std::vector<int64_t> steps = ListCheckpoints(checkpoint_dir, r.options_.worker_name);
    std::erase_if(steps, [&](int64_t s) { return s <= floor; });
    const size_t keep = size_t(std::max(2, r.options_.keep_unacknowledged));
    if (steps.size() <= keep + 1) return;
    const int64_t first_after = steps.front(), keep_from = steps[steps.size() - keep];
    PruneCheckpoints(checkpoint_dir, r.options_.worker_name,
                     [&](int64_t s) { return s > first_after && s < keep_from; });
  }

  // The checkpoint to resume at a.resume_step() from: any rank whose own checkpoint is at that
  // step broadcasts it (every rank's is identical), so a restart may land on different workers.
  // Fetched before the trainer exists: the policy version it was written under can decide the
  // version the attempt starts with (TakeStartPolicy). Its geometry, written under an older
  // version, is kept where the version in force now would have kept it (Trainer::Restore).
  train::Checkpoint FetchCheckpoint(int64_t resume_step) {
    const size_t weights = params.empty() ? 0 : size_t(params.back().offset + params.back().size());
    bool have = false;
    train::Checkpoint c;
    const std::string path = checkpoint_dir.empty() ? "" : CheckpointPath(resume_step);
    if (!path.empty() && std::filesystem::exists(path)) {
      try {
        c = train::LoadCheckpoint(path);
        have = c.next_step == resume_step && c.fingerprint == Fingerprint() &&
               c.weights.size() == weights;
      } catch (const std::exception& e) {
        Log("job " + a.job_id() + ": ignoring checkpoint " + path + ": " + e.what());
      }
    }
    // Steps past the resume point were trained by an attempt the coordinator gave up on (cut
    // off, say): this attempt writes its own.
    if (!checkpoint_dir.empty()) {
      PruneCheckpoints(checkpoint_dir, r.options_.worker_name,
                       [&](int64_t s) { return s > resume_step; });
    }
    const uint32_t holder = comm->MaxReduce(have ? uint32_t(rank + 1) : 0u);
    GEOFP8_CHECK(holder > 0, "resume: no rank holds a checkpoint at step ", resume_step,
                 " (looked for ", path.empty() ? "<checkpoints off>" : path, " on every worker)");
    const int root = int(holder) - 1;
    std::string bytes = rank == root ? train::SerializeCheckpoint(c) : std::string();
    uint64_t size = bytes.size();
    comm->Broadcast({reinterpret_cast<uint8_t*>(&size), sizeof size}, root);
    bytes.resize(size);
    comm->Broadcast({reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()}, root);
    if (rank != root)
      c = train::ParseCheckpoint(bytes, "rank " + std::to_string(root) + "'s checkpoint");
    Log("job " + a.job_id() + " rank " + std::to_string(rank) + ": resumed at step " +
        std::to_string(resume_step) + " from rank " + std::to_string(root) +
        "'s checkpoint (policy v" + std::to_string(c.policy_version) + ")");
    return c;
  }

  // Rank 0 sends each layer's rel_fro_error and residual-subspace error from a measured step,
  // with its geometry version and the drift of its last refresh.
  void Summaries(const train::StepRecord& rec) {
    if (rank != 0) return;
    v1::WorkerMessage m;
    auto* sums = m.mutable_summaries();
    for (size_t l = 0; l < params.size(); ++l) {
      auto* s = sums->add_layers();
      s->set_layer(params[l].name);
      s->set_step(rec.step);
      s->set_rel_fro_error(rec.layer_error[l]);
      s->set_residual_error(rec.residual_error[l]);
      s->set_geometry_version(trainer->exchanger().active_geometry(uint32_t(l)).version);
      s->set_drift(trainer->last_drift()[l]);
      if (r.metrics_) r.metrics_->LayerError(params[l].name, rec.layer_error[l]);
    }
    Send(std::move(m), false);
  }

  // Auto mode (DESIGN.md section 2): rank 0 quantizes each matrix's local gradient with and
  // without the basis the layer deploys (or, while off, would deploy), no communication, and
  // reports the errors and the transform cost (geometry_probe.h).
  void Probes(int64_t step) {
    v1::WorkerMessage m;
    auto* probes = m.mutable_probes();
    for (const LayerProbe& lp :
         prober->Probe(trainer->local_gradient(), layer_policies, trainer->exchanger())) {
      const std::string& name = params[lp.layer].name;
      auto* pr = probes->add_probes();
      pr->set_layer(name);
      pr->set_step(step);
      pr->set_error_without(lp.error_without);
      pr->set_error_with(lp.error_with);
      pr->set_transform_seconds(lp.transform_seconds);
      pr->set_step_seconds(last_step_seconds);
      pr->set_drift(trainer->last_drift()[lp.layer]);
      pr->set_basis(lp.basis == ProbeBasisKind::kDeployed ? v1::PROBE_BASIS_DEPLOYED
                                                          : v1::PROBE_BASIS_SHADOW);
      if (r.metrics_ && lp.error_with > 0) {
        r.metrics_->ProbeGain(name, ProbeBasisName(pr->basis()), lp.error_without / lp.error_with);
      }
    }
    if (probes->probes_size() > 0) Send(std::move(m), false);
  }

  // The decisions every rank takes at a step boundary, agreed by one max-reduction: the most
  // severe wish of any rank wins; and the newest policy version every rank holds (the minimum
  // over ranks, as the maximum of the complements), which TakeDuePolicy may put in force.
  enum ControlWord : uint32_t { kRun = 0, kStop = 1, kAbort = 2 /* a rank failed */ };
  struct Agreed {
    ControlWord control;
    uint64_t policy_version;
  };
  Agreed Control() {
    uint64_t words[2] = {kRun, ~NewestHeld()};
    {
      std::lock_guard<std::mutex> lock(r.mu_);
      if (!r.stop_reason_.empty()) words[0] = kStop;
    }
    comm->MaxReduceWords(words);
    return {ControlWord(words[0]), ~words[1]};
  }

  JobOutcome Run() {
    JobOutcome out;
    rank = a.rank();
    world = a.world_size();
    auto parsed = ParseJobSpec(a.spec_yaml());
    GEOFP8_CHECK(parsed.ok(), "spec: ", std::string(parsed.status().message()));
    spec = *parsed;
    GEOFP8_CHECK(spec.backend == "gloo",
                 "backend: this worker runs --device cpu, which needs gloo (", spec.backend, ")");
    GEOFP8_CHECK(spec.training.optimizer == "adamw",
                 "training.optimizer: the worker's trainer implements adamw only (",
                 spec.training.optimizer, ")");
    GEOFP8_CHECK(spec.data.source == "synthetic" || spec.data.source == "file",
                 "data.source: unknown (", spec.data.source, ")");
    auto mc = ModelConfigFor(spec);
    GEOFP8_CHECK(mc.ok(), std::string(mc.status().message()));
    model_config = *mc;
    params = model::Model<float>(model_config).params();
    model::SetBlasThreads(r.options_.blas_threads);
    seq = spec.training.seq_len;
    train::TrainOptions to;
    to.model = model_config;
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
    to.seq = seq;
    to.steps = spec.training.steps;
    to.seed = spec.training.seed;
    to.data_seed = spec.data.seed;
    to.data = "synthetic";
    if (spec.data.source == "file") {
      const auto inside = ResolveInDataDir(r.options_.data_dir, spec.data.path);
      GEOFP8_CHECK(inside.has_value(), "data.path: must stay inside the data directory ",
                   r.options_.data_dir, " (", spec.data.path, ")");
      to.data = *inside;
    }
    to.policy = "coordinator";  // the versions come from the coordinator (SetPolicies)
    to.eval_every = 0;          // the loop below owns validation, checksums and checkpoints
    to.eval_batches = spec.training.eval_batches;
    to.checksum_every = 0;
    to.blas_threads = r.options_.blas_threads;
    to.timeout = milliseconds(int64_t(spec.exchange.timeout_s) * 1000);
    if (std::string err = train::ValidateTrainOptions(to); !err.empty()) {
      GEOFP8_FAIL("training: ", err);
    }
    checkpoint_dir = ResolveCheckpointDir();
    {
      std::lock_guard<std::mutex> lock(r.mu_);
      r.checkpoint_dir_ = checkpoint_dir;
    }
    LoadPolicyVersions();

    // Rendezvous through the coordinator, under this attempt's key prefix.
    store = std::make_unique<GrpcStore>(r.connection_, a.job_id(), a.rendezvous_prefix());
    GlooOptions go;
    go.hostname = r.options_.advertise_host;
    go.prefix = "gloo";
    go.timeout = to.timeout;
    comm = CreateGlooCommunicator(*store, rank, world, go);
    comm->set_timeout(go.timeout);
    {
      std::lock_guard<std::mutex> lock(r.mu_);
      r.comm_ = comm.get();
    }
    r.cv_.notify_all();
    Log("job " + a.job_id() + " attempt " + std::to_string(a.attempt()) + ": rank " +
        std::to_string(rank) + "/" + std::to_string(world) + " connected over gloo");

    if (rank == 0) {
      v1::WorkerMessage m;
      for (const auto& p : params) {
        auto* li = m.mutable_catalog()->add_layers();
        li->set_name(p.name);
        li->set_rows(p.is_matrix() ? p.rows : p.size());
        li->set_cols(p.is_matrix() ? p.cols : 1);
      }
      Send(std::move(m), true);
    }

    const int64_t start = a.resume_step() > 0 ? a.resume_step() : 0;
    policy.set_version(0);
    std::optional<train::Checkpoint> resumed;
    if (start > 0) resumed = FetchCheckpoint(start);
    std::optional<v1::Policy> first = TakeStartPolicy(start, resumed ? resumed->policy_version : 0);
    GEOFP8_CHECK(first.has_value(), "policy: no version in force at step ", start);
    {
      train::ExchangePlan plan;
      plan.name = "policy v" + std::to_string(first->version());
      plan.algorithm = spec.exchange.algorithm;
      plan.bucket_cap_bytes = size_t(std::max(1.0, spec.exchange.bucket_mb * 1024 * 1024));
      std::vector<RefreshSchedule> schedule = Resolve(*first);
      plan.layers = layer_policies;
      plan.refresh = spec.geometry_refresh;
      trainer = std::make_unique<train::Trainer>(to, *comm, std::move(plan), std::move(schedule),
                                                 first->version());
    }
    if (spec.auto_policy.enabled && rank == 0) {
      ProbeSettings ps;
      ps.probe_every = spec.auto_policy.probe_every;
      ps.mode = spec.auto_policy.geometry;
      ps.rank = spec.auto_policy.rank;
      ps.estimator = spec.geometry_refresh.estimator;
      ps.sketch = spec.geometry_refresh.sketch;
      ps.refresh_interval = spec.geometry_refresh.interval;
      ps.seed = spec.training.seed;
      prober = std::make_unique<GeometryProbe>(params, ps);
    }
    if (resumed) trainer->Restore(*resumed);
    Announce(*first, start, first->has_taken_step() ? first->taken_step() : start);

    const int64_t steps = spec.training.steps;
    const double baseline_per_step =
        world > 1 ? 2.0 * (world - 1) / world * 4.0 * double(trainer->model().weights().size())
                  : 0.0;
    for (int64_t step = start; step < steps; ++step) {
      const Agreed agreed = Control();
      const ControlWord control = agreed.control;
      if (control != kRun) {
        std::lock_guard<std::mutex> lock(r.mu_);
        out.stopped = true;
        out.reason =
            control == kAbort ? "aborted at step " + std::to_string(step) + ": another rank failed"
            : !r.stop_reason_.empty()
                ? "stopped at step " + std::to_string(step) + ": " + r.stop_reason_
                : "stopped at step " + std::to_string(step) + " (another rank was told to stop)";
        out.steps = step;
        return out;
      }
      if (std::optional<v1::Policy> due = TakeDuePolicy(step, agreed.policy_version)) {
        Apply(*due, step);
      }

      train::StepControl sc;
      sc.measure_error = r.options_.summary_every > 0 && step % r.options_.summary_every == 0;
      const bool probe = prober && prober->IsProbeStep(step);
      sc.keep_local = probe;
      const train::StepRecord rec = trainer->Step(step, sc);
      if (sc.measure_error) Summaries(rec);
      if (probe) Probes(step);
      // The gradient buffers hold the step's averaged (clipped) gradient now.
      if (prober && prober->Observes(step)) {
        prober->Observe(step, trainer->model().grads(), layer_policies);
      }
      last_step_seconds = rec.step_seconds;
      const double tps = rec.step_seconds > 0 ? double(rec.tokens) / rec.step_seconds : 0;
      tokens_per_second = tokens_per_second == 0
                              ? tps
                              : kThroughputDecay * tokens_per_second + (1 - kThroughputDecay) * tps;
      GEOFP8_CHECK(std::isfinite(rec.loss) || rec.skipped, "loss is not finite at step ", step);

      if (r.metrics_) {
        r.metrics_->Step(step, rec.loss, tokens_per_second, rec.step_seconds, rec.exchange_seconds,
                         rec.skipped);
        for (const BucketResult& b : rec.exchange.buckets) {
          const auto& ls = trainer->exchanger().buckets()[b.bucket].layers;
          double total = 0;
          for (uint32_t l : ls) total += EncodedWeight(layer_policies[l], params[l].size());
          for (uint32_t l : ls) {
            const double share =
                total > 0 ? EncodedWeight(layer_policies[l], params[l].size()) / total : 0;
            r.metrics_->LayerBytes(params[l].name,
                                   std::string(FormatNameOf(layer_policies[l].format)),
                                   double(b.bytes_sent) * share);
          }
        }
        for (const RefreshRecord& rr : rec.exchange.refreshes) {
          // Every rank learns each refresh; the metric counts the ones this rank estimated.
          if (schedule[rr.layer].owner == rank) {
            r.metrics_->Refresh(params[rr.layer].name, rr.drift);
          }
        }
      }
      const bool last = step + 1 == steps;
      // Validation is collective: every rank runs the same loop, so all take this branch.
      double val_loss = NAN;
      if (last || (spec.training.eval_every > 0 && (step + 1) % spec.training.eval_every == 0)) {
        val_loss = trainer->Validate();
        if (r.metrics_) r.metrics_->ValidationLoss(step, val_loss);
      }
      v1::WorkerMessage pm;
      auto* p = pm.mutable_progress();
      p->set_step(step);
      p->set_loss(rec.loss);
      p->set_tokens_per_second(tokens_per_second);
      p->set_bytes_sent(trainer->bytes_sent());
      p->set_bytes_baseline(uint64_t(baseline_per_step * double(step + 1)));
      p->set_policy_version(policy.version());
      if (!std::isnan(val_loss)) p->set_val_loss(val_loss);
      Send(std::move(pm), false);

      if (last || (r.options_.checksum_every > 0 && (step + 1) % r.options_.checksum_every == 0)) {
        const uint64_t checksum = trainer->VerifyChecksum(step);
        if (last) out.checksum = checksum;
      }
      if (!checkpoint_dir.empty() && (last || (step + 1) % spec.checkpoint.every == 0)) {
        SaveCheckpoint(step + 1);
      }
      if (r.options_.debug_step_delay.count() > 0) {
        std::this_thread::sleep_for(r.options_.debug_step_delay);
      }
    }
    out.success = true;
    out.steps = steps;
    out.policy_version = policy.version();
    if (start == steps) out.checksum = trainer->VerifyChecksum(steps - 1);
    out.reason = "completed " + std::to_string(steps) + " steps; checksum " + Hex(out.checksum);
    return out;
  }
};

// ---------------------------------------------------------------------------------------------

JobRunner::JobRunner(std::shared_ptr<Connection> connection, v1::Assignment assignment,
                     JobRunnerOptions options, SendFn send, WorkerMetrics* metrics)
    : connection_(std::move(connection)),
      assignment_(std::move(assignment)),
      options_(std::move(options)),
      send_(std::move(send)),
      metrics_(metrics) {
  for (const auto& s : assignment_.policy().refresh()) initial_schedule_.push_back(s);
  if (!initial_schedule_.empty()) initial_schedule_version_ = assignment_.policy().version();
}

JobRunner::~JobRunner() { Join(); }

void JobRunner::Start() {
  thread_ = std::thread([this] {
    JobOutcome o = Run();
    {
      std::lock_guard<std::mutex> lock(mu_);
      outcome_ = o;
      done_ = true;
    }
    cv_.notify_all();
  });
  watchdog_ = std::thread([this] { Watchdog(); });
}

void JobRunner::Join() {
  if (thread_.joinable()) thread_.join();
  if (watchdog_.joinable()) watchdog_.join();
}

// A Stop is honoured at the next step boundary, where the ranks agree on it (Control). A rank
// whose peer hangs never gets there: it waits inside a collective. After stop_abort_after the
// communicator is aborted, which ends that collective now and closes the connections, so the
// peers that are alive leave theirs too.
void JobRunner::Watchdog() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_.load() || !stop_reason_.empty(); });
  if (cv_.wait_for(lock, options_.stop_abort_after, [&] { return done_.load(); })) return;
  // A stop during the rendezvous aborts the communicator as soon as it exists.
  cv_.wait(lock, [&] { return done_.load() || comm_ != nullptr; });
  if (done_.load()) return;
  Log("job " + assignment_.job_id() + " rank " + std::to_string(assignment_.rank()) +
      ": not at a step boundary " + std::to_string(options_.stop_abort_after.count()) +
      " ms after the stop; aborting its collectives");
  if (!comm_->Abort("stop: " + stop_reason_)) {
    Log("job " + assignment_.job_id() + ": backend " + std::string(comm_->backend()) +
        " cannot abort; the collective ends at exchange.timeout_s");
  }
}

JobOutcome JobRunner::outcome() const {
  std::lock_guard<std::mutex> lock(mu_);
  return outcome_;
}

void JobRunner::OfferPolicy(const v1::Policy& policy) {
  if (options_.debug_policy_delay.count() > 0)
    std::this_thread::sleep_for(options_.debug_policy_delay);
  std::lock_guard<std::mutex> lock(mu_);
  if (policy.version() <= version_in_force_.load() || policies_.count(policy.version())) return;
  // Arriving after its effective step is no error: the step is a lower bound, and the ranks put
  // the version in force once every one of them holds it (Impl::Control).
  policies_.emplace(policy.version(), policy);
}

void JobRunner::OfferRefresh(const v1::RefreshSchedules& refresh) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The catalog's schedule is taken once, before the first step: it has no effective step,
    // so a later one could not be applied at the same step on every rank. Policy versions carry
    // their own schedules after that.
    if (!initial_schedule_.empty()) return;
    initial_schedule_.assign(refresh.schedules().begin(), refresh.schedules().end());
    initial_schedule_version_ = refresh.policy_version();
  }
  cv_.notify_all();
}

void JobRunner::OnCheckpointAcknowledged(int64_t recovery_step) {
  std::string dir;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (recovery_step <= acknowledged_checkpoint_) return;
    acknowledged_checkpoint_ = recovery_step;
    dir = checkpoint_dir_;
  }
  // No restart of this job resumes before the recovery point the coordinator has persisted.
  if (!dir.empty()) {
    PruneCheckpoints(dir, options_.worker_name, [&](int64_t s) { return s < recovery_step; });
  }
}

HeldCheckpointsInfo JobRunner::HeldCheckpoints() const {
  HeldCheckpointsInfo h;
  h.job_id = assignment_.job_id();
  h.attempt = assignment_.attempt();
  h.rank = assignment_.rank();
  std::string dir;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dir = checkpoint_dir_;
  }
  if (!dir.empty()) h.steps = ListCheckpoints(dir, options_.worker_name);
  return h;
}

void JobRunner::RequestStop(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_reason_.empty()) stop_reason_ = reason.empty() ? "stop requested" : reason;
  }
  cv_.notify_all();
}

JobOutcome JobRunner::Run() {
  const auto start = Clock::now();
  if (metrics_)
    metrics_->JobStarted(assignment_.job_id(), assignment_.rank(), assignment_.world_size());
  Log("job " + assignment_.job_id() + " attempt " + std::to_string(assignment_.attempt()) +
      ": starting rank " + std::to_string(assignment_.rank()) + " of " +
      std::to_string(assignment_.world_size()) +
      (assignment_.resume_step() > 0
           ? " from checkpoint step " + std::to_string(assignment_.resume_step())
           : std::string()));
  JobOutcome out;
  bool transport = false;
  try {
    try {
      Impl impl(*this);
      out = impl.Run();
    } catch (const TransportError&) {
      transport = true;
      throw;
    }
  } catch (const std::exception& e) {
    out.success = false;
    out.reason = e.what();
    std::unique_lock<std::mutex> lock(mu_);
    // A collective that failed because a peer vanished is the coordinator's to judge: it
    // declares the peer dead and restarts the attempt from its checkpoint (a Stop reaches us).
    // Reporting the failure ourselves would make it final.
    if (transport && stop_reason_.empty()) {
      Log("job " + assignment_.job_id() + ": collective failed (" + out.reason +
          "); waiting up to " + std::to_string(options_.peer_failure_grace.count()) +
          " ms for the coordinator's verdict");
      cv_.wait_for(lock, options_.peer_failure_grace, [&] { return !stop_reason_.empty(); });
    }
    // A failure while a stop was pending is the stop's consequence (peers left), not news.
    if (!stop_reason_.empty()) {
      out.stopped = true;
      out.reason = "stopped (" + stop_reason_ + "); then: " + out.reason;
    }
  }
  out.policy_version = version_in_force_.load();
  // Before the coordinator hears of the end: a scrape after it sees the job's gauges gone.
  if (metrics_) metrics_->JobEnded(out.success, out.stopped, out.reason);
  if (!out.stopped) {
    v1::WorkerMessage m;
    m.mutable_finished()->set_success(out.success);
    m.mutable_finished()->set_reason(out.reason);
    m.mutable_finished()->set_job_id(assignment_.job_id());
    m.mutable_finished()->set_attempt(assignment_.attempt());
    send_(std::move(m), true);
  }
  Log("job " + assignment_.job_id() + " attempt " + std::to_string(assignment_.attempt()) +
      " rank " + std::to_string(assignment_.rank()) + ": " +
      (out.success   ? "SUCCEEDED"
       : out.stopped ? "STOPPED"
                     : "FAILED") +
      ": " + out.reason + " (" +
      std::to_string(std::chrono::duration<double>(Clock::now() - start).count()) + " s)");
  // A small result file: tests and operators read the final checksum without scraping logs.
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(options_.data_dir) / "results";
  std::filesystem::create_directories(dir, ec);
  std::ofstream f(
      dir / (assignment_.job_id() + ".attempt" + std::to_string(assignment_.attempt()) + ".txt"));
  f << "job=" << assignment_.job_id() << "\nattempt=" << assignment_.attempt()
    << "\nrank=" << assignment_.rank() << "\nsuccess=" << (out.success ? 1 : 0)
    << "\nstopped=" << (out.stopped ? 1 : 0) << "\nsteps=" << out.steps
    << "\nchecksum=" << Hex(out.checksum) << "\npolicy_version=" << out.policy_version
    << "\nfinished_unix_ms=" << NowUnixMs() << "\nreason=" << out.reason << "\n";
  return out;
}

}  // namespace geofp8::worker
