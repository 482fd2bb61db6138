// The exchange engine (see exchanger.h). One gradient's trip: fingerprint + non-finite flag
// gather, divide by N, geometry Apply, the bucket algorithm, geometry Invert.
#include "kernels/exchange/exchanger.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "kernels/codec/codec.h"
#include "kernels/common/check.h"
#include "kernels/exchange/algorithms.h"
#include "kernels/exchange/chunking.h"
#include "kernels/exchange/fingerprint.h"
#include "kernels/exchange/sharded_gradient.h"
#include "kernels/geometry/hadamard.h"

namespace geofp8 {
namespace {
// Buckets that share one pipeline run: each has its own non-finite flag bit in the 64-bit word
// the ranks reduce after the data has moved.
constexpr size_t kBucketsPerRun = 64;
}  // namespace

std::string ValidateLayerPolicy(const LayerSpec& layer) {
  std::ostringstream os;
  os << "layer '" << layer.name << "': ";
  if (layer.rows < 0 || layer.cols < 1) {
    os << "shape: rows must be >= 0 and cols >= 1 (" << layer.rows << "x" << layer.cols << ")";
    return os.str();
  }
  const LayerPolicy& p = layer.policy;
  CodecOptions o;
  o.format = p.format;
  o.scaling = p.scaling;
  o.block = p.block;
  o.rounding = p.rounding;
  if (std::string err = ValidateCodecOptions(o); !err.empty()) return os.str() + err;
  if (p.geometry == GeometryMode::kLowRank && p.rank < 1) {
    os << "rank: must be >= 1 for lowrank geometry (" << p.rank << ")";
    return os.str();
  }
  if (p.geometry != GeometryMode::kNone && !(p.alpha > 0.f && p.alpha <= 1.f)) {
    os << "alpha: must be in (0, 1] (" << p.alpha << ")";
    return os.str();
  }
  if (p.hadamard) {
    if (std::string err = ValidateHadamardBlock(int(EffectiveHadamardBlock(p)),
                                                LayerCodecOptions(p, 0, 0, 0, 0, 0, 0));
        !err.empty()) {
      // The default block is the codec's: name the field the user would change.
      if (p.hadamard_block == 0) err += " (the default, from the codec's block)";
      return os.str() + err;
    }
  }
  if (p.error_feedback && p.format == Format::kFp32) {
    os << "error_feedback: fp32 loses nothing to feed back (format fp32)";
    return os.str();
  }
  return "";
}

std::vector<Bucket> MakeBuckets(std::span<const LayerSpec> layers, size_t cap_bytes) {
  std::vector<Bucket> buckets;
  for (size_t k = layers.size(); k-- > 0;) {
    const size_t bytes = static_cast<size_t>(layers[k].count()) * sizeof(float);
    if (buckets.empty() ||
        (buckets.back().bytes + bytes > cap_bytes && !buckets.back().layers.empty())) {
      buckets.emplace_back();
    }
    buckets.back().layers.push_back(static_cast<uint32_t>(k));
    buckets.back().bytes += bytes;
  }
  return buckets;
}

Exchanger::Exchanger(Communicator& comm, std::vector<LayerSpec> layers, ExchangeOptions options,
                     std::vector<RefreshSchedule> schedule)
    : comm_(comm), layers_(std::move(layers)), options_(options), schedule_(std::move(schedule)) {
  options_.algorithm = ResolveAlgorithm(options_.algorithm, comm_.size());
  GEOFP8_CHECK(options_.bucket_cap_bytes > 0, "bucket_cap_bytes: must be positive (0)");
  GEOFP8_CHECK(options_.timeout.count() > 0, "timeout: must be positive (",
               options_.timeout.count(), " ms)");
  GEOFP8_CHECK(options_.activation_delay >= 1, "activation_delay: must be >= 1 (",
               options_.activation_delay, ")");
  GEOFP8_CHECK(options_.helper_nice >= 0 && options_.helper_nice <= 19,
               "helper_nice: must be in [0, 19] (", options_.helper_nice, ")");
  for (const auto& l : layers_) {
    if (std::string err = ValidateLayerPolicy(l); !err.empty()) GEOFP8_FAIL(err);
  }
  GEOFP8_CHECK(options_.layer_ids.empty() || options_.layer_ids.size() == layers_.size(),
               "layer_ids: needs one entry per layer (", options_.layer_ids.size(), " entries for ",
               layers_.size(), " layers)");
  GEOFP8_CHECK(schedule_.empty() || schedule_.size() == layers_.size(),
               "schedule: needs one entry per layer (", schedule_.size(), " entries for ",
               layers_.size(), " layers)");
  for (size_t l = 0; l < schedule_.size(); ++l) {
    const auto& s = schedule_[l];
    GEOFP8_CHECK(s.owner >= 0 && s.owner < comm_.size(), "schedule: layer '", layers_[l].name,
                 "': owner must be a rank in [0, ", comm_.size(), ") (", s.owner, ")");
    GEOFP8_CHECK(s.interval >= 1, "schedule: layer '", layers_[l].name,
                 "': interval must be >= 1 (", s.interval, ")");
    GEOFP8_CHECK(s.offset >= 0, "schedule: layer '", layers_[l].name, "': offset must be >= 0 (",
                 s.offset, ")");
  }
  for (const auto& l : layers_) {
    const Algorithm a = options_.algorithm;
    GEOFP8_CHECK(
        !l.policy.error_feedback || a == Algorithm::kTwoPhase || a == Algorithm::kAllGather,
        "layer '", l.name,
        "': error_feedback: needs a quantizing algorithm (two_phase or allgather), not ",
        AlgorithmName(a));
  }
  // A device wire over a communicator that reads host memory only is refused here, before a
  // step could hand it device addresses.
  if (options_.plane) CheckWire(comm_, *options_.plane);
  if (options_.plane && !options_.plane->host_memory()) {
    for (const auto& l : layers_) {
      BucketLayer probe;
      probe.policy = l.policy;
      if (std::string why = options_.plane->Unsupported(probe); !why.empty()) {
        GEOFP8_FAIL("layer '", l.name, "': ", why);
      }
    }
  }
  comm_.set_timeout(options_.timeout);
  buckets_ = MakeBuckets(layers_, options_.bucket_cap_bytes);
  bucket_of_.assign(layers_.size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    for (uint32_t l : buckets_[b].layers) bucket_of_[l] = b;
  }
  for (const auto& l : layers_) layer_names_.push_back(l.name);
  AttachStates();
  worker_ = std::thread([this] { WorkerLoop(); });
}

Exchanger::~Exchanger() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void Exchanger::Enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_all();
}

void Exchanger::WorkerLoop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();  // packaged tasks: exceptions land in their futures
  }
}

bool Exchanger::UsesGeometry(uint32_t layer) const {
  const auto& spec = layers_[layer];
  return spec.policy.geometry != GeometryMode::kNone && spec.rows > 1 && spec.cols > 1 &&
         options_.algorithm != Algorithm::kFp32 && options_.algorithm != Algorithm::kBf16;
}

bool Exchanger::UsesErrorFeedback(uint32_t layer) const {
  return layers_[layer].policy.error_feedback && (options_.algorithm == Algorithm::kTwoPhase ||
                                                  options_.algorithm == Algorithm::kAllGather);
}

void Exchanger::AttachStates() {
  LayerStateTable* table = options_.states;
  if (!table) {
    owned_states_ = std::make_unique<LayerStateTable>();
    table = owned_states_.get();
  }
  std::vector<bool> seen;
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const uint32_t id = LayerId(l);
    if (id >= seen.size()) seen.resize(id + 1, false);
    GEOFP8_CHECK(!seen[id], "layer_ids: layer '", layers_[l].name, "' has id ", id,
                 ", which another layer has too");
    seen[id] = true;
    state_.push_back(&table->at(id));
  }
  if (!options_.states) return;
  // A shared table may hold what another policy left (a policy change): what no longer fits this
  // policy restarts from identity, as ImportGeometry's kDropMismatched would, and residuals go
  // where the layer keeps none.
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    LayerState& st = *state_[l];
    const bool stale_sketch =
        st.sketch.updates > 0 &&
        (!UsesGeometry(l) || options_.estimator != GeometryEstimator::kFactorEma);
    if (stale_sketch || (!st.active.is_identity() && !PolicyMismatch(l, st.active).empty()) ||
        (st.has_pending && !PolicyMismatch(l, st.pending).empty())) {
      st.ResetGeometry();
    }
    if (!UsesErrorFeedback(l)) st.residual = LayerResidual{};
  }
}

std::vector<LayerResidual> Exchanger::ExportResiduals() const {
  std::vector<LayerResidual> out(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) out[l] = state_[l]->residual;
  return out;
}

void Exchanger::ImportResiduals(const std::vector<LayerResidual>& residuals) {
  if (residuals.empty()) return;
  GEOFP8_CHECK(residuals.size() == layers_.size(), "residuals: ", residuals.size(), " entries for ",
               layers_.size(), " layers");
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerResidual& r = residuals[l];
    const size_t n = static_cast<size_t>(layers_[l].count());
    GEOFP8_CHECK(r.local.empty() || r.local.size() == n, "residuals: layer '", layers_[l].name,
                 "': local has ", r.local.size(), " values, the layer ", n);
    GEOFP8_CHECK(r.owner.empty() || r.owner.size() == n, "residuals: layer '", layers_[l].name,
                 "': owner has ", r.owner.size(), " values, the layer ", n);
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    // A layer without error feedback has nothing to continue.
    state_[l]->residual = UsesErrorFeedback(uint32_t(l)) ? residuals[l] : LayerResidual{};
  }
}

void Exchanger::CommitResiduals(bool skipped) {
  // A skipped step is not applied, so neither is what its quantization lost.
  if (skipped) return;
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    if (UsesErrorFeedback(l)) std::swap(state_[l]->residual, state_[l]->next_residual);
  }
}

uint32_t Exchanger::HadamardBlockOf(uint32_t layer) const {
  const auto& spec = layers_[layer];
  const bool compressed =
      options_.algorithm != Algorithm::kFp32 && options_.algorithm != Algorithm::kBf16;
  return compressed && spec.rows > 1 && spec.cols > 1 ? EffectiveHadamardBlock(spec.policy) : 0;
}

bool Exchanger::RefreshesAt(uint32_t layer, uint64_t step) const {
  if (schedule_.empty()) return false;
  const RefreshSchedule& s = schedule_[layer];
  return step >= static_cast<uint64_t>(s.offset) && (step - s.offset) % s.interval == 0;
}

std::shared_future<BucketResult> Exchanger::Submit(uint64_t step, size_t bucket, GradSpans grads) {
  GEOFP8_CHECK(bucket < buckets_.size(), "submit: bucket ", bucket, " out of range (",
               buckets_.size(), " buckets)");
  if (deferred_) RunPendingRefreshes();
  GEOFP8_CHECK(grads.size() == layers_.size(), "submit: ", grads.size(), " gradients for ",
               layers_.size(), " layers");
  auto& pending = steps_[step];
  GEOFP8_CHECK(pending.futures.size() == bucket, "submit: step ", step, " expects bucket ",
               pending.futures.size(), " next, got ", bucket);
  if (bucket == 0) pending.start = std::chrono::steady_clock::now();
  pending.grads = grads;
  auto task = std::make_shared<std::packaged_task<BucketResult()>>(
      [this, step, bucket, grads = std::move(grads)] {
        return RunBuckets(step, bucket, bucket + 1, grads)[0];
      });
  std::shared_future<BucketResult> future = task->get_future().share();
  pending.futures.push_back(future);
  Enqueue([task] { (*task)(); });
  return future;
}

void Exchanger::BeginStep(uint64_t step, GradSpans grads) {
  GEOFP8_CHECK(grads.size() == layers_.size(), "begin step: ", grads.size(), " gradients for ",
               layers_.size(), " layers");
  GEOFP8_CHECK(steps_.find(step) == steps_.end(), "begin step: step ", step,
               " already has submitted buckets");
  if (deferred_) RunPendingRefreshes();
  Pending& pending = steps_[step];
  pending.grads = std::move(grads);
  pending.unready.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) pending.unready[b] = buckets_[b].layers.size();
  pending.ready.assign(layers_.size(), false);
}

void Exchanger::LayerReady(uint64_t step, uint32_t layer) {
  auto it = steps_.find(step);
  GEOFP8_CHECK(it != steps_.end() && !it->second.unready.empty(), "layer ready: step ", step,
               " was not begun (BeginStep)");
  GEOFP8_CHECK(layer < layers_.size(), "layer ready: layer ", layer, " out of range (",
               layers_.size(), " layers)");
  Pending& pending = it->second;
  GEOFP8_CHECK(!pending.ready[layer], "layer ready: ", layers_[layer].name,
               " was reported ready twice in step ", step);
  pending.ready[layer] = true;
  --pending.unready[bucket_of_[layer]];
  while (pending.futures.size() < buckets_.size() && pending.unready[pending.futures.size()] == 0) {
    Submit(step, pending.futures.size(), pending.grads);
  }
}

std::vector<double> Exchanger::LayerBytesSent(const StepResult& result) const {
  // A layer's share of its bucket: its encoded size under its own policy.
  auto encoded = [](const LayerSpec& l) {
    const LayerPolicy& p = l.policy;
    if (p.format == Format::kFp32) return 4.0 * double(l.count());
    if (p.format == Format::kBf16) return 2.0 * double(l.count());
    CodecOptions o;
    o.format = p.format;
    o.scaling = p.scaling;
    o.block = p.block;
    return double(EncodedBytes(o, size_t(l.count())));
  };
  std::vector<double> bytes(layers_.size(), 0.0);
  for (const BucketResult& b : result.buckets) {
    GEOFP8_CHECK(b.bucket < buckets_.size(), "layer bytes: bucket ", b.bucket, " out of range (",
                 buckets_.size(), " buckets)");
    double total = 0;
    for (uint32_t l : buckets_[b.bucket].layers) total += encoded(layers_[l]);
    if (total <= 0) continue;
    for (uint32_t l : buckets_[b.bucket].layers) {
      bytes[l] = double(b.bytes_sent) * encoded(layers_[l]) / total;
    }
  }
  return bytes;
}

StepResult Exchanger::Finish(uint64_t step) {
  auto it = steps_.find(step);
  GEOFP8_CHECK(it != steps_.end(), "finish: step ", step, " has no submitted buckets");
  Pending pending = std::move(it->second);
  steps_.erase(it);
  if (!pending.unready.empty() && pending.futures.size() < buckets_.size()) {
    std::string missing;
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (!pending.ready[l]) missing += (missing.empty() ? "" : ", ") + layers_[l].name;
    }
    // The submitted buckets still run: wait for them so nothing refers to this step's grads.
    for (auto& f : pending.futures) f.wait();
    GEOFP8_FAIL("finish: step ", step,
                ": backward left buckets unsubmitted (never ready: ", missing, ")");
  }
  GEOFP8_CHECK(pending.futures.size() == buckets_.size(), "finish: step ", step, " submitted ",
               pending.futures.size(), " of ", buckets_.size(), " buckets");
  StepResult result;
  result.step = step;
  std::exception_ptr first_error;
  for (auto& f : pending.futures) {
    try {
      result.buckets.push_back(f.get());
      result.skipped = result.skipped || result.buckets.back().skipped;
      result.bytes_sent += result.buckets.back().bytes_sent;
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);
  CommitResiduals(result.skipped);
  if (!result.skipped && !schedule_.empty()) {
    auto task = std::make_shared<std::packaged_task<std::vector<RefreshRecord>()>>(
        [this, step, grads = pending.grads] { return RunRefreshes(step, grads); });
    auto f = task->get_future();
    Enqueue([task] { (*task)(); });
    AddRefreshes(result, f.get());
  }
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - pending.start).count();
  return result;
}

StepResult Exchanger::Exchange(uint64_t step, GradSpans grads, Refreshes refreshes) {
  GEOFP8_CHECK(refreshes == Refreshes::kNow || options_.estimator == GeometryEstimator::kFactorEma,
               "exchange: deferred refreshes need estimator ema (the instant estimator's owner "
               "broadcasts each refresh, a collective that cannot wait), not ",
               GeometryEstimatorName(options_.estimator));
  GEOFP8_CHECK(grads.size() == layers_.size(), "exchange: ", grads.size(), " gradients for ",
               layers_.size(), " layers");
  GEOFP8_CHECK(!steps_.contains(step), "exchange: step ", step, " already has submitted buckets");
  if (deferred_ && steps_.empty()) RunPendingRefreshes();
  // Every bucket is here at once, on every rank: run them as one pipeline (up to 64 buckets per
  // run, one non-finite flag bit each), so there is one fill and one drain instead of one per
  // bucket. Results and errors are per bucket, as with Submit.
  if (steps_.empty()) {
    // Nothing queued: the worker thread is idle (Submit and Finish run on this caller's thread,
    // and Finish waits for every task it queued), so the caller runs the tasks itself.
    return RunAll(step, grads, nullptr, refreshes);
  }
  auto& pending = steps_[step];
  pending.start = std::chrono::steady_clock::now();
  pending.grads = grads;
  for (size_t first = 0; first < buckets_.size(); first += kBucketsPerRun) {
    const size_t last = std::min(buckets_.size(), first + kBucketsPerRun);
    auto promises = std::make_shared<std::vector<std::promise<BucketResult>>>(last - first);
    for (auto& p : *promises) pending.futures.push_back(p.get_future().share());
    Enqueue([this, step, first, last, grads, promises] {
      try {
        auto results = RunBuckets(step, first, last, grads);
        for (size_t i = 0; i < results.size(); ++i) (*promises)[i].set_value(results[i]);
      } catch (...) {
        for (auto& p : *promises) p.set_exception(std::current_exception());
      }
    });
  }
  return Finish(step);
}

// A bf16 or fp16 gradient's products, over a host fp32 copy of it that they own (read through
// the plane: a device plane's gradient is device memory).
std::unique_ptr<GradientProducts> Exchanger::LowpProducts(GradSpan g, int64_t m, int64_t n) {
  std::vector<float> copy(g.size());
  plane().Read(g, copy);  // exact
  return std::make_unique<HostSnapshot>(std::move(copy), m, n);
}

bool Exchanger::ShardedRefresh(uint32_t l) const {
  if (options_.estimator != GeometryEstimator::kFactorEma) return false;
  const LayerSpec& spec = layers_[l];
  const FactorSketchOptions o = SketchOptions(l);
  // Per update on average: probes join every probe_every-th update only.
  const double held = double((o.width + 7) / 8 * 8),
               probing = double((o.width + o.probes + 7) / 8 * 8);
  const double ldx = held + (probing - held) / o.probe_every;
  const double c = 2.0 * o.width + double(o.probes) / o.probe_every;
  const double m = double(spec.rows), n = double(spec.cols);
  const double per_element = FormatBits(spec.policy.format) / 8.0;
  return 4.0 * (m * ldx + 2.0 * n * c) < m * n * per_element;
}

std::unique_ptr<GradientProducts> Exchanger::ShardProducts(uint32_t l, GradSpan rows, bool copy) {
  const LayerSpec& spec = layers_[l];
  if (!copy && rows.fp32() && plane().host_memory()) {
    return std::make_unique<ShardedGradient>(comm_, rows.f32(), spec.rows, spec.cols);
  }
  // A host fp32 copy of this rank's rows (a device plane's are device memory).
  std::vector<float> fp32(rows.size());
  plane().Read(rows, fp32);  // exact
  return std::make_unique<ShardedGradient>(comm_, std::move(fp32), spec.rows, spec.cols);
}

void Exchanger::Defer(uint64_t step, const GradSpans& grads, const GradSpans* outs) {
  Deferred d;
  d.step = step;
  d.snapshots.resize(layers_.size());
  bool any = false;
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    if (!UsesGeometry(l) || !RefreshesAt(l, step)) continue;
    const LayerSpec& spec = layers_[l];
    if (outs && ShardedRefresh(l)) {  // a reduce-scatter's: this rank's rows, copied
      d.snapshots[l] = ShardProducts(l, (*outs)[l], /*copy=*/true);
      any = true;
      continue;
    }
    if (!grads[l].fp32()) {
      d.snapshots[l] = LowpProducts(grads[l], spec.rows, spec.cols);
      any = true;
      continue;
    }
    d.snapshots[l] = plane().Snapshot(grads[l].f32(), spec.rows, spec.cols);
    // The inverse's products describe this gradient, which a host copy is bit for bit.
    if (state_[l]->products.data == grads[l].data)
      state_[l]->products.data = d.snapshots[l]->host_data();
    any = true;
  }
  if (any) deferred_ = std::move(d);
}

std::vector<RefreshRecord> Exchanger::RunPendingRefreshes() {
  if (!deferred_) return {};
  GEOFP8_CHECK(steps_.empty(), "RunPendingRefreshes: step ", steps_.begin()->first,
               " is in flight");
  Deferred d = std::move(*deferred_);
  deferred_.reset();
  return RunRefreshes(d.step, GradSpans(layers_.size()), &d.snapshots);
}

std::vector<LayerGeometryState> Exchanger::ExportGeometry() const {
  if (!steps_.empty()) GEOFP8_FAIL("ExportGeometry: step ", steps_.begin()->first, " is in flight");
  if (deferred_) {
    GEOFP8_FAIL("ExportGeometry: the refreshes of step ", deferred_->step,
                " are deferred and have not run (RunPendingRefreshes)");
  }
  std::vector<LayerGeometryState> out(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) out[l] = ExportLayerGeometry(*state_[l]);
  return out;
}

LayerGeometryState ExportLayerGeometry(const LayerState& st) {
  LayerGeometryState out;
  if (!st.active.is_identity()) out.active = SerializeGeometry(st.active);
  if (st.has_pending) {
    out.pending = SerializeGeometry(st.pending);
    out.pending_from = st.pending_from;
  }
  if (st.sketch.updates > 0) out.sketch = SerializeFactorSketch(st.sketch);
  return out;
}

// "" when geometry g is what layer l's policy would estimate here, else "field: problem".
std::string Exchanger::PolicyMismatch(uint32_t l, const Geometry& g) const {
  const LayerSpec& spec = layers_[l];
  const LayerPolicy& p = spec.policy;
  std::ostringstream os;
  if (!UsesGeometry(l)) {
    os << "geometry: the layer uses none here ("
       << (spec.rows <= 1 || spec.cols <= 1    ? "1-D"
           : p.geometry == GeometryMode::kNone ? "policy geometry none"
                                               : "fp32/bf16 algorithm")
       << ") but the state holds a " << GeometryModeName(g.mode) << " geometry";
  } else if (g.mode != p.geometry) {
    os << "mode: " << GeometryModeName(g.mode) << " but the policy says "
       << GeometryModeName(p.geometry);
  } else if (const int64_t k = std::min<int64_t>({p.rank, spec.rows, spec.cols});
             g.mode == GeometryMode::kLowRank && g.k != k) {
    os << "rank: k = " << g.k << " but the policy's rank " << p.rank << " gives k = " << k;
  } else if (g.alpha != p.alpha) {
    os << "alpha: " << g.alpha << " but the policy says " << p.alpha;
  }
  return os.str();
}

std::vector<uint32_t> Exchanger::ImportGeometry(const std::vector<LayerGeometryState>& state,
                                                GeometryImport mode) {
  if (!steps_.empty()) GEOFP8_FAIL("ImportGeometry: step ", steps_.begin()->first, " is in flight");
  if (deferred_) {
    GEOFP8_FAIL("ImportGeometry: the refreshes of step ", deferred_->step,
                " are deferred and have not run (RunPendingRefreshes)");
  }
  GEOFP8_CHECK(state.size() == layers_.size(), "ImportGeometry: ", state.size(),
               " layer states for ", layers_.size(), " layers");
  std::vector<LayerState> next(layers_.size());
  std::vector<uint32_t> reset;
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const LayerSpec& spec = layers_[l];
    const LayerGeometryState& in = state[l];
    auto fail = [&](const auto&... parts) {
      GEOFP8_FAIL("ImportGeometry: layer ", l, " '", spec.name, "': ", parts...);
    };
    const bool has_active = !in.active.empty(), has_pending = !in.pending.empty();
    if (!has_pending && in.pending_from != 0) {
      fail("pending_from: set without a pending geometry (", in.pending_from, ")");
    }
    FactorSketch sketch;
    if (!in.sketch.empty()) {
      try {
        sketch = DeserializeFactorSketch(in.sketch);
      } catch (const Error& e) {
        fail("sketch: ", e.what());
      }
      if (sketch.m != spec.rows || sketch.n != spec.cols) {
        fail("sketch.shape: ", sketch.m, "x", sketch.n, " but the layer is ", spec.rows, "x",
             spec.cols);
      }
      if (!UsesGeometry(l) || options_.estimator != GeometryEstimator::kFactorEma) {
        if (mode == GeometryImport::kStrict) {
          fail("sketch: the layer keeps no sketch here (estimator ",
               GeometryEstimatorName(options_.estimator), ")");
        }
        reset.push_back(l);
        continue;
      }
    }
    if (!has_active && !has_pending) {
      next[l].sketch = std::move(sketch);
      continue;
    }
    Geometry active, pending;
    for (const bool is_pending : {false, true}) {
      const std::vector<uint8_t>& bytes = is_pending ? in.pending : in.active;
      if (bytes.empty()) continue;
      const char* field = is_pending ? "pending" : "active";
      Geometry& g = is_pending ? pending : active;
      try {
        g = DeserializeGeometry(bytes);
      } catch (const Error& e) {
        fail(field, ": ", e.what());
      }
      if (g.m != spec.rows || g.n != spec.cols) {
        fail(field, ".shape: ", g.m, "x", g.n, " but the layer is ", spec.rows, "x", spec.cols);
      }
      if (g.version == 0) fail(field, ".version: must be >= 1 (0)");
    }
    if (has_pending && in.pending_from < 1) fail("pending_from: must be >= 1 (0)");
    if (has_pending && pending.version <= active.version) {
      fail("pending.version: must be newer than active.version (", pending.version,
           " <= ", active.version, ")");
    }
    std::string mismatch;
    if (has_active && !(mismatch = PolicyMismatch(l, active)).empty()) {
      mismatch = "active." + mismatch;
    } else if (has_pending && !(mismatch = PolicyMismatch(l, pending)).empty()) {
      mismatch = "pending." + mismatch;
    }
    if (!mismatch.empty()) {
      if (mode == GeometryImport::kStrict) fail(mismatch);
      reset.push_back(l);
      continue;
    }
    next[l].active_digest = active.is_identity() ? 0 : GeometryDigest(active);
    next[l].active = std::move(active);
    next[l].pending = std::move(pending);
    next[l].pending_from = has_pending ? in.pending_from : 0;
    next[l].has_pending = has_pending;
    next[l].sketch = std::move(sketch);
  }
  for (uint32_t l = 0; l < layers_.size(); ++l) *state_[l] = std::move(next[l]);
  return reset;
}

// Every bucket on the calling thread, up to kBucketsPerRun per pipeline run, then the step's
// residuals and refreshes (Exchange with nothing queued, and ReduceScatter).
StepResult Exchanger::RunAll(uint64_t step, const GradSpans& grads, const GradSpans* outs,
                             Refreshes refreshes) {
  StepResult result;
  result.step = step;
  const auto start = std::chrono::steady_clock::now();
  for (size_t first = 0; first < buckets_.size(); first += kBucketsPerRun) {
    const size_t last = std::min(buckets_.size(), first + kBucketsPerRun);
    for (BucketResult& r : RunBuckets(step, first, last, grads, outs)) {
      result.skipped = result.skipped || r.skipped;
      result.bytes_sent += r.bytes_sent;
      result.buckets.push_back(r);
    }
  }
  CommitResiduals(result.skipped);
  if (!result.skipped && !schedule_.empty()) {
    if (refreshes == Refreshes::kDeferred) {
      Defer(step, grads, outs);
    } else {
      AddRefreshes(result, RunRefreshes(step, grads, nullptr, outs));
    }
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

StepResult Exchanger::ReduceScatter(uint64_t step, GradSpans grads, GradSpans outs,
                                    Refreshes refreshes) {
  GEOFP8_CHECK(refreshes == Refreshes::kNow || options_.estimator == GeometryEstimator::kFactorEma,
               "reduce-scatter: deferred refreshes need estimator ema, not ",
               GeometryEstimatorName(options_.estimator));
  GEOFP8_CHECK(grads.size() == layers_.size() && outs.size() == layers_.size(),
               "reduce-scatter: ", grads.size(), " gradients and ", outs.size(), " outputs for ",
               layers_.size(), " layers");
  GEOFP8_CHECK(steps_.empty(), "reduce-scatter: a submitted step is still in flight");
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    const LayerSpec& spec = layers_[l];
    GEOFP8_CHECK(HadamardBlockOf(l) == 0, "layer '", spec.name,
                 "': the block Hadamard rotation mixes rows across the reduce-scatter's shards; "
                 "under sharding use geometry none, diag or lowrank without hadamard");
    const ChunkRange mine = RowChunkOf(static_cast<size_t>(spec.count()),
                                       static_cast<size_t>(spec.cols), comm_.size(), comm_.rank());
    GEOFP8_CHECK(outs[l].size() == mine.size(), "layer '", spec.name, "': output has ",
                 outs[l].size(), " elements, this rank's rows of ", spec.rows, "x", spec.cols,
                 " have ", mine.size());
  }
  if (deferred_) RunPendingRefreshes();
  return RunAll(step, grads, &outs, refreshes);
}

std::vector<BucketResult> Exchanger::RunBuckets(uint64_t step, size_t first, size_t last,
                                                const GradSpans& grads, const GradSpans* outs) {
  const auto start = std::chrono::steady_clock::now();
  const uint64_t bytes_before = comm_.stats().bytes_sent;
  GEOFP8_CHECK(first < last && last <= buckets_.size() && last - first <= kBucketsPerRun,
               "exchange: bucket range [", first, ", ", last, ") is invalid");
  std::vector<BucketFingerprint> prints;
  // The algorithms divide by N as they read each chunk (the sum is then the average and cannot
  // overflow) and note any NaN or inf on the way, in the bucket's own flag bit; the ranks agree on
  // the flags after the data has moved. One pass over the gradient.
  std::vector<BucketLayer> work;
  // Per entry of `work`: whether a reduce-scatter all-reduces it (it refreshes now), and the fp32
  // memory of a bf16 or fp16 layer's transformed result, rounded into its gradient (whole) and
  // output rows (rows) after the run.
  std::vector<uint32_t> work_layer;  // the layer of each entry
  std::vector<bool> reduced;
  struct LowpResult {
    std::span<float> whole, rows;
  };
  std::vector<LowpResult> lowp;
  // The plane's fp32 memory (a device plane's is device memory), kept from run to run.
  size_t pool_used = 0;
  auto take = [&](size_t n) { return plane().WorkBuffer(pool_used++, n); };
  for (size_t bucket = first; bucket < last; ++bucket) {
    BucketFingerprint fp;
    for (uint32_t l : buckets_[bucket].layers) {
      const LayerSpec& spec = layers_[l];
      GEOFP8_CHECK(grads[l].size() == static_cast<size_t>(spec.count()), "layer '", spec.name,
                   "': gradient has ", grads[l].size(), " elements, shape ", spec.rows, "x",
                   spec.cols, " needs ", spec.count());
      LayerState& st = *state_[l];
      if (st.has_pending && step >= st.pending_from) Activate(l, st);
      LayerRecord rec;
      rec.layer = l;
      rec.format = static_cast<uint8_t>(spec.policy.format);
      rec.scaling = static_cast<uint8_t>(spec.policy.scaling);
      rec.rounding = static_cast<uint8_t>(spec.policy.rounding);
      rec.block = spec.policy.block;
      rec.rows = spec.rows;
      rec.cols = spec.cols;
      if (UsesGeometry(l)) {
        rec.geometry = static_cast<uint8_t>(spec.policy.geometry);
        rec.rank_k = spec.policy.rank;
        rec.alpha = spec.policy.alpha;
        rec.geometry_version = st.active.version;
        rec.geometry_digest = st.active_digest;
      }
      rec.hadamard_block = HadamardBlockOf(l);
      rec.error_feedback = UsesErrorFeedback(l) ? 1 : 0;
      fp.layers.push_back(rec);
      BucketLayer w;
      w.layer = LayerId(l);
      w.policy = spec.policy;
      w.geometry = UsesGeometry(l) ? &st.active : nullptr;
      w.hadamard_block = rec.hadamard_block;
      w.hadamard_seed = HadamardLayerSeed(options_.seed, LayerId(l));
      w.in = grads[l];
      w.out = grads[l];
      w.cols = spec.cols;
      // Reduce-scatter: this rank's rows only, unless the layer refreshes now under the instant
      // estimator (its owner reads the whole average, so it is all-reduced). The ema sketch reads
      // the owners' rows where that moves fewer bytes (ShardedRefresh).
      const bool scatter = outs && !(UsesGeometry(l) && RefreshesAt(l, step) && !ShardedRefresh(l));
      if (scatter) w.out = (*outs)[l];
      // A transform runs in place in fp32: a bf16 or fp16 layer is read into work memory for it
      // (with its division), and its result is rounded back after the run. Other bf16 and fp16
      // layers are read and written by the plane as they are encoded and decoded.
      LowpResult lr;
      if (Transformed(w) && !w.in.fp32()) {
        w.work = take(w.in.size());
        if (!scatter) {
          w.out = lr.whole = w.work;  // the inputs are all read before the outputs are written
        } else if (!w.out.fp32()) {
          w.out = lr.rows = take(w.out.size());
        }
      } else if (Transformed(w) && scatter && !w.out.fp32()) {
        w.out = lr.rows = take(w.out.size());
      }
      reduced.push_back(outs && !scatter);
      lowp.push_back(lr);
      if (UsesErrorFeedback(l)) {
        // The residuals live in the codec's coordinates: under a newer basis they no longer
        // apply, and the layer starts again from none.
        const size_t n = static_cast<size_t>(spec.count());
        LayerResidual& cur = st.residual;
        LayerResidual& next = st.next_residual;
        if (cur.geometry_version != st.active.version) cur = LayerResidual{};
        next.geometry_version = st.active.version;
        if (next.local.size() != n) next.local.assign(n, 0.f);
        w.residual_in = cur.local.empty() ? nullptr : cur.local.data();
        w.residual_out = next.local.data();
        if (scatter) {
          next.owner.clear();  // no requantization: the owner loses nothing more
        } else if (options_.algorithm == Algorithm::kTwoPhase) {
          if (next.owner.size() != n) next.owner.assign(n, 0.f);
          w.owner_in = cur.owner.empty() ? nullptr : cur.owner.data();
          w.owner_out = next.owner.data();
        }
      }
      w.flag_bit = static_cast<uint32_t>(bucket - first);
      // The sketch that refreshes this layer after the exchange can take G V, U^T G and ||G||^2
      // from the inverse instead of reading the result for them.
      st.products.valid = false;
      // (On a device plane the sketch runs its own products over the result instead.)
      // A bf16 or fp16 layer's refresh reads its rounded average, which the inverse never saw.
      const bool host = !options_.plane || options_.plane->host_memory();
      if (host && !scatter && w.geometry && options_.estimator == GeometryEstimator::kFactorEma &&
          RefreshesAt(l, step) && w.in.fp32())
        w.products = &st.products;
      work.push_back(w);
      work_layer.push_back(l);
    }
    fp.header.policy_version = options_.policy_version;
    fp.header.step = step;
    fp.header.bucket = static_cast<uint32_t>(bucket);
    fp.header.algorithm = static_cast<uint32_t>(options_.algorithm);
    prints.push_back(std::move(fp));
  }
  AlgorithmOptions ao;
  ao.seed = options_.seed;
  ao.step = step;
  ao.divisor = static_cast<float>(comm_.size());
  ao.segment_bytes = options_.segment_bytes;
  ao.helper_nice = options_.helper_nice;
  ao.inline_bytes = options_.inline_bytes;
  ao.trace = options_.trace;
  ao.workspace = &workspace_;
  ao.plane = options_.plane;
  // The fingerprints are compared while the first groups are encoded, in one collective for
  // every bucket of the run; nothing moves before. Once a check of a run with this layout (layer
  // sizes, grouping options) has passed on this communicator, every rank is known to have
  // these layer sizes (the records hold them), which is what sizing the fused round's receives
  // needs: then, on a communicator with a bounded receive, the record rides in the run's first
  // data round instead (AlgorithmOptions::check_record). Every rank has passed the same checks,
  // so every rank makes the same choice.
  ao.before_data = [&] { CheckFingerprints(comm_, prints, layer_names_); };
  const uint64_t layout = RunLayoutDigest(work);
  if (comm_.IsAgreedLayout(layout)) {
    const RunRecord run = MakeRunRecord(prints);
    const auto* bytes = reinterpret_cast<const uint8_t*>(&run);
    ao.check_record.assign(bytes, bytes + sizeof run);
    ao.diagnose = [&] { DiagnoseFingerprints(comm_, prints, layer_names_); };
  }
  uint64_t nonfinite = 0;
  bool rounded = false;  // plane().Round wrote an output
  if (!outs) {
    nonfinite = ExchangeBucketData(comm_, options_.algorithm, ao, work);
  } else {
    // The reduce-scatter (with the check), then the layers that refresh now as an all-reduce.
    std::vector<BucketLayer> scattered, whole;
    std::vector<GradSpan> whole_outs;  // the reduce-scatter outputs of `whole`
    for (size_t k = 0; k < work.size(); ++k) {
      (reduced[k] ? whole : scattered).push_back(work[k]);
      if (reduced[k]) whole_outs.push_back((*outs)[work_layer[k]]);
    }
    AlgorithmOptions rs = ao;
    rs.reduce_scatter = true;
    rs.segment_bytes = options_.reduce_scatter_segment_bytes;
    nonfinite = ExchangeBucketData(comm_, options_.algorithm, rs, scattered);
    if (!whole.empty()) {
      AlgorithmOptions ar = ao;
      ar.before_data = {};
      ar.check_record.clear();
      ar.diagnose = {};
      nonfinite |= ExchangeBucketData(comm_, options_.algorithm, ar, whole);
      for (size_t k = 0; k < whole.size(); ++k) {
        const BucketLayer& w = whole[k];
        const ChunkRange mine =
            RowChunkOf(w.in.size(), static_cast<size_t>(w.cols), comm_.size(), comm_.rank());
        // These layers are transformed: their average is fp32 (the gradient or its work memory).
        plane().Round(w.out.f32().subspan(mine.begin, mine.size()), whole_outs[k]);
        rounded = true;
      }
    }
  }
  // bf16 and fp16 layers that were transformed in fp32 work memory: their results, rounded.
  for (size_t k = 0; k < work.size(); ++k) {
    if (!lowp[k].whole.empty()) plane().Round(lowp[k].whole, work[k].in);
    if (!lowp[k].rows.empty()) plane().Round(lowp[k].rows, (*outs)[work_layer[k]]);
    rounded = rounded || !lowp[k].whole.empty() || !lowp[k].rows.empty();
  }
  // A device plane rounds in stream order: done before the caller reads the outputs.
  if (rounded) plane().Flush();
  comm_.AddAgreedLayout(layout);
  // One run moved every bucket's bytes: each bucket is charged its share of the fp32 size.
  const uint64_t bytes = comm_.stats().bytes_sent - bytes_before;
  size_t total_fp32 = 0;
  for (size_t b = first; b < last; ++b) total_fp32 += buckets_[b].bytes;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::vector<BucketResult> results;
  uint64_t charged = 0;
  for (size_t b = first; b < last; ++b) {
    BucketResult r;
    r.bucket = b;
    r.skipped = (nonfinite >> (b - first)) & 1;
    r.bytes_sent =
        b + 1 == last ? bytes - charged : (total_fp32 ? bytes * buckets_[b].bytes / total_fp32 : 0);
    charged += r.bytes_sent;
    r.seconds = seconds;
    results.push_back(r);
  }
  return results;
}

uint64_t Exchanger::RunLayoutDigest(std::span<const BucketLayer> work) const {
  // FNV-1a over what decides the messages' largest sizes and grouping, whatever the policies and
  // the algorithm (the fused check's receives are sized for every algorithm, algorithms.h).
  std::vector<uint64_t> words = {options_.segment_bytes, options_.reduce_scatter_segment_bytes,
                                 options_.inline_bytes, work.size()};
  for (const BucketLayer& l : work) words.push_back(l.in.size() == l.out.size() ? 0 : 1);
  for (const BucketLayer& l : work) words.push_back(l.in.size());
  return Fnv1a(words.data(), words.size() * sizeof(uint64_t));
}

void Exchanger::Activate(uint32_t layer, LayerState& st) {
  // Error feedback: the residuals were taken in the coordinates the codec saw, R T_old (R the
  // rotation, if any). The transforms are linear, so what they hold is carried into the new
  // coordinates, r' = R T_new T_old^-1 R^-1 r, and is still sent; dropping them at every basis
  // change would turn error feedback off under a geometry refreshed every step. The owner's
  // residual keeps only its own chunk of r' (it requantizes no other): exact while the basis
  // moves little between refreshes, which the sketch's smoothing makes the common case.
  LayerResidual& r = st.residual;
  if (UsesErrorFeedback(layer) && r.geometry_version == st.active.version &&
      st.pending.version != st.active.version) {
    const uint32_t hb = HadamardBlockOf(layer);
    const uint64_t hs = HadamardLayerSeed(options_.seed, LayerId(layer));
    for (std::vector<float>* v : {&r.local, &r.owner}) {
      if (v->empty()) continue;
      if (hb) HadamardInverse(*v, int(hb), hs);
      if (!st.active.is_identity()) InvertGeometry(st.active, *v);
      if (!st.pending.is_identity()) ApplyGeometry(st.pending, *v);
      if (hb) HadamardForward(*v, int(hb), hs);
    }
    r.geometry_version = st.pending.version;
  }
  st.active = std::move(st.pending);
  st.pending = Geometry{};
  st.has_pending = false;
  st.active_digest = st.active.is_identity() ? 0 : GeometryDigest(st.active);
}

FactorSketchOptions Exchanger::SketchOptions(uint32_t layer) const {
  FactorSketchOptions o = options_.sketch;
  o.width = std::max(o.width, layers_[layer].policy.rank);
  o.seed = options_.seed ^ (0x5851f42d4c957f2dull * (uint64_t{LayerId(layer)} + 1));
  return o;
}

std::vector<RefreshRecord> Exchanger::RunRefreshes(
    uint64_t step, const GradSpans& grads,
    const std::vector<std::unique_ptr<GradientProducts>>* snapshots, const GradSpans* outs) {
  TraceScope span(options_.trace, "geometry_refresh", ExchangeTrace::kMainLane, step);
  std::vector<RefreshRecord> out;
  const bool device = options_.plane && !options_.plane->host_memory();
  std::vector<float> host_copy;  // a device plane's averaged gradient, read to the host
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    if (!UsesGeometry(l) || !RefreshesAt(l, step)) continue;
    const RefreshSchedule& s = schedule_[l];
    const LayerSpec& spec = layers_[l];
    LayerState& st = *state_[l];
    RefreshRecord rec;
    rec.layer = l;
    const uint64_t bytes_before = comm_.stats().bytes_sent;
    if (options_.estimator == GeometryEstimator::kFactorEma) {
      // Every rank holds the same averaged gradient and runs the same fixed-order arithmetic, so
      // every rank derives the same geometry; the fingerprint's digest checks it at its first use.
      const auto start = std::chrono::steady_clock::now();
      // The sketch's products where the gradient lives (the plane's), or over the copy a
      // deferred refresh took. The inverse's products are only ever valid on the host.
      std::unique_ptr<GradientProducts> own;
      GradientProducts* products = snapshots ? (*snapshots)[l].get() : nullptr;
      if (!products) {
        own = outs && ShardedRefresh(l) ? ShardProducts(l, (*outs)[l], /*copy=*/false)
              : grads[l].fp32()         ? plane().Products(grads[l].f32(), spec.rows, spec.cols)
                                        : LowpProducts(grads[l], spec.rows, spec.cols);
        products = own.get();
      }
      rec.from_inverse = UpdateFactorSketch(st.sketch, *products, spec.rows, spec.cols,
                                            spec.policy.rank, SketchOptions(l), &st.products);
      st.products.valid = false;
      SketchGeometryOptions go;
      go.rank = spec.policy.rank;
      go.alpha = spec.policy.alpha;
      go.adapt = options_.adapt;
      const Geometry& latest = st.has_pending ? st.pending : st.active;
      Geometry g = GeometryFromSketch(st.sketch, go, latest.version + 1);
      if (g.is_identity()) continue;
      rec.drift = options_.measure_drift && !latest.is_identity() ? SubspaceDrift(latest, g) : 0.0;
      rec.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      st.pending = std::move(g);
      st.pending_from = step + options_.activation_delay;
      st.has_pending = true;
      rec.version = st.pending.version;
      rec.active_from = st.pending_from;
      rec.bytes_sent = comm_.stats().bytes_sent - bytes_before;
      out.push_back(rec);
      continue;
    }
    std::vector<uint8_t> bytes;
    std::string owner_error;
    if (comm_.rank() == s.owner) {
      try {
        GeometryOptions go;
        go.mode = spec.policy.geometry;
        go.rank = spec.policy.rank;
        go.alpha = spec.policy.alpha;
        go.power_iters = options_.power_iters;
        go.seed = options_.seed ^ (0x5851f42d4c957f2dull * (uint64_t{LayerId(l)} + 1));
        go.sigma_ema = options_.sigma_ema;
        const Geometry* previous = st.has_pending          ? &st.pending
                                   : st.active.version > 0 ? &st.active
                                                           : nullptr;
        // The owner reads a device plane's gradient to the host, and a bf16 or fp16 average in
        // fp32, exactly.
        std::span<const float> grad;
        if (device || !grads[l].fp32()) {
          host_copy.resize(grads[l].size());
          plane().Read(grads[l], host_copy);
          grad = host_copy;
        } else {
          grad = grads[l].f32();
        }
        RefreshResult r = EstimateGeometry(grad, spec.rows, spec.cols, go, previous);
        rec.drift = r.drift;
        rec.seconds = r.seconds;
        bytes = SerializeGeometry(r.geometry);
      } catch (const std::exception& e) {
        owner_error = e.what();
        bytes.clear();
      }
    }
    // A small header first (size 0 tells the others the owner failed), then the geometry.
    struct {
      uint64_t size;
      double drift, seconds;
    } head = {bytes.size(), rec.drift, rec.seconds};
    comm_.Broadcast({reinterpret_cast<uint8_t*>(&head), sizeof head}, s.owner);
    if (head.size == 0) {
      GEOFP8_FAIL("geometry refresh of layer '", spec.name, "' at step ", step,
                  " failed on owner rank ", s.owner, owner_error.empty() ? "" : ": ", owner_error);
    }
    bytes.resize(head.size);
    comm_.Broadcast(bytes, s.owner);
    rec.drift = head.drift;
    rec.seconds = head.seconds;
    st.pending = DeserializeGeometry(bytes);
    st.pending_from = step + options_.activation_delay;
    st.has_pending = true;
    rec.version = st.pending.version;
    rec.active_from = st.pending_from;
    rec.bytes_sent = comm_.stats().bytes_sent - bytes_before;
    out.push_back(rec);
  }
  return out;
}

}  // namespace geofp8
