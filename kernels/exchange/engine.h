// The exchange engine a framework drives: a model's layers, the policy in force, each layer's
// state (layer_state.h) and buckets that the caller defines. geofp8.torch's DDP hook is a thin
// binding over it (client/python/geofp8_module.cc); so is any other caller that groups gradients
// its own way (FSDP2's parameter groups, a trainer's buckets).
//
//   ExchangeEngine engine(comm, options);
//   engine.SetLayers({{"wq", 512, 512}, {"norm", 512, 1}});
//   engine.SetPolicy(policy);                  // one LayerPolicy per layer, the algorithm, ...
//   engine.Exchange(step, {1, 0}, {g1, g0});   // any grouping, averaged in place
//   engine.Submit(step, {1}, {g1}, done);      // the same on the engine's exchange thread
//   engine.ReduceScatter(step, {1, 0}, {g1, g0}, {rows1, rows0});  // this rank's rows only
//
// Each layer's geometry, sketch and error-feedback residuals live in one LayerStateTable keyed by
// the layer's index, so they continue whatever grouping the next call uses, and across policy
// changes where they still fit the new policy. Every rank must make the same calls in the same
// order (the groupings and the steps); the bucket fingerprint names the layer and rank where
// they differ.
//
// Threads: one caller thread drives the engine. Submitted buckets run one at a time in
// submission order on the engine's exchange thread; their callbacks run in the same order on its
// completion thread, never on the exchange thread, so a callback that blocks (one waiting for an
// interpreter lock) never stalls the wire.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kernels/exchange/exchanger.h"
#include "kernels/exchange/layer_state.h"

namespace geofp8 {

// One layer (a model parameter) as the engine sees it.
struct EngineLayer {
  std::string name;  // for error messages and fingerprints, e.g. "blocks.3.mlp.fc1.weight"
  int64_t rows = 0;  // a 1-D parameter of n elements is (n, 1), as in LayerSpec
  int64_t cols = 1;
};

// The policy in force: what to do with each layer, and how to exchange.
struct EnginePolicy {
  std::vector<LayerPolicy> layers;  // one per engine layer, in SetLayers order
  // algorithm, bucket_cap_bytes, estimator and its knobs (platform/policy MakeExchangeOptions).
  // The engine sets the fields that EngineOptions and the call decide: seed, timeout,
  // policy_version, layer_ids, states, plane, trace, inline_bytes, measure_drift.
  ExchangeOptions options;
  std::vector<RefreshSchedule> schedule;  // one per layer, or empty: no refreshes
  uint64_t version = 0;                   // checked across ranks in every fingerprint
};

struct EngineOptions {
  uint64_t seed = 0;  // stochastic rounding streams and geometry cold starts
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;  // every collective's
  // A group up to this many fp32 bytes runs on the calling thread with no pipeline threads
  // (ExchangeOptions::inline_bytes). geofp8.torch: 4 MiB (docs/benchmarks.md, "DDP comm hooks").
  size_t inline_bytes = 0;
  // ExchangeOptions::measure_drift. geofp8.torch reports no drift and turns it off.
  bool measure_drift = true;
  // Where the gradients live (ExchangeOptions::plane). Not owned. Null: host memory.
  DataPlane* plane = nullptr;
  // ema estimator: the refreshes of an Exchange() call run afterwards on the exchange thread (off
  // the caller's critical path) instead of inside it; every step still uses the geometry it
  // would have, bit for bit (Refreshes::kDeferred).
  bool defer_refreshes = true;
};

class ExchangeEngine {
 public:
  // A submitted group's end, as its Done sees it on the completion thread.
  struct Completion {
    StepResult* result = nullptr;                                     // null when it failed
    std::exception_ptr error;                                         // null when it succeeded
    std::chrono::steady_clock::time_point queued, started, finished;  // Submit, run, end
  };
  using Done = std::function<void(const Completion&)>;
  // Runs on the exchange thread just before a submitted group is exchanged (a device plane waits
  // there for the event that orders it after the caller's stream).
  using Before = std::function<void()>;

  ExchangeEngine(Communicator& comm, EngineOptions options);
  // Stop(), then drops what is still queued: their Done is destroyed uncalled.
  ~ExchangeEngine();
  ExchangeEngine(const ExchangeEngine&) = delete;
  ExchangeEngine& operator=(const ExchangeEngine&) = delete;

  // Stops the threads: a group still queued is not run; one on the wire is stopped through the
  // communicator's Abort (which leaves the communicator unusable), while deferred refreshes in
  // progress, which use no collective, are let finish. Safe from a Done callback (the completion
  // thread then ends on its own). The engine takes no more work afterwards.
  void Stop();

  // The model's layers; forgets the policy and every layer's state. Errors name the layer.
  void SetLayers(std::vector<EngineLayer> layers);
  const std::vector<EngineLayer>& layers() const { return layers_; }

  // Validates and takes a policy (errors name the layer and field). Each layer's geometry and
  // sketch carry over where they still fit the new policy (GeometryImport::kDropMismatched);
  // error-feedback residuals, taken under the old one, are dropped. Waits for submitted groups.
  void SetPolicy(EnginePolicy policy);
  bool has_policy() const { return has_policy_; }
  const EnginePolicy& policy() const { return policy_; }

  // Averages the gradients of `layers` (indices into SetLayers' list, distinct) over the ranks in
  // place: grads[i] is layer layers[i]'s gradient, fp32, or bf16 or fp16 in host memory (read
  // straight into fp32 as it is encoded, summed in fp32 and written back rounded to nearest even
  // in its dtype; grad_span.h). Runs on the calling thread once the groups
  // submitted before it are done; rethrows the first error of a submitted group that failed since
  // the last Drain (that group's Done got it too). `before` runs first (as Submit's).
  // The result's refreshes include those deferred refreshes that ran since the last result.
  // `started`, if given, is set to when the exchange began, after the wait for the queue.
  StepResult Exchange(uint64_t step, const std::vector<uint32_t>& layers, GradSpans grads,
                      const Before& before = {},
                      std::chrono::steady_clock::time_point* started = nullptr);

  // Exchange() as a reduce-scatter (Exchanger::ReduceScatter): outs[i] receives this rank's rows
  // of layer layers[i]'s average, FSDP's dim-0 chunk (rows [r c, min((r + 1) c, rows)) with
  // c = ceil(rows / N)); grads[i] is clobbered and must not overlap any output. Each output has a
  // dtype of its own (fp32, bf16 or fp16), whatever its gradient's. Runs on the calling thread as
  // Exchange() does, `before` first. Memory of the exchangers' plane (host, or the device plane's).
  StepResult ReduceScatter(uint64_t step, const std::vector<uint32_t>& layers, GradSpans grads,
                           GradSpans outs, const Before& before = {});

  // Exchange() on the exchange thread, in submission order, without waiting. The gradients must
  // stay valid and untouched until `done` is called.
  void Submit(uint64_t step, const std::vector<uint32_t>& layers, GradSpans grads, Done done,
              Before before = {});

  // Waits until every submitted group's Done has returned. forget_errors: the next Exchange()
  // does not rethrow a submitted group's error.
  void Drain(bool forget_errors = true);
  // Submitted groups whose Done has not yet returned.
  size_t in_flight() const;

  // The minimum of `value` over the ranks, one small collective (after the submitted groups).
  uint64_t AgreeMin(uint64_t value);

  // Every layer's state, in SetLayers order, between steps (waits for submitted groups).
  std::vector<LayerGeometryState> ExportGeometry();
  std::vector<LayerResidual> ExportResiduals();
  // Takes ExportGeometry's list back (a resume), checked strictly against the policy in force:
  // an error names the layer and field and changes nothing. Residuals are dropped; restore them
  // afterwards with ImportResiduals.
  void ImportGeometry(const std::vector<LayerGeometryState>& state);
  // One entry per layer; sizes 0 or the layer's (an error names the layer). A layer without
  // error feedback under the policy in force keeps none.
  void ImportResiduals(const std::vector<LayerResidual>& residuals);

  // Exchangers alive, one per grouping in use (a grouping that shares a layer with a new one is
  // dropped when the new one forms).
  size_t exchanger_count();

  // Records every exchange's collectives, codec stages and geometry refreshes from now on.
  void StartTrace();
  ExchangeTrace* trace() { return trace_.get(); }

  Communicator& communicator() { return comm_; }

 private:
  struct Job {
    uint64_t step = 0;
    Exchanger* exchanger = nullptr;  // alive: groupings change only with the queue empty
    GradSpans grads;
    Done done;
    Before before;
    bool refresh_only = false;  // an Exchange()'s deferred refreshes: no data, no callback
    std::chrono::steady_clock::time_point queued, started, finished;
    StepResult result;
    std::exception_ptr error;
  };
  // Shared with the completion thread, which may outlive the engine by a few instructions (a
  // callback may destroy the engine's owner, and so the engine, on that very thread).
  struct Queue {
    std::mutex mu;
    std::condition_variable work_cv, done_cv, idle_cv;
    std::deque<std::unique_ptr<Job>> exchange, done;
    size_t in_flight = 0;        // submitted, Done not yet returned
    bool running = false;        // the exchange thread is inside a job
    bool running_local = false;  // ... and it is deferred refreshes, which use no collective
    bool stop = false;
    std::exception_ptr first_error;  // of a submitted group, for the next Exchange()
    // Deferred refreshes run since the last result handed out, which the next one takes.
    std::vector<RefreshRecord> deferred;
  };

  // Exchange() (outs null) and ReduceScatter() (outs: this rank's rows of each layer).
  StepResult Run(uint64_t step, const std::vector<uint32_t>& layers, GradSpans grads,
                 GradSpans* outs, const Before& before,
                 std::chrono::steady_clock::time_point* started);
  Exchanger& ExchangerFor(const std::vector<uint32_t>& layers);
  // An exchanger over `layers` under the policy in force, on the engine's layer states (or, for
  // validation alone, on a table of its own).
  std::unique_ptr<Exchanger> MakeExchanger(const std::vector<uint32_t>& layers,
                                           bool shared_states = true);
  GradSpans Checked(const std::vector<uint32_t>& layers, GradSpans grads) const;
  void Enqueue(std::unique_ptr<Job> job);
  void WaitForExchanges();
  void RequirePolicy(const char* what) const;
  void ExchangeLoop();
  static void CompletionLoop(std::shared_ptr<Queue> q);

  Communicator& comm_;
  EngineOptions options_;
  std::vector<EngineLayer> layers_;
  EnginePolicy policy_;
  bool has_policy_ = false;
  std::unique_ptr<ExchangeTrace> trace_;  // before exchangers_: they write into it
  LayerStateTable states_;                // before exchangers_: they point into it
  std::map<std::vector<uint32_t>, std::unique_ptr<Exchanger>> exchangers_;
  std::shared_ptr<Queue> q_ = std::make_shared<Queue>();
  std::thread exchange_thread_, completion_thread_;  // started by the first Submit or deferral
};

}  // namespace geofp8
