// Lowering one thread's scheduling priority (Linux niceness is per thread).
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace geofp8 {

// Adds `nice` to the calling thread's niceness (capped at 19); threads it creates afterwards
// inherit the result. Raising niceness needs no privilege; a failure only leaves the priority as
// it was, so it is ignored.
inline void LowerThreadPriority(int nice) {
  if (nice <= 0) return;
  const pid_t tid = gettid();
  errno = 0;
  const int current = getpriority(PRIO_PROCESS, tid);
  if (errno != 0) return;
  setpriority(PRIO_PROCESS, tid, std::min(current + nice, 19));
}

}  // namespace geofp8
