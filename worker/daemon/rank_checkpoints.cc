#include "worker/daemon/rank_checkpoints.h"

#include <algorithm>
#include <filesystem>

namespace geofp8::worker {

std::string CheckpointFile(const std::string& dir, const std::string& worker_name, int64_t step) {
  return (std::filesystem::path(dir) / (worker_name + "." + std::to_string(step) + ".ckpt"))
      .string();
}

namespace {

// The step of a file named <worker_name>.<step>.ckpt; -1 for any other name.
int64_t CheckpointStepOf(const std::string& file, const std::string& worker_name) {
  const std::string prefix = worker_name + ".", suffix = ".ckpt";
  if (file.size() <= prefix.size() + suffix.size() || file.compare(0, prefix.size(), prefix) != 0 ||
      file.compare(file.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return -1;
  }
  const std::string digits =
      file.substr(prefix.size(), file.size() - prefix.size() - suffix.size());
  if (digits.empty() || digits.size() > 18 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    return -1;
  }
  return std::stoll(digits);
}

}  // namespace

int PruneCheckpoints(const std::string& dir, const std::string& worker_name,
                     const std::function<bool(int64_t step)>& remove) {
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const int64_t step = CheckpointStepOf(entry.path().filename().string(), worker_name);
    if (step >= 0 && remove(step) && std::filesystem::remove(entry.path(), ec)) ++removed;
  }
  return removed;
}

std::vector<int64_t> ListCheckpoints(const std::string& dir, const std::string& worker_name) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const int64_t step = CheckpointStepOf(entry.path().filename().string(), worker_name);
    if (step >= 0) steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

RankCheckpoints::RankCheckpoints(std::string worker_name, int keep_unacknowledged)
    : worker_name_(std::move(worker_name)), keep_unacknowledged_(keep_unacknowledged) {}

void RankCheckpoints::SetDir(const std::string& dir) {
  std::lock_guard<std::mutex> lock(mu_);
  dir_ = dir;
}

std::string RankCheckpoints::dir() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dir_;
}

std::string RankCheckpoints::Path(int64_t step) const {
  return CheckpointFile(dir(), worker_name_, step);
}

void RankCheckpoints::OnAcknowledged(int64_t recovery_step) {
  std::string dir;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (recovery_step <= acknowledged_) return;
    acknowledged_ = recovery_step;
    dir = dir_;
  }
  if (!dir.empty()) {
    PruneCheckpoints(dir, worker_name_, [&](int64_t s) { return s < recovery_step; });
  }
}

std::vector<int64_t> RankCheckpoints::Held() const {
  const std::string d = dir();
  return d.empty() ? std::vector<int64_t>{} : ListCheckpoints(d, worker_name_);
}

void RankCheckpoints::PruneAfter(int64_t resume_step) {
  const std::string d = dir();
  if (!d.empty()) PruneCheckpoints(d, worker_name_, [&](int64_t s) { return s > resume_step; });
}

void RankCheckpoints::BoundUnacknowledged(int64_t resume_step, bool stopping) {
  if (stopping) return;
  int64_t floor = 0;
  std::string d;
  {
    std::lock_guard<std::mutex> lock(mu_);
    floor = std::max(acknowledged_, resume_step);
    d = dir_;
  }
  std::vector<int64_t> steps = ListCheckpoints(d, worker_name_);
  std::erase_if(steps, [&](int64_t s) { return s <= floor; });
  const size_t keep = size_t(std::max(2, keep_unacknowledged_));
  if (steps.size() <= keep + 1) return;
  const int64_t first_after = steps.front(), keep_from = steps[steps.size() - keep];
  PruneCheckpoints(d, worker_name_, [&](int64_t s) { return s > first_after && s < keep_from; });
}

}  // namespace geofp8::worker
