#include "worker/daemon/policy_inbox.h"

#include <algorithm>
#include <vector>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "platform/policy/policy.h"
#include "worker/daemon/log.h"

namespace geofp8::worker {

PolicyInbox::PolicyInbox(const v1::Assignment& assignment) {
  for (const auto& s : assignment.policy().refresh()) initial_schedule_.push_back(s);
}

void PolicyInbox::LoadVersions(const v1::Assignment& a, Connection& connection) {
  // The assignment carries the version in force at the resume step and every later one.
  if (a.policy_history_size() > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& p : a.policy_history()) queued_.emplace(p.version(), p);
    queued_.emplace(a.policy().version(), a.policy());
    return;
  }
  // An assignment without history (an older coordinator): ask for the versions, page by page.
  auto stub = v1::PolicyService::NewStub(connection.channel());
  v1::ListPolicyVersionsRequest req;
  req.set_job_id(a.job_id());
  std::vector<v1::Policy> listed;
  grpc::Status s;
  do {
    v1::ListPolicyVersionsResponse resp;
    s = stub->ListPolicyVersions(connection.Context(std::chrono::milliseconds(10000)).get(), req,
                                 &resp);
    if (!s.ok()) break;
    listed.insert(listed.end(), resp.policies().begin(), resp.policies().end());
    req.set_page_token(resp.next_page_token());
  } while (!req.page_token().empty());
  std::lock_guard<std::mutex> lock(mu_);
  if (s.ok()) {
    for (const auto& p : listed) queued_.emplace(p.version(), p);
  } else {
    Log("job " + a.job_id() + ": listing policy versions failed (" + DescribeStatus(s) +
        "); using the assignment's policy v" + std::to_string(a.policy().version()));
  }
  queued_.emplace(a.policy().version(), a.policy());
}

void PolicyInbox::Offer(const v1::Policy& policy) {
  std::lock_guard<std::mutex> lock(mu_);
  if (policy.version() <= in_force_ || queued_.count(policy.version())) return;
  // Arriving after its effective step is no error: the step is a lower bound, and the ranks put
  // the version in force once every one of them holds it (RankAttempt::Control).
  queued_.emplace(policy.version(), policy);
}

void PolicyInbox::OfferRefresh(const v1::RefreshSchedules& refresh) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The catalog's schedule is taken once, before the first step: it has no effective step,
    // so a later one could not be applied at the same step on every rank. Policy versions carry
    // their own schedules after that.
    if (!initial_schedule_.empty()) return;
    initial_schedule_.assign(refresh.schedules().begin(), refresh.schedules().end());
  }
  cv_.notify_all();
}

void PolicyInbox::Interrupt() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    interrupted_ = true;
  }
  cv_.notify_all();
}

std::optional<v1::Policy> PolicyInbox::TakeDue(int64_t step, uint64_t agreed) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::optional<v1::Policy> due = DueVersion(queued_, in_force_, step, agreed);
  const uint64_t drop = due ? due->version() : in_force_;
  queued_.erase(queued_.begin(), queued_.upper_bound(drop));
  return due;
}

std::optional<v1::Policy> PolicyInbox::TakeStart(int64_t start, uint64_t written_under) {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<v1::Policy> first = StartVersion(queued_, start);
  if (auto it = queued_.find(written_under); first && written_under > first->version() &&
                                             it != queued_.end() && !it->second.has_taken_step()) {
    first = it->second;
  }
  if (first) queued_.erase(queued_.begin(), queued_.upper_bound(first->version()));
  return first;
}

uint64_t PolicyInbox::NewestHeld() const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::max(in_force_, queued_.empty() ? 0 : queued_.rbegin()->first);
}

void PolicyInbox::SetInForce(uint64_t version, int64_t taken) {
  std::lock_guard<std::mutex> lock(mu_);
  in_force_ = version;
  taken_.emplace_back(version, taken);
}

std::vector<std::pair<uint64_t, int64_t>> PolicyInbox::Taken() const {
  std::lock_guard<std::mutex> lock(mu_);
  return taken_;
}

uint64_t PolicyInbox::in_force() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_force_;
}

std::vector<v1::RefreshSchedule> PolicyInbox::InitialSchedule() const {
  std::lock_guard<std::mutex> lock(mu_);
  return initial_schedule_;
}

void PolicyInbox::WaitForInitialSchedule(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !initial_schedule_.empty() || interrupted_; });
}

}  // namespace geofp8::worker
