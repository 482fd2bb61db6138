// Coordinator::StreamLogs (`geofp8ctl logs`): resolves which worker holds a rank's output, then
// pulls it from that worker one bounded chunk at a time over its session (log_relay.h).
#include <thread>

#include "platform/common/status.h"
#include "server/coordinator/coordinator.h"

namespace geofp8::coordinator {
namespace {

// What a worker is asked for at once (the worker caps it too).
constexpr int32_t kLogChunkBytes = 64 << 10;

std::string FileName(const LogTarget& t) {
  return "rank" + std::to_string(t.rank) + (t.stream == v1::LOG_STDERR ? ".err" : ".out");
}

std::string RankName(const LogTarget& t) {
  return "rank " + std::to_string(t.rank) + " of job " + t.job_id + " attempt " +
         std::to_string(t.attempt);
}

// Sleeps `ms` in short steps, returning early once `cancelled` says so.
void SleepUnless(int ms, const std::function<bool()>& cancelled) {
  constexpr int kStepMs = 50;
  for (int slept = 0; slept < ms && !cancelled(); slept += kStepMs) {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(kStepMs, ms - slept)));
  }
}

// A request the job can answer: a command job, a rank and an attempt it has, a tail >= 0.
absl::Status CheckLogsRequest(const JobRec& rec, const v1::LogsRequest& request) {
  const std::string& id = rec.job.id();
  if (IsExternal(rec.spec)) {
    return absl::FailedPreconditionError(
        "job " + id +
        " is external: its launcher (torchrun, srun, a PyTorchJob) keeps its ranks' output; logs "
        "shows a command: job's output");
  }
  if (rec.spec.command.empty()) {
    return absl::FailedPreconditionError(
        "job " + id +
        " runs the built-in trainer, which has no program output: its ranks' events are in "
        "their workers' logs (geofp8-worker's stderr); logs shows a command: job's output");
  }
  const int world = rec.job.world_size();
  if (request.rank() < 0 || request.rank() >= world) {
    return absl::OutOfRangeError("rank: job " + id + " has ranks 0.." + std::to_string(world - 1) +
                                 " (" + std::to_string(request.rank()) + ")");
  }
  if (request.has_attempt() && (request.attempt() < 0 || request.attempt() > rec.job.attempt())) {
    return absl::OutOfRangeError("attempt: job " + id + " has attempts 0.." +
                                 std::to_string(rec.job.attempt()) + " (" +
                                 std::to_string(request.attempt()) + ")");
  }
  if (request.tail_lines() < 0) {
    return absl::InvalidArgumentError("tail_lines: must be >= 0 (" +
                                      std::to_string(request.tail_lines()) + ")");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LogTarget> Coordinator::ResolveLogs(const v1::LogsRequest& request) {
  LogTarget t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    GEOFP8_ASSIGN_OR_RETURN(const JobRec* rec, jobs_.Find(request.job_id()));
    GEOFP8_RETURN_IF_ERROR(CheckLogsRequest(*rec, request));
    const std::string& id = rec->job.id();
    if (rec->attempt_workers.empty()) {
      return absl::FailedPreconditionError(
          "job " + id + " (" + StateName(rec->job.state()) +
          "): no attempt of it was placed on workers since this coordinator started");
    }
    t.attempt = request.has_attempt() ? request.attempt() : rec->attempt_workers.rbegin()->first;
    auto placed = rec->attempt_workers.find(t.attempt);
    if (placed == rec->attempt_workers.end() ||
        static_cast<int>(placed->second.size()) <= request.rank() ||
        placed->second[request.rank()].empty()) {
      return absl::FailedPreconditionError(
          "attempt " + std::to_string(t.attempt) + " of job " + id +
          ": this coordinator does not know its workers (it was never placed, or ran before the "
          "coordinator restarted)");
    }
    t.job_id = id;
    t.rank = request.rank();
    t.stream = request.stream();
    t.worker_id = placed->second[t.rank];
  }
  GEOFP8_RETURN_IF_ERROR(logs_.Acquire(t.worker_id));
  return t;
}

absl::StatusOr<v1::LogData> Coordinator::ReadLog(const LogTarget& t, int64_t offset,
                                                 int32_t tail_lines) {
  std::shared_ptr<SessionSink> sink;
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const WorkerRec* w = workers_.Find(t.worker_id);
    if (!w || !w->sink) {
      // FAILED_PRECONDITION, not UNAVAILABLE: the coordinator answered; it is the worker that
      // is missing (a client must not read it as "coordinator unreachable").
      return absl::FailedPreconditionError("worker " + t.worker_id + ", which ran " + RankName(t) +
                                           ", is not connected");
    }
    sink = w->sink;
    id = logs_.Begin(t.worker_id, w->info.generation(), sink.get());
  }
  v1::CoordinatorMessage m;
  v1::LogRead* r = m.mutable_log_read();
  r->set_request_id(id);
  r->set_job_id(t.job_id);
  r->set_attempt(t.attempt);
  r->set_rank(t.rank);
  r->set_stream(t.stream);
  r->set_offset(offset);
  r->set_max_bytes(kLogChunkBytes);
  r->set_tail_lines(tail_lines);
  sink->Send(m);
  GEOFP8_ASSIGN_OR_RETURN(v1::LogData data,
                          logs_.Wait(id, std::chrono::milliseconds(options_.log_read_timeout_ms)));
  if (!data.error().empty()) {
    return absl::InternalError("worker " + t.worker_id + ": cannot read " + FileName(t) + " of " +
                               RankName(t) + ": " + data.error());
  }
  return data;
}

bool Coordinator::RankEnded(const LogTarget& t) {
  std::lock_guard<std::mutex> lock(mu_);
  const JobRec* rec = jobs_.FindOrNull(t.job_id);
  if (shutdown_ || !rec || rec->job.attempt() != t.attempt || rec->ranks.empty()) return true;
  return t.rank < static_cast<int>(rec->ranks.size()) && rec->ranks[t.rank].finished;
}

absl::Status Coordinator::StreamLogs(const v1::LogsRequest& request,
                                     const std::function<bool(const v1::LogsChunk&)>& write,
                                     const std::function<bool()>& cancelled) {
  GEOFP8_ASSIGN_OR_RETURN(const LogTarget t, ResolveLogs(request));
  struct Slot {
    LogRelay* relay;
    const std::string& worker;
    ~Slot() { relay->Release(worker); }
  } slot{&logs_, t.worker_id};
  int64_t offset = 0;
  int32_t tail = request.tail_lines();
  while (!cancelled()) {
    // Asked before the read: a rank that had ended by then wrote all it will before this read,
    // so an end of file now means its output is drained.
    const bool ended = RankEnded(t);
    GEOFP8_ASSIGN_OR_RETURN(v1::LogData data, ReadLog(t, offset, tail));
    if (data.missing()) {
      if (ended) {
        return absl::NotFoundError("worker " + t.worker_id + " has no " + FileName(t) + " of " +
                                   RankName(t) +
                                   " (the rank never started its program, or the worker was "
                                   "replaced or its data dir cleaned)");
      }
      if (!request.follow()) return absl::OkStatus();  // nothing written yet
      SleepUnless(options_.log_poll_ms, cancelled);
      continue;
    }
    tail = 0;
    if (!data.data().empty()) {
      v1::LogsChunk chunk;
      chunk.set_offset(data.offset());
      chunk.set_worker_id(t.worker_id);
      offset = data.offset() + static_cast<int64_t>(data.data().size());
      chunk.set_data(std::move(*data.mutable_data()));
      if (!write(chunk)) return absl::OkStatus();  // the client went away
    } else {
      offset = data.offset();
    }
    if (!data.eof()) continue;
    if (!request.follow() || ended) return absl::OkStatus();
    SleepUnless(options_.log_poll_ms, cancelled);
  }
  return absl::CancelledError("logs cancelled by the client");
}

}  // namespace geofp8::coordinator
