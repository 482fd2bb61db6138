// The classes of geofp8._geofp8, which geofp8_module.cc registers with the module's functions:
// the exchange engine (engine_binding.cc) and a command job's hook channel (hook_binding.cc).
#pragma once

#include <pybind11/pybind11.h>

namespace geofp8::python {

void BindEngine(pybind11::module_& m);      // Engine
void BindHookClient(pybind11::module_& m);  // HookClient

// f() with the GIL released.
template <typename F>
auto Released(F&& f) {
  pybind11::gil_scoped_release release;
  return f();
}

}  // namespace geofp8::python
