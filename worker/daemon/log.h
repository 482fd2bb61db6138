// One-line timestamped log messages of the worker daemon on stderr ("geofp8-worker[name]: ...").
#pragma once

#include <string>

namespace geofp8::worker {

// Prefix shown after "geofp8-worker" (the worker name), set once at start-up.
void SetLogName(const std::string& name);
void Log(const std::string& message);

}  // namespace geofp8::worker
