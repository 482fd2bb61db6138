// geofp8._geofp8.Engine (engine_binding.cc): the kernels' ExchangeEngine for Python, and the
// module's error type, which the engine's callbacks raise into Python.
#pragma once

#include <pybind11/pybind11.h>

#include "kernels/common/check.h"

namespace geofp8::python {

// geofp8._geofp8.Error, set when the module is imported (geofp8_module.cc).
extern pybind11::handle g_error_type;

// A geofp8.Error for e: its message, and the source location that raised it as `where` (for
// debugging; the message carries none).
pybind11::object ErrorObject(const geofp8::Error& e);

// Registers Engine in `m`.
void BindEngine(pybind11::module_& m);

}  // namespace geofp8::python
