// geofp8._geofp8: the exchange engine (kernels/exchange) for Python, as geofp8.torch's DDP comm
// hook drives it. One Engine per process group: a Gloo communicator bootstrapped from a Python
// store object (torch's c10d Store), the policy of geofp8-train's --policy (presets or YAML,
// parsed by platform/policy/exchange_policy), and one Exchanger per DDP bucket layout, whose
// geometry moves with the layers when DDP rebuilds its buckets or the policy changes.
//
// The GIL: every call into the Python store takes it; the rendezvous and the exchange run with
// it released, so the store may be served by another Python thread.
//
// Asynchronous buckets (submit): the engine's own exchange thread runs each submitted bucket
// through its Exchanger, one at a time in submission order (the order DDP hands buckets over,
// the same on every rank), and a completer thread takes the GIL to call the bucket's Python
// callback, which completes the hook's torch Future. The exchange thread never takes the GIL,
// so a Python thread holding it (DDP's autograd hook calling into Python) never stalls the
// wire; every other engine call first waits, with the GIL released, until the queue is empty.
//
// backend "nccl" (builds with CUDA and NCCL, GEOFP8_PYTHON_CUDA): the same Exchangers over an
// NCCL communicator bootstrapped from the same store, with the device plane
// (kernels/exchange/data_plane.h, StagedPlane over cuda_backend.h): CUDA buckets are exchanged
// in place in device memory, the codec and geometry on the device, after the work queued on the
// caller's CUDA stream.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client/python/hook_binding.h"
#include "kernels/common/check.h"
#include "kernels/exchange/exchanger.h"
#include "kernels/exchange/gloo_communicator.h"
#include "kernels/exchange/store.h"
#include "kernels/model/ops.h"
#include "platform/policy/exchange_policy.h"
#include "platform/policy/job_spec.h"

#ifndef GEOFP8_PYTHON_CUDA
#define GEOFP8_PYTHON_CUDA 0
#endif
#if GEOFP8_PYTHON_CUDA
#include "kernels/exchange/cuda_backend.h"
#include "kernels/exchange/nccl_communicator.h"
#endif

namespace py = pybind11;

namespace geofp8::python {
namespace {

// geofp8::Store over a Python object with the methods of torch.distributed.Store:
// set(key, bytes), get(key) -> bytes, wait(keys, timedelta), add(key, int) -> int.
class PyStore final : public Store {
 public:
  explicit PyStore(py::object store) : store_(std::move(store)) {}
  ~PyStore() override {
    py::gil_scoped_acquire gil;
    store_ = py::object();
  }

  void Set(const std::string& key, const std::vector<uint8_t>& value) override {
    py::gil_scoped_acquire gil;
    try {
      store_.attr("set")(key, py::bytes(reinterpret_cast<const char*>(value.data()), value.size()));
    } catch (py::error_already_set& e) {
      GEOFP8_FAIL("store set '", key, "': ", e.what());
    }
  }

  std::vector<uint8_t> Get(const std::string& key, std::chrono::milliseconds timeout) override {
    Wait({key}, timeout);
    py::gil_scoped_acquire gil;
    try {
      const std::string v = py::bytes(store_.attr("get")(key));
      return std::vector<uint8_t>(v.begin(), v.end());
    } catch (py::error_already_set& e) {
      GEOFP8_FAIL("store get '", key, "': ", e.what());
    }
  }

  void Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    try {
      py::object delta = py::module_::import("datetime")
                             .attr("timedelta")(py::arg("milliseconds") = timeout.count());
      store_.attr("wait")(py::cast(keys), delta);
    } catch (py::error_already_set& e) {
      GEOFP8_FAIL("store wait for '", keys.empty() ? std::string() : keys.front(), "' (",
                  keys.size(), " keys, timeout ", timeout.count(), " ms): ", e.what());
    }
  }

  int64_t Add(const std::string& key, int64_t delta) override {
    py::gil_scoped_acquire gil;
    try {
      return store_.attr("add")(key, delta).cast<int64_t>();
    } catch (py::error_already_set& e) {
      GEOFP8_FAIL("store add '", key, "': ", e.what());
    }
  }

 private:
  py::object store_;
};

py::bytes Bytes(const std::vector<uint8_t>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}
std::vector<uint8_t> FromBytes(const py::bytes& b) {
  const std::string s = b;
  return std::vector<uint8_t>(s.begin(), s.end());
}

constexpr size_t kInlineBytes = size_t{4} << 20;

// geofp8._geofp8.Error, for exceptions handed to a submitted bucket's callback (set at import).
py::handle g_error_type;

// A geofp8.Error for e: its message, and the source location that raised it as `where` (for
// debugging; the message carries none).
py::object ErrorObject(const geofp8::Error& e) {
  py::object instance = g_error_type(e.what());
  instance.attr("where") = e.where();
  return instance;
}

double SteadySeconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// An exchange's figures for Python (exchange()'s and submit()'s result), with the deferred
// refreshes run since the last exchange() (`deferred`, `deferred_from_inverse`).
py::dict ResultDict(const StepResult& r, size_t deferred, size_t deferred_from_inverse) {
  py::dict d;
  d["skipped"] = r.skipped;
  d["bytes_sent"] = r.bytes_sent;
  d["seconds"] = r.seconds;
  size_t from_inverse = 0;  // refreshes whose sketch took its projections from the inverse
  for (const RefreshRecord& rec : r.refreshes) from_inverse += rec.from_inverse;
  d["refreshes"] = r.refreshes.size() + deferred;
  d["refreshes_from_inverse"] = from_inverse + deferred_from_inverse;
  return d;
}

// The engine of one process group.
class Engine {
 public:
  Engine(py::object store, int rank, int size, std::string hostname, double timeout_s,
         uint64_t seed, const std::string& backend, int device)
      : store_(std::make_unique<PyStore>(std::move(store))), seed_(seed), rank_(rank), size_(size) {
    GEOFP8_CHECK(timeout_s > 0, "timeout: must be > 0 seconds (", timeout_s, ")");
    timeout_ = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
    if (backend == "nccl") {
#if GEOFP8_PYTHON_CUDA
      py::gil_scoped_release release;
      const int devices = CudaDeviceCount();
      GEOFP8_CHECK(devices > 0, "device: no CUDA device visible on rank ", rank);
      const int dev = device >= 0 ? device : rank % devices;
      GEOFP8_CHECK(dev < devices, "device: cuda:", dev, " out of range (", devices, " devices)");
      NcclOptions no;
      no.device = dev;
      no.prefix = "geofp8";
      no.timeout = timeout_;
      comm_ = CreateNcclCommunicator(*store_, rank, size, no);
      cuda_ = std::make_unique<cuda::CudaBackend>(dev);
      plane_ = std::make_unique<StagedPlane>(*cuda_);
      return;
#else
      GEOFP8_FAIL(
          "device: CUDA tensors need a CUDA build of geofp8 (configure with "
          "-DGEOFP8_ENABLE_CUDA=ON where nvcc and NCCL are found); this build has the Gloo "
          "engine on CPU tensors only");
#endif
    }
    GEOFP8_CHECK(backend == "gloo", "backend: unknown value '", backend,
                 "' (accepted: gloo, nccl)");
    GlooOptions go;
    go.hostname = std::move(hostname);
    go.prefix = "geofp8";
    go.timeout = timeout_;
    py::gil_scoped_release release;
    comm_ = CreateGlooCommunicator(*store_, rank, size, go);
  }

  // Called by Python with the GIL held. A bucket still queued is dropped with its callback
  // uncalled; one on the wire is stopped through the communicator's abort.
  ~Engine() {
    if (exchange_thread_.joinable()) {
      {
        py::gil_scoped_release release;
        {
          std::lock_guard<std::mutex> lock(q_->mu);
          q_->stop = true;
          if (q_->running && comm_) comm_->Abort("the geofp8 engine is being destroyed");
        }
        q_->work_cv.notify_all();
        q_->done_cv.notify_all();
        exchange_thread_.join();
        if (completer_.get_id() == std::this_thread::get_id()) {
          completer_.detach();  // a callback let go of the engine; the loop ends on its own
        } else {
          completer_.join();
        }
      }
#if GEOFP8_PYTHON_CUDA
      // CUDA buckets dropped unexchanged: their events are released, never waited for.
      for (const auto& job : q_->exchange) {
        if (job->event) cuda_->ReleaseEvent(job->event);
      }
#endif
      q_->exchange.clear();  // their Python objects are released with the GIL held
      q_->done.clear();
    }
    exchangers_.clear();
    comm_.reset();
  }

  bool OnCuda() const { return plane_ != nullptr; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  std::string backend() const { return OnCuda() ? "nccl" : "gloo"; }

  // The model's parameters in named_parameters() order: names and shapes (rows, cols); a 1-D
  // parameter is (1, n).
  void SetLayers(const std::vector<std::string>& names,
                 const std::vector<std::pair<int64_t, int64_t>>& shapes) {
    GEOFP8_CHECK(names.size() == shapes.size(), "layers: ", names.size(), " names but ",
                 shapes.size(), " shapes");
    GEOFP8_CHECK(!names.empty(), "layers: the model has no parameter that requires a gradient");
    Drain();
    params_.clear();
    int64_t offset = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      model::ParamInfo p;
      p.name = names[i];
      p.rows = shapes[i].first;
      p.cols = shapes[i].second;
      GEOFP8_CHECK(p.rows >= 1 && p.cols >= 1, "layers: parameter '", p.name, "' has shape (",
                   p.rows, ", ", p.cols, ")");
      p.offset = offset;
      offset += p.size();
      params_.push_back(p);
    }
    exchangers_.clear();
    stash_.assign(params_.size(), std::nullopt);
    plan_.reset();
  }

  // kind: "preset" (fp32, bf16, fp8, geofp8, nvfp4, geonvfp4, fp8-ef, nvfp4-ef), "file" (a YAML
  // path) or "text" (YAML). Geometry of the previous policy carries over where it still fits the
  // new one (GeometryImport::kDropMismatched). Returns one summary dict per layer.
  py::list SetPolicy(const std::string& kind, const std::string& spec, const std::string& model,
                     uint64_t version) {
    ExchangePlan plan = BuildPlan(kind, spec, model);
    std::vector<RefreshSchedule> schedule = MakeRefreshSchedule(plan, size_);
    return SetPlan(std::move(plan), std::move(schedule), version);
  }

  // A coordinator policy version (hook_binding.h, PlanFromCoordinator), as SetPolicy.
  py::list SetCoordinatorPolicy(const py::bytes& policy, const std::vector<py::bytes>& refresh,
                                const std::string& spec_yaml) {
    GEOFP8_CHECK(!params_.empty(), "policy: set_layers first");
    std::vector<std::string> r(refresh.begin(), refresh.end());
    CoordinatorPlan c = PlanFromCoordinator(policy, r, spec_yaml, params_);
    return SetPlan(std::move(c.plan), std::move(c.schedule), c.version);
  }

  // The minimum of `value` over the ranks, as one small collective (the per-step agreement on
  // the newest policy version every rank holds, as the worker's trainer makes it).
  uint64_t AgreeMin(uint64_t value, uintptr_t stream) {
    (void)stream;  // the NCCL communicator orders its collectives on a stream of its own
    GEOFP8_CHECK(comm_, "agree_min: the engine has no communicator");
    Drain();  // the communicator runs one collective at a time
    uint64_t word = ~value;
    {
      py::gil_scoped_release release;
      comm_->MaxReduceWords(std::span<uint64_t>(&word, 1));
    }
    return ~word;
  }

  py::list SetPlan(ExchangePlan plan, std::vector<RefreshSchedule> schedule, uint64_t version) {
    if (OnCuda()) CheckCudaPlan(plan);
    Drain();
    if (plan_) StashAll(GeometryImport::kDropMismatched);
    plan_ = std::move(plan);
    schedule_ = std::move(schedule);
    version_ = version;
    py::list out;
    for (size_t i = 0; i < params_.size(); ++i) {
      const LayerPolicy& lp = plan_->layers[i];
      py::dict d;
      d["name"] = params_[i].name;
      d["algorithm"] = std::string(AlgorithmNameOf(plan_->algorithm));
      d["format"] = std::string(FormatNameOf(lp.format));
      d["scaling"] = std::string(ScalingNameOf(lp.scaling));
      d["block"] = lp.block;
      d["rounding"] = std::string(RoundingNameOf(lp.rounding));
      d["geometry"] = std::string(GeometryNameOf(lp.geometry));
      d["rank"] = lp.rank;
      d["alpha"] = lp.alpha;
      d["refresh_interval"] = schedule_.empty() ? 0 : schedule_[i].interval;
      out.append(d);
    }
    return out;
  }

  // Parses and checks a policy against the layers without applying it.
  void CheckPolicy(const std::string& kind, const std::string& spec, const std::string& model) {
    const ExchangePlan plan = BuildPlan(kind, spec, model);
    if (OnCuda()) CheckCudaPlan(plan);
  }

  // The CUDA path: averages the float32 device buffer at `ptr` (numel floats) over the ranks in
  // place, after the work queued so far on CUDA stream `stream`
  // (torch.cuda.current_stream().cuda_stream); layers and offsets as in exchange(). Returns once
  // the result is in device memory.
  py::dict ExchangeCuda(uint64_t step, const std::vector<uint32_t>& layers, uintptr_t ptr,
                        int64_t numel, const std::vector<int64_t>& offsets, uintptr_t stream) {
    return ExchangeInCall(step, layers, DeviceBucketGrads(layers, ptr, numel, offsets), stream);
  }

  // submit() for a CUDA bucket: exchange_cuda() on the engine's exchange thread, after the work
  // queued on `stream` by now (an event recorded here). The bucket's memory must stay valid and
  // untouched until done(result, error) is called.
  void SubmitCuda(uint64_t step, const std::vector<uint32_t>& layers, uintptr_t ptr, int64_t numel,
                  const std::vector<int64_t>& offsets, uintptr_t stream, py::function done) {
    std::unique_ptr<Job> job =
        MakeJob(step, layers, DeviceBucketGrads(layers, ptr, numel, offsets), std::move(done));
    job->event = RecordEvent(stream);
    Enqueue(std::move(job));
  }

  // Averages the gradients of `layers` (indices into set_layers' list) over the ranks in place:
  // layer layers[i] is buffer[offsets[i] .. + its size). `buffer` is a writable, contiguous
  // float32 buffer (a CPU tensor's numpy() view).
  py::dict Exchange(uint64_t step, const std::vector<uint32_t>& layers, py::buffer buffer,
                    const std::vector<int64_t>& offsets) {
    return ExchangeInCall(step, layers, BucketGrads(layers, buffer, offsets), std::nullopt);
  }

  // exchange() and exchange_cuda(): the bucket on the calling thread, after the work queued on
  // CUDA stream `stream` where there is one.
  py::dict ExchangeInCall(uint64_t step, const std::vector<uint32_t>& layers,
                          const std::vector<std::span<float>>& grads,
                          std::optional<uintptr_t> stream) {
    // The buckets submitted before this one go first; their callbacks may still run meanwhile
    // (they touch no exchanger), and a new layout waits for those too.
    if (exchangers_.contains(layers)) {
      WaitForExchanges();
    } else {
      Drain(/*forget_errors=*/false);
    }
    // A queued bucket of this step failed (a timeout, a fingerprint mismatch): its Future holds
    // the error, but DDP raises this call's first, so this call raises that root cause too,
    // and leaves the bucket unexchanged on every rank, as the synchronous hook stops at the
    // first failed bucket.
    if (q_->first_error) std::rethrow_exception(std::exchange(q_->first_error, nullptr));
    Exchanger& ex = ExchangerFor(layers);
    StepResult r;
    // After the wait for the queued buckets: the trace's start of this bucket's own exchange.
    const auto started = std::chrono::steady_clock::now();
    {
      py::gil_scoped_release release;
      if (stream) WaitForEvent(RecordEvent(*stream));
      // A bucket exchanged in the hook call (the step's last, or every one when synchronous)
      // leaves its sketch updates to the engine's exchange thread, off the step's critical
      // path. The instant estimator's broadcast cannot wait.
      r = ex.Exchange(step, grads,
                      plan_->refresh.estimator == GeometryEstimator::kFactorEma
                          ? Refreshes::kDeferred
                          : Refreshes::kNow);
    }
    // The refreshes deferred by earlier calls have run (the queue was waited for above): this
    // dict counts them, and the next exchange() counts this call's. Only here, never in a
    // submitted bucket's dict, so the count after a step does not depend on when the completer
    // thread ran (sync and async paths count the same refreshes at the same call).
    const auto [deferred, deferred_from_inverse] = TakeDeferred(*q_);
    if (ex.has_pending_refreshes()) {
      // The step's refreshes run on the exchange thread after this returns, while the optimizer
      // and the next forward run; the next exchange waits for them.
      auto job = std::make_unique<Job>();
      job->step = step;
      job->exchanger = &ex;
      job->refresh_only = true;
      Enqueue(std::move(job));
    }
    py::dict d = ResultDict(r, deferred, deferred_from_inverse);
    d["started"] = SteadySeconds(started);
    return d;
  }

  // exchange() without waiting: queues the bucket for the engine's exchange thread, which runs
  // the buckets one at a time in submission order (the same Exchanger call as exchange(), so the
  // same bits), and returns. When it is done, `done(result, error)` is called on the engine's
  // completer thread with the GIL held: result is exchange()'s dict plus "queued", "started" and
  // "finished" (steady_clock seconds, Python's time.monotonic()) and error None, or result None
  // and error the exception (geofp8.Error for the engine's own). The buffer must not be touched
  // until then.
  void Submit(uint64_t step, const std::vector<uint32_t>& layers, py::buffer buffer,
              const std::vector<int64_t>& offsets, py::function done) {
    std::unique_ptr<Job> job =
        MakeJob(step, layers, BucketGrads(layers, buffer, offsets), std::move(done));
    job->buffer = std::move(buffer);
    Enqueue(std::move(job));
  }

  // Waits, with the GIL released, until every submitted bucket is exchanged and its callback
  // has returned. forget_errors: the queued buckets' errors have reached their Futures and
  // are not raised again by the next exchange() (a new step).
  void Drain(bool forget_errors = true) {
    if (!exchange_thread_.joinable()) return;
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(q_->mu);
      q_->idle_cv.wait(lock, [this] { return q_->in_flight == 0; });
    }
    if (forget_errors) q_->first_error = nullptr;
  }

  // Waits, with the GIL released, until the exchange thread has nothing queued or running.
  void WaitForExchanges() {
    if (!exchange_thread_.joinable()) return;
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(q_->mu);
    q_->idle_cv.wait(lock, [this] { return q_->exchange.empty() && !q_->running; });
  }

  size_t in_flight() {
    std::lock_guard<std::mutex> lock(q_->mu);
    return q_->in_flight;
  }

  // Every layer's geometry state, in set_layers order: (active, pending, pending_from, sketch).
  py::list ExportGeometry() {
    py::list out;
    for (const LayerGeometryState& s : PerLayer(&Exchanger::ExportGeometry, &Stashed::state)) {
      out.append(
          py::make_tuple(Bytes(s.active), Bytes(s.pending), s.pending_from, Bytes(s.sketch)));
    }
    return out;
  }

  // Restores ExportGeometry's list (resume): checked now, strictly, against the current policy
  // (an error names the layer and field), then taken up by the bucket exchangers as they form.
  void ImportGeometry(const py::list& state) {
    GEOFP8_CHECK(plan_.has_value(), "import_geometry: set_policy first");
    Drain();
    GEOFP8_CHECK(state.size() == params_.size(), "geometry: ", state.size(),
                 " layers in the state, the model has ", params_.size());
    std::vector<LayerGeometryState> all;
    for (const py::handle& h : state) {
      auto t = h.cast<py::tuple>();
      GEOFP8_CHECK(t.size() == 4,
                   "geometry: each entry is (active, pending, pending_from, sketch)");
      LayerGeometryState s;
      s.active = FromBytes(t[0].cast<py::bytes>());
      s.pending = FromBytes(t[1].cast<py::bytes>());
      s.pending_from = t[2].cast<uint64_t>();
      s.sketch = FromBytes(t[3].cast<py::bytes>());
      all.push_back(std::move(s));
    }
    std::vector<uint32_t> every(params_.size());
    for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<uint32_t>(i);
    {
      // Validation only: an Exchanger over every layer takes the state in (or throws).
      std::unique_ptr<Exchanger> check = MakeExchanger(every);
      check->ImportGeometry(all, GeometryImport::kStrict);
    }
    exchangers_.clear();
    for (size_t i = 0; i < all.size(); ++i) {
      stash_[i] = Stashed{std::move(all[i]), GeometryImport::kStrict};
    }
  }

  // Every layer's error-feedback residuals, in set_layers order: (geometry_version, local,
  // owner), the float32 values as bytes (empty where the layer keeps none).
  py::list ExportResiduals() {
    auto floats = [](const std::vector<float>& v) {
      return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    };
    py::list out;
    for (const LayerResidual& r : PerLayer(&Exchanger::ExportResiduals, &Stashed::residual)) {
      out.append(py::make_tuple(r.geometry_version, floats(r.local), floats(r.owner)));
    }
    return out;
  }

  // Restores ExportResiduals' list (resume), after import_geometry: each layer's residuals are
  // taken up with its geometry when its bucket's exchanger forms.
  void ImportResiduals(const py::list& state) {
    GEOFP8_CHECK(plan_.has_value(), "import_residuals: set_policy first");
    Drain();
    GEOFP8_CHECK(state.size() == params_.size(), "residuals: ", state.size(),
                 " layers in the state, the model has ", params_.size());
    std::vector<LayerResidual> all;
    for (size_t i = 0; i < params_.size(); ++i) {
      auto t = py::reinterpret_borrow<py::object>(state[i]).cast<py::tuple>();
      GEOFP8_CHECK(t.size() == 3, "residuals: each entry is (geometry_version, local, owner)");
      LayerResidual r;
      r.geometry_version = t[0].cast<uint64_t>();
      for (auto [k, dst] : {std::pair{1, &r.local}, std::pair{2, &r.owner}}) {
        const std::string b = t[k].cast<std::string>();
        const size_t want = size_t(params_[i].size()) * sizeof(float);
        GEOFP8_CHECK(b.empty() || b.size() == want, "residuals: layer '", params_[i].name,
                     "' holds ", b.size() / sizeof(float), " values, the layer ",
                     params_[i].size());
        dst->resize(b.size() / sizeof(float));
        if (!b.empty()) std::memcpy(dst->data(), b.data(), b.size());
      }
      all.push_back(std::move(r));
    }
    StashAll(GeometryImport::kStrict);
    for (size_t i = 0; i < all.size(); ++i) {
      if (!stash_[i]) stash_[i] = Stashed{};
      stash_[i]->residual = std::move(all[i]);
    }
  }

  size_t exchanger_count() {
    Drain();
    return exchangers_.size();
  }

  // Starts recording every exchange's collectives, codec stages and geometry refreshes
  // (kernels/exchange/trace.h) from the next bucket on; write_trace saves them.
  void StartTrace() {
    if (trace_) return;
    Drain();
    trace_ = std::make_unique<ExchangeTrace>();
    StashAll(GeometryImport::kStrict);  // the exchangers are rebuilt with the trace attached
  }

  // Chrome trace JSON of what was recorded since start_trace (ui.perfetto.dev), this rank as
  // process `rank`. Returns the number of spans written.
  size_t WriteTrace(const std::string& path) {
    GEOFP8_CHECK(trace_, "write_trace: no trace recorded (call start_trace first)");
    Drain();
    trace_->WriteChromeJson(path, rank_);
    return trace_->spans().size();
  }

 private:
  struct Stashed {
    LayerGeometryState state;
    GeometryImport mode = GeometryImport::kStrict;
    // Error feedback's residuals (LayerPolicy::error_feedback), carried with the geometry they
    // were taken under; a policy change (kDropMismatched) drops them.
    LayerResidual residual;
  };

  // One kind of per-layer state, in set_layers order: from the exchanger holding the layer,
  // else from the stash, else empty.
  template <class T>
  std::vector<T> PerLayer(std::vector<T> (Exchanger::*exported)() const, T Stashed::*stashed) {
    Drain();
    std::vector<T> all(params_.size());
    std::vector<bool> held(params_.size(), false);
    for (auto& [key, ex] : exchangers_) {
      std::vector<T> s = ((*ex).*exported)();
      for (size_t j = 0; j < key.size(); ++j) {
        all[key[j]] = std::move(s[j]);
        held[key[j]] = true;
      }
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      if (!held[i] && stash_[i]) all[i] = (*stash_[i]).*stashed;
    }
    return all;
  }

  // One submitted bucket. It holds Python objects, so it is created and destroyed with the GIL
  // held, and moves between the threads as a unique_ptr (never copied).
  struct Job {
    uint64_t step = 0;
    Exchanger* exchanger = nullptr;  // stays alive: layouts change only with the queue empty
    std::vector<std::span<float>> grads;
    py::object buffer;  // keeps the bucket's memory alive (CPU; a CUDA bucket's caller keeps it)
    py::object done;
    uintptr_t event = 0;  // CUDA: recorded on torch's stream at submit, waited for before the run
    // The deferred geometry refreshes of a bucket exchanged in the hook call
    // (Refreshes::kDeferred): no data, no callback; an error is raised by the next
    // exchange.
    bool refresh_only = false;
    std::chrono::steady_clock::time_point queued, started, finished;
    StepResult result;
    std::exception_ptr error;
  };

  // submit()'s queues. Shared with the completer thread, which may outlive the engine by a few
  // instructions: a callback may drop the last reference to the engine's Python owner, so the
  // engine can be destroyed on that very thread.
  struct Queue {
    std::mutex mu;
    std::condition_variable work_cv, done_cv, idle_cv;
    std::deque<std::unique_ptr<Job>> exchange, done;  // for the exchange thread, the completer
    size_t in_flight = 0;                             // submitted, callback not yet returned
    bool running = false;                             // the exchange thread is inside an exchange
    bool stop = false;
    std::exception_ptr first_error;  // of a queued bucket, for the next exchange() to raise
    // Deferred refreshes run since the last exchange() dict, added to the next one. Counted by
    // the exchange thread as it finishes them (under mu), not by the completer: an exchange()
    // that waited for the queue then sees them all, however late the completer gets the GIL.
    size_t deferred_refreshes = 0, deferred_from_inverse = 0;
  };

  // A job for the exchange thread (submit() and submit_cuda()).
  std::unique_ptr<Job> MakeJob(uint64_t step, const std::vector<uint32_t>& layers,
                               std::vector<std::span<float>> grads, py::function done) {
    // A new layout takes geometry over from exchangers that a queued bucket may be using.
    if (!exchangers_.contains(layers)) Drain(/*forget_errors=*/false);
    auto job = std::make_unique<Job>();
    job->step = step;
    job->exchanger = &ExchangerFor(layers);
    job->grads = std::move(grads);
    job->done = std::move(done);
    return job;
  }

  // Queues a job for the exchange thread, starting the threads.
  void Enqueue(std::unique_ptr<Job> job) {
    job->queued = std::chrono::steady_clock::now();
    if (!exchange_thread_.joinable()) {
      exchange_thread_ = std::thread([this] { ExchangeLoop(); });
      completer_ = std::thread([q = q_] { CompleterLoop(q); });
    }
    {
      std::lock_guard<std::mutex> lock(q_->mu);
      q_->exchange.push_back(std::move(job));
      ++q_->in_flight;
    }
    q_->work_cv.notify_one();
  }

  // A CUDA bucket's layers as spans of device memory (exchange_cuda() and submit_cuda()).
  std::vector<std::span<float>> DeviceBucketGrads(const std::vector<uint32_t>& layers,
                                                  uintptr_t ptr, int64_t numel,
                                                  const std::vector<int64_t>& offsets) {
    GEOFP8_CHECK(OnCuda(),
                 "device: this engine runs on CPU tensors (backend gloo); create it "
                 "with backend 'nccl' for CUDA tensors");
    GEOFP8_CHECK(plan_.has_value(), "exchange: set_policy first");
    GEOFP8_CHECK(numel >= 0, "exchange: numel must be >= 0 (", numel, ")");
#if GEOFP8_PYTHON_CUDA
    cuda_->CheckDeviceMemory(reinterpret_cast<const void*>(ptr), "bucket");
#endif
    return LayerSpans(layers, reinterpret_cast<float*>(ptr), numel, offsets);
  }

  // A CUDA event recorded on `stream` now, and a wait for it on the device plane's stream.
  uintptr_t RecordEvent(uintptr_t stream) {
#if GEOFP8_PYTHON_CUDA
    return cuda_->RecordEvent(stream);
#else
    (void)stream;
    GEOFP8_FAIL("device: this geofp8 has no CUDA path");
#endif
  }
  void WaitForEvent(uintptr_t event) {
#if GEOFP8_PYTHON_CUDA
    cuda_->WaitForEvent(event);
#else
    (void)event;
#endif
  }

  // The bucket's layers as spans into `buffer`, checked (exchange() and submit()).
  std::vector<std::span<float>> BucketGrads(const std::vector<uint32_t>& layers, py::buffer& buffer,
                                            const std::vector<int64_t>& offsets) {
    GEOFP8_CHECK(!OnCuda(),
                 "device: this engine runs on CUDA tensors (backend nccl); CPU tensors "
                 "need a gloo engine");
    GEOFP8_CHECK(plan_.has_value(), "exchange: set_policy first");
    py::buffer_info info = buffer.request(/*writable=*/true);
    const bool f32 =
        info.itemsize == 4 && (info.format == "f" || info.format == "<f" || info.format == "=f");
    GEOFP8_CHECK(f32, "gradient dtype: must be float32 (buffer format '", info.format, "')");
    GEOFP8_CHECK(info.ndim == 1 && info.strides[0] == 4,
                 "gradient buffer: must be one contiguous 1-D array");
    return LayerSpans(layers, static_cast<float*>(info.ptr), info.shape[0], offsets);
  }

  // Layer layers[i] as data[offsets[i] .. + its size), each inside the bucket of numel floats.
  std::vector<std::span<float>> LayerSpans(const std::vector<uint32_t>& layers, float* data,
                                           int64_t numel, const std::vector<int64_t>& offsets) {
    GEOFP8_CHECK(layers.size() == offsets.size() && !layers.empty(), "exchange: ", layers.size(),
                 " layers but ", offsets.size(), " offsets");
    std::vector<std::span<float>> grads;
    for (size_t i = 0; i < layers.size(); ++i) {
      GEOFP8_CHECK(layers[i] < params_.size(), "exchange: layer index ", layers[i],
                   " >= ", params_.size());
      const int64_t n = params_[layers[i]].size();
      GEOFP8_CHECK(offsets[i] >= 0 && offsets[i] + n <= numel, "exchange: layer '",
                   params_[layers[i]].name, "' at offset ", offsets[i], " + ", n,
                   " is outside the bucket of ", numel, " floats");
      grads.emplace_back(data + offsets[i], static_cast<size_t>(n));
    }
    return grads;
  }

  // The exchange thread: never takes the GIL.
  void ExchangeLoop() {
    for (;;) {
      std::unique_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(q_->mu);
        q_->work_cv.wait(lock, [this] { return q_->stop || !q_->exchange.empty(); });
        if (q_->stop) return;
        job = std::move(q_->exchange.front());
        q_->exchange.pop_front();
        q_->running = true;
      }
      job->started = std::chrono::steady_clock::now();
      try {
        if (job->refresh_only) {
          job->result.refreshes = job->exchanger->RunPendingRefreshes();
        } else {
          if (job->event) WaitForEvent(std::exchange(job->event, 0));
          job->result = job->exchanger->Exchange(job->step, job->grads);
        }
      } catch (...) {
        job->error = std::current_exception();
      }
      job->finished = std::chrono::steady_clock::now();
      {
        std::lock_guard<std::mutex> lock(q_->mu);
        q_->running = false;
        if (job->error && !q_->first_error) q_->first_error = job->error;
        if (job->refresh_only) {
          q_->deferred_refreshes += job->result.refreshes.size();
          for (const RefreshRecord& rec : job->result.refreshes) {
            q_->deferred_from_inverse += rec.from_inverse;
          }
        }
        q_->done.push_back(std::move(job));
      }
      q_->done_cv.notify_one();
      q_->idle_cv.notify_all();  // WaitForExchanges
    }
  }

  // The completer thread: calls each finished bucket's callback with the GIL, in order.
  static void CompleterLoop(std::shared_ptr<Queue> q) {
    for (;;) {
      std::unique_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(q->mu);
        q->done_cv.wait(lock, [&q] { return q->stop || !q->done.empty(); });
        if (q->stop) return;
        job = std::move(q->done.front());
        q->done.pop_front();
      }
      {
        py::gil_scoped_acquire gil;
        Complete(*q, *job);
        job.reset();
      }
      {
        std::lock_guard<std::mutex> lock(q->mu);
        --q->in_flight;
      }
      q->idle_cv.notify_all();
    }
  }

  // The deferred refreshes counted since the last exchange() dict (refreshes, from the inverse).
  static std::pair<size_t, size_t> TakeDeferred(Queue& q) {
    std::lock_guard<std::mutex> lock(q.mu);
    return {std::exchange(q.deferred_refreshes, 0), std::exchange(q.deferred_from_inverse, 0)};
  }

  // With the GIL held.
  static void Complete(Queue& q, Job& job) {
    // Counted by the exchange thread; an error waits in first_error for the next exchange.
    if (job.refresh_only) return;
    try {
      py::object result = py::none(), error = py::none();
      if (job.error) {
        try {
          std::rethrow_exception(job.error);
        } catch (const geofp8::Error& e) {
          error = ErrorObject(e);
        } catch (const std::exception& e) {
          error = py::reinterpret_borrow<py::object>(PyExc_RuntimeError)(e.what());
        }
      } else {
        py::dict d = ResultDict(job.result, 0, 0);
        d["queued"] = SteadySeconds(job.queued);
        d["started"] = SteadySeconds(job.started);
        d["finished"] = SteadySeconds(job.finished);
        result = std::move(d);
      }
      job.done(result, error);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("geofp8 engine: a submitted bucket's callback");
    }
  }

  ExchangePlan BuildPlan(const std::string& kind, const std::string& spec,
                         const std::string& model) const {
    GEOFP8_CHECK(!params_.empty(), "policy: set_layers first");
    if (kind == "preset") return MakeExchangePlan(spec, params_);
    // No name: the errors already start "policy: " ("policy: line 1: ...").
    if (kind == "text") return MakeExchangePlanFromText(spec, "", params_, model);
    if (kind == "file") {
      std::ifstream in(spec);
      if (!in) GEOFP8_FAIL("policy: cannot read file ", spec);
      std::stringstream text;
      text << in.rdbuf();
      return MakeExchangePlanFromText(text.str(), spec, params_, model);
    }
    GEOFP8_FAIL("policy kind: unknown value '", kind, "' (accepted: preset, file, text)");
  }

  // The CUDA path runs every policy the host does but error feedback (data_plane.h): refused at
  // set_policy, naming the layer, rather than when the first bucket forms its exchanger.
  void CheckCudaPlan(const ExchangePlan& plan) const {
    for (size_t i = 0; i < params_.size(); ++i) {
      GEOFP8_CHECK(!plan.layers[i].error_feedback, "policy: layer '", params_[i].name,
                   "': error_feedback, which the CUDA path of geofp8.torch does not run yet (use "
                   "CPU tensors)");
    }
  }

  std::unique_ptr<Exchanger> MakeExchanger(const std::vector<uint32_t>& layers) const {
    std::vector<LayerSpec> specs;
    std::vector<RefreshSchedule> schedule;
    for (uint32_t l : layers) {
      const model::ParamInfo& p = params_[l];
      LayerSpec s;
      s.name = p.name;
      // LayerSpec's 1-D convention is cols == 1.
      s.rows = p.is_matrix() ? p.rows : p.size();
      s.cols = p.is_matrix() ? p.cols : 1;
      s.policy = plan_->layers[l];
      specs.push_back(std::move(s));
      if (!schedule_.empty()) schedule.push_back(schedule_[l]);
    }
    ExchangeOptions eo = MakeExchangeOptions(*plan_);
    eo.seed = seed_;
    eo.timeout = timeout_;
    eo.policy_version = version_;
    eo.layer_ids = layers;  // streams keyed by the model's layer index, whatever the bucket
    // A DDP bucket up to this size runs on the hook's thread as one group, with no pipeline
    // threads: DDP's first bucket (1 MiB) and small models' buckets, where thread handoffs cost
    // more than the overlap saves (docs/benchmarks.md, "DDP comm hooks"). Larger ones (DDP's
    // 25 MiB default) keep the pipeline, which overlaps the codec with the wire.
    eo.inline_bytes = kInlineBytes;
    // The hook reports no drift (its layer reports carry the exchange error only), so it does not
    // pay for it: about a twelfth of an EMA refresh at the GPT example's shapes.
    eo.measure_drift = false;
    eo.trace = trace_.get();
    eo.plane = plane_.get();  // null: host memory
    return std::make_unique<Exchanger>(*comm_, std::move(specs), eo, std::move(schedule));
  }

  // Moves every exchanger's geometry into the stash and drops the exchangers.
  void StashAll(GeometryImport mode) {
    for (auto& [key, ex] : exchangers_) {
      std::vector<LayerGeometryState> s = ex->ExportGeometry();
      std::vector<LayerResidual> r = ex->ExportResiduals();
      for (size_t j = 0; j < key.size(); ++j) {
        stash_[key[j]] =
            Stashed{std::move(s[j]), mode,
                    mode == GeometryImport::kStrict ? std::move(r[j]) : LayerResidual{}};
      }
    }
    exchangers_.clear();
  }

  Exchanger& ExchangerFor(const std::vector<uint32_t>& layers) {
    auto it = exchangers_.find(layers);
    if (it != exchangers_.end()) return *it->second;
    // A new bucket layout (DDP rebuilds its buckets after the first step): exchangers holding
    // any of these layers hand their geometry over through the stash.
    std::vector<bool> wanted(params_.size(), false);
    for (uint32_t l : layers) {
      GEOFP8_CHECK(!wanted[l], "exchange: layer '", params_[l].name, "' twice in one bucket");
      wanted[l] = true;
    }
    for (auto e = exchangers_.begin(); e != exchangers_.end();) {
      bool overlaps = false;
      for (uint32_t l : e->first) overlaps = overlaps || wanted[l];
      if (!overlaps) {
        ++e;
        continue;
      }
      std::vector<LayerGeometryState> s = e->second->ExportGeometry();
      std::vector<LayerResidual> r = e->second->ExportResiduals();
      for (size_t j = 0; j < e->first.size(); ++j) {
        stash_[e->first[j]] = Stashed{std::move(s[j]), GeometryImport::kStrict, std::move(r[j])};
      }
      e = exchangers_.erase(e);
    }
    std::unique_ptr<Exchanger> ex = MakeExchanger(layers);
    std::vector<LayerGeometryState> state(layers.size());
    std::vector<LayerResidual> residuals(layers.size());
    bool any = false, any_residual = false;
    GeometryImport mode = GeometryImport::kStrict;
    for (size_t j = 0; j < layers.size(); ++j) {
      if (!stash_[layers[j]]) continue;
      any = true;
      if (stash_[layers[j]]->mode == GeometryImport::kDropMismatched) {
        mode = GeometryImport::kDropMismatched;
      }
      state[j] = std::move(stash_[layers[j]]->state);
      residuals[j] = std::move(stash_[layers[j]]->residual);
      any_residual = any_residual || !residuals[j].local.empty() || !residuals[j].owner.empty();
    }
    if (any) ex->ImportGeometry(state, mode);
    if (any_residual) ex->ImportResiduals(residuals);
    for (uint32_t l : layers) stash_[l].reset();
    return *exchangers_.emplace(layers, std::move(ex)).first->second;
  }

  std::unique_ptr<PyStore> store_;
  std::unique_ptr<Communicator> comm_;  // gloo, or nccl for CUDA tensors
#if GEOFP8_PYTHON_CUDA
  std::unique_ptr<cuda::CudaBackend> cuda_;  // backend nccl: the device plane's kernels
#endif
  std::unique_ptr<StagedPlane> plane_;  // backend nccl; null: CPU tensors (the host plane)
  uint64_t seed_ = 0;
  int rank_ = 0, size_ = 1;
  std::chrono::milliseconds timeout_{kDefaultCollectiveTimeout};
  std::vector<model::ParamInfo> params_;
  std::optional<ExchangePlan> plan_;
  std::vector<RefreshSchedule> schedule_;
  uint64_t version_ = 0;
  std::unique_ptr<ExchangeTrace> trace_;  // before exchangers_: they write into it
  std::map<std::vector<uint32_t>, std::unique_ptr<Exchanger>> exchangers_;
  std::vector<std::optional<Stashed>> stash_;

  std::shared_ptr<Queue> q_ = std::make_shared<Queue>();
  std::thread exchange_thread_, completer_;  // started by the first submit()
};

}  // namespace
}  // namespace geofp8::python

PYBIND11_MODULE(_geofp8, m) {
  using geofp8::python::Engine;
  m.doc() = "GeoFP8's exchange engine (kernels/exchange) for Python; see geofp8.torch.";
  // geofp8.Error: the message for the user; the C++ source location that raised it, for
  // debugging, in its `where` attribute ("exchange_policy.cc:103"), never in the message.
  static py::exception<geofp8::Error> error(m, "Error", PyExc_RuntimeError);
  geofp8::python::g_error_type = error;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const geofp8::Error& e) {
      PyErr_SetObject(error.ptr(), geofp8::python::ErrorObject(e).ptr());
    }
  });

  py::class_<Engine>(m, "Engine")
      .def(py::init<py::object, int, int, std::string, double, uint64_t, std::string, int>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("hostname") = "127.0.0.1",
           py::arg("timeout_s") = 300.0, py::arg("seed") = 0, py::arg("backend") = "gloo",
           py::arg("device") = -1,
           "Connects rank `rank` of `size` over Gloo (backend 'gloo', CPU tensors) or NCCL "
           "(backend 'nccl', CUDA tensors on CUDA device `device`), meeting the other ranks "
           "through `store` (an object with torch.distributed.Store's set/get/wait/add). Blocks "
           "until all join.")
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("size", &Engine::size)
      .def_property_readonly("backend", &Engine::backend)
      .def("set_layers", &Engine::SetLayers, py::arg("names"), py::arg("shapes"))
      .def("set_policy", &Engine::SetPolicy, py::arg("kind"), py::arg("spec"),
           py::arg("model") = "model", py::arg("version") = 0)
      .def("set_coordinator_policy", &Engine::SetCoordinatorPolicy, py::arg("policy"),
           py::arg("refresh"), py::arg("spec_yaml") = "")
      .def("agree_min", &Engine::AgreeMin, py::arg("value"), py::arg("stream") = 0,
           "The minimum of `value` over the ranks (one small collective). `stream`: the CUDA "
           "stream (as an integer) the NCCL engine runs it on; ignored by the Gloo engine.")
      .def("check_policy", &Engine::CheckPolicy, py::arg("kind"), py::arg("spec"),
           py::arg("model") = "model")
      .def("exchange", &Engine::Exchange, py::arg("step"), py::arg("layers"), py::arg("buffer"),
           py::arg("offsets"),
           "Averages the bucket now, after the submitted ones; returns skipped, bytes_sent, "
           "seconds, refreshes, refreshes_from_inverse and started (time.monotonic() seconds "
           "when its own exchange began).")
      .def("submit", &Engine::Submit, py::arg("step"), py::arg("layers"), py::arg("buffer"),
           py::arg("offsets"), py::arg("done"),
           "exchange() on the engine's exchange thread, in submission order; returns at once and "
           "calls done(result, error) with the GIL when the bucket is averaged (result: "
           "exchange()'s dict plus queued/started/finished, time.monotonic() seconds).")
      .def("drain", &Engine::Drain, py::arg("forget_errors") = true,
           "Waits until every submitted bucket's callback has returned; forget_errors: the next "
           "exchange() does not raise a queued bucket's error again.")
      .def_property_readonly("in_flight", &Engine::in_flight,
                             "Buckets submitted whose callback has not yet returned.")
      .def("exchange_cuda", &Engine::ExchangeCuda, py::arg("step"), py::arg("layers"),
           py::arg("ptr"), py::arg("numel"), py::arg("offsets"), py::arg("stream"),
           "exchange() of a CUDA bucket (device pointer, float count), after the work queued on "
           "CUDA stream `stream`; returns once the result is in device memory.")
      .def("submit_cuda", &Engine::SubmitCuda, py::arg("step"), py::arg("layers"), py::arg("ptr"),
           py::arg("numel"), py::arg("offsets"), py::arg("stream"), py::arg("done"),
           "submit() of a CUDA bucket: exchange_cuda() on the engine's exchange thread.")
      .def("export_geometry", &Engine::ExportGeometry)
      .def("import_geometry", &Engine::ImportGeometry, py::arg("state"))
      .def("export_residuals", &Engine::ExportResiduals)
      .def("import_residuals", &Engine::ImportResiduals, py::arg("state"))
      .def_property_readonly("exchanger_count", &Engine::exchanger_count)
      .def("start_trace", &Engine::StartTrace,
           "Records every exchange's collectives, codec stages and geometry refreshes from now on.")
      .def("write_trace", &Engine::WriteTrace, py::arg("path"),
           "Writes what start_trace recorded as Chrome trace JSON (ui.perfetto.dev); returns the "
           "span count.");

  geofp8::python::BindHookClient(m);
  m.def("layer_matches", &geofp8::LayerMatches, py::arg("pattern"), py::arg("name"),
        "True when `name` matches the layer pattern (exact, or a shell glob), as in job specs.");
  m.attr("has_cuda") = py::bool_(GEOFP8_PYTHON_CUDA != 0);
  m.def(
      "set_blas_threads",
      [](int threads) {
        GEOFP8_CHECK(threads >= 1, "blas_threads: must be >= 1 (", threads, ")");
        geofp8::model::SetBlasThreads(threads);
      },
      py::arg("threads"),
      "Sets OpenBLAS's thread count for the whole process (torch's CPU matmuls too, when torch "
      "uses the same OpenBLAS).");
  m.def("accepted_presets", [] { return std::string(geofp8::AcceptedPolicyPresets()); });
}
