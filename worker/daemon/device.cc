// --device parsing and the driver's GPU count (device.h).
#include "worker/daemon/device.h"

#include <charconv>
#include <filesystem>
#include <system_error>

#include "absl/status/status.h"

namespace geofp8::worker {

int CountNvidiaGpus(const std::string& dir) {
  std::error_code ec;
  int n = 0;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    ++n;
  }
  return ec ? 0 : n;
}

absl::StatusOr<WorkerDevice> ParseWorkerDevice(const std::string& text, int gpu_count,
                                               const std::string& where) {
  WorkerDevice d;
  if (text == "cpu") return d;
  int index = 0;
  if (text != "cuda") {
    const std::string prefix = "cuda:";
    const std::string digits =
        text.compare(0, prefix.size(), prefix) == 0 ? text.substr(prefix.size()) : "";
    const char* last = digits.data() + digits.size();
    auto [end, err] = std::from_chars(digits.data(), last, index);
    if (digits.empty() || digits.size() > 4 || err != std::errc() || end != last || index < 0) {
      return absl::InvalidArgumentError("unknown value (" + text +
                                        "); accepted: cpu, cuda, cuda:N (N a GPU index)");
    }
  }
  if (gpu_count <= 0) {
    return absl::InvalidArgumentError(text + ": this machine has no GPU (none listed in " + where +
                                      ")");
  }
  if (index >= gpu_count) {
    return absl::InvalidArgumentError(text + " names GPU " + std::to_string(index) +
                                      ", but this machine has " + std::to_string(gpu_count) +
                                      " GPU" + (gpu_count == 1 ? "" : "s") + " (0-" +
                                      std::to_string(gpu_count - 1) + ", listed in " + where + ")");
  }
  d.cuda_index = index;
  d.name = "cuda:" + std::to_string(index);
  return d;
}

}  // namespace geofp8::worker
