// The worker daemon's free-form notes: lines that are no lifecycle event of their own, written in
// the shared structured format (platform/common/log.h) as `event=worker.note msg=...`.
#pragma once

#include <string>

#include "platform/common/log.h"

namespace geofp8::worker {

inline void Log(const std::string& message) { log::Info("worker.note").Msg(message); }

}  // namespace geofp8::worker
