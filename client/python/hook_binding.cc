// geofp8._geofp8.HookClient: the Python binding of worker/hook/hook_client.h (a `command:` job's
// channel to the coordinator through its worker). geofp8.torch drives it; see docs/pytorch.md.
// Every blocking call releases the GIL; the client's own threads never take it (HookClient calls
// back into nothing), so the binding adds no lock order.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "client/python/bindings.h"
#include "kernels/common/check.h"
#include "platform/policy/policy.h"
#include "worker/hook/hook_client.h"

namespace py = pybind11;

namespace geofp8::python {
namespace {

using std::chrono::milliseconds;

milliseconds Millis(double seconds) {
  GEOFP8_CHECK(seconds >= 0, "timeout_s: must be >= 0 (", seconds, ")");
  return milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

py::bytes Serialized(const google::protobuf::Message& m) {
  return py::bytes(m.SerializeAsString());
}

// The Python object: the client, closed explicitly by close() or when collected.
class PyHookClient {
 public:
  explicit PyHookClient(std::unique_ptr<hook::HookClient> c) : c_(std::move(c)) {}
  ~PyHookClient() { Close(); }

  hook::HookClient& c() {
    GEOFP8_CHECK(c_ != nullptr, "hook client: closed");
    return *c_;
  }
  // Half-closes the channel (the worker reads what was written) and joins the client's thread.
  void Close() {
    std::unique_ptr<hook::HookClient> c = std::move(c_);
    if (!c) return;
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      c.reset();
    } else {
      c.reset();
    }
  }
  bool closed() const { return c_ == nullptr; }

 private:
  std::unique_ptr<hook::HookClient> c_;
};

py::object ChangeDict(const std::optional<hook::PolicyChange>& change) {
  if (!change) return py::none();
  py::dict d;
  d["version"] = change->version;
  d["effective_step"] = change->effective_step;
  d["reason"] = change->reason;
  d["taken_step"] = change->policy.has_taken_step()
                        ? py::object(py::int_(change->policy.taken_step()))
                        : py::object(py::none());
  d["policy"] = Serialized(change->policy);
  py::list refresh;
  for (const auto& s : change->refresh) refresh.append(Serialized(s));
  d["refresh"] = refresh;
  py::list layers;
  for (const auto& l : change->layers) {
    py::dict ld;
    ld["layer"] = l.layer;
    ld["format"] = NameOf(l.policy.format());
    ld["geometry"] = NameOf(l.policy.geometry());
    ld["rank"] = l.policy.rank();
    ld["refresh_interval"] = l.refresh_interval;
    layers.append(ld);
  }
  d["layers"] = layers;
  return d;
}

}  // namespace

void BindHookClient(py::module_& m) {
  py::class_<PyHookClient>(m, "HookClient",
                           "A command job's channel to the coordinator through its worker "
                           "(worker/hook/hook_client.h). geofp8.torch.GeoFP8State drives it.")
      .def_static(
          "from_environment",
          []() -> std::unique_ptr<PyHookClient> {
            auto c = hook::HookClient::FromEnvironment();
            if (!c) return nullptr;
            return std::make_unique<PyHookClient>(std::move(c));
          },
          "None when GEOFP8_HOOK_ADDRESS is unset (not under a GeoFP8 command job); never "
          "blocks.")
      .def_static(
          "connect",
          [](const std::string& address) {
            return std::make_unique<PyHookClient>(hook::HookClient::Connect(address));
          },
          py::arg("address"))
      .def_property_readonly("job_id", [](PyHookClient& h) { return h.c().job_id(); })
      .def_property_readonly("attempt", [](PyHookClient& h) { return h.c().attempt(); })
      .def_property_readonly("rank", [](PyHookClient& h) { return h.c().rank(); })
      .def_property_readonly("world_size", [](PyHookClient& h) { return h.c().world_size(); })
      .def_property_readonly("resume_step", [](PyHookClient& h) { return h.c().resume_step(); })
      .def_property_readonly("checkpoint_dir",
                             [](PyHookClient& h) { return h.c().checkpoint_dir(); })
      .def_property_readonly("connected", [](PyHookClient& h) { return h.c().connected(); })
      .def_property_readonly("version_in_force",
                             [](PyHookClient& h) { return h.c().version_in_force(); })
      .def_property_readonly("closed", &PyHookClient::closed)
      .def(
          "wait_for_welcome",
          [](PyHookClient& h, double timeout_s) -> py::object {
            std::optional<v1::HookWelcome> w;
            {
              py::gil_scoped_release release;
              w = h.c().WaitForWelcome(Millis(timeout_s));
            }
            if (!w) return py::none();
            py::dict d;
            d["job_id"] = w->job_id();
            d["attempt"] = w->attempt();
            d["rank"] = w->rank();
            d["world_size"] = w->world_size();
            d["resume_step"] = w->resume_step();
            return d;
          },
          py::arg("timeout_s"),
          "The job as the worker was assigned it (dict), or None after timeout_s.")
      .def(
          "wait_for_policy",
          [](PyHookClient& h, double timeout_s) {
            py::gil_scoped_release release;
            return h.c().WaitForPolicy(Millis(timeout_s));
          },
          py::arg("timeout_s"))
      .def(
          "wait_for_refresh",
          [](PyHookClient& h, double timeout_s) -> py::object {
            std::optional<std::vector<v1::RefreshSchedule>> r;
            {
              py::gil_scoped_release release;
              r = h.c().WaitForRefresh(Millis(timeout_s));
            }
            if (!r) return py::none();
            py::list out;
            for (const auto& s : *r) out.append(Serialized(s));
            return out;
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
      .def(
          "report_step",
          [](PyHookClient& h, int64_t step, double loss, double tps, uint64_t sent,
             uint64_t baseline, double step_s, double exchange_s, std::optional<double> val) {
            h.c().ReportStep(step, loss, tps, sent, baseline, step_s, exchange_s, val);
          },
          py::arg("step"), py::arg("loss"), py::arg("tokens_per_second") = 0.0,
          py::arg("bytes_sent") = 0, py::arg("bytes_baseline") = 0, py::arg("step_seconds") = 0.0,
          py::arg("exchange_seconds") = 0.0, py::arg("val_loss") = py::none())
      .def(
          "report_layers",
          [](PyHookClient& h,
             const std::vector<std::tuple<std::string, int64_t, double, double>>& l) {
            std::vector<hook::LayerReport> reports;
            for (const auto& [layer, step, rel, residual] : l) {
              hook::LayerReport r;
              r.layer = layer;
              r.step = step;
              r.rel_fro_error = rel;
              r.residual_error = residual;
              reports.push_back(r);
            }
            h.c().ReportLayers(reports);
          },
          py::arg("layers"), "[(layer, step, rel_fro_error, residual_error)]")
      .def(
          "report_checkpoint",
          [](PyHookClient& h, int64_t step, const std::string& path) {
            h.c().ReportCheckpoint(step, path);
          },
          py::arg("step"), py::arg("path"))
      .def("newest_held", [](PyHookClient& h) { return h.c().NewestHeld(); })
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
      .def_property_readonly("attach_mode", [](PyHookClient& h) { return h.c().attach_mode(); })
      .def_property_readonly("refused", [](PyHookClient& h) { return h.c().refused(); })
      .def(
          "finish",
          [](PyHookClient& h, bool success, const std::string& reason) {
            h.c().Finish(success, reason);
          },
          py::arg("success"), py::arg("reason") = "",
          "Attach mode: the rank is done (success) or failed (reason); sent before close.")
      .def("close", &PyHookClient::Close);
}

}  // namespace geofp8::python
