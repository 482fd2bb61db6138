// The exchange engine: averages a model's layer gradients across ranks, bucket by bucket on a
// background thread (one future per bucket, so a trainer can overlap them with its backward
// pass), with per-layer policies, the geometry transform, fingerprints and the non-finite skip.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kernels/exchange/algorithms.h"
#include "kernels/exchange/communicator.h"
#include "kernels/exchange/grad_span.h"
#include "kernels/exchange/layer_state.h"
#include "kernels/exchange/policy.h"
#include "kernels/exchange/trace.h"
#include "kernels/geometry/factor_sketch.h"
#include "kernels/geometry/geometry.h"

namespace geofp8 {

// One parameter's gradient as the exchange sees it.
struct LayerSpec {
  std::string name;  // for error messages, e.g. "blocks.3.mlp.fc1.weight"
  int64_t rows = 0;  // a 1-D parameter has cols == 1 and always uses geometry none
  int64_t cols = 1;
  LayerPolicy policy;
  int64_t count() const { return rows * cols; }
};

struct ExchangeOptions {
  Algorithm algorithm = Algorithm::kTwoPhase;
  // Largest bucket in fp32 bytes of gradient; a larger layer gets a bucket of its own.
  size_t bucket_cap_bytes = size_t{25} << 20;
  // two_phase pipelines groups of layers of about this many fp32 bytes within a bucket.
  size_t segment_bytes = size_t{1} << 20;
  // The same for the reduce-scatter (ReduceScatter), whose groups are one all-to-all each: on a
  // shared CPU each collective costs milliseconds of scheduling, which outweighed the encode that
  // smaller groups overlap (FSDP2 over 1 Gbit/s, 20.7M parameters: docs/benchmarks.md, "FSDP2
  // reduce-scatter segments").
  size_t reduce_scatter_segment_bytes = size_t{16} << 20;
  // A run of buckets totalling at most this many fp32 bytes runs on one thread, with no pipeline
  // threads (AlgorithmOptions::inline_bytes). 0: never. Every rank must use the same value.
  size_t inline_bytes = 0;
  // Niceness added to the pipeline's codec thread, in [0, 19] (AlgorithmOptions::helper_nice).
  int helper_nice = 0;
  // Records every step's collectives, codec stages and geometry refreshes (trace.h). Not owned:
  // it must outlive the Exchanger. Null: no timeline.
  ExchangeTrace* trace = nullptr;
  // Every collective's timeout (DESIGN.md section 4).
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
  // Checked across ranks in every bucket's fingerprint.
  uint64_t policy_version = 0;
  // Stochastic rounding streams and geometry cold starts derive from it.
  uint64_t seed = 0;
  // A geometry refreshed after step s is used from step s + activation_delay on every rank.
  int activation_delay = 1;
  // How geometries are estimated. kInstant uses power_iters and sigma_ema below (GeometryOptions
  // fields) and the schedule's owner; kFactorEma uses sketch and adapt, on every rank.
  GeometryEstimator estimator = GeometryEstimator::kInstant;
  int power_iters = 1;
  float sigma_ema = 0.f;
  FactorSketchOptions sketch;  // width is raised to the layer's rank k where it is smaller
  float adapt = 0.0f;          // SketchGeometryOptions::adapt: strength follows the sketch's fit
  // kFactorEma: measure each refresh's RefreshRecord::drift (SubspaceDrift to the geometry it
  // replaces, O((m + n) k^2) and two small eigenproblems per refresh). False leaves drift 0 and
  // changes nothing else; geofp8.torch, which reports no drift, turns it off.
  bool measure_drift = true;
  // The model index of each layer (one per layer, distinct), which keys its stochastic-rounding
  // stream, sketch probes and geometry cold start. Empty: the layer's position here. An
  // Exchanger over a subset of a model's layers (geofp8.torch has one per DDP bucket) sets it
  // so a layer's streams do not depend on which layers share its Exchanger.
  std::vector<uint32_t> layer_ids;
  // Where the gradients handed to Submit/Exchange live and what runs the codec on them
  // (data_plane.h): null, host memory and the CPU engine; a StagedPlane, device memory (every
  // span a device pointer and a length) with the codec on the device and the wire staged through
  // host memory or kept in device memory (WireMemory). Not owned: it must outlive the Exchanger.
  // Every rank uses the same kind. Layers whose policy the plane cannot run, and a device wire
  // over a communicator that takes host spans only, are refused at construction, naming the
  // layer and field, or the plane and communicator.
  // The ema sketch runs its products over the averaged gradient on the plane
  // (DataPlane::Products); the instant estimator's owner reads it to the host.
  DataPlane* plane = nullptr;
  // Where each layer's state lives (layer_state.h), keyed by its layer id (layer_ids, else its
  // position): an Exchanger that shares a table with others over other groupings of the same
  // layers continues each layer's geometry, sketch and residuals where the last one left them.
  // Not owned: it must outlive the Exchanger. Null: the Exchanger keeps a table of its own.
  // A shared layer's state that no longer fits its policy here (a policy change) is reset at
  // construction as ImportGeometry's kDropMismatched resets it, and residuals of a layer without
  // error feedback here are dropped.
  LayerStateTable* states = nullptr;
};

// When Exchange runs the step's geometry refreshes.
enum class Refreshes {
  kNow,
  // estimator kFactorEma only: Exchange leaves them pending (each refreshed layer's averaged
  // gradient is copied for them) and returns no RefreshRecords; RunPendingRefreshes runs them,
  // and so does the next Exchange, Submit or BeginStep before anything else (dropping their
  // records). Every step still uses the geometry it would have, bit for bit. For a caller with a
  // thread to spare (geofp8.torch's engine runs them on its exchange thread while the optimizer
  // and the next forward run): the sketch's update leaves the step's critical path.
  kDeferred,
};

// Buckets: layers in reverse order (the order backward produces them), greedily packed.
struct Bucket {
  std::vector<uint32_t> layers;
  size_t bytes = 0;  // fp32 bytes
};
std::vector<Bucket> MakeBuckets(std::span<const LayerSpec> layers, size_t cap_bytes);

struct BucketResult {
  size_t bucket = 0;
  // Some rank's gradient held a NaN or inf: the bucket's gradients hold no meaningful values and
  // the caller must not apply them (found while the data moves, as loss scaling does).
  bool skipped = false;
  uint64_t bytes_sent = 0;  // this rank's payload on the wire (fingerprint included)
  double seconds = 0.0;
};

struct RefreshRecord {
  uint32_t layer = 0;
  uint64_t version = 0;      // the new geometry's version
  uint64_t active_from = 0;  // step at which every rank switches to it
  double drift = 0.0;        // owner-measured subspace distance to the previous basis
  double seconds = 0.0;      // owner's estimate time (the same figure on every rank)
  // factor_ema: the sketch took G V, U^T G and ||G||^2 from the step's inverse transform instead
  // of reading G for them (factor_sketch.h), as it does whenever the geometry in force is the one
  // its last update derived.
  bool from_inverse = false;
  // What the refresh's own collectives sent from this rank: an instant owner's broadcast, or a
  // sharded sketch's thin products (ShardedGradient). Counted in the result that carries it.
  uint64_t bytes_sent = 0;
};

struct StepResult {
  uint64_t step = 0;
  bool skipped = false;     // any bucket skipped: the same decision on every rank
  uint64_t bytes_sent = 0;  // the buckets', plus the refreshes' it carries
  double seconds = 0.0;     // wall time from the first submit to the end of the refreshes
  std::vector<BucketResult> buckets;
  std::vector<RefreshRecord> refreshes;
};

// Appends `records` to r's refreshes and their bytes to r's (a deferred refresh's go with the
// next result handed out).
inline void AddRefreshes(StepResult& r, const std::vector<RefreshRecord>& records) {
  for (const RefreshRecord& rec : records) r.bytes_sent += rec.bytes_sent;
  r.refreshes.insert(r.refreshes.end(), records.begin(), records.end());
}

// One layer's geometry state in the checksummed wire form of kernels/geometry
// (SerializeGeometry), for checkpoints and policy changes. Empty bytes mean identity (never
// refreshed) for `active` and nothing waiting for `pending`.
struct LayerGeometryState {
  std::vector<uint8_t> active;   // the geometry in use
  std::vector<uint8_t> pending;  // refreshed and broadcast, not yet active
  uint64_t pending_from = 0;     // step at which `pending` becomes active (0 when none)
  std::vector<uint8_t> sketch;   // the ema estimator's FactorSketch wire form (empty: none)
};

// One layer's state in ExportGeometry's form.
LayerGeometryState ExportLayerGeometry(const LayerState& state);

// How ImportGeometry treats a layer whose saved geometry disagrees with the layer's policy.
enum class GeometryImport {
  kStrict,          // resume: any disagreement is an error naming the layer and field
  kDropMismatched,  // policy change: such a layer restarts from identity (warm-up) instead
};

// Thread-compatible: one caller thread drives an Exchanger; collectives run on its own thread.
class Exchanger {
 public:
  // Validates every layer's policy (error names the layer and field) and the schedule, which has
  // one entry per layer or is empty (no refreshes).
  Exchanger(Communicator& comm, std::vector<LayerSpec> layers, ExchangeOptions options,
            std::vector<RefreshSchedule> schedule = {});
  ~Exchanger();
  Exchanger(const Exchanger&) = delete;
  Exchanger& operator=(const Exchanger&) = delete;

  const std::vector<Bucket>& buckets() const { return buckets_; }
  const std::vector<LayerSpec>& layers() const { return layers_; }
  // The bucket that holds layer l.
  size_t bucket_of(uint32_t layer) const { return bucket_of_.at(layer); }

  // Backward-driven submission, for a caller that learns the layers' gradients one at a time
  // (a backward pass, last layer first): BeginStep names the step's gradients (as Submit's
  // grads, valid until Finish), then LayerReady(step, l) says layer l's gradient is final. A
  // bucket goes to the exchange as soon as it and every bucket before it are complete, so the
  // caller keeps no bucket bookkeeping. Each layer once per step; Finish names any layer that
  // never came. Not to be mixed with Submit within one step.
  void BeginStep(uint64_t step, GradSpans grads);
  void LayerReady(uint64_t step, uint32_t layer);

  // What this rank sent for each layer in `result` (one entry per layer, in bytes): each
  // bucket's payload shared among its layers in proportion to their encoded sizes under their
  // policies. Layers of buckets absent from `result` get 0.
  std::vector<double> LayerBytesSent(const StepResult& result) const;

  // Queues bucket `bucket` of `step`. grads[l] is layer l's gradient (count() elements: fp32, or
  // bf16 or fp16 in host memory, summed in fp32 and written back rounded to its dtype; a
  // transformed one is read into fp32 work memory that the exchanger keeps) for every l; only the
  // bucket's layers are read and replaced by the average over ranks (by values with no meaning if
  // the bucket is skipped). They must stay valid until the future is ready. Buckets
  // of a step are submitted in bucket order, each once.
  std::shared_future<BucketResult> Submit(uint64_t step, size_t bucket, GradSpans grads);

  // Waits for every bucket of `step` (all must have been submitted), then runs the step's
  // scheduled geometry refreshes (skipped on a skipped step). Rethrows the first bucket error.
  StepResult Finish(uint64_t step);

  // Every bucket at once, then Finish: the same results as submitting each bucket, but the
  // buckets share one pipeline run (one fill and one drain), as nothing has to overlap a backward
  // pass. When no other step is in flight it runs on the calling thread (the exchanger's own
  // thread is idle then), saving two thread handoffs per call.
  StepResult Exchange(uint64_t step, GradSpans grads, Refreshes refreshes = Refreshes::kNow);

  // Exchange() as a reduce-scatter (AlgorithmOptions::reduce_scatter): outs[l] receives this
  // rank's rows of layer l's average (FSDP's dim-0 chunk: rows [r c, min((r + 1) c, rows)),
  // c = ceil(rows / N), in its own dtype); grads[l] is clobbered. A layer whose geometry
  // refreshes at this step is
  // all-reduced instead (the same algorithm, in a second run after the reduce-scatter), since its
  // refresh reads the whole averaged gradient, and its rows are copied out; grads[l] then holds
  // that average, which the refresh reads. Host memory only, and no step may be in flight. A
  // layer with the block Hadamard rotation is refused, naming it.
  StepResult ReduceScatter(uint64_t step, GradSpans grads, GradSpans outs,
                           Refreshes refreshes = Refreshes::kNow);

  // Refreshes::kDeferred: whether a step's refreshes wait, and running them (their records;
  // empty when none wait). Not while a step is in flight.
  bool has_pending_refreshes() const { return deferred_.has_value(); }
  std::vector<RefreshRecord> RunPendingRefreshes();

  // The geometry layer l uses at `step` (after activations up to it). For tests and metrics.
  const Geometry& active_geometry(uint32_t layer) const { return state_[layer]->active; }

  // Every layer's geometry state (one entry per layer), for a checkpoint or a policy change.
  // Only between steps: throws if a step was submitted and not finished, or its deferred
  // refreshes have not run.
  std::vector<LayerGeometryState> ExportGeometry() const;

  // Takes in state from ExportGeometry (one entry per layer), between steps. Every non-empty
  // entry must deserialize (checksum) and match the layer's shape, and a pending one must be
  // newer than the active one with pending_from >= 1; those are always errors. Mode, rank
  // (k = min(rank, rows, cols)) and alpha must match the layer's policy, and a layer that uses no
  // geometry here (1-D, geometry none, fp32/bf16 algorithm) takes only empty state: kStrict
  // throws naming the layer and field, kDropMismatched resets such a layer to identity. On an
  // error nothing is changed. Returns the layers reset.
  // This rank's error-feedback residuals, one entry per layer (empty vectors where the layer
  // has no error feedback or nothing was lost yet). Between steps.
  std::vector<LayerResidual> ExportResiduals() const;
  // Takes ExportResiduals' output back (one entry per layer, or empty for none), between steps.
  // Throws geofp8::Error naming the layer when a vector's size is neither 0 nor the layer's.
  void ImportResiduals(const std::vector<LayerResidual>& residuals);

  std::vector<uint32_t> ImportGeometry(const std::vector<LayerGeometryState>& state,
                                       GeometryImport mode = GeometryImport::kStrict);

 private:
  // Whether layer's exchange adds its residuals (policy and a quantizing algorithm).
  bool UsesErrorFeedback(uint32_t layer) const;
  // Points state_ at each layer's entry in options_.states (reconciled with this policy), or at
  // a table of its own.
  void AttachStates();
  // After a step: its new residuals become the current ones unless it was skipped.
  void CommitResiduals(bool skipped);
  // Makes the pending geometry the active one, carrying the layer's error-feedback residuals
  // into its coordinates.
  void Activate(uint32_t layer, LayerState& st);
  // The run's layout for Communicator::IsAgreedLayout: grouping options and layer sizes.
  uint64_t RunLayoutDigest(std::span<const BucketLayer> work) const;
  FactorSketchOptions SketchOptions(uint32_t layer) const;
  uint32_t LayerId(uint32_t layer) const {
    return options_.layer_ids.empty() ? layer : options_.layer_ids[layer];
  }

  // Every bucket of `step` on the calling thread, then its residuals and refreshes.
  StepResult RunAll(uint64_t step, const GradSpans& grads, const GradSpans* outs,
                    Refreshes refreshes);
  // Buckets [first, last) of `step` (at most 64) through one run of the algorithm.
  // outs: reduce-scatter's outputs (ReduceScatter); null: all-reduce in place.
  std::vector<BucketResult> RunBuckets(uint64_t step, size_t first, size_t last,
                                       const GradSpans& grads, const GradSpans* outs = nullptr);
  // `snapshots` (deferred refreshes): per layer, the products over the gradient as it was; null
  // entries and null: read `grads`, or with `outs` (a reduce-scatter's) the ema sketch reads this
  // rank's rows of the average there, through ShardedGradient's collectives.
  std::vector<RefreshRecord> RunRefreshes(
      uint64_t step, const GradSpans& grads,
      const std::vector<std::unique_ptr<GradientProducts>>* snapshots = nullptr,
      const GradSpans* outs = nullptr);
  // Whether a reduce-scatter's layer that refreshes at a step stays a reduce-scatter, its ema
  // sketch reading the owners' rows (ShardedGradient), or is all-reduced at that step. The
  // instant estimator's owner reads the whole average: always all-reduced. Under ema, whichever
  // moves fewer bytes on average per update: the sketch's thin products (about 4 (m ldx + 2 n c)
  // bytes: ldx the columns of Y, the sketch's width padded to 8, plus its probes on every
  // probe_every-th update; c the columns of G^T Q, twice the width plus those probes) or the
  // all-reduce's second pass over the layer (m n times the format's bytes per element). The same
  // choice on every rank: it depends on the shape and the policy only.
  bool ShardedRefresh(uint32_t layer) const;
  // The sketch's products over this rank's rows `rows` of layer l's average (a reduce-scatter's
  // output), owning a host fp32 copy of them when `copy` (a deferred refresh), when they are bf16
  // or fp16, or when they are device memory.
  std::unique_ptr<GradientProducts> ShardProducts(uint32_t l, GradSpan rows, bool copy);
  // The plane the gradients live on: options_.plane, or the workspace's host plane.
  DataPlane& plane() { return options_.plane ? *options_.plane : workspace_.host; }
  // The factor sketch's products over a bf16 or fp16 gradient, through a host fp32 copy.
  std::unique_ptr<GradientProducts> LowpProducts(GradSpan g, int64_t m, int64_t n);
  // Refreshes::kDeferred: keeps copies of the gradients the step's refreshes read (with `outs`,
  // of this rank's rows of them), for later.
  void Defer(uint64_t step, const GradSpans& grads, const GradSpans* outs = nullptr);
  // The rotation block the layer's exchange uses (0: none): matrices under a compressed algorithm,
  // as for geometry.
  uint32_t HadamardBlockOf(uint32_t layer) const;
  bool UsesGeometry(uint32_t layer) const;
  bool RefreshesAt(uint32_t layer, uint64_t step) const;
  std::string PolicyMismatch(uint32_t layer, const Geometry& geometry) const;
  void Enqueue(std::function<void()> task);
  void WorkerLoop();

  Communicator& comm_;
  std::vector<LayerSpec> layers_;
  ExchangeOptions options_;
  std::vector<RefreshSchedule> schedule_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;         // layer -> its bucket
  std::vector<std::string> layer_names_;  // layers_[i].name, for fingerprint messages
  // Each layer's state, in options_.states or owned_states_: touched only on the worker thread
  // while tasks run.
  std::unique_ptr<LayerStateTable> owned_states_;
  std::vector<LayerState*> state_;
  ExchangeWorkspace workspace_;  // the algorithms' buffers, reused every step: worker thread only

  // Per-step bookkeeping on the caller's thread.
  struct Pending {
    std::vector<std::shared_future<BucketResult>> futures;
    GradSpans grads;
    std::chrono::steady_clock::time_point start;
    // BeginStep / LayerReady: layers not yet ready in each bucket (empty when driven by Submit).
    std::vector<size_t> unready;
    std::vector<bool> ready;  // per layer
  };
  std::map<uint64_t, Pending> steps_;
  // Refreshes::kDeferred: the step whose refreshes wait, with copies of their layers' gradients
  // where the plane keeps them (DataPlane::Snapshot: device memory on a device plane).
  struct Deferred {
    uint64_t step = 0;
    std::vector<std::unique_ptr<GradientProducts>> snapshots;  // per layer; null: no refresh
  };
  std::optional<Deferred> deferred_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread worker_;
};

// Validates a policy for a layer; "" if usable, else one line naming the layer and the field.
std::string ValidateLayerPolicy(const LayerSpec& layer);

}  // namespace geofp8
