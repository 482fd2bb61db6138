// geofp8._geofp8.Engine: the exchange engine of one process group (kernels/exchange/hook_session.h)
// for Python, as geofp8.torch's DDP comm hook and FSDP2 reduce-scatter drive it. Conversion only:
// the store, tensors, results and callbacks between Python and the session, whose policies the
// policy library builds (platform/policy/exchange_policy.h).
//
// The GIL: every call into the Python store takes it; the rendezvous, the exchange and every
// wait on the engine run with it released, so the store may be served by another Python thread
// and a submitted bucket's callback (which takes it on the engine's completion thread) can run.
// The engine's exchange thread never takes it, so a Python thread holding it (DDP's autograd
// hook calling into Python) never stalls the wire.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "client/python/bindings.h"
#include "kernels/common/check.h"
#include "kernels/exchange/function_store.h"
#include "kernels/exchange/hook_session.h"
#include "platform/policy/exchange_policy.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace geofp8::python {
namespace {

using Layers = std::vector<uint32_t>;
using Offsets = std::vector<int64_t>;

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

double SteadySeconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// f() with the GIL; a Python exception becomes a C++ one with its message, taken while the GIL
// is held (FunctionStore names the store call).
template <typename F>
auto WithGil(F&& f) -> decltype(f()) {
  py::gil_scoped_acquire gil;
  try {
    return f();
  } catch (py::error_already_set& e) {
    throw std::runtime_error(e.what());
  }
}

// A Python object for C++ threads to hold: released with the GIL, wherever they let go of it.
std::shared_ptr<py::object> Held(py::object o) {
  return {new py::object(std::move(o)), [](py::object* p) {
            py::gil_scoped_acquire gil;
            delete p;
          }};
}

// A store over a Python object with the methods of torch.distributed.Store: set(key, bytes),
// get(key) -> bytes, wait(keys, timedelta), add(key, int) -> int.
std::unique_ptr<Store> PyStore(py::object store) {
  std::shared_ptr<py::object> s = Held(std::move(store));
  FunctionStore::Calls c;
  c.set = [s](const std::string& key, const std::vector<uint8_t>& value) {
    WithGil([&] { s->attr("set")(key, Bytes(value)); });
  };
  c.get = [s](const std::string& key) {
    return WithGil([&] { return FromBytes<uint8_t>(s->attr("get")(key)); });
  };
  c.wait = [s](const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
    WithGil([&] { s->attr("wait")(keys, timeout); });
  };
  c.add = [s](const std::string& key, int64_t delta) {
    return WithGil([&] { return s->attr("add")(key, delta).cast<int64_t>(); });
  };
  return std::make_unique<FunctionStore>(std::move(c));
}

// The engine as Python holds it: released without the GIL, which the engine's completion thread
// may need to finish a callback before the engine stops (a bucket still queued is dropped with
// its callback uncalled: Callback). The session keeps the store it met the other ranks through.
struct ReleasedDelete {
  void operator()(HookSession* s) const {
    py::gil_scoped_release release;
    delete s;
  }
};
using Engine = std::unique_ptr<HookSession, ReleasedDelete>;

// An exchange's figures for Python (exchange()'s and submit()'s result). The refreshes include
// the deferred ones that ran since the last result (ExchangeEngine::Exchange).
py::dict ResultDict(const StepResult& r) {
  size_t from_inverse = 0;  // refreshes whose sketch took its projections from the inverse
  for (const RefreshRecord& rec : r.refreshes) from_inverse += rec.from_inverse;
  return py::dict("skipped"_a = r.skipped, "bytes_sent"_a = r.bytes_sent, "seconds"_a = r.seconds,
                  "refreshes"_a = r.refreshes.size(), "refreshes_from_inverse"_a = from_inverse);
}

// The exception as Python raises it: rethrown through a Python call, so that the module's
// translators make it a geofp8.Error (the engine's own) or a RuntimeError.
py::object PyError(std::exception_ptr error) {
  try {
    py::cpp_function([error] { std::rethrow_exception(error); })();
  } catch (py::error_already_set& e) {
    return e.value();
  }
  return py::none();
}

// done(result, error) with the GIL on the engine's completion thread: result is exchange()'s dict
// plus "queued", "started" and "finished" (time.monotonic() seconds) and error None, or result
// None and error the exception. The callback and `buffer` (what keeps the bucket's memory alive)
// are released by the call, or wherever the engine drops it uncalled.
ExchangeEngine::Done Callback(py::function done, py::object buffer) {
  return [done = Held(std::move(done)),
          buffer = Held(std::move(buffer))](const ExchangeEngine::Completion& c) mutable {
    py::gil_scoped_acquire gil;
    try {
      py::object result = py::none(), error = py::none();
      if (c.error) {
        error = PyError(c.error);
      } else {
        result = ResultDict(*c.result);
        result["queued"] = SteadySeconds(c.queued);
        result["started"] = SteadySeconds(c.started);
        result["finished"] = SteadySeconds(c.finished);
      }
      (*done)(result, error);
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("geofp8 engine: a submitted bucket's callback");
    }
    done.reset();
    buffer.reset();
  };
}

// A torch tensor (anything with its data_ptr(), numel(), dtype, is_cuda and is_contiguous()) as
// one flat gradient span: float32, bfloat16 or float16, host or CUDA memory.
GradSpan SpanOf(const py::handle& t, const char* what, bool* cuda = nullptr) {
  GEOFP8_CHECK(t.attr("is_contiguous")().cast<bool>(), what, ": must be contiguous");
  std::string dtype = py::str(t.attr("dtype"));
  if (dtype.starts_with("torch.")) dtype.erase(0, 6);
  if (cuda) *cuda = t.attr("is_cuda").cast<bool>();
  return GradSpan(reinterpret_cast<void*>(t.attr("data_ptr")().cast<uintptr_t>()),
                  t.attr("numel")().cast<size_t>(), GradDtypeNamed(dtype));
}
// A bucket over tensor `t`; a CUDA one's exchange follows the work queued on `stream` by now.
FlatBucket BucketOf(Layers layers, const py::handle& t, Offsets offsets, uintptr_t stream) {
  FlatBucket b{std::move(layers), {}, std::move(offsets)};
  b.data = SpanOf(t, "gradient buffer", &b.on_device);
  b.stream = stream;
  return b;
}

// The methods of geofp8.Engine that convert more than their arguments; documented where BindEngine
// registers them.
Engine Connect(py::object store, int rank, int size, std::string hostname, double timeout_s,
               uint64_t seed, std::string backend, int device) {
  const std::chrono::duration<double> timeout(timeout_s);
  const HookSessionOptions o{rank,    size, std::move(backend), device, std::move(hostname),
                             timeout, seed};
  std::unique_ptr<Store> py_store = PyStore(std::move(store));
  return Released([&] { return Engine(new HookSession(std::move(py_store), o)); });
}

py::dict Exchange(HookSession& s, uint64_t step, Layers layers, py::object grads, Offsets offsets,
                  uintptr_t stream) {
  const FlatBucket b = BucketOf(std::move(layers), grads, std::move(offsets), stream);
  std::chrono::steady_clock::time_point started;
  py::dict d = ResultDict(Released([&] { return s.Exchange(step, b, &started); }));
  d["started"] = SteadySeconds(started);
  return d;
}
void Submit(HookSession& s, uint64_t step, Layers layers, py::object grads, Offsets offsets,
            py::function done, uintptr_t stream) {
  const FlatBucket b = BucketOf(std::move(layers), grads, std::move(offsets), stream);
  ExchangeEngine::Done callback = Callback(std::move(done), std::move(grads));
  Released([&] { s.Submit(step, b, std::move(callback)); });
}
py::dict ReduceScatter(HookSession& s, uint64_t step, Layers layers, py::object grads,
                       Offsets offsets, py::object out, const Offsets& out_offsets,
                       uintptr_t stream) {
  const FlatBucket b = BucketOf(std::move(layers), grads, std::move(offsets), stream);
  const GradSpan o = SpanOf(out, "reduce-scatter output");
  return ResultDict(Released([&] { return s.ReduceScatter(step, b, o, out_offsets); }));
}

// Puts a policy version in force; one summary dict per layer.
py::list Apply(HookSession& s, const ExchangePlan& plan, std::vector<RefreshSchedule> schedule,
               uint64_t version) {
  py::list out;
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    const LayerPolicy& lp = plan.layers[i];
    out.append(py::dict(
        "name"_a = s.params()[i].name, "algorithm"_a = AlgorithmNameOf(plan.algorithm),
        "format"_a = FormatNameOf(lp.format), "scaling"_a = ScalingNameOf(lp.scaling),
        "block"_a = lp.block, "rounding"_a = RoundingNameOf(lp.rounding),
        "geometry"_a = GeometryNameOf(lp.geometry), "rank"_a = lp.rank, "alpha"_a = lp.alpha,
        "refresh_interval"_a = schedule.empty() ? 0 : schedule[i].interval));
  }
  Released([&] { s.SetPolicy(EnginePolicyOf(plan, std::move(schedule), version)); });
  return out;
}
py::list SetPolicy(HookSession& s, const std::string& kind, const std::string& spec,
                   const std::string& model, uint64_t version) {
  ExchangePlan plan = MakeExchangePlanOf(kind, spec, s.params(), model);
  return Apply(s, plan, MakeRefreshSchedule(plan, s.size()), version);
}
py::list SetCoordinatorPolicy(HookSession& s, const py::bytes& policy,
                              const std::vector<py::bytes>& refresh, const std::string& spec) {
  const std::vector<std::string> r(refresh.begin(), refresh.end());
  VersionPlan v = PlanOfCoordinatorVersion(policy, r, spec, s.params());
  return Apply(s, v.plan, std::move(v.schedule), v.version);
}
void CheckPolicy(HookSession& s, const std::string& kind, const std::string& spec,
                 const std::string& model) {
  s.CheckPolicy(MakeExchangePlanOf(kind, spec, s.params(), model).layers);
}

// Every layer's geometry as (active, pending, pending_from, sketch) and its residuals as
// (geometry_version, local, owner), in bytes, for checkpoints; and back.
py::list ExportGeometry(HookSession& s) {
  py::list out;
  for (const LayerGeometryState& g : Released([&] { return s.engine().ExportGeometry(); })) {
    out.append(py::make_tuple(Bytes(g.active), Bytes(g.pending), g.pending_from, Bytes(g.sketch)));
  }
  return out;
}
py::list ExportResiduals(HookSession& s) {
  py::list out;
  for (const LayerResidual& r : Released([&] { return s.engine().ExportResiduals(); })) {
    out.append(py::make_tuple(r.geometry_version, Bytes(r.local), Bytes(r.owner)));
  }
  return out;
}
void ImportGeometry(HookSession& s, const py::list& state) {
  std::vector<LayerGeometryState> all;
  for (const py::handle& h : state) {
    auto t = h.cast<py::tuple>();
    GEOFP8_CHECK(t.size() == 4, "geometry: each entry is (active, pending, pending_from, sketch)");
    all.push_back({FromBytes<uint8_t>(t[0]), FromBytes<uint8_t>(t[1]), t[2].cast<uint64_t>(),
                   FromBytes<uint8_t>(t[3])});
  }
  Released([&] { s.engine().ImportGeometry(all); });
}
void ImportResiduals(HookSession& s, const py::list& state) {
  std::vector<LayerResidual> all;
  for (const py::handle& h : state) {
    auto t = h.cast<py::tuple>();
    GEOFP8_CHECK(t.size() == 3, "residuals: each entry is (geometry_version, local, owner)");
    all.push_back({t[0].cast<uint64_t>(), FromBytes<float>(t[1]), FromBytes<float>(t[2])});
  }
  Released([&] { s.engine().ImportResiduals(all); });
}

// The engine's own calls, on the session's engine.
uint64_t AgreeMin(HookSession& s, uint64_t value, uintptr_t) { return s.engine().AgreeMin(value); }
void Drain(HookSession& s, bool forget_errors) { s.engine().Drain(forget_errors); }
size_t InFlight(HookSession& s) { return s.engine().in_flight(); }
size_t ExchangerCount(HookSession& s) {
  return Released([&] { return s.engine().exchanger_count(); });
}
void StartTrace(HookSession& s) { s.engine().StartTrace(); }

}  // namespace

void BindEngine(py::module_& m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<HookSession, Engine>(m, "Engine")
      .def(py::init(&Connect), py::arg("store"), py::arg("rank"), py::arg("size"),
           py::arg("hostname") = "127.0.0.1", py::arg("timeout_s") = 300.0, py::arg("seed") = 0,
           py::arg("backend") = "gloo", py::arg("device") = -1,
           "Connects over Gloo (CPU tensors) or NCCL (CUDA tensors on `device`) through `store` "
           "(torch.distributed.Store's set/get/wait/add); blocks until all ranks join.")
      .def_property_readonly("rank", &HookSession::rank)
      .def_property_readonly("size", &HookSession::size)
      .def_property_readonly("backend", &HookSession::backend)
      .def("set_layers", &HookSession::SetLayers, nogil, py::arg("names"), py::arg("shapes"),
           "The model's parameters in order: names and shapes (rows, cols; 1-D: (1, n)).")
      .def("set_policy", &SetPolicy, py::arg("kind"), py::arg("spec"), py::arg("model") = "model",
           py::arg("version") = 0,
           "kind: 'preset', 'file' (a YAML path) or 'text' (YAML); one summary dict per layer.")
      .def("set_coordinator_policy", &SetCoordinatorPolicy, py::arg("policy"), py::arg("refresh"),
           py::arg("spec_yaml") = "",
           "set_policy of HookClient's change (policy, refresh) under the job's spec.")
      .def("check_policy", &CheckPolicy, py::arg("kind"), py::arg("spec"),
           py::arg("model") = "model", "set_policy's checks without applying it.")
      .def("agree_min", &AgreeMin, nogil, py::arg("value"), py::arg("stream") = 0,
           "The minimum of `value` over the ranks (one small collective); `stream` is unused.")
      .def("reduce_scatter", &ReduceScatter, py::arg("step"), py::arg("layers"), py::arg("grads"),
           py::arg("offsets"), py::arg("out"), py::arg("out_offsets"), py::arg("stream") = 0,
           "exchange() whose average's rows of this rank (FSDP's chunk) go to tensor out (float32 "
           "or grads' dtype); clobbers grads.")
      .def("exchange", &Exchange, py::arg("step"), py::arg("layers"), py::arg("grads"),
           py::arg("offsets"), py::arg("stream") = 0,
           "Averages layers[i] at grads[offsets[i]..] over the ranks in place: one contiguous "
           "float32, bfloat16 or float16 tensor, read and written back in its dtype; a CUDA one "
           "after the work queued on `stream` (torch's cuda_stream) by now.")
      .def("submit", &Submit, py::arg("step"), py::arg("layers"), py::arg("grads"),
           py::arg("offsets"), py::arg("done"), py::arg("stream") = 0,
           "exchange() on the engine's thread, in order; then done(result, error) with the GIL.")
      .def("drain", &Drain, nogil, py::arg("forget_errors") = true,
           "Waits for every submitted bucket's callback; forget_errors: not raised again.")
      .def("abort", &HookSession::Abort, nogil, py::arg("reason"),
           "From any thread: this exchange and every later one raise `reason`; False: cannot.")
      .def_property_readonly("in_flight", &InFlight,
                             "Buckets submitted whose callback has not yet returned.")
      .def("export_geometry", &ExportGeometry,
           "Every layer's geometry state: (active, pending, pending_from, sketch).")
      .def("import_geometry", &ImportGeometry, py::arg("state"),
           "Restores export_geometry's list (resume), checked strictly against the policy.")
      .def("export_residuals", &ExportResiduals,
           "Every layer's (geometry_version, local, owner), float32 residuals as bytes.")
      .def("import_residuals", &ImportResiduals, py::arg("state"),
           "Restores export_residuals' list (resume), after import_geometry.")
      .def_property_readonly("exchanger_count", &ExchangerCount)
      .def("start_trace", &StartTrace, nogil, "Records every exchange's spans from now on.")
      .def("write_trace", &HookSession::WriteTrace, nogil, py::arg("path"),
           "Writes the spans recorded as Chrome trace JSON; returns their count.");
}

}  // namespace geofp8::python
