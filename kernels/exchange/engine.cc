#include "kernels/exchange/engine.h"

#include <utility>

#include "kernels/common/check.h"

namespace geofp8 {

ExchangeEngine::ExchangeEngine(Communicator& comm, EngineOptions options)
    : comm_(comm), options_(options) {
  GEOFP8_CHECK(options_.timeout.count() > 0, "timeout: must be positive (",
               options_.timeout.count(), " ms)");
}

ExchangeEngine::~ExchangeEngine() {
  Stop();
  // What was never run is dropped here, on the owner's thread, with its callbacks uncalled.
  q_->exchange.clear();
  q_->done.clear();
  exchangers_.clear();
}

void ExchangeEngine::Stop() {
  if (!exchange_thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(q_->mu);
    q_->stop = true;
    if (q_->running && !q_->running_local) comm_.Abort("the geofp8 engine is being destroyed");
  }
  q_->work_cv.notify_all();
  q_->done_cv.notify_all();
  q_->idle_cv.notify_all();
  exchange_thread_.join();
  if (completion_thread_.get_id() == std::this_thread::get_id()) {
    completion_thread_.detach();  // a callback let go of the engine; its loop ends on its own
  } else {
    completion_thread_.join();
  }
}

void ExchangeEngine::SetLayers(std::vector<EngineLayer> layers) {
  GEOFP8_CHECK(!layers.empty(), "layers: the model has no parameter that requires a gradient");
  for (const EngineLayer& l : layers) {
    GEOFP8_CHECK(l.rows >= 1 && l.cols >= 1, "layers: parameter '", l.name, "' has shape (", l.rows,
                 ", ", l.cols, ")");
  }
  Drain();
  exchangers_.clear();
  states_.clear();
  layers_ = std::move(layers);
  policy_ = EnginePolicy{};
  has_policy_ = false;
}

void ExchangeEngine::SetPolicy(EnginePolicy policy) {
  GEOFP8_CHECK(!layers_.empty(), "policy: set the layers first");
  GEOFP8_CHECK(policy.layers.size() == layers_.size(), "policy: ", policy.layers.size(),
               " layer policies for ", layers_.size(), " layers");
  GEOFP8_CHECK(policy.schedule.empty() || policy.schedule.size() == layers_.size(),
               "schedule: needs one entry per layer (", policy.schedule.size(), " entries for ",
               layers_.size(), " layers)");
  Drain();
  EnginePolicy previous = std::exchange(policy_, std::move(policy));
  const bool had = std::exchange(has_policy_, true);
  try {
    // Every check the exchangers make, made now over every layer, naming the layer and field.
    // A table of its own: the layers' states are not touched.
    std::vector<uint32_t> every(layers_.size());
    for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<uint32_t>(i);
    MakeExchanger(every, /*shared_states=*/false);
  } catch (...) {
    policy_ = std::move(previous);
    has_policy_ = had;
    throw;
  }
  exchangers_.clear();
  // Residuals were taken in the old policy's formats and coordinates; geometry that no longer
  // fits is reset as each new exchanger forms (ExchangeOptions::states).
  states_.DropResiduals();
}

void ExchangeEngine::RequirePolicy(const char* what) const {
  GEOFP8_CHECK(has_policy_, what, ": set_policy first");
}

GradSpans ExchangeEngine::Checked(const std::vector<uint32_t>& layers, GradSpans grads) const {
  RequirePolicy("exchange");
  GEOFP8_CHECK(!layers.empty() && layers.size() == grads.size(), "exchange: ", layers.size(),
               " layers but ", grads.size(), " gradients");
  for (size_t i = 0; i < layers.size(); ++i) {
    GEOFP8_CHECK(layers[i] < layers_.size(), "exchange: layer index ", layers[i],
                 " >= ", layers_.size());
    const EngineLayer& l = layers_[layers[i]];
    GEOFP8_CHECK(grads[i].size() == static_cast<size_t>(l.rows * l.cols), "exchange: layer '",
                 l.name, "' has ", l.rows * l.cols, " elements, its gradient ", grads[i].size());
  }
  return grads;
}

std::unique_ptr<Exchanger> ExchangeEngine::MakeExchanger(const std::vector<uint32_t>& layers,
                                                         bool shared_states) {
  std::vector<LayerSpec> specs;
  std::vector<RefreshSchedule> schedule;
  for (uint32_t l : layers) {
    specs.push_back(
        LayerSpec{layers_[l].name, layers_[l].rows, layers_[l].cols, policy_.layers[l]});
    if (!policy_.schedule.empty()) schedule.push_back(policy_.schedule[l]);
  }
  ExchangeOptions eo = policy_.options;
  eo.seed = options_.seed;
  eo.timeout = options_.timeout;
  eo.policy_version = policy_.version;
  eo.layer_ids = layers;  // streams keyed by the model's layer index, whatever the grouping
  eo.inline_bytes = options_.inline_bytes;
  eo.measure_drift = options_.measure_drift;
  eo.trace = trace_.get();
  eo.plane = options_.plane;
  eo.states = shared_states ? &states_ : nullptr;
  return std::make_unique<Exchanger>(comm_, std::move(specs), eo, std::move(schedule));
}

Exchanger& ExchangeEngine::ExchangerFor(const std::vector<uint32_t>& layers) {
  auto it = exchangers_.find(layers);
  if (it != exchangers_.end()) return *it->second;
  // A new grouping (DDP rebuilds its buckets after the first step): groupings sharing a layer
  // with it go, so that one exchanger at most holds each layer. The layers' states stay in the
  // table. The caller has drained the queue, so none of them is running or holds deferred work.
  std::vector<bool> wanted(layers_.size(), false);
  for (uint32_t l : layers) {
    GEOFP8_CHECK(!wanted[l], "exchange: layer '", layers_[l].name, "' twice in one bucket");
    wanted[l] = true;
  }
  for (auto e = exchangers_.begin(); e != exchangers_.end();) {
    bool overlaps = false;
    for (uint32_t l : e->first) overlaps = overlaps || wanted[l];
    e = overlaps ? exchangers_.erase(e) : std::next(e);
  }
  return *exchangers_.emplace(layers, MakeExchanger(layers)).first->second;
}

StepResult ExchangeEngine::Exchange(uint64_t step, const std::vector<uint32_t>& layers,
                                    GradSpans grads, const Before& before,
                                    std::chrono::steady_clock::time_point* started) {
  return Run(step, layers, std::move(grads), nullptr, before, started);
}

StepResult ExchangeEngine::ReduceScatter(uint64_t step, const std::vector<uint32_t>& layers,
                                         GradSpans grads, GradSpans outs, const Before& before) {
  GEOFP8_CHECK(outs.size() == layers.size(), "reduce-scatter: ", layers.size(), " layers but ",
               outs.size(), " outputs");
  return Run(step, layers, std::move(grads), &outs, before, nullptr);
}

StepResult ExchangeEngine::Run(uint64_t step, const std::vector<uint32_t>& layers, GradSpans grads,
                               GradSpans* outs, const Before& before,
                               std::chrono::steady_clock::time_point* started) {
  grads = Checked(layers, std::move(grads));
  // The groups submitted before this one go first; their callbacks may still run meanwhile
  // (they touch no exchanger), and a new grouping waits for those too.
  if (exchangers_.contains(layers)) {
    WaitForExchanges();
  } else {
    Drain(/*forget_errors=*/false);
  }
  // A submitted group of this step failed (a timeout, a fingerprint mismatch): its Done had the
  // error, and this call raises that root cause too, leaving its group unexchanged on every
  // rank, as a synchronous caller stops at the first failed group.
  if (q_->first_error) std::rethrow_exception(std::exchange(q_->first_error, nullptr));
  Exchanger& ex = ExchangerFor(layers);
  if (started) *started = std::chrono::steady_clock::now();
  if (before) before();
  // The ema estimator's refreshes run on the exchange thread after this returns, while the
  // optimizer and the next forward run; the instant estimator's broadcast cannot wait.
  const bool defer =
      options_.defer_refreshes && policy_.options.estimator == GeometryEstimator::kFactorEma;
  const Refreshes refreshes = defer ? Refreshes::kDeferred : Refreshes::kNow;
  StepResult r = outs ? ex.ReduceScatter(step, std::move(grads), std::move(*outs), refreshes)
                      : ex.Exchange(step, std::move(grads), refreshes);
  {
    // The deferred refreshes queued before this call have run (the queue was idle).
    std::lock_guard<std::mutex> lock(q_->mu);
    AddRefreshes(r, q_->deferred);
    q_->deferred.clear();
  }
  if (ex.has_pending_refreshes()) {
    auto job = std::make_unique<Job>();
    job->step = step;
    job->exchanger = &ex;
    job->refresh_only = true;
    Enqueue(std::move(job));
  }
  return r;
}

void ExchangeEngine::Submit(uint64_t step, const std::vector<uint32_t>& layers, GradSpans grads,
                            Done done, Before before) {
  grads = Checked(layers, std::move(grads));
  // A new grouping takes layers over from exchangers that a queued group may be using.
  if (!exchangers_.contains(layers)) Drain(/*forget_errors=*/false);
  auto job = std::make_unique<Job>();
  job->step = step;
  job->exchanger = &ExchangerFor(layers);
  job->grads = std::move(grads);
  job->done = std::move(done);
  job->before = std::move(before);
  Enqueue(std::move(job));
}

void ExchangeEngine::Enqueue(std::unique_ptr<Job> job) {
  job->queued = std::chrono::steady_clock::now();
  if (!exchange_thread_.joinable()) {
    GEOFP8_CHECK(!q_->stop, "exchange: the engine has been stopped");
    exchange_thread_ = std::thread([this] { ExchangeLoop(); });
    completion_thread_ = std::thread([q = q_] { CompletionLoop(q); });
  }
  {
    std::lock_guard<std::mutex> lock(q_->mu);
    q_->exchange.push_back(std::move(job));
    ++q_->in_flight;
  }
  q_->work_cv.notify_one();
}

void ExchangeEngine::ExchangeLoop() {
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(q_->mu);
      q_->work_cv.wait(lock, [this] { return q_->stop || !q_->exchange.empty(); });
      if (q_->stop) return;
      job = std::move(q_->exchange.front());
      q_->exchange.pop_front();
      q_->running = true;
      q_->running_local = job->refresh_only;
    }
    job->started = std::chrono::steady_clock::now();
    std::vector<RefreshRecord> deferred;
    try {
      if (job->refresh_only) {
        deferred = job->exchanger->RunPendingRefreshes();
      } else {
        if (job->before) std::exchange(job->before, nullptr)();
        job->result = job->exchanger->Exchange(job->step, job->grads);
      }
    } catch (...) {
      job->error = std::current_exception();
    }
    job->finished = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(q_->mu);
      q_->running = false;
      q_->running_local = false;
      if (job->error && !q_->first_error) q_->first_error = job->error;
      // Deferred refreshes go with the next result handed out, in queue order: the same
      // accounting whatever the threads' timing.
      auto& pool = q_->deferred;
      pool.insert(pool.end(), deferred.begin(), deferred.end());
      if (!job->refresh_only && !job->error) {
        AddRefreshes(job->result, pool);
        pool.clear();
      }
      q_->done.push_back(std::move(job));
    }
    q_->done_cv.notify_one();
    q_->idle_cv.notify_all();
  }
}

void ExchangeEngine::CompletionLoop(std::shared_ptr<Queue> q) {
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(q->mu);
      q->done_cv.wait(lock, [&q] { return q->stop || !q->done.empty(); });
      if (q->stop) return;
      job = std::move(q->done.front());
      q->done.pop_front();
    }
    if (!job->refresh_only && job->done) {
      // An error of a refresh-only job waits in first_error for the next Exchange().
      try {
        const Completion c{job->error ? nullptr : &job->result, job->error, job->queued,
                           job->started, job->finished};
        job->done(c);
      } catch (...) {
        // A callback's own failure is its to report; the queue goes on.
      }
    }
    job.reset();
    {
      std::lock_guard<std::mutex> lock(q->mu);
      --q->in_flight;
    }
    q->idle_cv.notify_all();
  }
}

void ExchangeEngine::Drain(bool forget_errors) {
  if (exchange_thread_.joinable()) {
    std::unique_lock<std::mutex> lock(q_->mu);
    q_->idle_cv.wait(lock, [this] { return q_->in_flight == 0 || q_->stop; });
  }
  if (forget_errors) q_->first_error = nullptr;
}

void ExchangeEngine::WaitForExchanges() {
  if (!exchange_thread_.joinable()) return;
  std::unique_lock<std::mutex> lock(q_->mu);
  q_->idle_cv.wait(lock, [this] { return (q_->exchange.empty() && !q_->running) || q_->stop; });
}

size_t ExchangeEngine::in_flight() const {
  std::lock_guard<std::mutex> lock(q_->mu);
  return q_->in_flight;
}

uint64_t ExchangeEngine::AgreeMin(uint64_t value) {
  Drain();  // the communicator runs one collective at a time
  uint64_t word = ~value;
  comm_.MaxReduceWords(std::span<uint64_t>(&word, 1));
  return ~word;
}

std::vector<LayerGeometryState> ExchangeEngine::ExportGeometry() {
  Drain();
  std::vector<LayerGeometryState> out(layers_.size());
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    if (const LayerState* st = states_.find(l)) out[l] = ExportLayerGeometry(*st);
  }
  return out;
}

std::vector<LayerResidual> ExchangeEngine::ExportResiduals() {
  Drain();
  std::vector<LayerResidual> out(layers_.size());
  for (uint32_t l = 0; l < layers_.size(); ++l) {
    if (const LayerState* st = states_.find(l)) out[l] = st->residual;
  }
  return out;
}

void ExchangeEngine::ImportGeometry(const std::vector<LayerGeometryState>& state) {
  RequirePolicy("import_geometry");
  GEOFP8_CHECK(state.size() == layers_.size(), "geometry: ", state.size(),
               " layers in the state, the model has ", layers_.size());
  Drain();
  exchangers_.clear();
  std::vector<uint32_t> every(layers_.size());
  for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<uint32_t>(i);
  // An exchanger over every layer checks the whole state before it writes any of it.
  MakeExchanger(every)->ImportGeometry(state, GeometryImport::kStrict);
}

void ExchangeEngine::ImportResiduals(const std::vector<LayerResidual>& residuals) {
  RequirePolicy("import_residuals");
  GEOFP8_CHECK(residuals.size() == layers_.size(), "residuals: ", residuals.size(),
               " layers in the state, the model has ", layers_.size());
  Drain();
  exchangers_.clear();
  std::vector<uint32_t> every(layers_.size());
  for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<uint32_t>(i);
  MakeExchanger(every)->ImportResiduals(residuals);
}

size_t ExchangeEngine::exchanger_count() {
  Drain();
  return exchangers_.size();
}

void ExchangeEngine::StartTrace() {
  if (trace_) return;
  Drain();
  exchangers_.clear();  // rebuilt with the trace attached; the layers' states stay
  trace_ = std::make_unique<ExchangeTrace>();
}

}  // namespace geofp8
