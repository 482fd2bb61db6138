// geofp8._geofp8.Engine: the exchange engine of one process group (kernels/exchange/hook_session.h)
// for Python, as geofp8.torch's DDP comm hook drives it (the module itself: geofp8_module.cc).
// Conversion only: the store, buffers, results and callbacks between Python and the session, whose
// policies the policy library builds (platform/policy/exchange_policy.h).
//
// The GIL: every call into the Python store takes it; the rendezvous, the exchange and every
// wait on the engine run with it released, so the store may be served by another Python thread
// and a submitted bucket's callback (which takes it on the engine's completion thread) can run.
// The engine's exchange thread never takes it, so a Python thread holding it (DDP's autograd
// hook calling into Python) never stalls the wire.

#include "client/python/engine_binding.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/check.h"
#include "kernels/exchange/hook_session.h"
#include "platform/policy/exchange_policy.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace geofp8::python {

// geofp8._geofp8.Error, for exceptions handed to a submitted bucket's callback (set at import).
py::handle g_error_type;

py::object ErrorObject(const geofp8::Error& e) {
  py::object instance = g_error_type(e.what());
  instance.attr("where") = e.where();
  return instance;
}

namespace {

// A vector's values as bytes, and back (a whole number of values, else an error).
template <typename T>
py::bytes Bytes(const std::vector<T>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}
template <typename T>
std::vector<T> FromBytes(const py::handle& b) {
  const std::string s = b.cast<std::string>();
  GEOFP8_CHECK(s.size() % sizeof(T) == 0, "state: ", s.size(), " bytes are not ", sizeof(T),
               "-byte values");
  std::vector<T> v(s.size() / sizeof(T));
  if (!s.empty()) std::memcpy(v.data(), s.data(), s.size());
  return v;
}
using Layers = std::vector<uint32_t>;
using Offsets = std::vector<int64_t>;
using Shapes = std::vector<std::pair<int64_t, int64_t>>;

double SteadySeconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}
// f() with the GIL released.
template <typename F>
auto Released(F&& f) {
  py::gil_scoped_release release;
  return f();
}

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
    Call("set '" + key + "'", [&] { store_.attr("set")(key, Bytes(value)); });
  }
  std::vector<uint8_t> Get(const std::string& key, std::chrono::milliseconds timeout) override {
    Wait({key}, timeout);
    return Call("get '" + key + "'", [&] { return FromBytes<uint8_t>(store_.attr("get")(key)); });
  }
  void Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    const std::string what = "wait for '" + (keys.empty() ? std::string() : keys.front()) + "' (" +
                             std::to_string(keys.size()) + " keys, timeout " +
                             std::to_string(timeout.count()) + " ms)";
    Call(what, [&] {
      py::object delta = py::module_::import("datetime")
                             .attr("timedelta")(py::arg("milliseconds") = timeout.count());
      store_.attr("wait")(py::cast(keys), delta);
    });
  }
  int64_t Add(const std::string& key, int64_t delta) override {
    return Call("add '" + key + "'",
                [&] { return store_.attr("add")(key, delta).cast<int64_t>(); });
  }

 private:
  template <typename F>
  auto Call(const std::string& what, F&& f) -> decltype(f()) {
    py::gil_scoped_acquire gil;
    try {
      return f();
    } catch (py::error_already_set& e) {
      GEOFP8_FAIL("store ", what, ": ", e.what());
    }
  }
  py::object store_;
};

// An exchange's figures for Python (exchange()'s and submit()'s result). The refreshes include
// the deferred ones that ran since the last result (ExchangeEngine::Exchange).
py::dict ResultDict(const StepResult& r) {
  size_t from_inverse = 0;  // refreshes whose sketch took its projections from the inverse
  for (const RefreshRecord& rec : r.refreshes) from_inverse += rec.from_inverse;
  return py::dict("skipped"_a = r.skipped, "bytes_sent"_a = r.bytes_sent, "seconds"_a = r.seconds,
                  "refreshes"_a = r.refreshes.size(), "refreshes_from_inverse"_a = from_inverse);
}

// A submitted bucket's Python objects: the callback and what keeps the bucket's memory alive.
// Released with the GIL: by the callback itself, or wherever the engine drops it uncalled.
struct PyRefs {
  py::object done, buffer;
  ~PyRefs() {
    if (!done && !buffer) return;
    py::gil_scoped_acquire gil;
    done = buffer = py::object();
  }
};

// done(result, error) with the GIL on the engine's completion thread: result is exchange()'s dict
// plus "queued", "started" and "finished" (time.monotonic() seconds) and error None, or result
// None and error the exception (geofp8.Error for the engine's own).
ExchangeEngine::Done Callback(py::function done, py::object buffer) {
  auto refs = std::make_shared<PyRefs>(std::move(done), std::move(buffer));
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
    refs->done = refs->buffer = py::object();
  };
}

// A CPU bucket: layers, a writable contiguous 1-D float32 buffer (a CPU tensor's numpy() view)
// and each layer's offset in it.
// A buffer's gradient dtype: `dtype` ("float32", "bfloat16" or "float16"), checked against its
// items (4-byte floats, or 2-byte items: numpy has no bfloat16, so torch's is viewed as int16).
GradDtype BufferDtype(const py::buffer_info& info, const std::string& dtype) {
  const std::string f = info.format.empty() ? "" : info.format.substr(info.format.size() - 1);
  if (dtype == "float32") {
    GEOFP8_CHECK(info.itemsize == 4 && f == "f",
                 "gradient dtype: float32 needs a float32 buffer (buffer format '", info.format,
                 "')");
    return GradDtype::kFp32;
  }
  GEOFP8_CHECK(dtype == "bfloat16" || dtype == "float16", "gradient dtype: unknown value '", dtype,
               "' (accepted: float32, bfloat16, float16)");
  GEOFP8_CHECK(info.itemsize == 2 && (f == "e" || f == "h" || f == "H"), "gradient dtype: ", dtype,
               " needs a buffer of 2-byte items (buffer format '", info.format, "')");
  return dtype == "bfloat16" ? GradDtype::kBf16 : GradDtype::kFp16;
}

// A host buffer of `dtype` as one contiguous 1-D gradient span.
GradSpan HostSpan(py::buffer& buffer, const std::string& dtype, const char* what) {
  py::buffer_info info = buffer.request(/*writable=*/true);
  const GradDtype d = BufferDtype(info, dtype);
  GEOFP8_CHECK(info.ndim == 1 && info.strides[0] == info.itemsize, what,
               ": must be one contiguous 1-D array");
  return GradSpan(info.ptr, static_cast<size_t>(info.shape[0]), d);
}

FlatBucket HostBucket(std::vector<uint32_t> layers, py::buffer& buffer,
                      std::vector<int64_t> offsets, const std::string& dtype) {
  return FlatBucket{std::move(layers), HostSpan(buffer, dtype, "gradient buffer"),
                    std::move(offsets)};
}

// A CUDA bucket: numel floats of device memory at `ptr`, after the work queued on `stream`.
FlatBucket DeviceBucket(std::vector<uint32_t> layers, uintptr_t ptr, int64_t numel,
                        std::vector<int64_t> offsets, uintptr_t stream) {
  GEOFP8_CHECK(numel >= 0, "exchange: numel must be >= 0 (", numel, ")");
  GradSpan data(reinterpret_cast<void*>(ptr), static_cast<size_t>(numel), GradDtype::kFp32);
  return FlatBucket{std::move(layers), data, std::move(offsets), /*on_device=*/true, stream};
}

// One process group's session, and the Python store it met the other ranks through. The methods
// are the Python API's, documented where BindEngine registers them.
class Engine {
 public:
  Engine(py::object py_store, int rank, int size, std::string hostname, double timeout_s,
         uint64_t seed, std::string backend, int device)
      : store_(std::make_unique<PyStore>(std::move(py_store))) {
    GEOFP8_CHECK(timeout_s > 0, "timeout: must be > 0 seconds (", timeout_s, ")");
    const std::chrono::milliseconds timeout(static_cast<int64_t>(timeout_s * 1000.0));
    const HookSessionOptions o{rank,    size, std::move(backend), device, std::move(hostname),
                               timeout, seed};
    s_ = Released([&] { return std::make_unique<HookSession>(*store_, o); });
  }
  // Called with the GIL held (or on the completion thread, by a callback that let go of the
  // engine): a bucket still queued is dropped with its callback uncalled (PyRefs).
  ~Engine() {
    Released([&] { s_->engine().Stop(); });
    s_.reset();
  }

  int rank() const { return s_->rank(); }
  int size() const { return s_->size(); }
  std::string backend() const { return s_->backend(); }
  size_t in_flight() const { return s_->engine().in_flight(); }
  size_t exchanger_count() {
    return Released([&] { return s_->engine().exchanger_count(); });
  }

  // With the GIL released (nogil): C++ arguments only.
  void SetLayers(const std::vector<std::string>& names, const Shapes& shapes) {
    s_->SetLayers(names, shapes);
  }
  uint64_t AgreeMin(uint64_t value, uintptr_t /*stream*/) { return s_->engine().AgreeMin(value); }
  void Drain(bool forget_errors) { s_->engine().Drain(forget_errors); }
  bool Abort(const std::string& reason) { return s_->Abort(reason); }
  void StartTrace() { s_->engine().StartTrace(); }
  size_t WriteTrace(const std::string& path) { return s_->WriteTrace(path); }

  py::list SetPolicy(const std::string& kind, const std::string& spec, const std::string& model,
                     uint64_t version) {
    ExchangePlan plan = MakeExchangePlanOf(kind, spec, s_->params(), model);
    return Apply(plan, MakeRefreshSchedule(plan, s_->size()), version);
  }
  py::list SetCoordinatorPolicy(const py::bytes& policy, const std::vector<py::bytes>& refresh,
                                const std::string& spec_yaml) {
    const std::vector<std::string> r(refresh.begin(), refresh.end());
    VersionPlan v = PlanOfCoordinatorVersion(policy, r, spec_yaml, s_->params());
    return Apply(v.plan, v.schedule, v.version);
  }
  void CheckPolicy(const std::string& kind, const std::string& spec, const std::string& model) {
    s_->CheckPolicy(MakeExchangePlanOf(kind, spec, s_->params(), model).layers);
  }

  py::dict Exchange(uint64_t step, Layers layers, py::buffer buffer, Offsets offsets,
                    const std::string& dtype) {
    return Run(step, HostBucket(std::move(layers), buffer, std::move(offsets), dtype));
  }
  py::dict ExchangeCuda(uint64_t step, Layers layers, uintptr_t ptr, int64_t numel, Offsets offsets,
                        uintptr_t stream) {
    return Run(step, DeviceBucket(std::move(layers), ptr, numel, std::move(offsets), stream));
  }
  void Submit(uint64_t step, Layers layers, py::buffer buffer, Offsets offsets, py::function done,
              const std::string& dtype) {
    const FlatBucket b = HostBucket(std::move(layers), buffer, std::move(offsets), dtype);
    Queue(step, b, Callback(std::move(done), std::move(buffer)));
  }
  void SubmitCuda(uint64_t step, Layers layers, uintptr_t ptr, int64_t numel, Offsets offsets,
                  uintptr_t stream, py::function done) {
    const FlatBucket b = DeviceBucket(std::move(layers), ptr, numel, std::move(offsets), stream);
    Queue(step, b, Callback(std::move(done), py::object()));
  }
  py::dict ReduceScatter(uint64_t step, Layers layers, py::buffer buffer, Offsets offsets,
                         py::buffer out, const Offsets& out_offsets, const std::string& dtype) {
    const FlatBucket b = HostBucket(std::move(layers), buffer, std::move(offsets), dtype);
    // float32 rows, or rows of the gradients' own dtype.
    const bool f32 = out.request().itemsize == 4;
    const GradSpan o = HostSpan(out, f32 ? "float32" : dtype, "reduce-scatter output");
    return ResultDict(Released([&] { return s_->ReduceScatter(step, b, o, out_offsets); }));
  }

  py::list ExportGeometry() {
    py::list out;
    for (const LayerGeometryState& g : Released([&] { return s_->engine().ExportGeometry(); })) {
      out.append(
          py::make_tuple(Bytes(g.active), Bytes(g.pending), g.pending_from, Bytes(g.sketch)));
    }
    return out;
  }
  void ImportGeometry(const py::list& state) {
    std::vector<LayerGeometryState> all;
    for (const py::handle& h : state) {
      auto t = h.cast<py::tuple>();
      GEOFP8_CHECK(t.size() == 4,
                   "geometry: each entry is (active, pending, pending_from, sketch)");
      all.push_back({FromBytes<uint8_t>(t[0]), FromBytes<uint8_t>(t[1]), t[2].cast<uint64_t>(),
                     FromBytes<uint8_t>(t[3])});
    }
    Released([&] { s_->engine().ImportGeometry(all); });
  }
  py::list ExportResiduals() {
    py::list out;
    for (const LayerResidual& r : Released([&] { return s_->engine().ExportResiduals(); })) {
      out.append(py::make_tuple(r.geometry_version, Bytes(r.local), Bytes(r.owner)));
    }
    return out;
  }
  void ImportResiduals(const py::list& state) {
    std::vector<LayerResidual> all;
    for (const py::handle& h : state) {
      auto t = h.cast<py::tuple>();
      GEOFP8_CHECK(t.size() == 3, "residuals: each entry is (geometry_version, local, owner)");
      all.push_back({t[0].cast<uint64_t>(), FromBytes<float>(t[1]), FromBytes<float>(t[2])});
    }
    Released([&] { s_->engine().ImportResiduals(all); });
  }

 private:
  // Puts a plan in force; one summary dict per layer.
  py::list Apply(const ExchangePlan& plan, const std::vector<RefreshSchedule>& schedule,
                 uint64_t version) {
    Released([&] { s_->SetPolicy(EnginePolicyOf(plan, schedule, version)); });
    py::list out;
    for (size_t i = 0; i < plan.layers.size(); ++i) {
      const LayerPolicy& lp = plan.layers[i];
      out.append(py::dict(
          "name"_a = s_->params()[i].name, "algorithm"_a = AlgorithmNameOf(plan.algorithm),
          "format"_a = FormatNameOf(lp.format), "scaling"_a = ScalingNameOf(lp.scaling),
          "block"_a = lp.block, "rounding"_a = RoundingNameOf(lp.rounding),
          "geometry"_a = GeometryNameOf(lp.geometry), "rank"_a = lp.rank, "alpha"_a = lp.alpha,
          "refresh_interval"_a = schedule.empty() ? 0 : schedule[i].interval));
    }
    return out;
  }
  py::dict Run(uint64_t step, const FlatBucket& b) {
    std::chrono::steady_clock::time_point started;
    py::dict d = ResultDict(Released([&] { return s_->Exchange(step, b, &started); }));
    d["started"] = SteadySeconds(started);
    return d;
  }
  void Queue(uint64_t step, const FlatBucket& b, ExchangeEngine::Done done) {
    Released([&] { s_->Submit(step, b, std::move(done)); });
  }

  std::unique_ptr<PyStore> store_;  // outlives the session, which met the other ranks through it
  std::unique_ptr<HookSession> s_;
};

}  // namespace

void BindEngine(py::module_& m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<Engine>(m, "Engine")
      .def(py::init<py::object, int, int, std::string, double, uint64_t, std::string, int>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("hostname") = "127.0.0.1",
           py::arg("timeout_s") = 300.0, py::arg("seed") = 0, py::arg("backend") = "gloo",
           py::arg("device") = -1,
           "Connects over Gloo (CPU tensors) or NCCL (CUDA tensors on `device`) through `store` "
           "(torch.distributed.Store's set/get/wait/add); blocks until all ranks join.")
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("size", &Engine::size)
      .def_property_readonly("backend", &Engine::backend)
      .def("set_layers", &Engine::SetLayers, nogil, py::arg("names"), py::arg("shapes"),
           "The model's parameters in order: names and shapes (rows, cols; 1-D: (1, n)).")
      .def("set_policy", &Engine::SetPolicy, py::arg("kind"), py::arg("spec"),
           py::arg("model") = "model", py::arg("version") = 0,
           "kind: 'preset', 'file' (a YAML path) or 'text' (YAML); one summary dict per layer.")
      .def("set_coordinator_policy", &Engine::SetCoordinatorPolicy, py::arg("policy"),
           py::arg("refresh"), py::arg("spec_yaml") = "",
           "set_policy of HookClient's change (policy, refresh) under the job's spec.")
      .def("check_policy", &Engine::CheckPolicy, py::arg("kind"), py::arg("spec"),
           py::arg("model") = "model", "set_policy's checks without applying it.")
      .def("agree_min", &Engine::AgreeMin, nogil, py::arg("value"), py::arg("stream") = 0,
           "The minimum of `value` over the ranks (one small collective); `stream` is unused.")
      .def("reduce_scatter", &Engine::ReduceScatter, py::arg("step"), py::arg("layers"),
           py::arg("buffer"), py::arg("offsets"), py::arg("out"), py::arg("out_offsets"),
           py::arg("dtype") = "float32",
           "exchange() whose average's rows of this rank (FSDP's chunk) go to out (float32 or "
           "dtype); clobbers buffer.")
      .def("exchange", &Engine::Exchange, py::arg("step"), py::arg("layers"), py::arg("buffer"),
           py::arg("offsets"), py::arg("dtype") = "float32",
           "Averages layers[i] at buffer[offsets[i]..] over the ranks in place; dtype float32, "
           "bfloat16 or float16 (2-byte ones viewed as int16), read and written back in it.")
      .def("submit", &Engine::Submit, py::arg("step"), py::arg("layers"), py::arg("buffer"),
           py::arg("offsets"), py::arg("done"), py::arg("dtype") = "float32",
           "exchange() on the engine's thread, in order; then done(result, error) with the GIL.")
      .def("drain", &Engine::Drain, nogil, py::arg("forget_errors") = true,
           "Waits for every submitted bucket's callback; forget_errors: not raised again.")
      .def("abort", &Engine::Abort, nogil, py::arg("reason"),
           "From any thread: this exchange and every later one raise `reason`; False: cannot.")
      .def_property_readonly("in_flight", &Engine::in_flight,
                             "Buckets submitted whose callback has not yet returned.")
      .def("exchange_cuda", &Engine::ExchangeCuda, py::arg("step"), py::arg("layers"),
           py::arg("ptr"), py::arg("numel"), py::arg("offsets"), py::arg("stream"),
           "exchange() of a CUDA bucket, after the work queued on `stream`.")
      .def("submit_cuda", &Engine::SubmitCuda, py::arg("step"), py::arg("layers"), py::arg("ptr"),
           py::arg("numel"), py::arg("offsets"), py::arg("stream"), py::arg("done"),
           "submit() of a CUDA bucket.")
      .def("export_geometry", &Engine::ExportGeometry,
           "Every layer's geometry state: (active, pending, pending_from, sketch).")
      .def("import_geometry", &Engine::ImportGeometry, py::arg("state"),
           "Restores export_geometry's list (resume), checked strictly against the policy.")
      .def("export_residuals", &Engine::ExportResiduals,
           "Every layer's (geometry_version, local, owner), float32 residuals as bytes.")
      .def("import_residuals", &Engine::ImportResiduals, py::arg("state"),
           "Restores export_residuals' list (resume), after import_geometry.")
      .def_property_readonly("exchanger_count", &Engine::exchanger_count)
      .def("start_trace", &Engine::StartTrace, nogil, "Records every exchange's spans from now on.")
      .def("write_trace", &Engine::WriteTrace, nogil, py::arg("path"),
           "Writes the spans recorded as Chrome trace JSON; returns their count.");
}

}  // namespace geofp8::python
