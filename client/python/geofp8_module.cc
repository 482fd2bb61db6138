// geofp8._geofp8: GeoFP8 for Python. The exchange engine (engine_binding.cc, over the kernels'
// HookSession), a command job's channel to the coordinator (hook_binding.cc), and a few
// module functions. geofp8.torch (geofp8/torch.py) drives them as a DDP comm hook.

#include <pybind11/pybind11.h>

#include <string>

#include "client/python/bindings.h"
#include "kernels/common/check.h"
#include "kernels/exchange/hook_session.h"
#include "kernels/model/ops.h"
#include "platform/policy/job_spec.h"

namespace py = pybind11;

PYBIND11_MODULE(_geofp8, m) {
  m.doc() = "GeoFP8's exchange engine (kernels/exchange) for Python; see geofp8.torch.";
  // geofp8.Error: the message for the user; the C++ source location that raised it, for
  // debugging, in its `where` attribute ("exchange_policy.cc:103"), never in the message. Every
  // geofp8::Error becomes one, a submitted bucket's too (engine_binding.cc, PyError).
  static py::exception<geofp8::Error> error(m, "Error", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const geofp8::Error& e) {
      py::object instance = py::handle(error)(e.what());
      instance.attr("where") = e.where();
      PyErr_SetObject(error.ptr(), instance.ptr());
    }
  });

  geofp8::python::BindEngine(m);
  geofp8::python::BindHookClient(m);
  m.def("layer_matches", &geofp8::LayerMatches, py::arg("pattern"), py::arg("name"),
        "True when `name` matches the layer pattern (exact, or a shell glob), as in job specs.");
  m.attr("has_cuda") = py::bool_(geofp8::HookSession::kHasDevicePlane);
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
