// geofp8._geofp8.HookClient: the Python binding of worker/hook/hook_client.h (a `command:` job's
// channel to the coordinator through its worker). geofp8.torch drives it; see docs/pytorch.md.
// Every blocking call releases the GIL; the client's own threads never take it (HookClient calls
// back into nothing), so the binding adds no lock order.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "client/python/bindings.h"
#include "kernels/common/check.h"
#include "platform/policy/policy.h"
#include "worker/hook/hook_client.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace geofp8::python {
namespace {

using hook::HookClient;

std::chrono::milliseconds Millis(double seconds) {
  GEOFP8_CHECK(seconds >= 0, "timeout_s: must be >= 0 (", seconds, ")");
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// The Python object: the client, closed explicitly by close() or when collected.
class PyHookClient {
 public:
  explicit PyHookClient(std::unique_ptr<HookClient> c) : c_(std::move(c)) {}
  ~PyHookClient() { Close(); }

  HookClient& c() {
    GEOFP8_CHECK(c_ != nullptr, "hook client: closed");
    return *c_;
  }
  // Half-closes the channel (the worker reads what was written) and joins the client's thread.
  void Close() {
    std::unique_ptr<HookClient> c = std::move(c_);
    if (c && PyGILState_Check()) {
      py::gil_scoped_release release;
      c.reset();
    }
  }
  bool closed() const { return c_ == nullptr; }

 private:
  std::unique_ptr<HookClient> c_;
};

// A HookClient method as one of the Python object's (an error once it is closed).
template <typename R, typename... A>
auto On(R (HookClient::*method)(A...)) {
  return [method](PyHookClient& h, A... a) { return (h.c().*method)(std::forward<A>(a)...); };
}
template <typename R, typename... A>
auto On(R (HookClient::*method)(A...) const) {
  return [method](PyHookClient& h, A... a) { return (h.c().*method)(std::forward<A>(a)...); };
}

py::bytes Serialized(const google::protobuf::Message& m) {
  return py::bytes(m.SerializeAsString());
}
template <typename M>
py::list SerializedAll(const std::vector<M>& all) {
  py::list out;
  for (const M& m : all) out.append(Serialized(m));
  return out;
}

py::object ChangeDict(const std::optional<hook::PolicyChange>& change) {
  if (!change) return py::none();
  py::list layers;
  for (const hook::ResolvedLayerPolicy& l : change->layers) {
    layers.append(py::dict("layer"_a = l.layer, "format"_a = NameOf(l.policy.format()),
                           "geometry"_a = NameOf(l.policy.geometry()), "rank"_a = l.policy.rank(),
                           "refresh_interval"_a = l.refresh_interval));
  }
  const v1::Policy& p = change->policy;
  return py::dict("version"_a = change->version, "effective_step"_a = change->effective_step,
                  "reason"_a = change->reason,
                  "taken_step"_a = p.has_taken_step() ? py::cast(p.taken_step()) : py::none(),
                  "policy"_a = Serialized(p), "refresh"_a = SerializedAll(change->refresh),
                  "layers"_a = layers);
}

}  // namespace

void BindHookClient(py::module_& m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<PyHookClient>(m, "HookClient",
                           "A command job's channel to the coordinator through its worker "
                           "(worker/hook/hook_client.h). geofp8.torch.GeoFP8State drives it.")
      .def_static(
          "from_environment",
          []() -> std::unique_ptr<PyHookClient> {
            auto c = HookClient::FromEnvironment();
            return c ? std::make_unique<PyHookClient>(std::move(c)) : nullptr;
          },
          "None when GEOFP8_HOOK_ADDRESS is unset (not under a GeoFP8 command job); never "
          "blocks.")
      .def_static(
          "connect",
          [](const std::string& address) {
            return std::make_unique<PyHookClient>(HookClient::Connect(address));
          },
          py::arg("address"))
      .def_property_readonly("job_id", On(&HookClient::job_id))
      .def_property_readonly("attempt", On(&HookClient::attempt))
      .def_property_readonly("rank", On(&HookClient::rank))
      .def_property_readonly("world_size", On(&HookClient::world_size))
      .def_property_readonly("resume_step", On(&HookClient::resume_step))
      .def_property_readonly("checkpoint_dir", On(&HookClient::checkpoint_dir))
      .def_property_readonly("connected", On(&HookClient::connected))
      .def_property_readonly("version_in_force", On(&HookClient::version_in_force))
      .def_property_readonly("closed", &PyHookClient::closed)
      .def(
          "wait_for_welcome",
          [](PyHookClient& h, double timeout_s) -> py::object {
            const auto w = Released([&] { return h.c().WaitForWelcome(Millis(timeout_s)); });
            if (!w) return py::none();
            return py::dict("job_id"_a = w->job_id(), "attempt"_a = w->attempt(),
                            "rank"_a = w->rank(), "world_size"_a = w->world_size(),
                            "resume_step"_a = w->resume_step());
          },
          py::arg("timeout_s"),
          "The job as the worker was assigned it (dict), or None after timeout_s.")
      .def(
          "wait_for_policy",
          [](PyHookClient& h, double timeout_s) { return h.c().WaitForPolicy(Millis(timeout_s)); },
          nogil, py::arg("timeout_s"))
      .def(
          "wait_for_refresh",
          [](PyHookClient& h, double timeout_s) -> py::object {
            const auto r = Released([&] { return h.c().WaitForRefresh(Millis(timeout_s)); });
            return r ? py::object(SerializedAll(*r)) : py::none();
          },
          py::arg("timeout_s"))
      .def(
          "send_catalog",
          [](PyHookClient& h, const std::vector<std::tuple<std::string, int64_t, int64_t>>& l,
             const std::string& model_name) {
            std::vector<hook::LayerInfo> layers;
            for (const auto& [name, rows, cols] : l) layers.push_back({name, rows, cols});
            h.c().SendCatalog(layers, model_name);
          },
          py::arg("layers"), py::arg("model_name") = "",
          "[(name, rows, cols)]; cols 1 for a 1-D tensor. model_name: what the coordinator's "
          "messages call the model.")
      .def("report_step",
           On(py::overload_cast<int64_t, double, double, uint64_t, uint64_t, double, double,
                                std::optional<double>>(&HookClient::ReportStep)),
           py::arg("step"), py::arg("loss"), py::arg("tokens_per_second") = 0.0,
           py::arg("bytes_sent") = 0, py::arg("bytes_baseline") = 0, py::arg("step_seconds") = 0.0,
           py::arg("exchange_seconds") = 0.0, py::arg("val_loss") = py::none())
      .def(
          "report_layers",
          [](PyHookClient& h,
             const std::vector<std::tuple<std::string, int64_t, double, double>>& l) {
            std::vector<hook::LayerReport> reports;
            for (const auto& [layer, step, rel, residual] : l) {
              reports.push_back(
                  {.layer = layer, .step = step, .rel_fro_error = rel, .residual_error = residual});
            }
            h.c().ReportLayers(reports);
          },
          py::arg("layers"), "[(layer, step, rel_fro_error, residual_error)]")
      .def("report_checkpoint", On(&HookClient::ReportCheckpoint), py::arg("step"), py::arg("path"))
      .def("newest_held", On(&HookClient::NewestHeld))
      .def(
          "policy_due_at",
          [](PyHookClient& h, int64_t step) { return ChangeDict(h.c().PolicyDueAt(step)); },
          py::arg("step"))
      .def(
          "policy_agreed_at",
          [](PyHookClient& h, int64_t step, uint64_t agreed) {
            return ChangeDict(h.c().PolicyAgreedAt(step, agreed));
          },
          py::arg("step"), py::arg("agreed"),
          "The version to put in force from `step` given `agreed`, the minimum of newest_held() "
          "over the ranks (hook_client.h); a dict or None. Acknowledged with the step taken.")
      .def_property_readonly("attach_mode", On(&HookClient::attach_mode))
      .def_property_readonly("refused", On(&HookClient::refused))
      .def("finish", On(&HookClient::Finish), py::arg("success"), py::arg("reason") = "",
           "Attach mode: the rank is done (success) or failed (reason); sent before close.")
      .def("close", &PyHookClient::Close);
}

}  // namespace geofp8::python
