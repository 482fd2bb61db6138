// Worker daemon wiring (see worker.h). Coordinator messages arrive on the session thread and
// are handed to the rank's thread-safe entry points; a supervisor starts queued assignments
// once the previous rank has ended and samples session state for /metrics.
#include "worker/daemon/worker.h"

#include "platform/common/status.h"
#include "platform/policy/job_spec.h"
#include "worker/daemon/command_runner.h"
#include "worker/daemon/log.h"
#include "worker/daemon/log_reader.h"

namespace geofp8::worker {

Worker::Worker(WorkerOptions options) : options_(std::move(options)) {}

Worker::~Worker() { Shutdown(std::chrono::hours(1)); }

absl::Status Worker::Start() {
  GEOFP8_ASSIGN_OR_RETURN(connection_, Connection::Open(options_.connection));
  metrics_ = std::make_unique<WorkerMetrics>();
  if (options_.metrics_port >= 0) {
    GEOFP8_ASSIGN_OR_RETURN(metrics_port_,
                            metrics_->Serve(options_.metrics_host, options_.metrics_port));
  }
  SessionEvents events;
  events.on_message = [this](const v1::CoordinatorMessage& m) { OnMessage(m); };
  events.on_generation_lost = [this](const std::string& reason) { OnGenerationLost(reason); };
  // After a coordinator outage the job resumes from the newest step every rank of the attempt
  // holds: the files of the rank this process ran last, if any.
  events.held_checkpoints = [this] {
    std::vector<v1::HeldCheckpoints> out;
    std::lock_guard<std::mutex> lock(mu_);
    if (!runner_) return out;
    const HeldCheckpointsInfo h = runner_->HeldCheckpoints();
    if (h.steps.empty()) return out;
    v1::HeldCheckpoints& m = out.emplace_back();
    m.set_job_id(h.job_id);
    m.set_attempt(h.attempt);
    m.set_rank(h.rank);
    for (int64_t s : h.steps) m.add_steps(s);
    for (const auto& [version, step] : h.taken) {
      v1::PolicyAck* t = m.add_taken();
      t->set_version(version);
      t->set_step(step);
    }
    return out;
  };
  session_ = std::make_unique<SessionClient>(connection_, options_.session, std::move(events));
  if (!options_.hook_socket.empty()) {
    GEOFP8_ASSIGN_OR_RETURN(gate_,
                            HookServer::StartGate(
                                options_.hook_socket,
                                [this](const v1::HookAttach& a) { return ForwardAttach(a, false); },
                                [this](const v1::HookAttach& a) { ForwardAttach(a, true); }));
  }
  session_->Start();
  supervisor_ = std::thread([this] { Supervise(); });
  return absl::OkStatus();
}

namespace {

// Equal, in a time that does not depend on where they differ.
bool SameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

std::string Worker::ForwardAttach(const v1::HookAttach& a, bool withdraw) {
  if (!withdraw && !options_.connection.token.empty() &&
      !SameSecret(a.token(), options_.connection.token)) {
    log::Warn("rank.attach_refused")
        .F("job", a.job())
        .F("rank", a.rank())
        .Msg("a program attached with a token that is not this worker's");
    return a.token().empty()
               ? "token: this worker needs the cluster's token: set GEOFP8_TOKEN_FILE (or "
                 "GEOFP8_TOKEN) for the launcher's processes"
               : "token: the token given (GEOFP8_TOKEN_FILE or GEOFP8_TOKEN) is not this "
                 "worker's";
  }
  v1::WorkerMessage m;
  m.mutable_attach()->set_job(a.job());
  m.mutable_attach()->set_rank(a.rank());
  m.mutable_attach()->set_world_size(a.world_size());
  m.mutable_attach()->set_withdraw(withdraw);
  log::Info(withdraw ? "rank.attach_withdrawn" : "rank.attach")
      .F("job", a.job())
      .F("rank", a.rank())
      .F("world_size", a.world_size())
      .Msg(withdraw ? "the attached program left before its attempt was placed"
                    : "a program attached as rank " + std::to_string(a.rank()) + " of job " +
                          a.job() + "; asking the coordinator");
  session_->Send(std::move(m), true);
  return "";
}

bool Worker::Shutdown(std::chrono::milliseconds grace, const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return !runner_ || runner_->done();
    stopping_ = true;
    pending_.reset();
  }
  // Tell the coordinator first: it fences this generation and stops the job's other ranks now,
  // so they do not wait in a collective for a rank that is leaving (and the job restarts without
  // waiting out the heartbeat timeout). Outside mu_: the coordinator's Stop comes back to
  // OnMessage.
  if (session_) session_->Leave(reason, std::chrono::milliseconds(2000));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (runner_ && !runner_->done())
      runner_->RequestStop("worker shutting down", v1::STOP_CAUSE_UNSPECIFIED);
  }
  cv_.notify_all();
  if (supervisor_.joinable()) supervisor_.join();
  // The rank stops at its next step boundary (its peers with it); waiting longer than the grace
  // only delays the exit, the coordinator restarts the job either way.
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (runner_ && !runner_->done() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (runner_ && !runner_->done()) {
    Log("the rank is still inside a collective after the grace period");
    return false;
  }
  if (session_) session_->Stop();
  runner_.reset();
  gate_.reset();
  return true;
}

void Worker::StartRunner(const v1::Assignment& a) {
  auto send = [this](v1::WorkerMessage m, bool reliable) {
    return session_->Send(std::move(m), reliable);
  };
  JobRunnerOptions o = options_.job;
  // A peer's death reaches this rank as a failed collective; give the coordinator the heartbeat
  // timeout to notice it too, plus a margin for the report and the Stop to travel.
  constexpr std::chrono::milliseconds kStopTravelMargin{3000};
  o.peer_failure_grace = session_->heartbeat_timeout() + kStopTravelMargin;
  // A `command:` job runs the user's program; a spec that does not parse goes to the trainer,
  // which reports the error as the rank's failure.
  auto spec = ParseJobSpec(a.spec_yaml());
  if (spec.ok() && RunsOwnScript(*spec)) {
    CommandRunnerOptions co;
    co.job = o;
    co.coordinator = options_.connection.address;
    co.token = options_.connection.token;
    co.allow_commands = options_.session.accepts_commands;
    co.pass_env = options_.command_env;
    co.hook_attach_timeout = options_.hook_attach_timeout;
    co.cuda_device = options_.cuda_device;
    co.command_uid_base = options_.command_uid_base;
    co.limits = options_.command_limits;
    co.gate = gate_.get();
    runner_ = std::make_unique<CommandRunner>(connection_, a, co, send, metrics_.get());
  } else {
    if (options_.cuda_device >= 0) {
      log::Warn("job.cpu_only")
          .F("job", a.job_id())
          .F("device", options_.session.device)
          .Msg("job " + a.job_id() + ": the built-in trainer runs on CPU only; this worker's " +
               options_.session.device + " stays unused (a command: job gets it)");
    }
    runner_ = std::make_unique<TrainerRankRunner>(
        std::make_unique<JobRunner>(connection_, a, o, send, metrics_.get()));
  }
  runner_->Start();
}

void Worker::OnMessage(const v1::CoordinatorMessage& message) {
  if (message.has_log_read()) {
    // Answered at once from the disk, bounded (log_reader.h), without the rank's mutex: a log
    // read never waits for, or delays, the rank.
    v1::WorkerMessage reply;
    *reply.mutable_log_data() = ReadRankLog(options_.job.data_dir, message.log_read());
    session_->Send(std::move(reply));
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return;
  const bool active = runner_ && !runner_->done();
  switch (message.body_case()) {
    case v1::CoordinatorMessage::kAssignment: {
      const v1::Assignment& a = message.assignment();
      if (active && runner_->assignment().job_id() == a.job_id() &&
          runner_->assignment().attempt() == a.attempt()) {
        return;  // a repeat of what is running
      }
      log::Info("job.assigned")
          .F("job", a.job_id())
          .F("attempt", a.attempt())
          .F("rank", a.rank())
          .F("world_size", a.world_size())
          .F("step", a.resume_step())
          .Msg("assignment: job " + a.job_id() + " attempt " + std::to_string(a.attempt()) +
               " rank " + std::to_string(a.rank()) + "/" + std::to_string(a.world_size()));
      if (active) {
        // The coordinator has moved on (e.g. released our ranks); the old rank winds down first.
        runner_->RequestStop(
            "superseded by job " + a.job_id() + " attempt " + std::to_string(a.attempt()),
            v1::STOP_ATTEMPT_ENDED);
        pending_ = a;
        cv_.notify_all();
        return;
      }
      if (runner_) runner_.reset();  // joins the finished thread
      StartRunner(a);
      return;
    }
    case v1::CoordinatorMessage::kPolicy:
      // An assignment waiting for the previous rank to end keeps every later version, in
      // order, as a running rank would (the ranks agree on versions they all hold).
      if (pending_ && pending_->job_id() == message.policy().job_id() &&
          message.policy().version() > pending_->policy().version()) {
        *pending_->mutable_policy() = message.policy();
        *pending_->add_policy_history() = message.policy();
      }
      if (active && runner_->assignment().job_id() == message.policy().job_id()) {
        runner_->OfferPolicy(message.policy());
      }
      return;
    case v1::CoordinatorMessage::kRefresh:
      if (active && runner_->assignment().job_id() == message.refresh().job_id()) {
        runner_->OfferRefresh(message.refresh());
      }
      return;
    case v1::CoordinatorMessage::kAck:
      // The last rank's, even once it has ended: its final checkpoint's Ack comes after.
      if (runner_ && runner_->assignment().job_id() == message.ack().job_id()) {
        runner_->OnCheckpointAcknowledged(message.ack().checkpoint_step());
      }
      return;
    case v1::CoordinatorMessage::kAttachRefused:
      if (gate_) gate_->Refuse(message.attach_refused().reason());
      return;
    case v1::CoordinatorMessage::kStop: {
      const v1::Stop& s = message.stop();
      // The job succeeded: what precedes its final recovery point can go, even on a rank that
      // ended before that point was persisted (the Ack of its own report came earlier).
      if (runner_ && s.cause() == v1::STOP_JOB_SUCCEEDED && s.recovery_step() > 0 &&
          runner_->assignment().job_id() == s.job_id()) {
        runner_->OnCheckpointAcknowledged(s.recovery_step());
      }
      if (pending_ && (s.job_id().empty() || s.job_id() == pending_->job_id())) pending_.reset();
      if (active && (s.job_id().empty() || s.job_id() == runner_->assignment().job_id())) {
        log::Info("job.stop_requested")
            .F("job", runner_->assignment().job_id())
            .F("rank", runner_->assignment().rank())
            .Msg("stop: job " + runner_->assignment().job_id() + ": " + s.reason());
        runner_->RequestStop(s.reason(), s.cause());
      }
      return;
    }
    default:
      return;
  }
}

void Worker::OnGenerationLost(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.reset();
  if (runner_ && !runner_->done())
    runner_->RequestStop("generation lost: " + reason, v1::STOP_FENCED);
  if (metrics_) metrics_->Error("session_lost");
}

void Worker::Supervise() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, std::chrono::milliseconds(200));
    if (stopping_) break;
    if (pending_ && (!runner_ || runner_->done())) {
      v1::Assignment a = *pending_;
      pending_.reset();
      runner_.reset();
      StartRunner(a);
    }
    if (metrics_ && session_) {
      const SessionCounters& c = session_->counters();
      metrics_->Session(session_->connected(), session_->generation(), c.heartbeats_sent.load(),
                        c.reconnects.load());
    }
  }
}

}  // namespace geofp8::worker
