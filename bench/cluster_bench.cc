// geofp8-bench cluster: the real geofp8-coordinator in its own process against thousands of
// simulated workers driven from a few completion-queue threads (cold start, heartbeats, a large
// placement, policy updates), each level against same-run baselines.
#include <fcntl.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <queue>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/synchronization/mutex.h"
#include "bench/control_plane.h"
#include "bench/registry.h"
#include "geofp8/v1/geofp8.grpc.pb.h"

namespace geofp8::bench {
namespace {

using Clock = SteadyClock;
using Stream = grpc::ClientAsyncReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// A time that was never reached (not every worker got there) prints as "n/a".
std::string Time(double v, int decimals) {
  if (v < 0) return "n/a";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

// The real worker's Register deadline (worker/daemon/session.h, rpc_timeout): a registration
// slower than this would have timed out and been retried by a real worker.
constexpr double kWorkerRegisterDeadlineS = 10.0;

// ---------------------------------------------------------------------------------------------
// The coordinator daemon, in its own process with a fresh data directory. Its stdout and stderr
// (one event line per registration and per assigned rank) go to a file, not the terminal.

class CoordinatorProcess {
 public:
  ~CoordinatorProcess() { Stop(); }

  // Starts `binary` and waits for its ready file. Returns an error sentence, empty on success.
  std::string Start(const std::string& binary, const std::string& dir,
                    const std::vector<std::string>& extra_flags) {
    log_path_ = dir + "/coordinator.log";
    const std::string ready = dir + "/ready.json";
    std::vector<std::string> args = {binary,       "--listen",         "127.0.0.1:0",
                                     "--data-dir", dir + "/data",      "--ready-file",
                                     ready,        "--metrics-listen", ""};
    args.insert(args.end(), extra_flags.begin(), extra_flags.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int log_fd = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log_fd < 0) return "cannot create " + log_path_ + ": " + std::strerror(errno);
    pid_ = fork();
    if (pid_ == 0) {
      // Only async-signal-safe calls between fork and exec (gRPC's threads exist in the parent).
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive a bench that crashed
      dup2(log_fd, 1);
      dup2(log_fd, 2);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(log_fd);
    if (pid_ < 0) return std::string("fork: ") + std::strerror(errno);
    const auto until = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < until) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return binary + " exited (status " + std::to_string(status) + ") before it served; see " +
               log_path_;
      }
      std::ifstream in(ready);
      std::stringstream text;
      text << in.rdbuf();
      const std::string json = text.str();
      const std::string key = "\"grpc\": \"";
      if (const size_t at = json.find(key); at != std::string::npos) {
        const size_t end = json.find('"', at + key.size());
        if (end != std::string::npos) {
          address_ = json.substr(at + key.size(), end - at - key.size());
          return "";
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return binary + " wrote no ready file within 30 s; see " + log_path_;
  }

  // SIGTERM, then SIGKILL after 10 s.
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    const auto until = Clock::now() + std::chrono::seconds(10);
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (Clock::now() > until) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = -1;
  }

  const std::string& address() const { return address_; }
  const std::string& log_path() const { return log_path_; }

  struct Usage {
    long threads = 0;
    long peak_rss_mib = 0;
    double cpu_s = 0;  // user + system since start
  };
  Usage ReadUsage() const {
    Usage u;
    if (pid_ <= 0) return u;
    std::ifstream status("/proc/" + std::to_string(pid_) + "/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("Threads:", 0) == 0) u.threads = std::atol(line.c_str() + 8);
      if (line.rfind("VmHWM:", 0) == 0) u.peak_rss_mib = std::atol(line.c_str() + 6) / 1024;
    }
    std::ifstream stat("/proc/" + std::to_string(pid_) + "/stat");
    std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    // Fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15.
    if (const size_t close = all.rfind(')'); close != std::string::npos) {
      std::istringstream fields(all.substr(close + 2));
      std::string f;
      double ticks = 0;
      for (int i = 3; i <= 15 && fields >> f; ++i) {
        if (i >= 14) ticks += std::atof(f.c_str());
      }
      u.cpu_s = ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
    }
    return u;
  }

 private:
  pid_t pid_ = -1;
  std::string address_;
  std::string log_path_;
};

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

// ---------------------------------------------------------------------------------------------
// The noise floor: gRPC's health check on the coordinator, which runs no coordinator code (no
// lock, no store, no log line), through a generic stub on its own connection.

class HealthProbe {
 public:
  explicit HealthProbe(const std::string& address) {
    grpc::ChannelArguments args;
    args.SetInt("geofp8.bench.probe", 1);  // its own TCP connection
    stub_ = std::make_unique<grpc::GenericStub>(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }
  ~HealthProbe() {
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  // One round trip in ms; negative when the call failed (then *error says why).
  double RoundTripMs(std::string* error) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Slice empty;
    grpc::ByteBuffer request(&empty, 1), response;  // an empty HealthCheckRequest: the server
    grpc::Status status;
    const auto t0 = Clock::now();
    auto call = stub_->PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq_);
    call->StartCall();
    call->Finish(&response, &status, this);
    void* tag;
    bool ok;
    cq_.Next(&tag, &ok);
    const double ms = Ms(Clock::now() - t0);
    if (!status.ok()) {
      *error = std::to_string(status.error_code()) + " " + status.error_message();
      return -1;
    }
    return ms;
  }

 private:
  std::unique_ptr<grpc::GenericStub> stub_;
  grpc::CompletionQueue cq_;
};

// ---------------------------------------------------------------------------------------------
// Simulated workers. Each belongs to one FleetThread, which alone touches it: it registers,
// opens its Session with the generation's secret (the first message, a heartbeat), beats at the
// coordinator's interval, matches acks, and answers an Assignment as a rank's first report does
// (StepProgress step 0 under the assignment's policy version).

struct SimWorker;
struct Tag {
  enum Kind { kRegister, kStart, kRead, kWrite, kFinish };
  SimWorker* worker;
  Kind kind;
};

struct SimWorker {
  int index = 0;
  v1::WorkerService::Stub* stub = nullptr;
  Tag t_register{this, Tag::kRegister}, t_start{this, Tag::kStart}, t_read{this, Tag::kRead},
      t_write{this, Tag::kWrite}, t_finish{this, Tag::kFinish};

  std::unique_ptr<grpc::ClientContext> register_ctx;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::RegisterResponse>> register_call;
  v1::RegisterResponse register_response;
  grpc::Status register_status;
  Clock::time_point register_sent;

  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<Stream> stream;
  v1::CoordinatorMessage in;
  v1::WorkerMessage writing_message;
  std::deque<v1::WorkerMessage> queued;
  bool writing = false, read_ended = false, finishing = false, ended = false;
  grpc::Status finish_status;

  std::string id, secret;
  uint64_t generation = 0, seq = 0;
  std::chrono::milliseconds interval{1000};
  bool opened = false;  // the hello's ack arrived: the session is open
  struct Beat {
    uint64_t seq;
    Clock::time_point sent;
    bool recorded;  // sent while a measurement window was open
  };
  std::deque<Beat> beats;  // heartbeats written and not yet acknowledged, oldest first
};

// What the fleet's threads count; read by the main thread under `mu`.
struct FleetStats {
  std::mutex mu;
  std::vector<double> register_s;  // each Register's round trip
  std::string first_error;
  std::vector<double> beat_ms;  // recorded heartbeats' ack round trips
  uint64_t beats_sent = 0, beats_acked = 0, beats_skipped = 0;
  std::vector<Clock::time_point> assigned_at;
  double max_lag_ms = 0;  // how late a thread fired a due heartbeat: the simulator's own limit

  std::atomic<int> registered{0}, register_failed{0}, opened{0}, sessions_lost{0};
  std::atomic<int> assignments{0}, stops{0};
  std::atomic<uint64_t> policies{0};
};

class FleetThread {
 public:
  FleetThread(FleetStats* stats, const std::atomic<bool>* recording, double register_deadline_s)
      : stats_(stats), recording_(recording), register_deadline_s_(register_deadline_s) {}

  void Add(SimWorker* w) { workers_.push_back(w); }
  void Start() {
    thread_ = std::thread([this] { Loop(); });
  }
  // Registers every worker of this thread at once.
  void Register() {
    Post([this] {
      for (SimWorker* w : workers_) StartRegister(w);
    });
  }
  // Cancels every call and returns once all have completed.
  void Stop() {
    Post([this] {
      stopping_ = true;
      for (SimWorker* w : workers_) {
        if (w->register_ctx) w->register_ctx->TryCancel();
        if (w->ctx) w->ctx->TryCancel();
      }
    });
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Post(std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    commands_.push_back(std::move(fn));
  }

  void Loop() {
    while (true) {
      std::vector<std::function<void()>> commands;
      {
        std::lock_guard<std::mutex> lock(cmd_mu_);
        commands.swap(commands_);
      }
      for (auto& c : commands) c();
      if (stopping_ && outstanding_ == 0) break;
      // Wake at the next due heartbeat, and every 5 ms for posted commands.
      auto deadline = Clock::now() + std::chrono::milliseconds(5);
      if (!due_.empty()) deadline = std::min(deadline, due_.top().first);
      void* tag = nullptr;
      bool ok = false;
      // gRPC takes system_clock deadlines; the schedule is kept on the steady clock.
      const auto got =
          cq_.AsyncNext(&tag, &ok,
                        std::chrono::system_clock::now() +
                            std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                deadline - Clock::now()));
      if (got == grpc::CompletionQueue::GOT_EVENT) Handle(static_cast<Tag*>(tag), ok);
      FireDueBeats();
    }
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  void StartRegister(SimWorker* w) {
    v1::RegisterRequest req;
    req.set_name("sim-" + std::to_string(w->index));
    req.set_host("cluster-bench");
    req.set_device("cpu");
    req.set_memory_bytes(uint64_t{16} << 30);
    w->register_ctx = std::make_unique<grpc::ClientContext>();
    w->register_ctx->set_deadline(
        std::chrono::system_clock::now() +
        std::chrono::milliseconds(static_cast<int64_t>(register_deadline_s_ * 1000)));
    w->register_sent = Clock::now();
    w->register_call = w->stub->PrepareAsyncRegister(w->register_ctx.get(), req, &cq_);
    w->register_call->StartCall();
    w->register_call->Finish(&w->register_response, &w->register_status, &w->t_register);
    ++outstanding_;
  }

  void Handle(Tag* tag, bool ok) {
    --outstanding_;
    SimWorker* w = tag->worker;
    switch (tag->kind) {
      case Tag::kRegister:
        OnRegistered(w);
        break;
      case Tag::kStart:
        if (!ok) {
          w->read_ended = true;
          MaybeFinish(w);
          break;
        }
        {
          v1::WorkerMessage hello;  // the first message names the generation and proves it
          hello.set_session_secret(w->secret);
          Send(w, std::move(hello), /*heartbeat=*/true);
        }
        Read(w);
        break;
      case Tag::kRead:
        if (!ok) {
          w->read_ended = true;
          MaybeFinish(w);
          break;
        }
        OnMessage(w);
        Read(w);
        break;
      case Tag::kWrite:
        w->writing = false;
        if (!ok) {
          MaybeFinish(w);
          break;
        }
        if (!w->queued.empty()) {
          v1::WorkerMessage next = std::move(w->queued.front());
          w->queued.pop_front();
          Write(w, std::move(next));
        } else if (w->read_ended) {
          MaybeFinish(w);
        }
        break;
      case Tag::kFinish:
        w->ended = true;
        if (!stopping_) {
          ++stats_->sessions_lost;
          Error("session of sim-" + std::to_string(w->index) +
                " ended: " + w->finish_status.error_message());
        }
        break;
    }
  }

  void Error(const std::string& message) {
    std::lock_guard<std::mutex> lock(stats_->mu);
    if (stats_->first_error.empty()) stats_->first_error = message;
  }

  void OnRegistered(SimWorker* w) {
    w->register_ctx.reset();
    w->register_call.reset();
    const double s = Seconds(Clock::now() - w->register_sent);
    if (!w->register_status.ok()) {
      ++stats_->register_failed;
      Error("register sim-" + std::to_string(w->index) + ": " + w->register_status.error_message());
      return;
    }
    {
      std::lock_guard<std::mutex> lock(stats_->mu);
      stats_->register_s.push_back(s);
    }
    ++stats_->registered;
    const v1::RegisterResponse& r = w->register_response;
    w->id = r.worker_id();
    w->generation = r.generation();
    w->secret = r.session_secret();
    if (r.heartbeat_interval_ms() > 0)
      w->interval = std::chrono::milliseconds(r.heartbeat_interval_ms());
    if (stopping_) return;
    w->ctx = std::make_unique<grpc::ClientContext>();
    w->stream = w->stub->PrepareAsyncSession(w->ctx.get(), &cq_);
    w->stream->StartCall(&w->t_start);
    ++outstanding_;
  }

  void Read(SimWorker* w) {
    w->stream->Read(&w->in, &w->t_read);
    ++outstanding_;
  }

  void Write(SimWorker* w, v1::WorkerMessage m) {
    w->writing_message = std::move(m);
    w->writing = true;
    w->stream->Write(w->writing_message, &w->t_write);
    ++outstanding_;
  }

  void Send(SimWorker* w, v1::WorkerMessage m, bool heartbeat) {
    m.set_worker_id(w->id);
    m.set_generation(w->generation);
    m.set_seq(++w->seq);
    if (heartbeat) {
      // The send time, as the real worker stamps it: the coordinator measures its own lag by it.
      m.mutable_heartbeat()->set_unix_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                             std::chrono::system_clock::now().time_since_epoch())
                                             .count());
      w->beats.push_back({w->seq, Clock::now(), recording_->load()});
      if (w->beats.back().recorded) {
        std::lock_guard<std::mutex> lock(stats_->mu);
        ++stats_->beats_sent;
      }
    }
    if (w->writing) {
      w->queued.push_back(std::move(m));
    } else {
      Write(w, std::move(m));
    }
  }

  // The stream is finished once its read side ended and no write is in flight.
  void MaybeFinish(SimWorker* w) {
    if (!w->read_ended || w->writing || w->finishing) return;
    w->finishing = true;
    w->stream->Finish(&w->finish_status, &w->t_finish);
    ++outstanding_;
  }

  void OnMessage(SimWorker* w) {
    const v1::CoordinatorMessage& m = w->in;
    switch (m.body_case()) {
      case v1::CoordinatorMessage::kAck:
        OnAck(w, m.ack().seq());
        break;
      case v1::CoordinatorMessage::kAssignment: {
        {
          std::lock_guard<std::mutex> lock(stats_->mu);
          stats_->assigned_at.push_back(Clock::now());
        }
        ++stats_->assignments;
        v1::WorkerMessage progress;
        progress.mutable_progress()->set_step(0);
        progress.mutable_progress()->set_policy_version(m.assignment().policy().version());
        Send(w, std::move(progress), /*heartbeat=*/false);
        break;
      }
      case v1::CoordinatorMessage::kPolicy:
        ++stats_->policies;
        break;
      case v1::CoordinatorMessage::kStop:
        ++stats_->stops;
        break;
      default:
        break;
    }
  }

  void OnAck(SimWorker* w, uint64_t seq) {
    const auto now = Clock::now();
    // Acks come in order on a stream; only heartbeats are in `beats`.
    while (!w->beats.empty() && w->beats.front().seq < seq) w->beats.pop_front();
    if (w->beats.empty() || w->beats.front().seq != seq) return;
    const SimWorker::Beat beat = w->beats.front();
    w->beats.pop_front();
    if (!w->opened) {
      w->opened = true;
      ++stats_->opened;
      // Phases spread evenly over the interval (golden-ratio sequence: even for any count).
      const double phase = std::fmod(w->index * 0.6180339887, 1.0);
      due_.push({now + std::chrono::microseconds(static_cast<int64_t>(
                           phase * 1000.0 * static_cast<double>(w->interval.count()))),
                 w});
    }
    if (beat.recorded) {
      std::lock_guard<std::mutex> lock(stats_->mu);
      stats_->beat_ms.push_back(Ms(now - beat.sent));
      ++stats_->beats_acked;
    }
  }

  void FireDueBeats() {
    const auto now = Clock::now();
    double lag_ms = 0;
    while (!due_.empty() && due_.top().first <= now) {
      auto [at, w] = due_.top();
      due_.pop();
      if (w->read_ended || stopping_) continue;
      lag_ms = std::max(lag_ms, Ms(now - at));
      if (w->writing) {
        // The stream has not taken the last message yet: a real worker's Send would block.
        if (recording_->load()) {
          std::lock_guard<std::mutex> lock(stats_->mu);
          ++stats_->beats_skipped;
        }
      } else {
        Send(w, v1::WorkerMessage(), /*heartbeat=*/true);
      }
      due_.push({at + w->interval, w});
    }
    if (lag_ms > 0 && recording_->load()) {
      std::lock_guard<std::mutex> lock(stats_->mu);
      stats_->max_lag_ms = std::max(stats_->max_lag_ms, lag_ms);
    }
  }

  FleetStats* stats_;
  const std::atomic<bool>* recording_;
  double register_deadline_s_;
  std::vector<SimWorker*> workers_;
  grpc::CompletionQueue cq_;
  std::thread thread_;
  std::mutex cmd_mu_;
  std::vector<std::function<void()>> commands_;
  bool stopping_ = false;
  int64_t outstanding_ = 0;
  using Due = std::pair<Clock::time_point, SimWorker*>;
  struct Later {
    bool operator()(const Due& a, const Due& b) const { return a.first > b.first; }
  };
  std::priority_queue<Due, std::vector<Due>, Later> due_;
};

// N simulated workers over `channels` TCP connections and `threads` completion queues.
class Fleet {
 public:
  Fleet(const std::string& address, int workers, int channels, int threads,
        double register_deadline_s)
      : workers_(workers) {
    for (int c = 0; c < channels; ++c) {
      grpc::ChannelArguments args;
      args.SetInt("geofp8.bench.channel", c);  // distinct args: a distinct TCP connection
      stubs_.push_back(v1::WorkerService::NewStub(
          grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args)));
    }
    for (int t = 0; t < threads; ++t) {
      threads_.push_back(std::make_unique<FleetThread>(&stats_, &recording_, register_deadline_s));
    }
    for (int i = 0; i < workers; ++i) {
      workers_[i].index = i;
      workers_[i].stub = stubs_[i % channels].get();
      threads_[i % threads]->Add(&workers_[i]);
    }
    for (auto& t : threads_) t->Start();
  }
  ~Fleet() { Stop(); }

  void Register() {
    for (auto& t : threads_) t->Register();
  }
  void Stop() {
    for (auto& t : threads_) t->Stop();
    threads_.clear();
  }
  FleetStats& stats() { return stats_; }
  void set_recording(bool on) { recording_ = on; }

 private:
  std::vector<SimWorker> workers_;
  std::vector<std::unique_ptr<v1::WorkerService::Stub>> stubs_;
  FleetStats stats_;
  std::atomic<bool> recording_{false};
  std::vector<std::unique_ptr<FleetThread>> threads_;
};

// ---------------------------------------------------------------------------------------------
// One level: a fresh coordinator and N workers through the four phases.

struct Options {
  std::vector<int> levels = {1000, 2000, 5000, 10000};
  std::string coordinator;
  std::vector<std::string> coordinator_flags;
  // Completion queues (a thread each) of the simulated fleet. Eight, as the coordinator's session
  // queues: Debian's libgrpc checks every completion against its queue's outstanding tags, so two
  // queues of 5,000 streams each made the simulator, not the coordinator, the bottleneck at 10,000
  // workers (beats skipped because their stream's last write had not completed).
  int threads = 8;
  int workers_per_channel = 100;
  double seconds = 10;
  double settle_seconds = 2;
  double baseline_seconds = 2;
  int job_ranks = 1000;
  int update_callers = 4;
  double update_seconds = 5;
  double register_deadline_s = 600;
  double cold_start_timeout_s = 900;
  bool keep = false;
};

struct Beats {
  uint64_t sent = 0, acked = 0, skipped = 0;
  double p50 = 0, p99 = 0, max = 0, lag_max = 0;
  double probe_p50 = -1, probe_p99 = -1;  // -1: no probe answered
  int probes = 0, probes_failed = 0;
  std::string probe_error;
  uint64_t unacked() const { return sent - acked; }
};

struct LevelResult {
  int workers = 0;
  std::string load_start, load_end;
  int registered = 0, register_failed = 0, opened = 0, sessions_lost = 0;
  double register_all_s = -1, sessions_all_s = -1;
  double register_p50_s = 0, register_p99_s = 0, register_max_s = 0;
  int register_over_deadline = 0;
  CoordinatorProcess::Usage usage_after_start;
  Beats steady;
  int job_ranks = 0, assigned = 0;
  double submit_ms = 0, first_assign_s = -1, all_assign_s = -1, running_s = -1;
  double update_rate = 0, update_p50 = 0, update_p99 = 0;
  uint64_t updates = 0, update_failures = 0, policies_expected = 0, policies_delivered = 0;
  std::string update_error;
  std::vector<std::string> update_jobs;
  Beats during_updates;
  // No simulated worker dies: every worker the coordinator declared dead is a false death, and
  // every restart of the bench's jobs was caused by one.
  int false_deaths = 0, fencing_holds = 0;
  int job_restarts = 0;
  double sqlite_commits = 0;
  CoordinatorProcess::Usage usage_end;
  std::string first_error;
};

// Opens a measurement window of `seconds`, probing every 10 ms, then waits two heartbeat
// intervals for the window's acks.
Beats MeasureBeats(Fleet& fleet, HealthProbe& probe, double seconds,
                   const std::function<void()>& during = nullptr) {
  FleetStats& s = fleet.stats();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.beat_ms.clear();
    s.beats_sent = s.beats_acked = s.beats_skipped = 0;
    s.max_lag_ms = 0;
  }
  fleet.set_recording(true);
  std::vector<double> probes;
  int failed = 0;
  std::string error;
  const auto until = Clock::now() + std::chrono::duration<double>(seconds);
  while (Clock::now() < until) {
    const double ms = probe.RoundTripMs(&error);
    if (ms >= 0) {
      probes.push_back(ms);
    } else {
      ++failed;
    }
    if (during) during();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  fleet.set_recording(false);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  Beats b;
  std::lock_guard<std::mutex> lock(s.mu);
  b.sent = s.beats_sent;
  b.acked = s.beats_acked;
  b.skipped = s.beats_skipped;
  b.p50 = Percentile(s.beat_ms, 0.5);
  b.p99 = Percentile(s.beat_ms, 0.99);
  b.max = s.beat_ms.empty() ? 0 : *std::max_element(s.beat_ms.begin(), s.beat_ms.end());
  b.lag_max = s.max_lag_ms;
  b.probes = static_cast<int>(probes.size()) + failed;
  b.probes_failed = failed;
  b.probe_error = error;
  if (!probes.empty()) {
    b.probe_p50 = Percentile(probes, 0.5);
    b.probe_p99 = Percentile(probes, 0.99);
  }
  return b;
}

// Waits until pred() holds or `timeout_s` passes, printing `progress()` on stderr every 5 s.
bool WaitFor(const std::function<bool()>& pred, double timeout_s,
             const std::function<std::string()>& progress) {
  const auto start = Clock::now();
  auto next_report = start + std::chrono::seconds(5);
  while (!pred()) {
    const auto now = Clock::now();
    if (Seconds(now - start) > timeout_s) return false;
    if (progress && now >= next_report) {
      std::fprintf(stderr, "  ... %.0f s: %s\n", Seconds(now - start), progress().c_str());
      next_report += std::chrono::seconds(5);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

void PrintBeats(const char* what, const Beats& b) {
  std::printf(
      "%s: sent %llu, acked %llu, skipped %llu, unacked %llu; ack round trip p50 %.3f ms, "
      "p99 %.3f ms, max %.1f ms; probe p50 %s ms, p99 %s ms (%d probes, %d failed%s%s); "
      "simulator lag max %.1f ms\n",
      what, static_cast<unsigned long long>(b.sent), static_cast<unsigned long long>(b.acked),
      static_cast<unsigned long long>(b.skipped), static_cast<unsigned long long>(b.unacked()),
      b.p50, b.p99, b.max, Time(b.probe_p50, 3).c_str(), Time(b.probe_p99, 3).c_str(), b.probes,
      b.probes_failed, b.probe_error.empty() ? "" : ": ", b.probe_error.c_str(), b.lag_max);
}

// Submits a job of `world` ranks and returns its id, or an error sentence after "!".
std::string Submit(v1::JobService::Stub* jobs, const std::string& name, int world) {
  v1::SubmitJobRequest req;
  req.set_spec_yaml("name: " + name + "\nworld_size: " + std::to_string(world) + "\n");
  v1::SubmitJobResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  const grpc::Status s = jobs->SubmitJob(&ctx, req, &resp);
  return s.ok() ? resp.job().id() : "!" + s.error_message();
}

// Restarts the job has used so far; 0 when it cannot be read.
int JobRestarts(v1::JobService::Stub* jobs, const std::string& id) {
  v1::GetJobRequest req;
  req.set_job_id(id);
  v1::Job job;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return jobs->GetJob(&ctx, req, &job).ok() ? job.restarts() : 0;
}

// Lines of the coordinator's log that hold `text`.
int CountLogLines(const std::string& path, const std::string& text) {
  std::ifstream in(path);
  int n = 0;
  for (std::string line; std::getline(in, line);) n += line.find(text) != std::string::npos;
  return n;
}

v1::JobState JobStateOf(v1::JobService::Stub* jobs, const std::string& id) {
  v1::GetJobRequest req;
  req.set_job_id(id);
  v1::Job job;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return jobs->GetJob(&ctx, req, &job).ok() ? job.state() : v1::JOB_STATE_UNSPECIFIED;
}

void Placement(const Options& o, Fleet& fleet, v1::JobService::Stub* jobs, LevelResult* r) {
  FleetStats& s = fleet.stats();
  r->job_ranks = std::min(o.job_ranks, r->opened);
  if (r->job_ranks <= 0) return;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.assigned_at.clear();
  }
  const int assigned0 = s.assignments.load();
  const int stops0 = s.stops.load();
  const auto t0 = Clock::now();
  const std::string id = Submit(jobs, "cluster-bench-placement", r->job_ranks);
  r->submit_ms = Ms(Clock::now() - t0);
  if (id.rfind('!', 0) == 0) {
    r->first_error = "submit: " + id.substr(1);
    return;
  }
  std::fprintf(stderr, "  placing a %d-rank job\n", r->job_ranks);
  WaitFor([&] { return s.assignments.load() - assigned0 >= r->job_ranks; }, 60,
          [&] {
            return std::to_string(s.assignments.load() - assigned0) + "/" +
                   std::to_string(r->job_ranks) + " assignments received";
          });
  {
    std::lock_guard<std::mutex> lock(s.mu);
    r->assigned = static_cast<int>(s.assigned_at.size());
    if (!s.assigned_at.empty()) {
      r->first_assign_s =
          Seconds(*std::min_element(s.assigned_at.begin(), s.assigned_at.end()) - t0);
      r->all_assign_s = Seconds(*std::max_element(s.assigned_at.begin(), s.assigned_at.end()) - t0);
    }
  }
  if (r->assigned < r->job_ranks) r->all_assign_s = -1;
  // Every rank answered with its first progress report: the job runs once all arrived.
  if (WaitFor([&] { return JobStateOf(jobs, id) == v1::JOB_RUNNING; }, 60, nullptr)) {
    r->running_s = Seconds(Clock::now() - t0);
  }
  v1::CancelJobRequest cancel;
  cancel.set_job_id(id);
  cancel.set_reason("cluster bench: placement measured");
  v1::Job cancelled;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  jobs->CancelJob(&ctx, cancel, &cancelled).IgnoreError();
  WaitFor([&] { return s.stops.load() - stops0 >= r->assigned; }, 60, nullptr);
}

// `callers` UpdatePolicy callers, each on its own 4-rank job (a job's versions are bounded, see
// kMaxPolicyHistoryBytes), while every worker keeps heartbeating.
void PolicyUpdates(const Options& o, Fleet& fleet, HealthProbe& probe, v1::JobService::Stub* jobs,
                   const std::string& address, LevelResult* r) {
  FleetStats& s = fleet.stats();
  const int ranks_per_job = 4;
  if (r->opened < ranks_per_job * o.update_callers) {
    r->update_error = "too few workers for the update jobs";
    return;
  }
  const int assigned0 = s.assignments.load();
  std::vector<std::string> ids;
  for (int t = 0; t < o.update_callers; ++t) {
    ids.push_back(Submit(jobs, "cluster-bench-policy-" + std::to_string(t), ranks_per_job));
    if (ids.back().rfind('!', 0) == 0) {
      r->update_error = "submit: " + ids.back().substr(1);
      return;
    }
    r->update_jobs.push_back(ids.back());
  }
  if (!WaitFor([&] { return s.assignments.load() - assigned0 >= ranks_per_job * o.update_callers; },
               60, nullptr)) {
    r->update_error = "the update jobs were not placed within 60 s";
    return;
  }
  grpc::ChannelArguments args;
  args.SetInt("geofp8.bench.policy", 1);
  auto policy_stub = v1::PolicyService::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  const uint64_t policies0 = s.policies.load();
  std::atomic<bool> updating{true};
  std::vector<std::vector<double>> lat(o.update_callers);
  std::vector<uint64_t> failures(o.update_callers, 0);
  std::vector<std::string> errors(o.update_callers);
  std::vector<Clock::time_point> ended(o.update_callers);  // each caller's last reply
  std::vector<std::thread> callers;
  const auto u0 = Clock::now();
  for (int t = 0; t < o.update_callers; ++t) {
    callers.emplace_back([&, t] {
      for (int i = 0; updating.load(); ++i) {
        v1::UpdatePolicyRequest req;
        req.set_job_id(ids[t]);
        req.set_reason("cluster bench");
        auto* p = req.add_patches();
        p->set_layer(std::string(1 + i % 8, '*'));  // distinct patterns that all match
        p->set_format(i % 2 ? v1::FORMAT_NVFP4 : v1::FORMAT_FP8_E4M3);
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
        v1::UpdatePolicyResponse resp;
        const auto t0 = Clock::now();
        const grpc::Status st = policy_stub->UpdatePolicy(&ctx, req, &resp);
        if (st.ok()) {
          lat[t].push_back(Ms(Clock::now() - t0));
        } else {
          ++failures[t];
          if (errors[t].empty()) errors[t] = st.error_message();
        }
      }
      ended[t] = Clock::now();
    });
  }
  r->during_updates = MeasureBeats(fleet, probe, o.update_seconds, [&] {
    // The callers stop when the window closes, before the acks' grace period.
    if (Seconds(Clock::now() - u0) >= o.update_seconds) updating = false;
  });
  updating = false;
  for (auto& c : callers) c.join();
  const double elapsed = Seconds(*std::max_element(ended.begin(), ended.end()) - u0);
  std::vector<double> all;
  for (int t = 0; t < o.update_callers; ++t) {
    all.insert(all.end(), lat[t].begin(), lat[t].end());
    r->update_failures += failures[t];
    if (r->update_error.empty() && !errors[t].empty()) r->update_error = errors[t];
  }
  r->updates = all.size();
  r->update_rate = static_cast<double>(all.size()) / elapsed;
  r->update_p50 = Percentile(all, 0.5);
  r->update_p99 = Percentile(all, 0.99);
  // Every version goes to the job's 4 ranks (MeasureBeats waited 2 s for the acks).
  r->policies_expected = r->updates * ranks_per_job;
  r->policies_delivered = s.policies.load() - policies0;
}

LevelResult RunLevel(const Options& o, int n, const std::string& dir) {
  LevelResult r;
  r.workers = n;
  r.load_start = LoadAverage();
  std::printf("== %d workers (load average %s) ==\n", n, r.load_start.c_str());
  std::fflush(stdout);
  CoordinatorProcess coordinator;
  if (std::string e = coordinator.Start(o.coordinator, dir, o.coordinator_flags); !e.empty()) {
    r.first_error = e;
    return r;
  }
  const std::string& address = coordinator.address();
  HealthProbe probe(address);
  grpc::ChannelArguments args;
  args.SetInt("geofp8.bench.jobs", 1);
  auto jobs = v1::JobService::NewStub(
      grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  const int channels = std::max(1, (n + o.workers_per_channel - 1) / o.workers_per_channel);
  Fleet fleet(address, n, channels, o.threads, o.register_deadline_s);
  FleetStats& s = fleet.stats();

  // 1. Cold start: every worker registers at once, then opens its session.
  std::fprintf(stderr, "  %d workers register at once (%d connections, %d threads)\n", n, channels,
               o.threads);
  const auto t0 = Clock::now();
  fleet.Register();
  const bool all_registered = WaitFor(
      [&] { return s.registered.load() + s.register_failed.load() >= n; }, o.cold_start_timeout_s,
      [&] {
        return std::to_string(s.registered.load()) + " registered, " +
               std::to_string(s.opened.load()) + " sessions open, " +
               std::to_string(s.register_failed.load()) + " failed (load " + LoadAverage() + ")";
      });
  if (all_registered && s.register_failed.load() == 0)
    r.register_all_s = Seconds(Clock::now() - t0);
  const double left = o.cold_start_timeout_s - Seconds(Clock::now() - t0);
  if (WaitFor(
          [&] { return s.opened.load() + s.register_failed.load() + s.sessions_lost.load() >= n; },
          std::max(left, 5.0), nullptr) &&
      s.opened.load() == n) {
    r.sessions_all_s = Seconds(Clock::now() - t0);
  }
  r.registered = s.registered.load();
  r.register_failed = s.register_failed.load();
  r.opened = s.opened.load();
  r.usage_after_start = coordinator.ReadUsage();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    r.register_p50_s = Percentile(s.register_s, 0.5);
    r.register_p99_s = Percentile(s.register_s, 0.99);
    r.register_max_s =
        s.register_s.empty() ? 0 : *std::max_element(s.register_s.begin(), s.register_s.end());
    r.register_over_deadline =
        static_cast<int>(std::count_if(s.register_s.begin(), s.register_s.end(),
                                       [](double v) { return v > kWorkerRegisterDeadlineS; }));
  }
  std::printf(
      "cold start: %d/%d registered in %s s (%.0f/s), %d sessions open in %s s; Register "
      "p50 %.2f s, p99 %.2f s, max %.2f s; %d over the worker's %.0f s deadline, %d failed\n",
      r.registered, n, Time(r.register_all_s, 2).c_str(),
      r.register_all_s > 0 ? n / r.register_all_s : 0.0, r.opened,
      Time(r.sessions_all_s, 2).c_str(), r.register_p50_s, r.register_p99_s, r.register_max_s,
      r.register_over_deadline, kWorkerRegisterDeadlineS, r.register_failed);
  std::printf("  coordinator after cold start: %ld threads, peak RSS %ld MiB, %.1f CPU s\n",
              r.usage_after_start.threads, r.usage_after_start.peak_rss_mib,
              r.usage_after_start.cpu_s);
  std::fflush(stdout);

  // 2. Heartbeats at steady state, against the probe.
  std::this_thread::sleep_for(std::chrono::duration<double>(o.settle_seconds));
  std::fprintf(stderr, "  measuring heartbeats for %.0f s\n", o.seconds);
  r.steady = MeasureBeats(fleet, probe, o.seconds);
  PrintBeats("heartbeats", r.steady);
  std::fflush(stdout);

  // 3. One large job: SubmitJob to every rank's Assignment.
  Placement(o, fleet, jobs.get(), &r);
  std::printf(
      "placement: %d-rank job, SubmitJob %.1f ms; %d/%d assignments, first %.3f s, all %.3f s; "
      "RUNNING after %.3f s (each rank's first progress report)\n",
      r.job_ranks, r.submit_ms, r.assigned, r.job_ranks, r.first_assign_s, r.all_assign_s,
      r.running_s);
  std::fflush(stdout);

  // 4. Policy updates from a few callers while every worker heartbeats.
  std::fprintf(stderr, "  %d policy update callers for %.0f s\n", o.update_callers,
               o.update_seconds);
  PolicyUpdates(o, fleet, probe, jobs.get(), address, &r);
  std::printf(
      "policy updates: %d callers, %.0f updates/s, p50 %.2f ms, p99 %.2f ms, %llu failed%s%s; "
      "versions delivered to ranks %llu/%llu\n",
      o.update_callers, r.update_rate, r.update_p50, r.update_p99,
      static_cast<unsigned long long>(r.update_failures), r.update_error.empty() ? "" : ": ",
      r.update_error.c_str(), static_cast<unsigned long long>(r.policies_delivered),
      static_cast<unsigned long long>(r.policies_expected));
  PrintBeats("  heartbeats meanwhile", r.during_updates);

  r.sqlite_commits = SqliteCommitsPerSecond(dir, o.baseline_seconds);
  std::printf("baseline: %.0f SQLite WAL+FULL commits/s on the same disk\n", r.sqlite_commits);
  r.usage_end = coordinator.ReadUsage();
  r.sessions_lost = s.sessions_lost.load();
  for (const std::string& id : r.update_jobs) r.job_restarts += JobRestarts(jobs.get(), id);
  r.false_deaths = CountLogLines(coordinator.log_path(), "event=worker.dead");
  r.fencing_holds = CountLogLines(coordinator.log_path(), "event=fencing.held");
  std::printf(
      "liveness: %d sessions lost (%.2f%%), %d workers declared dead (all false: no simulated "
      "worker dies), %d restarts of the update jobs, fencing held off %d times\n",
      r.sessions_lost, n > 0 ? 100.0 * r.sessions_lost / n : 0.0, r.false_deaths, r.job_restarts,
      r.fencing_holds);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (r.first_error.empty()) r.first_error = s.first_error;
  }
  fleet.Stop();
  coordinator.Stop();
  r.load_end = LoadAverage();
  std::printf(
      "  coordinator at the end: %ld threads, peak RSS %ld MiB, %.1f CPU s; %d sessions lost%s%s; "
      "load average %s\n",
      r.usage_end.threads, r.usage_end.peak_rss_mib, r.usage_end.cpu_s, r.sessions_lost,
      r.first_error.empty() ? "" : "; first error: ", r.first_error.c_str(), r.load_end.c_str());
  // One line for scripts (tests/bench/cluster_bench_test.sh).
  std::printf(
      "result workers=%d registered=%d sessions=%d register_failed=%d sessions_lost=%d "
      "false_deaths=%d job_restarts=%d beats_sent=%llu beats_acked=%llu beats_skipped=%llu "
      "beats_unacked=%llu assigned=%d/%d updates=%llu\n\n",
      n, r.registered, r.opened, r.register_failed, r.sessions_lost, r.false_deaths, r.job_restarts,
      static_cast<unsigned long long>(r.steady.sent),
      static_cast<unsigned long long>(r.steady.acked),
      static_cast<unsigned long long>(r.steady.skipped),
      static_cast<unsigned long long>(r.steady.unacked()), r.assigned, r.job_ranks,
      static_cast<unsigned long long>(r.updates));
  std::fflush(stdout);
  return r;
}

const char* Verdict(bool met) { return met ? "met" : "MISSED"; }

void PrintSummary(const std::vector<LevelResult>& results) {
  std::printf(
      "| workers | register all s | Register p99 s | sessions open | hb p50 ms | hb p99 ms | "
      "probe p99 ms | unacked | assign all s | RUNNING s | updates/s | update p99 ms | "
      "hb p99 during ms | SQLite commits/s | sessions lost | false deaths | job restarts | "
      "load (start) |\n");
  std::printf(
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
      "\n");
  for (const LevelResult& r : results) {
    std::printf(
        "| %d | %s | %.2f | %d/%d in %s | %.3f | %.3f | %s | %llu | %s | %s | %.0f | %.2f | "
        "%.3f | %.0f | %d | %d | %d | %s |\n",
        r.workers, Time(r.register_all_s, 2).c_str(), r.register_p99_s, r.opened, r.workers,
        Time(r.sessions_all_s, 2).c_str(), r.steady.p50, r.steady.p99,
        Time(r.steady.probe_p99, 3).c_str(), static_cast<unsigned long long>(r.steady.unacked()),
        Time(r.all_assign_s, 3).c_str(), Time(r.running_s, 3).c_str(), r.update_rate, r.update_p99,
        r.during_updates.p99, r.sqlite_commits, r.sessions_lost, r.false_deaths, r.job_restarts,
        r.load_start.c_str());
  }
  std::printf("\n");
  for (const LevelResult& r : results) {
    const int n = r.workers;
    const bool reg = r.register_all_s >= 0 && r.sessions_all_s >= 0 && r.sessions_all_s <= 30;
    std::printf(
        "verdict %d: all register and open sessions within 30 s: %s (%d/%d sessions open, all in "
        "%s s)\n",
        n, Verdict(reg), r.opened, n, Time(r.sessions_all_s, 2).c_str());
    const bool hb = r.steady.acked > 0 && r.steady.unacked() == 0 &&
                    (r.steady.p99 < 10 || r.steady.p99 < 2 * r.steady.probe_p99);
    std::printf(
        "verdict %d: heartbeat p99 < 10 ms or < 2x probe p99, every beat acked: %s (p99 %.3f ms, "
        "probe p99 %s ms, %llu unacked, %llu skipped, over %d open sessions)\n",
        n, Verdict(hb), r.steady.p99, Time(r.steady.probe_p99, 3).c_str(),
        static_cast<unsigned long long>(r.steady.unacked()),
        static_cast<unsigned long long>(r.steady.skipped), r.opened);
    std::printf("verdict %d: >= 1000 policy updates/s: %s (%.0f/s)\n", n,
                Verdict(r.update_rate >= 1000), r.update_rate);
    const bool live = r.sessions_lost * 100 <= n && r.job_restarts == 0;
    std::printf(
        "verdict %d: at most 1%% of sessions lost, no job restarted by a false death: %s (%d "
        "lost, %d false deaths, %d restarts)\n",
        n, Verdict(live), r.sessions_lost, r.false_deaths, r.job_restarts);
    const bool placed = r.all_assign_s >= 0 && r.all_assign_s <= 5;
    std::printf("verdict %d: %d-rank job assigned within 5 s: %s (%s s)\n", n, r.job_ranks,
                Verdict(placed), Time(r.all_assign_s, 3).c_str());
  }
}

// The daemon next to this binary in a build tree (build/bench/ and build/server/coordinator/)
// or in an install (both in bin/).
std::string DefaultCoordinator() {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec).parent_path();
  for (const auto& p :
       {self / "../server/coordinator/geofp8-coordinator", self / "geofp8-coordinator"}) {
    if (std::filesystem::exists(p, ec)) return std::filesystem::weakly_canonical(p, ec).string();
  }
  return "geofp8-coordinator";
}

// 10k sessions travel over a few hundred connections here, but a real fleet holds one per
// worker: raise this process's descriptor limit to its hard limit (the coordinator inherits it).
void RaiseFileLimit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
  }
}

int Run(int argc, char** argv) {
  CLI::App app{
      "geofp8-bench cluster: the geofp8-coordinator daemon against N simulated workers (cold "
      "start, heartbeats, a 1000-rank placement, policy updates)",
      "cluster"};
  Options o;
  app.add_option("--workers", o.levels, "Worker counts, one fresh coordinator each")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  app.add_option("--coordinator", o.coordinator,
                 "geofp8-coordinator binary (default: the one next to this build)");
  app.add_option("--coordinator-flag", o.coordinator_flags,
                 "Extra flag passed to the coordinator verbatim (repeat for several)");
  app.add_option("--threads", o.threads, "Completion-queue threads driving the workers")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--workers-per-connection", o.workers_per_channel,
                 "Sessions sharing one client TCP connection")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  app.add_option("--seconds", o.seconds, "Measured seconds of steady heartbeats")
      ->capture_default_str()
      ->check(CLI::Range(0.5, 3600.0));
  app.add_option("--settle-seconds", o.settle_seconds,
                 "Seconds between the cold start and the heartbeat measurement")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 3600.0));
  app.add_option("--baseline-seconds", o.baseline_seconds,
                 "Seconds of the SQLite commit baseline per level")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--job-ranks", o.job_ranks, "Ranks of the placement job (at most the workers)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  app.add_option("--update-callers", o.update_callers, "Concurrent UpdatePolicy callers")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--update-seconds", o.update_seconds, "Seconds of the policy update stream")
      ->capture_default_str()
      ->check(CLI::Range(0.5, 3600.0));
  app.add_option("--register-deadline-s", o.register_deadline_s,
                 "Deadline of each simulated Register (one try; a real worker waits 10 s and "
                 "retries)")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 86400.0));
  app.add_option("--cold-start-timeout-s", o.cold_start_timeout_s,
                 "Give up the cold start after this long")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 86400.0));
  app.add_flag("--keep", o.keep, "Keep each level's directory (data, coordinator.log)");
  if (int rc = ParseFlags(app, argc, argv); rc >= 0) return rc;
  if (o.coordinator.empty()) o.coordinator = DefaultCoordinator();
  if (access(o.coordinator.c_str(), X_OK) != 0) {
    UsageError("geofp8-bench cluster", "--coordinator", "not an executable file", o.coordinator);
  }
  RaiseFileLimit();
  // As the coordinator does (grpc_services.cc): Debian's abseil checks every gRPC mutex for
  // deadlock cycles, and the simulator's CPU comes out of the same two cores.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  std::printf(
      "geofp8-bench cluster: %s on 127.0.0.1, fresh data directory per level; %d client "
      "threads, %d sessions per connection; open files limit %llu\n",
      o.coordinator.c_str(), o.threads, o.workers_per_channel,
      static_cast<unsigned long long>(files.rlim_cur));
  std::printf(
      "probe: gRPC health check every 10 ms during each measurement (machine noise floor)\n\n");
  std::fflush(stdout);
  std::vector<LevelResult> results;
  for (int n : o.levels) {
    char tmpl[] = "/tmp/geofp8-cluster-bench-XXXXXX";
    if (!mkdtemp(tmpl)) {
      std::fprintf(stderr, "geofp8-bench cluster: error: mkdtemp: %s\n", std::strerror(errno));
      return 1;
    }
    const std::string dir = tmpl;
    results.push_back(RunLevel(o, n, dir));
    if (results.back().registered == 0) {
      std::fprintf(stderr, "geofp8-bench cluster: error: %s (directory %s kept)\n",
                   results.back().first_error.c_str(), dir.c_str());
      return 1;
    }
    if (o.keep) {
      std::printf("kept %s\n\n", dir.c_str());
    } else {
      std::filesystem::remove_all(dir);
    }
  }
  PrintSummary(results);
  return 0;
}

}  // namespace

GEOFP8_REGISTER_BENCH("cluster",
                      "cluster: geofp8-coordinator against 1k-10k simulated workers (cold start, "
                      "heartbeats, placement, policy updates)",
                      Run);

}  // namespace geofp8::bench
