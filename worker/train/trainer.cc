// One training step, as every rank runs it (Trainer::Step, see trainer.h):
//   batch (step, rank) -> forward+backward; each finished bucket goes to the exchange engine
//   while the backward continues -> wait for the average -> clip -> AdamW -> metrics, checksum,
//   validation, checkpoint, gradient dump.

#include "worker/train/trainer.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <memory>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include "kernels/common/check.h"
#include "kernels/exchange/exchanger.h"
#include "kernels/exchange/gloo_communicator.h"
#include "kernels/exchange/store.h"
#include "kernels/geometry/analysis.h"
#include "kernels/model/data.h"
#include "kernels/model/ops.h"
#include "platform/policy/job_spec.h"

namespace geofp8::train {

using Clock = std::chrono::steady_clock;

std::string ValidateTrainOptions(const TrainOptions& o) {
  std::ostringstream os;
  if (std::string err = model::ValidateModelConfig(o.model); !err.empty()) return err;
  model::OptimizerOptions opt = o.optimizer;
  if (opt.total_steps == 0) opt.total_steps = int(std::max<int64_t>(o.steps, 1));
  if (std::string err = model::ValidateOptimizerOptions(opt); !err.empty()) return err;
  if (o.ranks < 1 || o.ranks > 64) {
    os << "ranks: must be in [1, 64] (" << o.ranks << ")";
  } else if (o.batch < 1) {
    os << "batch: must be >= 1 (" << o.batch << ")";
  } else if (o.accum < 1 || o.accum > 65536) {
    os << "accum: must be in [1, 65536] (" << o.accum << ")";
  } else if (o.seq < 0 || o.seq > o.model.seq) {
    os << "seq: must be in [0, model.seq = " << o.model.seq << "] (" << o.seq << ")";
  } else if (o.steps < 1) {
    os << "steps: must be >= 1 (" << o.steps << ")";
  } else if (o.eval_every < 0) {
    os << "eval_every: must be >= 0 (" << o.eval_every << ")";
  } else if (o.eval_batches < 1) {
    os << "eval_batches: must be >= 1 (" << o.eval_batches << ")";
  } else if (o.checksum_every < 0) {
    os << "checksum_every: must be >= 0 (" << o.checksum_every << ")";
  } else if (o.error_every < 0) {
    os << "error_every: must be >= 0 (" << o.error_every << ")";
  } else if (!(o.gns_beta >= 0 && o.gns_beta < 1)) {
    os << "gns_beta: must be in [0, 1) (" << o.gns_beta << ")";
  } else if (o.checkpoint_every < 0) {
    os << "checkpoint_every: must be >= 0 (" << o.checkpoint_every << ")";
  } else if (o.checkpoint_every > 0 && o.checkpoint.empty()) {
    os << "checkpoint: needs a path when checkpoint_every is set (" << o.checkpoint_every << ")";
  } else if (o.resume && o.checkpoint.empty()) {
    os << "resume: needs a checkpoint path (empty)";
  } else if (o.blas_threads < 1) {
    os << "blas_threads: must be >= 1 (" << o.blas_threads << ")";
  } else if (o.timeout.count() < 1) {
    os << "timeout: must be >= 1 ms (" << o.timeout.count() << ")";
  } else if (o.data.empty()) {
    os << "data: must name a source (empty)";
  } else if (!o.dump_steps.empty() && o.dump_dir.empty()) {
    os << "dump_grads: needs an output folder when dump steps are given";
  } else if (!o.trace_dir.empty() && !std::filesystem::is_directory(o.trace_dir)) {
    os << "trace: not a directory (" << o.trace_dir << ")";
  }
  return os.str();
}

uint64_t Checksum(std::initializer_list<std::span<const float>> buffers) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (auto b : buffers) {
    const auto* p = reinterpret_cast<const uint8_t*>(b.data());
    for (size_t i = 0; i < b.size_bytes(); ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  }
  return h;
}

namespace {

std::string Fingerprint(const TrainOptions& o) {
  std::ostringstream os;
  const model::ModelConfig& m = o.model;
  os << "model=" << m.vocab << "/" << m.dim << "/" << m.layers << "/" << m.heads << "/" << m.ffn
     << "/" << m.seq << " ranks=" << o.ranks << " batch=" << o.batch << " seq=" << o.seq
     << " policy=" << o.policy << " data=" << o.data << " seed=" << o.seed;
  // Only when set, so checkpoints written before accumulation existed still resume.
  if (o.accum != 1) os << " accum=" << o.accum;
  return os.str();
}

bool Matches(const std::vector<std::string>& globs, const std::string& name) {
  for (const auto& g : globs) {
    if (LayerMatches(g, name)) return true;
  }
  return false;
}

void WriteFloats(const std::filesystem::path& path, std::span<const float> data) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size_bytes()));
  GEOFP8_CHECK(f.good(), "dump_grads: cannot write ", path.string());
}

}  // namespace

Trainer::Trainer(const TrainOptions& options, Communicator& comm)
    : Trainer(options, comm, ExchangePlan{}, {}, 0) {}

Trainer::Trainer(const TrainOptions& options, Communicator& comm, ExchangePlan plan,
                 std::vector<RefreshSchedule> schedule, uint64_t policy_version)
    : o_(options),
      comm_(comm),
      rank_(comm.rank()),
      ranks_(comm.size()),
      seq_(options.seq > 0 ? options.seq : options.model.seq),
      model_(options.model),
      plan_(std::move(plan)),
      policy_version_(policy_version),
      noise_scale_(options.gns_beta) {
  const std::string err = ValidateTrainOptions(o_);
  GEOFP8_CHECK(err.empty(), err);
  GEOFP8_CHECK(ranks_ == o_.ranks, "ranks: the communicator has ", ranks_, " ranks, options say ",
               o_.ranks);
  model::OptimizerOptions opt = o_.optimizer;
  if (opt.total_steps == 0) opt.total_steps = int(o_.steps);
  optimizer_ = std::make_unique<model::AdamW>(opt, model_.params());
  data_ = model::MakeDataSource(o_.data, o_.data_seed.value_or(o_.seed));
  if (plan_.layers.empty()) {  // the delegating constructor: the plan of options.policy
    plan_ = MakeExchangePlan(o_.policy, model_.params());
    schedule = MakeRefreshSchedule(plan_, ranks_);
  }
  GEOFP8_CHECK(plan_.layers.size() == model_.params().size(), "policy: ", plan_.layers.size(),
               " layer policies for ", model_.params().size(), " parameters");
  model_.Init(o_.seed);
  drift_.assign(model_.params().size(), 0.0);
  if (!o_.trace_dir.empty()) trace_ = std::make_unique<ExchangeTrace>();
  BuildExchanger(std::move(schedule));
}

Trainer::~Trainer() = default;

void Trainer::BuildExchanger(std::vector<RefreshSchedule> schedule) {
  std::vector<LayerSpec> layers;
  for (size_t i = 0; i < model_.params().size(); ++i) {
    const model::ParamInfo& p = model_.params()[i];
    LayerSpec spec;
    spec.name = p.name;
    spec.rows = p.exchange_rows();
    spec.cols = p.exchange_cols();
    spec.policy = plan_.layers[i];
    layers.push_back(spec);
  }
  ExchangeOptions eo = MakeExchangeOptions(plan_);
  eo.trace = trace_.get();
  eo.timeout = o_.timeout;
  eo.policy_version = policy_version_;
  eo.seed = o_.seed;
  auto next = std::make_unique<Exchanger>(comm_, std::move(layers), eo, std::move(schedule));
  if (exchanger_) {
    // Carry the geometry over where the new policy would estimate the same kind of geometry.
    for (uint32_t l :
         next->ImportGeometry(exchanger_->ExportGeometry(), GeometryImport::kDropMismatched)) {
      drift_[l] = 0.0;
    }
    // Error feedback continues where the layer still feeds back (a layer whose geometry was
    // dropped drops its residuals at its next step: they were taken under the old basis).
    next->ImportResiduals(exchanger_->ExportResiduals());
  }
  exchanger_ = std::move(next);
}

void Trainer::SetPolicies(uint64_t from_step, std::vector<LayerPolicy> policies,
                          std::vector<RefreshSchedule> schedule, uint64_t policy_version) {
  GEOFP8_CHECK(int64_t(from_step) >= next_step_, "policy v", policy_version,
               ": effective from step ", from_step, ", but step ", next_step_ - 1,
               " has already run on rank ", rank_);
  GEOFP8_CHECK(policies.size() == model_.params().size(), "policy v", policy_version, ": ",
               policies.size(), " layer policies for ", model_.params().size(), " parameters");
  // Validate now, so a bad policy fails where it is set rather than at its step.
  for (size_t i = 0; i < policies.size(); ++i) {
    const model::ParamInfo& p = model_.params()[i];
    LayerSpec spec{p.name, p.exchange_rows(), p.exchange_cols(), policies[i]};
    if (std::string err = ValidateLayerPolicy(spec); !err.empty()) {
      GEOFP8_FAIL("policy v", policy_version, ": ", err);
    }
  }
  policy_changes_[from_step] = {std::move(policies), std::move(schedule), policy_version};
}

void Trainer::ApplyDuePolicies(int64_t step) {
  while (!policy_changes_.empty() && int64_t(policy_changes_.begin()->first) <= step) {
    PolicyChange change = std::move(policy_changes_.begin()->second);
    policy_changes_.erase(policy_changes_.begin());
    ExchangePlan plan = plan_;
    plan.layers = std::move(change.policies);
    const uint64_t old_version = policy_version_;
    std::swap(plan_, plan);
    policy_version_ = change.version;
    try {
      BuildExchanger(std::move(change.schedule));
    } catch (...) {
      std::swap(plan_, plan);  // the old engine is still in place
      policy_version_ = old_version;
      throw;
    }
  }
}

TrainResult Trainer::Run(const StepCallback& on_step) {
  TrainResult result;
  result.params = model_.params();
  result.entropy_bound = data_->EntropyBound();
  int64_t start = 0;
  if (o_.resume && std::filesystem::exists(o_.checkpoint)) start = RestoreFile();
  result.start_step = start;
  const auto run_start = Clock::now();
  for (int64_t step = start; step < o_.steps; ++step) {
    StepControl control;
    control.measure_error = o_.error_every > 0 && step % o_.error_every == 0;
    StepRecord rec = Step(step, control);
    const bool last = step + 1 == o_.steps;
    if (last || (o_.eval_every > 0 && (step + 1) % o_.eval_every == 0)) {
      rec.val_loss = Validate();
      result.final_val_loss = rec.val_loss;
      if (!(best_val_loss_ <= rec.val_loss)) best_val_loss_ = rec.val_loss;
    }
    if (o_.checksum_every > 0 && ((step + 1) % o_.checksum_every == 0 || last))
      VerifyChecksum(step);
    if (!o_.checkpoint.empty() &&
        (last || (o_.checkpoint_every > 0 && (step + 1) % o_.checkpoint_every == 0))) {
      Save(step + 1);
    }
    if (rank_ == 0 && on_step) on_step(rec);
  }
  result.steps = o_.steps;
  result.best_val_loss = best_val_loss_;
  result.bytes_sent = bytes_sent_;
  result.seconds = std::chrono::duration<double>(Clock::now() - run_start).count();
  if (trace_) {
    trace_->WriteChromeJson(o_.trace_dir + "/rank" + std::to_string(rank_) + ".json", rank_);
  }
  result.weights = model_.weights();
  result.checksum = Checksum({model_.weights(), optimizer_->m(), optimizer_->v()});
  return result;
}

StepRecord Trainer::Step(int64_t step, const StepControl& control) {
  GEOFP8_CHECK(step >= next_step_, "step ", step, " after step ", next_step_ - 1,
               ": steps run in increasing order");
  ApplyDuePolicies(step);
  next_step_ = step + 1;
  const auto t0 = Clock::now();
  StepRecord rec;
  rec.step = step;
  const size_t L = model_.params().size();
  const bool dump = !o_.dump_dir.empty() && std::find(o_.dump_steps.begin(), o_.dump_steps.end(),
                                                      step) != o_.dump_steps.end();
  const bool keep = control.measure_error || control.keep_local || dump;
  // The step's accum * batch sequences, drawn as one batch: micro-batch m takes rows
  // [m * batch, (m + 1) * batch), so accumulation sees exactly the data of one accum * batch step.
  data_->TrainBatch(step, rank_, ranks_, o_.accum * o_.batch, seq_, &tokens_);
  const size_t micro_tokens = size_t(o_.batch) * (seq_ + 1);
  auto micro = [&](int m) {
    return std::span<const int32_t>(tokens_.data() + size_t(m) * micro_tokens, micro_tokens);
  };
  // Every micro-batch has batch * seq tokens, so the mean of their mean losses and gradients is
  // the mean over all accum * batch * seq tokens. The earlier micro-batches' gradients are summed
  // here; the last one's backward adds the sum and divides, layer by layer, before each bucket
  // goes to the exchange.
  double loss = 0;
  if (o_.accum > 1) {
    accum_grads_.assign(model_.grads().size(), 0.f);
    for (int m = 0; m + 1 < o_.accum; ++m) {
      loss += model_.ForwardBackward(micro(m), o_.batch, seq_);
      const std::vector<float>& g = model_.grads();
      for (size_t j = 0; j < g.size(); ++j) accum_grads_[j] += g[j];
    }
  }

  std::vector<std::span<float>> grads(L);
  for (size_t i = 0; i < L; ++i) grads[i] = model_.grad(int(i));
  if (keep) local_.resize(model_.grads().size());
  // The exchanger submits each bucket as soon as backward has finished its layers.
  exchanger_->BeginStep(uint64_t(step), grads);
  const float accum = float(o_.accum);
  double local_sq = 0;  // this rank's own gradient's squared norm, for the noise scale
  auto on_ready = [&](int i) {
    auto g = model_.grad(i);
    if (o_.accum > 1) {
      const float* acc = accum_grads_.data() + model_.params()[i].offset;
      for (size_t j = 0; j < g.size(); ++j) g[j] = (acc[j] + g[j]) / accum;
    }
    for (float v : g) local_sq += double(v) * v;
    if (keep) std::copy(g.begin(), g.end(), local_.begin() + model_.params()[i].offset);
    exchanger_->LayerReady(uint64_t(step), uint32_t(i));
  };
  loss += model_.ForwardBackward(micro(o_.accum - 1), o_.batch, seq_, on_ready);
  loss /= o_.accum;
  const auto t_backward = Clock::now();
  if (trace_)
    trace_->Add("forward_backward", ExchangeTrace::kTrainerLane, step, -1, t0, t_backward);
  rec.exchange = exchanger_->Finish(uint64_t(step));
  if (trace_) {
    trace_->Add("wait_exchange", ExchangeTrace::kTrainerLane, step, -1, t_backward, Clock::now());
  }
  const StepResult& ex = rec.exchange;
  rec.wait_seconds = std::chrono::duration<double>(Clock::now() - t_backward).count();
  rec.exchange_seconds = ex.seconds;
  rec.bytes_sent = ex.bytes_sent;
  bytes_sent_ += ex.bytes_sent;
  rec.skipped = ex.skipped;
  rec.refreshes = int(ex.refreshes.size());
  for (const RefreshRecord& r : ex.refreshes) {
    drift_[r.layer] = r.drift;
    rec.geometry_seconds += r.seconds;
  }

  if (control.measure_error) LayerErrors(rec);
  if (dump) Dump(step);

  rec.lr = model::LearningRate(optimizer_->options(), step);
  if (!ex.skipped) {
    TraceScope span(trace_.get(), "optimizer", ExchangeTrace::kTrainerLane, step);
    rec.grad_norm = model::ClipGradNorm(model_.grads(), optimizer_->options().clip_norm);
    optimizer_->Step(model_.weights(), model_.grads(), step);
  }
  if (rank_ == o_.debug_perturb_rank && step == o_.debug_perturb_step) model_.weights()[0] += 1e-3f;

  // The loss and the local squared norms travel in one all-reduce.
  float sum[2] = {float(loss), float(local_sq)};
  comm_.AllReduceSum(sum);
  rec.loss = double(sum[0]) / ranks_;
  rec.tokens = int64_t(ranks_) * o_.accum * o_.batch * seq_;
  // Both norms are those of the gradients the exchange carried: the local one before encode, the
  // averaged one after decode (its quantization error adds eps^2 |G_big|^2, second order).
  model::NoiseScaleSample ns;
  ns.small_sq = double(sum[1]) / ranks_;
  ns.big_sq = ex.skipped ? NAN : rec.grad_norm * rec.grad_norm;
  ns.b_small = double(o_.accum) * o_.batch * seq_;
  ns.b_big = double(rec.tokens);
  noise_scale_.Add(ns);
  rec.gradient_noise_scale = noise_scale_.value();
  for (size_t l = 0; l < rec.layer_error.size(); ++l) {
    rec.noise_ratio.push_back(
        model::QuantizationNoiseRatio(rec.layer_error[l], ns.b_big, rec.gradient_noise_scale,
                                      plan_.layers[l].rounding == Rounding::kStochastic));
  }
  rec.step_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return rec;
}

// rel_fro_error of each layer's exchanged average against the exact fp32 average of the local
// gradients (pre-divided by N and summed the way the fp32 baseline sums), and the residual-
// subspace error against the basis the step used.
void Trainer::LayerErrors(StepRecord& rec) {
  std::vector<float> exact(local_.size());
  const float n = float(ranks_);
  for (size_t i = 0; i < exact.size(); ++i) exact[i] = local_[i] / n;
  comm_.AllReduceSum(exact);
  for (size_t l = 0; l < model_.params().size(); ++l) {
    const model::ParamInfo& p = model_.params()[l];
    std::span<const float> g(exact.data() + p.offset, size_t(p.size()));
    std::span<const float> g_hat(model_.grads().data() + p.offset, size_t(p.size()));
    double e2 = 0, g2 = 0;
    for (size_t j = 0; j < g.size(); ++j) {
      const double d = double(g_hat[j]) - g[j];
      e2 += d * d;
      g2 += double(g[j]) * g[j];
    }
    rec.layer_error.push_back(g2 > 0 ? std::sqrt(e2 / g2) : std::sqrt(e2));
    // The step's basis: a pending refresh activates only at a later step.
    const Geometry& geo = exchanger_->active_geometry(uint32_t(l));
    const bool basis = geo.mode == GeometryMode::kLowRank && !geo.is_identity();
    const int64_t rows = p.exchange_rows(), cols = p.exchange_cols();
    const std::optional<double> residual = ResidualSubspaceError(
        g, g_hat, rows, cols, basis ? std::span<const float>(geo.U) : std::span<const float>(),
        basis ? std::span<const float>(geo.V) : std::span<const float>(), basis ? geo.k : 0);
    rec.residual_error.push_back(residual.value_or(NAN));
  }
  // The update each gradient would cause, clipped as Step clips it (each by its own global norm).
  const float clip = optimizer_->options().clip_norm;
  std::vector<float> hat(model_.grads().begin(), model_.grads().end());
  model::ClipGradNorm(exact, clip);
  model::ClipGradNorm(hat, clip);
  const int64_t step = next_step_ - 1;
  std::vector<float> u_exact, u_hat;
  for (const model::ParamInfo& p : model_.params()) {
    u_exact.resize(size_t(p.size()));
    u_hat.resize(size_t(p.size()));
    optimizer_->PreviewUpdate(model_.weights(), exact, step, p, u_exact);
    optimizer_->PreviewUpdate(model_.weights(), hat, step, p, u_hat);
    rec.update_error.push_back(RelFroError(u_exact, u_hat));
  }
}

void Trainer::Dump(int64_t step) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(o_.dump_dir) / ("step_" + std::to_string(step));
  fs::create_directories(dir);
  std::ostringstream json;
  json << "{\n  \"step\": " << step << ",\n  \"ranks\": " << ranks_ << ",\n  \"policy\": \""
       << plan_.name << "\",\n  \"dtype\": \"float32\",\n  \"layout\": \"row-major\",\n"
       << "  \"layers\": [";
  bool first = true;
  for (size_t i = 0; i < model_.params().size(); ++i) {
    const model::ParamInfo& p = model_.params()[i];
    if (!Matches(o_.dump_layers, p.name)) continue;
    std::span<const float> mine(local_.data() + p.offset, size_t(p.size()));
    WriteFloats(dir / (p.name + ".rank" + std::to_string(rank_) + ".f32"), mine);
    if (rank_ != 0) continue;
    WriteFloats(dir / (p.name + ".avg.f32"), model_.grad(int(i)));
    json << (first ? "\n" : ",\n") << "    {\"name\": \"" << p.name << "\", \"rows\": " << p.rows
         << ", \"cols\": " << p.cols << ", \"avg\": \"" << p.name << ".avg.f32\", \"per_rank\": [";
    for (int r = 0; r < ranks_; ++r) {
      json << (r ? ", " : "") << "\"" << p.name << ".rank" << r << ".f32\"";
    }
    json << "]}";
    first = false;
  }
  json << "\n  ]\n}\n";
  if (rank_ == 0) {
    std::ofstream f(dir / "shapes.json");
    f << json.str();
    GEOFP8_CHECK(f.good(), "dump_grads: cannot write ", (dir / "shapes.json").string());
  }
}

// Validation batches are split over ranks and the loss sums all-reduced.
double Trainer::Validate() {
  constexpr int kRows = 16;
  float sum[1] = {0.f};
  for (int i = rank_; i < o_.eval_batches; i += ranks_) {
    data_->ValidationBatch(i, kRows, seq_, &tokens_);
    sum[0] += float(model_.Loss(tokens_, kRows, seq_));
  }
  comm_.AllReduceSum(sum);
  return double(sum[0]) / o_.eval_batches;
}

uint64_t Trainer::VerifyChecksum(int64_t step) {
  const uint64_t mine = Checksum({model_.weights(), optimizer_->m(), optimizer_->v()});
  std::vector<uint64_t> all(ranks_);
  std::vector<size_t> counts(ranks_, sizeof(uint64_t));
  comm_.AllGatherV({reinterpret_cast<const uint8_t*>(&mine), sizeof mine},
                   {reinterpret_cast<uint8_t*>(all.data()), all.size() * sizeof(uint64_t)}, counts);
  for (int r = 1; r < ranks_; ++r) {
    if (all[r] != all[0]) {
      std::ostringstream hex;
      hex << std::hex << std::setfill('0') << std::setw(16) << all[r] << " vs rank 0 "
          << std::setw(16) << all[0];
      GEOFP8_FAIL("parameter checksum mismatch after step ", step, ": rank ", r, " has ", hex.str(),
                  "; ranks are no longer bitwise identical");
    }
  }
  return mine;
}

Checkpoint Trainer::MakeCheckpoint(int64_t next_step) const {
  Checkpoint c;
  c.fingerprint = Fingerprint(o_);
  c.next_step = next_step;
  c.rng_seed = o_.seed;
  c.policy_version = policy_version_;
  c.best_val_loss = best_val_loss_;
  c.bytes_sent = bytes_sent_;
  c.weights = model_.weights();
  c.m = optimizer_->m();
  c.v = optimizer_->v();
  c.geometry = exchanger_->ExportGeometry();
  // This rank's residuals under its own index (the others' are not here without a collective):
  // a driver that writes one file per rank resumes each rank exactly when the rank reads its
  // own file, and from zero residuals when it reads another rank's.
  if (std::any_of(plan_.layers.begin(), plan_.layers.end(),
                  [](const LayerPolicy& p) { return p.error_feedback; })) {
    c.residuals.assign(ranks_, {});
    c.residuals[rank_] = exchanger_->ExportResiduals();
  }
  c.gns_grad_sq = noise_scale_.grad_sq();
  c.gns_trace = noise_scale_.trace();
  c.gns_samples = noise_scale_.samples();
  return c;
}

int64_t Trainer::Restore(const Checkpoint& c) {
  GEOFP8_CHECK(c.weights.size() == model_.weights().size() && c.m.size() == c.weights.size() &&
                   c.v.size() == c.weights.size(),
               "checkpoint: parameter count ", c.weights.size(), " does not match the model (",
               model_.weights().size(), ")");
  GEOFP8_CHECK(c.rng_seed == o_.seed, "checkpoint: rng_seed ", c.rng_seed,
               " does not match this run's seed (", o_.seed, ")");
  GEOFP8_CHECK(c.next_step >= next_step_ && c.next_step <= o_.steps, "checkpoint: next_step ",
               c.next_step, " is outside [", next_step_, ", steps = ", o_.steps, "]");
  // Geometry first: it is the only part that can be refused for a reason other than size.
  std::vector<LayerGeometryState> geometry = c.geometry;
  if (geometry.empty()) geometry.resize(model_.params().size());  // no geometry was saved
  GEOFP8_CHECK(geometry.size() == model_.params().size(), "checkpoint: geometry for ",
               geometry.size(), " layers, the model has ", model_.params().size());
  // Under the policy version it was written with, the geometry must fit exactly; a checkpoint
  // from before a policy change keeps what the change would have kept (see SetPolicies).
  const GeometryImport mode = c.policy_version == policy_version_ ? GeometryImport::kStrict
                                                                  : GeometryImport::kDropMismatched;
  try {
    for (uint32_t l : exchanger_->ImportGeometry(geometry, mode)) drift_[l] = 0.0;
  } catch (const Error& e) {
    GEOFP8_FAIL("checkpoint: ", e.what());
  }
  if (!c.residuals.empty()) {
    GEOFP8_CHECK(c.residuals.size() == size_t(ranks_), "checkpoint: error-feedback residuals of ",
                 c.residuals.size(), " ranks, this run has ", ranks_);
    try {
      exchanger_->ImportResiduals(c.residuals[rank_]);
    } catch (const Error& e) {
      GEOFP8_FAIL("checkpoint: ", e.what());
    }
  }
  noise_scale_.Restore(c.gns_grad_sq, c.gns_trace, c.gns_samples);
  model_.weights() = c.weights;
  optimizer_->m() = c.m;
  optimizer_->v() = c.v;
  best_val_loss_ = c.best_val_loss;
  bytes_sent_ = c.bytes_sent;
  next_step_ = c.next_step;
  return c.next_step;
}

void Trainer::Save(int64_t next_step) {
  std::vector<std::vector<LayerResidual>> residuals = GatherResiduals();
  if (rank_ != 0) return;  // every rank holds the same state (checked by the checksum)
  Checkpoint c = MakeCheckpoint(next_step);
  c.residuals = std::move(residuals);
  SaveCheckpoint(o_.checkpoint, c);
}

std::vector<std::vector<LayerResidual>> Trainer::GatherResiduals() {
  // The same decision on every rank: the policies are.
  const bool any = std::any_of(plan_.layers.begin(), plan_.layers.end(),
                               [](const LayerPolicy& p) { return p.error_feedback; });
  if (!any) return {};
  // This rank's residuals as u64 layers | per layer u64 version, u64 n, f32[n], u64 n, f32[n].
  std::vector<uint8_t> mine;
  auto put = [&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    mine.insert(mine.end(), b, b + n);
  };
  const std::vector<LayerResidual> own = exchanger_->ExportResiduals();
  const uint64_t layers = own.size();
  put(&layers, 8);
  for (const LayerResidual& r : own) {
    put(&r.geometry_version, 8);
    for (const std::vector<float>* v : {&r.local, &r.owner}) {
      const uint64_t n = v->size();
      put(&n, 8);
      put(v->data(), n * sizeof(float));
    }
  }
  const uint64_t size = mine.size();
  std::vector<uint64_t> sizes(ranks_);
  comm_.AllGatherV({reinterpret_cast<const uint8_t*>(&size), 8},
                   {reinterpret_cast<uint8_t*>(sizes.data()), sizes.size() * 8},
                   std::vector<size_t>(ranks_, 8));
  std::vector<size_t> counts(sizes.begin(), sizes.end());
  std::vector<uint8_t> all(std::accumulate(counts.begin(), counts.end(), size_t{0}));
  comm_.AllGatherV(mine, all, counts);
  std::vector<std::vector<LayerResidual>> out(ranks_);
  size_t pos = 0;
  auto get = [&](void* p, size_t n) {
    std::memcpy(p, all.data() + pos, n);
    pos += n;
  };
  for (auto& rank : out) {
    uint64_t n_layers = 0;
    get(&n_layers, 8);
    rank.resize(n_layers);
    for (LayerResidual& r : rank) {
      get(&r.geometry_version, 8);
      for (std::vector<float>* v : {&r.local, &r.owner}) {
        uint64_t n = 0;
        get(&n, 8);
        v->resize(n);
        get(v->data(), n * sizeof(float));
      }
    }
  }
  return out;
}

int64_t Trainer::RestoreFile() {
  const Checkpoint c = LoadCheckpoint(o_.checkpoint);
  const std::string expected = Fingerprint(o_);
  GEOFP8_CHECK(c.fingerprint == expected, "checkpoint ", o_.checkpoint,
               ": written by a different run (", c.fingerprint, ") than this one (", expected, ")");
  try {
    return Restore(c);
  } catch (const Error& e) {
    GEOFP8_FAIL("checkpoint ", o_.checkpoint, ": ", e.what());
  }
}

TrainResult TrainRank(const TrainOptions& options, Communicator& comm,
                      const StepCallback& on_step) {
  const std::string err = ValidateTrainOptions(options);
  GEOFP8_CHECK(err.empty(), err);
  model::SetBlasThreads(options.blas_threads);
  Trainer trainer(options, comm);
  return trainer.Run(on_step);
}

TrainResult Train(const TrainOptions& options, const StepCallback& on_step) {
  const std::string err = ValidateTrainOptions(options);
  GEOFP8_CHECK(err.empty(), err);
  model::SetBlasThreads(options.blas_threads);
  static std::atomic<int> group{0};
  MemoryStore store;
  const std::string prefix = "train" + std::to_string(group++);
  std::vector<std::string> errors(options.ranks);
  // Whether a rank's error is a consequence of another's: a failed collective or a rendezvous
  // wait that ran out (char, not bool: the rank threads write their own entries concurrently).
  std::vector<char> consequence(options.ranks, 0);
  std::vector<TrainResult> results(options.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < options.ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        GlooOptions go;
        go.prefix = prefix;
        go.timeout = options.timeout;
        auto comm = CreateGlooCommunicator(store, r, options.ranks, go);
        Trainer trainer(options, *comm);
        results[r] = trainer.Run(r == 0 ? on_step : nullptr);
      } catch (const TransportError& e) {
        errors[r] = e.what();
        consequence[r] = 1;
      } catch (const StoreTimeoutError& e) {
        errors[r] = e.what();
        consequence[r] = 1;
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  // Report the root cause: a rank's own error before the failed collectives and timeouts it
  // caused in the others.
  for (int r = 0; r < options.ranks; ++r) {
    if (!errors[r].empty() && !consequence[r]) {
      throw Error("rank " + std::to_string(r) + ": " + errors[r]);
    }
  }
  for (int r = 0; r < options.ranks; ++r) {
    if (!errors[r].empty()) throw Error("rank " + std::to_string(r) + ": " + errors[r]);
  }
  return results[0];
}

}  // namespace geofp8::train
