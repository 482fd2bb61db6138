// The checksum of a job run without any fault: a fresh coordinator and two workers on
// 127.0.0.1 without a step delay (a job's checksum depends on its spec, not on timing or on the
// job's name), for fault tests to compare against.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "tests/worker/worker_process.h"

namespace geofp8::testing {

// The fault tests' job: llama-tiny on 2 ranks, batch 2 x 16 tokens, checkpoints every
// `checkpoint_every` steps. `extra`: more spec lines (each ending in a newline).
inline std::string TinyJobSpec(const std::string& name, int steps, int seed, int checkpoint_every,
                               int max_restarts, const std::string& extra = "") {
  return "name: " + name + "\nworld_size: 2\nmodel: {preset: llama-tiny}\ntraining: {steps: " +
         std::to_string(steps) + ", batch_size: 2, seq_len: 16, seed: " + std::to_string(seed) +
         "}\n" + extra + "checkpoint: {dir: ckpt, every: " + std::to_string(checkpoint_every) +
         "}\nrestarts: {max_restarts: " + std::to_string(max_restarts) + "}\n";
}

// Milliseconds since the Unix epoch, the clock of the coordinator's job events.
inline int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

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
