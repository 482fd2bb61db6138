// geofp8._geofp8.Engine: the exchange engine (kernels/exchange/engine.h) for Python, as
// geofp8.torch's DDP comm hook drives it (the module itself: geofp8_module.cc). A thin binding: one
// Engine per process group holds a communicator (Gloo, bootstrapped from a Python store object such
// as torch's c10d Store; or NCCL with the device plane for CUDA tensors) and the kernels'
// ExchangeEngine, which owns the model's layers, the policy, each layer's geometry, sketch and
// residuals, and the submitted buckets. Policies are parsed by platform/policy (presets, YAML,
// coordinator versions).
//
// The GIL: every call into the Python store takes it; the rendezvous, the exchange and every
// wait on the engine run with it released, so the store may be served by another Python thread
// and a submitted bucket's callback (which takes it on the engine's completion thread) can run.
// The engine's exchange thread never takes it, so a Python thread holding it (DDP's autograd
// hook calling into Python) never stalls the wire.
//
// backend "nccl" (builds with CUDA and NCCL, GEOFP8_PYTHON_CUDA): the engine over an NCCL
// communicator, with the device plane (kernels/exchange/data_plane.h, StagedPlane over
// cuda_backend.h): CUDA buckets are exchanged in place in device memory, the codec and geometry
// on the device, after the work queued on the caller's CUDA stream.

#include "client/python/engine_binding.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "client/python/hook_binding.h"
#include "kernels/common/check.h"
#include "kernels/exchange/engine.h"
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

// geofp8._geofp8.Error, for exceptions handed to a submitted bucket's callback (set at import).
py::handle g_error_type;

py::object ErrorObject(const geofp8::Error& e) {
  py::object instance = g_error_type(e.what());
  instance.attr("where") = e.where();
  return instance;
}

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

double SteadySeconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// An exchange's figures for Python (exchange()'s and submit()'s result). The refreshes include
// the deferred ones that ran since the last result (ExchangeEngine::Exchange).
py::dict ResultDict(const StepResult& r) {
  py::dict d;
  d["skipped"] = r.skipped;
  d["bytes_sent"] = r.bytes_sent;
  d["seconds"] = r.seconds;
  size_t from_inverse = 0;  // refreshes whose sketch took its projections from the inverse
  for (const RefreshRecord& rec : r.refreshes) from_inverse += rec.from_inverse;
  d["refreshes"] = r.refreshes.size();
  d["refreshes_from_inverse"] = from_inverse;
  return d;
}

// The engine of one process group: the communicator and device plane it runs on, and the
// kernels' ExchangeEngine, which owns the layers, the policy, each layer's state and the
// submitted buckets. Every call that may wait on the engine releases the GIL: a submitted
// bucket's callback takes it on the engine's completion thread.
class Engine {
 public:
  Engine(py::object store, int rank, int size, std::string hostname, double timeout_s,
         uint64_t seed, const std::string& backend, int device)
      : store_(std::make_unique<PyStore>(std::move(store))), rank_(rank) {
    GEOFP8_CHECK(timeout_s > 0, "timeout: must be > 0 seconds (", timeout_s, ")");
    EngineOptions eo;
    eo.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
    eo.seed = seed;
    // A DDP bucket up to this size runs on the hook's thread as one group, with no pipeline
    // threads: DDP's first bucket (1 MiB) and small models' buckets, where thread handoffs cost
    // more than the overlap saves (docs/benchmarks.md, "DDP comm hooks"). Larger ones (DDP's
    // 25 MiB default) keep the pipeline, which overlaps the codec with the wire.
    eo.inline_bytes = size_t{4} << 20;
    // The hook reports no drift (its layer reports carry the exchange error only), so it does not
    // pay for it: about a twelfth of an EMA refresh at the GPT example's shapes.
    eo.measure_drift = false;
    GEOFP8_CHECK(backend == "gloo" || backend == "nccl", "backend: unknown value '", backend,
                 "' (accepted: gloo, nccl)");
    py::gil_scoped_release release;
    if (backend == "nccl") {
#if GEOFP8_PYTHON_CUDA
      const int devices = CudaDeviceCount();
      GEOFP8_CHECK(devices > 0, "device: no CUDA device visible on rank ", rank);
      const int dev = device >= 0 ? device : rank % devices;
      GEOFP8_CHECK(dev < devices, "device: cuda:", dev, " out of range (", devices, " devices)");
      NcclOptions no;
      no.device = dev;
      no.prefix = "geofp8";
      no.timeout = eo.timeout;
      comm_ = CreateNcclCommunicator(*store_, rank, size, no);
      cuda_ = std::make_unique<cuda::CudaBackend>(dev);
      plane_ = std::make_unique<StagedPlane>(*cuda_);
      eo.plane = plane_.get();
#else
      (void)device;
      GEOFP8_FAIL(
          "device: CUDA tensors need a CUDA build of geofp8 (where nvcc and NCCL are found: "
          "GEOFP8_ENABLE_CUDA=ON pip install --no-build-isolation ., or configure CMake with "
          "-DGEOFP8_ENABLE_CUDA=ON); this is the cpu build, the Gloo engine on CPU tensors only");
#endif
    } else {
      GlooOptions go;
      go.hostname = std::move(hostname);
      go.prefix = "geofp8";
      go.timeout = eo.timeout;
      comm_ = CreateGlooCommunicator(*store_, rank, size, go);
    }
    engine_ = std::make_unique<ExchangeEngine>(*comm_, eo);
  }

  // Called by Python with the GIL held (or on the completion thread, by a callback that let go
  // of the engine). A bucket still queued is dropped with its callback uncalled, its Python
  // objects released here with the GIL; one on the wire is stopped through the communicator.
  ~Engine() {
    {
      py::gil_scoped_release release;
      engine_->Stop();
    }
    engine_.reset();
    comm_.reset();
  }

  bool OnCuda() const { return plane_ != nullptr; }
  int rank() const { return rank_; }
  int size() const { return comm_->size(); }
  std::string backend() const { return OnCuda() ? "nccl" : "gloo"; }

  // The model's parameters in named_parameters() order: names and shapes (rows, cols); a 1-D
  // parameter is (1, n).
  void SetLayers(const std::vector<std::string>& names,
                 const std::vector<std::pair<int64_t, int64_t>>& shapes) {
    GEOFP8_CHECK(names.size() == shapes.size(), "layers: ", names.size(), " names but ",
                 shapes.size(), " shapes");
    GEOFP8_CHECK(!names.empty(), "layers: the model has no parameter that requires a gradient");
    std::vector<model::ParamInfo> params;
    std::vector<EngineLayer> layers;
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
      layers.push_back(EngineLayer{p.name, p.exchange_rows(), p.exchange_cols()});
      params.push_back(std::move(p));
    }
    py::gil_scoped_release release;
    engine_->SetLayers(std::move(layers));
    params_ = std::move(params);
  }

  // kind: "preset" (fp32, bf16, fp8, geofp8, nvfp4, geonvfp4, fp8-ef, nvfp4-ef), "file" (a YAML
  // path) or "text" (YAML). Geometry of the previous policy carries over where it still fits the
  // new one. Returns one summary dict per layer.
  py::list SetPolicy(const std::string& kind, const std::string& spec, const std::string& model,
                     uint64_t version) {
    ExchangePlan plan = BuildPlan(kind, spec, model);
    std::vector<RefreshSchedule> schedule = MakeRefreshSchedule(plan, size());
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

  // Parses and checks a policy against the layers without applying it.
  void CheckPolicy(const std::string& kind, const std::string& spec, const std::string& model) {
    const ExchangePlan plan = BuildPlan(kind, spec, model);
    if (OnCuda()) CheckCudaPlan(plan);
  }

  // The minimum of `value` over the ranks, as one small collective (the per-step agreement on
  // the newest policy version every rank holds, as the worker's trainer makes it). `stream` is
  // unused: the NCCL communicator orders its collectives on a stream of its own.
  uint64_t AgreeMin(uint64_t value, uintptr_t /*stream*/) {
    py::gil_scoped_release release;
    return engine_->AgreeMin(value);
  }

  // Averages the gradients of `layers` (indices into set_layers' list) over the ranks in place:
  // layer layers[i] is buffer[offsets[i] .. + its size). `buffer` is a writable, contiguous
  // buffer of `dtype` (a CPU tensor's numpy() view; a bfloat16 or float16 one viewed as int16):
  // the engine reads it as it encodes and writes the average back rounded to it. The result's
  // "started" (time.monotonic() seconds) is when the exchange began, after the buckets
  // submitted before it.
  py::dict Exchange(uint64_t step, const std::vector<uint32_t>& layers, py::buffer buffer,
                    const std::vector<int64_t>& offsets, const std::string& dtype) {
    GradSpans grads = BucketGrads(layers, buffer, offsets, dtype);
    StepResult r;
    std::chrono::steady_clock::time_point started;
    {
      py::gil_scoped_release release;
      r = engine_->Exchange(step, layers, std::move(grads), {}, &started);
    }
    py::dict d = ResultDict(r);
    d["started"] = SteadySeconds(started);
    return d;
  }

  // exchange() as a reduce-scatter (ExchangeEngine::ReduceScatter): layer layers[i] is read from
  // buffer[offsets[i] ..] (and clobbered), and this rank's rows of its average (FSDP's dim-0
  // chunk, ceil(rows / N) rows, fewer or none at the end) are written to out[out_offsets[i] ..],
  // a float32 buffer or one of `dtype`, as buffer is.
  py::dict ReduceScatter(uint64_t step, const std::vector<uint32_t>& layers, py::buffer buffer,
                         const std::vector<int64_t>& offsets, py::buffer out,
                         const std::vector<int64_t>& out_offsets, const std::string& dtype) {
    GradSpans grads = BucketGrads(layers, buffer, offsets, dtype);
    py::buffer_info info = out.request(/*writable=*/true);
    const GradDtype out_dtype = BufferDtype(info, info.itemsize == 4 ? "float32" : dtype);
    GEOFP8_CHECK(info.ndim == 1 && info.strides[0] == info.itemsize,
                 "reduce-scatter output: must be one contiguous 1-D array");
    GEOFP8_CHECK(out_offsets.size() == layers.size(), "reduce-scatter: ", layers.size(),
                 " layers but ", out_offsets.size(), " output offsets");
    GradSpans outs;
    for (size_t i = 0; i < layers.size(); ++i) {
      const EngineLayer& l = engine_->layers()[layers[i]];
      const int64_t c = (l.rows + size() - 1) / size();
      const int64_t mine = std::clamp<int64_t>(l.rows - c * rank_, 0, c) * l.cols;
      GEOFP8_CHECK(out_offsets[i] >= 0 && out_offsets[i] + mine <= info.shape[0],
                   "reduce-scatter: layer '", l.name, "' at output offset ", out_offsets[i], " + ",
                   mine, " is outside the output of ", info.shape[0], " elements");
      outs.emplace_back(static_cast<uint8_t*>(info.ptr) + out_offsets[i] * info.itemsize,
                        static_cast<size_t>(mine), out_dtype);
    }
    StepResult r;
    {
      py::gil_scoped_release release;
      r = engine_->ReduceScatter(step, layers, std::move(grads), std::move(outs));
    }
    return ResultDict(r);
  }

  // exchange() without waiting: the bucket goes to the engine's exchange thread, which runs the
  // buckets one at a time in submission order (the same engine call as exchange(), so the same
  // bits). When it is done, `done(result, error)` is called on the engine's completion thread
  // with the GIL held: result is exchange()'s dict plus "queued", "started" and "finished"
  // (steady_clock seconds, Python's time.monotonic()) and error None, or result None and error
  // the exception (geofp8.Error for the engine's own). The buffer must not be touched until then.
  void Submit(uint64_t step, const std::vector<uint32_t>& layers, py::buffer buffer,
              const std::vector<int64_t>& offsets, py::function done, const std::string& dtype) {
    GradSpans grads = BucketGrads(layers, buffer, offsets, dtype);
    auto callback = Callback(std::move(done), std::move(buffer));
    py::gil_scoped_release release;
    engine_->Submit(step, layers, std::move(grads), std::move(callback));
  }

  // The CUDA path: averages the float32 device buffer at `ptr` (numel floats) over the ranks in
  // place, after the work queued so far on CUDA stream `stream`
  // (torch.cuda.current_stream().cuda_stream); layers and offsets as in exchange(). Returns once
  // the result is in device memory.
  py::dict ExchangeCuda(uint64_t step, const std::vector<uint32_t>& layers, uintptr_t ptr,
                        int64_t numel, const std::vector<int64_t>& offsets, uintptr_t stream) {
    GradSpans grads = DeviceBucketGrads(layers, ptr, numel, offsets);
    StepResult r;
    std::chrono::steady_clock::time_point started;
    {
      py::gil_scoped_release release;
      r = engine_->Exchange(step, layers, std::move(grads), AfterStream(stream), &started);
    }
    py::dict d = ResultDict(r);
    d["started"] = SteadySeconds(started);
    return d;
  }

  // submit() for a CUDA bucket: exchange_cuda() on the engine's exchange thread, after the work
  // queued on `stream` by now (an event recorded here). The bucket's memory must stay valid and
  // untouched until done(result, error) is called.
  void SubmitCuda(uint64_t step, const std::vector<uint32_t>& layers, uintptr_t ptr, int64_t numel,
                  const std::vector<int64_t>& offsets, uintptr_t stream, py::function done) {
    GradSpans grads = DeviceBucketGrads(layers, ptr, numel, offsets);
    auto callback = Callback(std::move(done), py::object());
    py::gil_scoped_release release;
    engine_->Submit(step, layers, std::move(grads), std::move(callback), AfterStream(stream));
  }

  // Waits, with the GIL released, until every submitted bucket is exchanged and its callback
  // has returned. forget_errors: the queued buckets' errors have reached their Futures and
  // are not raised again by the next exchange() (a new step).
  void Drain(bool forget_errors) {
    py::gil_scoped_release release;
    engine_->Drain(forget_errors);
  }
  size_t in_flight() const { return engine_->in_flight(); }

  // Makes the collective in flight, and every later one, throw with an error carrying `reason`
  // (Communicator::Abort), from any thread: geofp8.torch's bucket watch ends the wait for a
  // bucket that another rank will never exchange. The engine is broken afterwards. False: the
  // communicator cannot interrupt a collective, which then ends at its timeout.
  bool Abort(const std::string& reason) {
    py::gil_scoped_release release;
    return engine_->communicator().Abort(reason);
  }

  // Every layer's geometry state, in set_layers order: (active, pending, pending_from, sketch).
  py::list ExportGeometry() {
    std::vector<LayerGeometryState> all;
    {
      py::gil_scoped_release release;
      all = engine_->ExportGeometry();
    }
    py::list out;
    for (const LayerGeometryState& s : all) {
      out.append(
          py::make_tuple(Bytes(s.active), Bytes(s.pending), s.pending_from, Bytes(s.sketch)));
    }
    return out;
  }

  // Restores ExportGeometry's list (resume), checked strictly against the current policy (an
  // error names the layer and field).
  void ImportGeometry(const py::list& state) {
    std::vector<LayerGeometryState> all;
    for (const py::handle& h : state) {
      auto t = h.cast<py::tuple>();
      GEOFP8_CHECK(t.size() == 4,
                   "geometry: each entry is (active, pending, pending_from, sketch)");
      all.push_back(LayerGeometryState{FromBytes(t[0].cast<py::bytes>()),
                                       FromBytes(t[1].cast<py::bytes>()), t[2].cast<uint64_t>(),
                                       FromBytes(t[3].cast<py::bytes>())});
    }
    py::gil_scoped_release release;
    engine_->ImportGeometry(all);
  }

  // Every layer's error-feedback residuals, in set_layers order: (geometry_version, local,
  // owner), the float32 values as bytes (empty where the layer keeps none).
  py::list ExportResiduals() {
    std::vector<LayerResidual> all;
    {
      py::gil_scoped_release release;
      all = engine_->ExportResiduals();
    }
    auto floats = [](const std::vector<float>& v) {
      return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    };
    py::list out;
    for (const LayerResidual& r : all) {
      out.append(py::make_tuple(r.geometry_version, floats(r.local), floats(r.owner)));
    }
    return out;
  }

  // Restores ExportResiduals' list (resume), after import_geometry.
  void ImportResiduals(const py::list& state) {
    GEOFP8_CHECK(engine_->has_policy(), "import_residuals: set_policy first");
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
    py::gil_scoped_release release;
    engine_->ImportResiduals(all);
  }

  size_t exchanger_count() {
    py::gil_scoped_release release;
    return engine_->exchanger_count();
  }

  // Starts recording every exchange's collectives, codec stages and geometry refreshes
  // (kernels/exchange/trace.h) from the next bucket on; write_trace saves them.
  void StartTrace() {
    py::gil_scoped_release release;
    engine_->StartTrace();
  }

  // Chrome trace JSON of what was recorded since start_trace (ui.perfetto.dev), this rank as
  // process `rank`. Returns the number of spans written.
  size_t WriteTrace(const std::string& path) {
    GEOFP8_CHECK(engine_->trace(), "write_trace: no trace recorded (call start_trace first)");
    Drain(/*forget_errors=*/true);
    engine_->trace()->WriteChromeJson(path, rank_);
    return engine_->trace()->spans().size();
  }

 private:
  // A submitted bucket's Python objects: the callback and what keeps the bucket's memory alive.
  // Released by the callback itself, with the GIL, so the engine can drop the holder without it.
  struct PyRefs {
    py::object done, buffer;
  };

  static ExchangeEngine::Done Callback(py::function done, py::object buffer) {
    auto refs = std::make_shared<PyRefs>(PyRefs{std::move(done), std::move(buffer)});
    return [refs](const ExchangeEngine::Completion& c) {
      py::gil_scoped_acquire gil;
      try {
        py::object result = py::none(), error = py::none();
        if (c.error) {
          try {
            std::rethrow_exception(c.error);
          } catch (const geofp8::Error& e) {
            error = ErrorObject(e);
          } catch (const std::exception& e) {
            error = py::reinterpret_borrow<py::object>(PyExc_RuntimeError)(e.what());
          }
        } else {
          py::dict d = ResultDict(*c.result);
          d["queued"] = SteadySeconds(c.queued);
          d["started"] = SteadySeconds(c.started);
          d["finished"] = SteadySeconds(c.finished);
          result = std::move(d);
        }
        refs->done(result, error);
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("geofp8 engine: a submitted bucket's callback");
      }
      refs->done = py::object();
      refs->buffer = py::object();
    };
  }

  // Orders a device exchange after the work queued on CUDA stream `stream` by now: an event
  // recorded here, waited for on the device plane's stream just before the exchange. An event
  // whose bucket is dropped unexchanged is released, never waited for.
  ExchangeEngine::Before AfterStream(uintptr_t stream) {
#if GEOFP8_PYTHON_CUDA
    struct Event {
      cuda::CudaBackend* cuda;
      uintptr_t event;
      ~Event() {
        if (event) cuda->ReleaseEvent(event);
      }
    };
    auto e = std::make_shared<Event>(Event{cuda_.get(), cuda_->RecordEvent(stream)});
    return [e] { e->cuda->WaitForEvent(std::exchange(e->event, 0)); };
#else
    (void)stream;
    GEOFP8_FAIL("device: this geofp8 has no CUDA path");
#endif
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

  py::list SetPlan(ExchangePlan plan, std::vector<RefreshSchedule> schedule, uint64_t version) {
    if (OnCuda()) CheckCudaPlan(plan);
    EnginePolicy policy{plan.layers, MakeExchangeOptions(plan), schedule, version};
    {
      py::gil_scoped_release release;
      engine_->SetPolicy(std::move(policy));
    }
    py::list out;
    for (size_t i = 0; i < params_.size(); ++i) {
      const LayerPolicy& lp = plan.layers[i];
      py::dict d;
      d["name"] = params_[i].name;
      d["algorithm"] = std::string(AlgorithmNameOf(plan.algorithm));
      d["format"] = std::string(FormatNameOf(lp.format));
      d["scaling"] = std::string(ScalingNameOf(lp.scaling));
      d["block"] = lp.block;
      d["rounding"] = std::string(RoundingNameOf(lp.rounding));
      d["geometry"] = std::string(GeometryNameOf(lp.geometry));
      d["rank"] = lp.rank;
      d["alpha"] = lp.alpha;
      d["refresh_interval"] = schedule.empty() ? 0 : schedule[i].interval;
      out.append(d);
    }
    return out;
  }

  // A CUDA bucket's layers as spans of device memory (exchange_cuda() and submit_cuda()).
  GradSpans DeviceBucketGrads(const std::vector<uint32_t>& layers, uintptr_t ptr, int64_t numel,
                              const std::vector<int64_t>& offsets) {
    GEOFP8_CHECK(OnCuda(),
                 "device: this engine runs on CPU tensors (backend gloo); create it "
                 "with backend 'nccl' for CUDA tensors");
    GEOFP8_CHECK(engine_->has_policy(), "exchange: set_policy first");
    GEOFP8_CHECK(numel >= 0, "exchange: numel must be >= 0 (", numel, ")");
#if GEOFP8_PYTHON_CUDA
    cuda_->CheckDeviceMemory(reinterpret_cast<const void*>(ptr), "bucket");
#endif
    return LayerSpans(layers, reinterpret_cast<void*>(ptr), GradDtype::kFp32, numel, offsets);
  }

  // The bucket's layers as spans into `buffer`, checked (exchange() and submit()).
  GradSpans BucketGrads(const std::vector<uint32_t>& layers, py::buffer& buffer,
                        const std::vector<int64_t>& offsets, const std::string& dtype) {
    GEOFP8_CHECK(!OnCuda(),
                 "device: this engine runs on CUDA tensors (backend nccl); CPU tensors "
                 "need a gloo engine");
    GEOFP8_CHECK(engine_->has_policy(), "exchange: set_policy first");
    py::buffer_info info = buffer.request(/*writable=*/true);
    const GradDtype d = BufferDtype(info, dtype);
    GEOFP8_CHECK(info.ndim == 1 && info.strides[0] == info.itemsize,
                 "gradient buffer: must be one contiguous 1-D array");
    return LayerSpans(layers, info.ptr, d, info.shape[0], offsets);
  }

  // A buffer's gradient dtype: `dtype` ("float32", "bfloat16" or "float16"), checked against
  // its items (4-byte floats, or 2-byte items: numpy has no bfloat16, so torch's is viewed as
  // int16 on the way).
  static GradDtype BufferDtype(const py::buffer_info& info, const std::string& dtype) {
    const std::string f = info.format.empty() ? "" : info.format.substr(info.format.size() - 1);
    if (dtype == "float32") {
      GEOFP8_CHECK(info.itemsize == 4 && f == "f",
                   "gradient dtype: float32 needs a float32 "
                   "buffer (buffer format '",
                   info.format, "')");
      return GradDtype::kFp32;
    }
    GEOFP8_CHECK(dtype == "bfloat16" || dtype == "float16", "gradient dtype: unknown value '",
                 dtype, "' (accepted: float32, bfloat16, float16)");
    GEOFP8_CHECK(info.itemsize == 2 && (f == "e" || f == "h" || f == "H"),
                 "gradient dtype: ", dtype, " needs a buffer of 2-byte items (buffer format '",
                 info.format, "')");
    return dtype == "bfloat16" ? GradDtype::kBf16 : GradDtype::kFp16;
  }

  // Layer layers[i] as data[offsets[i] .. + its size), each inside the bucket of numel elements.
  GradSpans LayerSpans(const std::vector<uint32_t>& layers, void* data, GradDtype dtype,
                       int64_t numel, const std::vector<int64_t>& offsets) {
    GEOFP8_CHECK(layers.size() == offsets.size() && !layers.empty(), "exchange: ", layers.size(),
                 " layers but ", offsets.size(), " offsets");
    GradSpans grads;
    const GradSpan all(data, static_cast<size_t>(numel), dtype);
    for (size_t i = 0; i < layers.size(); ++i) {
      GEOFP8_CHECK(layers[i] < params_.size(), "exchange: layer index ", layers[i],
                   " >= ", params_.size());
      const int64_t n = params_[layers[i]].size();
      GEOFP8_CHECK(offsets[i] >= 0 && offsets[i] + n <= numel, "exchange: layer '",
                   params_[layers[i]].name, "' at offset ", offsets[i], " + ", n,
                   " is outside the bucket of ", numel, " elements");
      grads.push_back(all.subspan(static_cast<size_t>(offsets[i]), static_cast<size_t>(n)));
    }
    return grads;
  }

  std::unique_ptr<PyStore> store_;
  std::unique_ptr<Communicator> comm_;  // gloo, or nccl for CUDA tensors
#if GEOFP8_PYTHON_CUDA
  std::unique_ptr<cuda::CudaBackend> cuda_;  // backend nccl: the device plane's kernels
#endif
  std::unique_ptr<StagedPlane> plane_;  // backend nccl; null: CPU tensors (the host plane)
  std::unique_ptr<ExchangeEngine> engine_;
  int rank_ = 0;
  std::vector<model::ParamInfo> params_;  // what the policy builders resolve against
};

}  // namespace

void BindEngine(py::module_& m) {
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
      .def("reduce_scatter", &Engine::ReduceScatter, py::arg("step"), py::arg("layers"),
           py::arg("buffer"), py::arg("offsets"), py::arg("out"), py::arg("out_offsets"),
           py::arg("dtype") = "float32")
      .def("exchange", &Engine::Exchange, py::arg("step"), py::arg("layers"), py::arg("buffer"),
           py::arg("offsets"), py::arg("dtype") = "float32")
      .def("submit", &Engine::Submit, py::arg("step"), py::arg("layers"), py::arg("buffer"),
           py::arg("offsets"), py::arg("done"), py::arg("dtype") = "float32",
           "exchange() on the engine's exchange thread, in submission order; returns at once and "
           "calls done(result, error) with the GIL when the bucket is averaged (result: "
           "exchange()'s dict plus queued/started/finished, time.monotonic() seconds).")
      .def("drain", &Engine::Drain, py::arg("forget_errors") = true,
           "Waits until every submitted bucket's callback has returned; forget_errors: the next "
           "exchange() does not raise a queued bucket's error again.")
      .def("abort", &Engine::Abort, py::arg("reason"),
           "From any thread: the exchange in flight, and every later one, raise an error "
           "carrying `reason` (the peers see the connections close); the engine is broken "
           "afterwards. False where the communicator cannot interrupt a collective.")
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
}

}  // namespace geofp8::python
