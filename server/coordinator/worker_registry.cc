// Worker registration, sessions, liveness and fencing (see worker_registry.h for the locking).
#include "server/coordinator/worker_registry.h"

#include <algorithm>
#include <climits>
#include <cstdio>

#include "platform/common/log.h"
#include "server/coordinator/secrets.h"

namespace geofp8::coordinator {

WorkerRegistry::WorkerRegistry(Store* store, Clock* clock, LivenessOptions options,
                               RankLost rank_lost)
    : store_(store),
      clock_(clock),
      heartbeat_interval_ms_(options.heartbeat_interval_ms),
      heartbeat_timeout_ms_(options.heartbeat_timeout_ms),
      options_(options),
      rank_lost_(std::move(rank_lost)) {}

absl::Status WorkerRegistry::CheckName(const v1::RegisterRequest& request) const {
  // A name held by a live session belongs to a running process: a second process under the
  // same name would fence it, be fenced in turn when it re-registers, and so on for ever. A
  // restarted process gets the name once the old session ends (its stream breaks when the
  // process dies) or is declared dead. Checked before the write and again at install.
  auto it = workers_.find(request.name());
  if (it == workers_.end() || !it->second.fenced_reason.empty() || !it->second.sink) {
    return absl::OkStatus();
  }
  const v1::Worker& held = it->second.info;
  return absl::AlreadyExistsError("name: " + request.name() +
                                  " is held by a live session (generation " +
                                  std::to_string(held.generation()) + ", host " + held.host() +
                                  "); each worker process needs its own --name");
}

v1::RegisterResponse WorkerRegistry::Register(const v1::RegisterRequest& request, uint64_t gen,
                                              Outbox& out) {
  v1::RegisterResponse response;
  auto it = workers_.find(request.name());
  if (it != workers_.end() && it->second.info.generation() > gen) {
    // A racing registration of the name committed after this one and is installed: this
    // generation was replaced before it was ever current, so it is answered fenced (its
    // session is refused) and the process registers again.
    log::Warn("worker.superseded")
        .F("worker", request.name())
        .F("generation", gen)
        .F("current", it->second.info.generation())
        .Msg("registered concurrently with a later generation of the same name");
    response.set_worker_id(request.name());
    response.set_generation(gen);
    response.set_session_secret(RandomSecret());
    response.set_heartbeat_interval_ms(heartbeat_interval_ms_);
    response.set_heartbeat_timeout_ms(heartbeat_timeout_ms_);
    return response;
  }
  if (it != workers_.end() && it->second.fenced_reason.empty()) {
    // A new generation replaces the old one, which is fenced from now on.
    DeclareDead(it->second, "re-registered as generation " + std::to_string(gen), out);
  }
  WorkerRec& w = workers_[request.name()];
  w.info.set_id(request.name());
  w.info.set_name(request.name());
  w.info.set_host(request.host());
  w.info.set_device(request.device());
  w.info.set_memory_bytes(request.memory_bytes());
  w.info.set_accepts_commands(request.accepts_commands());
  w.info.set_attach_only(request.attach_only());
  w.info.set_generation(gen);
  w.info.set_state(v1::WORKER_DISCONNECTED);
  w.info.clear_job_id();
  w.info.set_rank(-1);
  w.info.set_last_step(-1);
  w.sink.reset();
  w.fenced_reason.clear();
  w.held.assign(request.checkpoints().begin(), request.checkpoints().end());
  w.session_secret = RandomSecret();
  w.registered_ms = clock_->NowMs();
  w.assigned_ms = 0;
  w.dead_ms = 0;
  w.info.set_registered_unix_ms(w.registered_ms);
  SyncLive(w, /*touch=*/true);
  response.set_worker_id(w.info.id());
  response.set_generation(gen);
  response.set_session_secret(w.session_secret);
  log::Info("worker.registered")
      .F("worker", w.info.id())
      .F("generation", gen)
      .F("host", w.info.host())
      .F("device", w.info.device())
      .F("accepts_commands", w.info.accepts_commands() ? "true" : "false")
      .F("held_checkpoints", w.held.size())
      .Msg("registered");
  response.set_heartbeat_interval_ms(heartbeat_interval_ms_);
  response.set_heartbeat_timeout_ms(heartbeat_timeout_ms_);
  return response;
}

absl::Status WorkerRegistry::Leave(const v1::LeaveRequest& request, Outbox& out) {
  auto it = workers_.find(request.worker_id());
  if (it == workers_.end()) {
    return absl::NotFoundError("worker_id: not registered (" + request.worker_id() + ")");
  }
  WorkerRec& w = it->second;
  if (request.generation() != w.info.generation() || !w.fenced_reason.empty()) {
    return FencedError(request.worker_id(), request.generation(), w.info.generation(),
                       w.fenced_reason);
  }
  if (auto s = CheckSecret(w, request.session_secret(), "leave"); !s.ok()) return s;
  DeclareDead(w, "left (" + (request.reason().empty() ? "shutdown" : request.reason()) + ")", out);
  return absl::OkStatus();
}

absl::Status WorkerRegistry::CheckSecret(const WorkerRec& w, const std::string& secret,
                                         const char* what) {
  if (SecretEquals(w.session_secret, secret)) return absl::OkStatus();
  ++forged_sessions_;
  return absl::PermissionDeniedError(
      std::string(what) + ": worker " + w.info.id() + " generation " +
      std::to_string(w.info.generation()) +
      (secret.empty() ? ": no session secret (RegisterResponse.session_secret)"
                      : ": wrong session secret") +
      "; only the process that registered this generation may open its session");
}

absl::StatusOr<WorkerRec*> WorkerRegistry::OpenSession(const std::string& worker_id,
                                                       uint64_t generation,
                                                       const std::string& session_secret,
                                                       std::shared_ptr<SessionSink> sink) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::FailedPreconditionError("worker " + worker_id +
                                         " is not registered; call Register first");
  }
  WorkerRec& w = it->second;
  if (generation != w.info.generation() || !w.fenced_reason.empty()) {
    return FencedError(worker_id, generation, w.info.generation(), w.fenced_reason);
  }
  if (auto s = CheckSecret(w, session_secret, "session"); !s.ok()) return s;
  // The same process again (it holds the secret) before its old stream was seen to break:
  // the new stream takes over, and the old one ends.
  if (w.sink && w.sink != sink) w.sink->End();
  w.sink = std::move(sink);
  SyncLive(w, /*touch=*/true);
  if (w.info.state() == v1::WORKER_DISCONNECTED) {
    w.info.set_state(w.info.job_id().empty() ? v1::WORKER_IDLE : v1::WORKER_ASSIGNED);
  }
  return &w;
}

void WorkerRegistry::CloseSession(const std::string& worker_id, uint64_t generation,
                                  const std::shared_ptr<SessionSink>& sink) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.info.generation() != generation) return;
  WorkerRec& w = it->second;
  if (!sink || w.sink != sink) return;  // replaced, or never this worker's session
  w.sink.reset();
  SyncLive(w, /*touch=*/false);
  // An assigned worker keeps its rank until its heartbeats time out: a short reconnect is fine.
  if (w.info.state() == v1::WORKER_IDLE) w.info.set_state(v1::WORKER_DISCONNECTED);
}

v1::ListWorkersResponse WorkerRegistry::List() {
  v1::ListWorkersResponse response;
  const int64_t now = clock_->NowMs();
  for (const auto& [id, w] : workers_) {
    v1::Worker* out = response.add_workers();
    *out = w.info;
    out->set_last_heartbeat_unix_ms(LastSeen(id));
    out->set_backoff_until_unix_ms(w.backoff_until_ms > now ? w.backoff_until_ms : 0);
  }
  return response;
}

absl::StatusOr<WorkerRec*> WorkerRegistry::Current(const v1::WorkerMessage& message) {
  auto it = workers_.find(message.worker_id());
  if (it == workers_.end()) {
    return absl::FailedPreconditionError("worker " + message.worker_id() + " is not registered");
  }
  WorkerRec& w = it->second;
  if (message.generation() != w.info.generation() || !w.fenced_reason.empty()) {
    return FencedError(message.worker_id(), message.generation(), w.info.generation(),
                       w.fenced_reason);
  }
  SyncLive(w, /*touch=*/true);
  return &w;
}

absl::Status WorkerRegistry::Heartbeat(const v1::WorkerMessage& message) {
  const int64_t now = clock_->NowMs();
  std::shared_ptr<SessionSink> sink;
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    auto it = live_.find(message.worker_id());
    if (it == live_.end()) {
      return absl::FailedPreconditionError("worker " + message.worker_id() + " is not registered");
    }
    Liveness& l = it->second;
    if (message.generation() != l.generation || !l.fenced_reason.empty()) {
      return FencedError(message.worker_id(), message.generation(), l.generation, l.fenced_reason);
    }
    l.last_ms = now;
    sink = l.sink;
    if (const int64_t sent = message.heartbeat().unix_ms(); sent > 0) {
      // The clocks need not agree: the least transit seen is this worker's skew plus network
      // time, and what a beat takes beyond it is time spent waiting to be handled.
      const int64_t transit = now - sent;
      l.min_transit_ms = std::min(l.min_transit_ms, transit);
      RecordLagLocked(now, transit - l.min_transit_ms);
    }
  }
  if (sink) {
    v1::CoordinatorMessage ack;
    ack.mutable_ack()->set_seq(message.seq());
    sink->Send(ack);
  }
  return absl::OkStatus();
}

void WorkerRegistry::DeclareDead(WorkerRec& w, const std::string& reason, Outbox& out,
                                 int64_t gone_ms) {
  const int64_t now = clock_->NowMs();
  const int64_t gone = gone_ms >= 0 ? std::min(gone_ms, now) : now;
  if (gone - w.registered_ms < kStableSessionMs) {
    ++w.short_sessions;
  } else {
    w.short_sessions = 0;
  }
  if (w.short_sessions >= 2) {
    int64_t delay = kWorkerBackoffBaseMs;
    for (int i = 2; i < w.short_sessions && delay < kWorkerBackoffMaxMs; ++i) delay *= 2;
    w.backoff_until_ms = now + std::min(delay, kWorkerBackoffMaxMs);
  }
  w.dead_ms = now;
  // Alive at its assignment, gone soon after (one already silent when it was assigned is not).
  const bool early = !w.info.job_id().empty() && gone >= w.assigned_ms &&
                     gone - w.assigned_ms < kUnchargedLossWindowMs;
  {
    log::Event e(log::Level::kWarn, "worker.dead");
    e.F("worker", w.info.id()).F("generation", w.info.generation());
    if (!w.info.job_id().empty()) e.F("job", w.info.job_id()).F("rank", w.info.rank());
    e.Msg(reason);
  }
  w.fenced_reason = "declared dead: " + reason;
  w.info.set_state(v1::WORKER_DEAD);
  if (w.sink) {
    v1::CoordinatorMessage m;
    m.mutable_stop()->set_reason("generation " + std::to_string(w.info.generation()) +
                                 " fenced: " + reason);
    m.mutable_stop()->set_cause(v1::STOP_FENCED);
    if (!w.info.job_id().empty()) m.mutable_stop()->set_job_id(w.info.job_id());
    out.emplace_back(w.sink, std::move(m));
  }
  w.sink.reset();
  SyncLive(w, /*touch=*/false);
  ++workers_declared_dead_;
  if (!w.info.job_id().empty()) {
    const std::string job_id = w.info.job_id();
    const int rank = w.info.rank();
    w.info.clear_job_id();
    w.info.set_rank(-1);
    rank_lost_(job_id,
               "worker " + w.info.id() + " (rank " + std::to_string(rank) + ", generation " +
                   std::to_string(w.info.generation()) + ") " + reason,
               early ? w.info.id() : std::string(), out);
  }
}

void WorkerRegistry::CreditPause(int64_t paused_ms) {
  std::lock_guard<std::mutex> live_lock(live_mu_);
  const int64_t now = clock_->NowMs();
  int credited = 0;
  for (auto& [id, l] : live_) {
    if (!l.fenced_reason.empty()) continue;
    // A full timeout from now: heartbeats sent while we were stopped are still in the socket
    // buffers, and a worker that really died meanwhile is found one timeout later.
    l.last_ms = std::max(l.last_ms, now);
    ++credited;
  }
  std::fprintf(stderr,
               "geofp8-coordinator: the coordinator itself did not run for %lld ms (stopped or "
               "starved); %d worker(s) get a fresh heartbeat timeout instead of being declared "
               "dead\n",
               static_cast<long long>(paused_ms), credited);
}

void WorkerRegistry::Tick(Outbox& out) {
  const int64_t now = clock_->NowMs();
  // A beat that arrived but waited in our queues is not the worker's miss: the deadline grows by
  // how late we handle heartbeats now.
  const int64_t lag = HeartbeatLagMs();
  const int64_t deadline = heartbeat_timeout_ms_ + lag;
  std::vector<std::pair<WorkerRec*, int64_t>> missing;  // and how long each was silent
  // A healthy coordinator hears every live worker once an interval. When most have not been heard
  // for two (or the timeout, if shorter), it is behind on its own queues, whatever it measured of
  // the beats it did handle: the silences are its own.
  const int64_t behind_after = std::min<int64_t>(2 * heartbeat_interval_ms_, heartbeat_timeout_ms_);
  int live = 0, unheard = 0;
  for (auto it = workers_.begin(); it != workers_.end();) {
    WorkerRec& w = it->second;
    if (!w.fenced_reason.empty()) {
      if (w.dead_ms > 0 && now - w.dead_ms > options_.dead_worker_retention_ms) {
        {
          std::lock_guard<std::mutex> lock(live_mu_);
          live_.erase(it->first);
        }
        ++workers_dropped_;
        it = workers_.erase(it);
        continue;
      }
      ++it;
      continue;
    }
    ++live;
    const int64_t silent = now - LastSeen(it->first);
    if (silent > deadline) missing.emplace_back(&w, silent);
    if (silent > behind_after) ++unheard;
    ++it;
  }
  const bool mass = live >= kHoldOffMinWorkers &&
                    static_cast<double>(unheard) > options_.fencing_holdoff_share * live;
  if (mass) {
    if (!fencing_held_) {
      fencing_held_ = true;
      held_since_ms_ = now;
      hold_keeping_up_since_ms_ = now;
      ++fencing_holds_;
      char share[16];
      std::snprintf(share, sizeof share, "%g", options_.fencing_holdoff_share);
      log::Warn("fencing.held")
          .F("unheard", unheard)
          .F("missing", missing.size())
          .F("live", live)
          .F("heartbeat_lag_ms", lag)
          .Msg(std::to_string(unheard) + " of " + std::to_string(live) +
               " live workers were not heard for " + std::to_string(behind_after) +
               " ms, more than the share of " + share +
               ": the coordinator is behind on its own queues; holding off fencing");
    }
    // While the beats it does handle come late, the coordinator is still behind and keeps holding;
    // once it keeps up with them (lag within an interval) for kMaxHoldTimeouts timeouts, the
    // workers still silent are a mass failure after all, and are fenced as before.
    if (lag > heartbeat_interval_ms_) hold_keeping_up_since_ms_ = now;
    if (now - hold_keeping_up_since_ms_ < int64_t{kMaxHoldTimeouts} * heartbeat_timeout_ms_) {
      return;
    }
  }
  if (fencing_held_) {
    fencing_held_ = false;
    log::Info("fencing.resumed")
        .F("unheard", unheard)
        .F("missing", missing.size())
        .F("live", live)
        .F("held_ms", now - held_since_ms_)
        .Msg(mass ? "held for the longest allowed; fencing the workers still silent"
                  : "caught up; every live worker gets a fresh heartbeat timeout");
    if (!mass) {
      // The silence during the hold was ours: as after a pause, every live worker's timeout
      // starts now, and those really gone are found one timeout later.
      std::lock_guard<std::mutex> lock(live_mu_);
      for (auto& [id, l] : live_) {
        if (l.fenced_reason.empty()) l.last_ms = std::max(l.last_ms, now);
      }
      return;
    }
  }
  for (auto& [w, silent] : missing) {
    DeclareDead(*w,
                "missed heartbeats for " + std::to_string(silent) + " ms (timeout " +
                    std::to_string(heartbeat_timeout_ms_) + " ms" +
                    (lag > 0 ? " + " + std::to_string(lag) + " ms of the coordinator's own lag"
                             : std::string()) +
                    ")",
                out, now - silent);
  }
}

void WorkerRegistry::RecordLagLocked(int64_t now, int64_t lag_ms) {
  if (now - lag_window_start_ms_ >= 1000) {
    if (lag_samples_.empty()) {
      lag_median_ms_ = 0;
    } else {
      auto mid = lag_samples_.begin() + lag_samples_.size() / 2;
      std::nth_element(lag_samples_.begin(), mid, lag_samples_.end());
      lag_median_ms_ = *mid;
    }
    lag_samples_.clear();
    lag_window_start_ms_ = now;
  }
  // A bounded sample of the window (every beat up to the bound, then every other one's slot).
  constexpr size_t kMaxSamples = 4096;
  if (lag_samples_.size() < kMaxSamples) {
    lag_samples_.push_back(lag_ms);
  } else {
    lag_samples_[static_cast<size_t>(now) % kMaxSamples] = lag_ms;
  }
}

void WorkerRegistry::RecordHandlingLag(int64_t lag_ms) {
  std::lock_guard<std::mutex> lock(live_mu_);
  RecordLagLocked(clock_->NowMs(), lag_ms);
}

int64_t WorkerRegistry::HeartbeatLagMs() {
  std::lock_guard<std::mutex> lock(live_mu_);
  // No beat handled for two windows: nothing measured lately (an idle fleet, or none at all).
  if (clock_->NowMs() - lag_window_start_ms_ >= 2000) return 0;
  return lag_median_ms_;
}

WorkerRec* WorkerRegistry::Find(const std::string& worker_id) {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : &it->second;
}

const WorkerRec* WorkerRegistry::Find(const std::string& worker_id) const {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : &it->second;
}

std::vector<WorkerSlot> WorkerRegistry::Slots() const {
  std::vector<WorkerSlot> slots;
  for (const auto& [id, w] : workers_) {
    slots.push_back({.id = id,
                     .device = w.info.device(),
                     .accepts_commands = w.info.accepts_commands(),
                     .attach_only = w.info.attach_only(),
                     .connected = w.sink != nullptr,
                     .fenced = !w.fenced_reason.empty(),
                     .idle = w.info.state() == v1::WORKER_IDLE,
                     .registered_ms = w.registered_ms,
                     .backoff_until_ms = w.backoff_until_ms});
  }
  return slots;
}

void WorkerRegistry::Assign(const std::string& worker_id, const std::string& job_id, int rank) {
  WorkerRec& w = workers_.at(worker_id);
  w.info.set_state(v1::WORKER_ASSIGNED);
  w.info.set_job_id(job_id);
  w.info.set_rank(rank);
  w.info.set_last_step(-1);
  w.assigned_ms = clock_->NowMs();
}

std::shared_ptr<SessionSink> WorkerRegistry::SinkOf(const std::string& worker_id,
                                                    uint64_t generation) const {
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.info.generation() != generation) return nullptr;
  return it->second.sink;
}

void WorkerRegistry::Release(const std::string& worker_id, uint64_t generation) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.info.generation() != generation) return;
  v1::Worker& info = it->second.info;
  info.clear_job_id();
  info.set_rank(-1);
  if (info.state() == v1::WORKER_ASSIGNED) {
    info.set_state(it->second.sink ? v1::WORKER_IDLE : v1::WORKER_DISCONNECTED);
  }
}

std::vector<std::shared_ptr<SessionSink>> WorkerRegistry::Sinks() const {
  std::vector<std::shared_ptr<SessionSink>> sinks;
  for (const auto& [id, w] : workers_) {
    if (w.sink) sinks.push_back(w.sink);
  }
  return sinks;
}

void WorkerRegistry::CountStates(std::map<int, int64_t>* by_state) const {
  for (const auto& [id, w] : workers_) ++(*by_state)[w.info.state()];
}

void WorkerRegistry::SyncLive(const WorkerRec& w, bool touch) {
  std::lock_guard<std::mutex> lock(live_mu_);
  Liveness& l = live_[w.info.id()];
  l.fenced_reason = w.fenced_reason;
  if (l.generation != w.info.generation()) l.min_transit_ms = INT64_MAX;
  l.generation = w.info.generation();
  l.sink = w.sink;
  if (touch) l.last_ms = clock_->NowMs();
}

int64_t WorkerRegistry::LastSeen(const std::string& worker_id) {
  std::lock_guard<std::mutex> lock(live_mu_);
  auto it = live_.find(worker_id);
  return it == live_.end() ? 0 : it->second.last_ms;
}

absl::Status WorkerRegistry::FencedError(const std::string& worker_id, uint64_t generation,
                                         uint64_t current, const std::string& reason) {
  ++fenced_messages_;
  return absl::FailedPreconditionError("worker " + worker_id + " generation " +
                                       std::to_string(generation) +
                                       " is fenced (current generation " + std::to_string(current) +
                                       (reason.empty() ? "" : ", " + reason) + ")");
}

}  // namespace geofp8::coordinator
