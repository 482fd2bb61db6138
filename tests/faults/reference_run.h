// The checksum of a job run without any fault: a fresh coordinator and two workers on
// 127.0.0.1 without a step delay (a job's checksum depends on its spec, not on timing or on the
// job's name), for fault tests to compare against.
#pragma once

#include <string>

#include "tests/worker/worker_process.h"

namespace geofp8::testing {

// The final checksum of rank 0, or a message starting with "error:".
inline std::string FaultFreeChecksum(const std::string& spec_yaml) {
  CoordinatorProcess coordinator;
  Client client(coordinator.address());
  WorkerProcess w0(coordinator.address(), "ref0"), w1(coordinator.address(), "ref1");
  if (!client.WaitIdle(2, std::chrono::seconds(30))) return "error: reference workers never idle";
  const v1::Job done = client.WaitFinal(client.Submit(spec_yaml).id(), std::chrono::seconds(90));
  if (done.state() != v1::JOB_SUCCEEDED) return "error: reference run: " + done.reason();
  return w0.Result(done.id())["checksum"];
}

}  // namespace geofp8::testing
