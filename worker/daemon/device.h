// The worker's compute device (--device): cpu, or one CUDA GPU that `command:` jobs get. The
// GPUs are counted from the NVIDIA driver's /proc listing, so the CPU build links no CUDA.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace geofp8::worker {

struct WorkerDevice {
  std::string name = "cpu";  // "cpu" or "cuda:N": what the worker reports at registration
  int cuda_index = -1;       // N (a physical GPU index); -1: cpu
  bool is_cuda() const { return cuda_index >= 0; }
};

// Where the NVIDIA driver lists one entry per GPU.
inline constexpr const char* kNvidiaGpusDir = "/proc/driver/nvidia/gpus";

// The number of entries in `dir` (0 when it does not exist: no NVIDIA driver).
int CountNvidiaGpus(const std::string& dir);

// Parses --device: "cpu", "cuda" (GPU 0) or "cuda:N", N < gpu_count. An error is one line
// naming the value and, for a GPU that is not there, both numbers and `where` they were counted.
absl::StatusOr<WorkerDevice> ParseWorkerDevice(const std::string& text, int gpu_count,
                                               const std::string& where);

}  // namespace geofp8::worker
