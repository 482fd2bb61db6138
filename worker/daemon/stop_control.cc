#include "worker/daemon/stop_control.h"

#include "worker/daemon/log.h"

namespace geofp8::worker {

void StopControl::Request(const std::string& reason, v1::StopCause cause) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.Record(reason, cause);
  }
  cv_.notify_all();
}

v1::StopCause StopControl::cause() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stop_.cause;
}

std::string StopControl::reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stop_.reason;
}

bool StopControl::requested() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !stop_.reason.empty();
}

bool StopControl::WaitFor(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return !stop_.reason.empty(); });
}

void StopControl::SetCommunicator(Communicator* comm) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    comm_ = comm;
  }
  cv_.notify_all();
}

void StopControl::MarkDone() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
}

bool StopControl::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void StopControl::Watchdog(std::chrono::milliseconds abort_after, const std::string& job_id,
                           int rank) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_ || !stop_.reason.empty(); });
  if (cv_.wait_for(lock, abort_after, [&] { return done_; })) return;
  // A stop during the rendezvous aborts the communicator as soon as it exists.
  cv_.wait(lock, [&] { return done_ || comm_ != nullptr; });
  if (done_) return;
  Log("job " + job_id + " rank " + std::to_string(rank) + ": not at a step boundary " +
      std::to_string(abort_after.count()) + " ms after the stop; aborting its collectives");
  if (!comm_->Abort("stop: " + stop_.reason)) {
    Log("job " + job_id + ": backend " + std::string(comm_->backend()) +
        " cannot abort; the collective ends at exchange.timeout_s");
  }
}

}  // namespace geofp8::worker
