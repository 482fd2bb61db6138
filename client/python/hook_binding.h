// geofp8._geofp8.HookClient: the Python binding of worker/hook/hook_client.h (a `command:` job's
// channel to the coordinator through its worker). geofp8.torch drives it; see docs/pytorch.md.
#pragma once

#include <pybind11/pybind11.h>

namespace geofp8::python {

// Registers HookClient in `m`.
void BindHookClient(pybind11::module_& m);

}  // namespace geofp8::python
