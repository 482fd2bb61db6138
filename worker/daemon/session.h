// The worker's Session with the coordinator: Register (worker id + generation), one
// bidirectional stream with heartbeats on a timer, reconnect with backoff, and re-registration
// when the coordinator no longer knows (or has fenced) this generation.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "worker/daemon/connection.h"

namespace geofp8::worker {

struct SessionOptions {
  std::string name;  // stable worker name; re-registering it fences the old process
  std::string host;  // where the worker runs (reported, informational)
  std::string device = "cpu";
  uint64_t memory_bytes = 0;
  bool accepts_commands = false;                   // --allow-commands: reported at registration
  bool attach_only = false;                        // --attach: reported at registration
  std::chrono::milliseconds backoff_initial{200};  // first reconnect delay, doubled per failure
  // At most this long between tries: a coordinator back from an outage sees its workers, and
  // resumes their jobs, within it (the recovery target is 5 s after it returns).
  std::chrono::milliseconds backoff_max{2000};
  std::chrono::milliseconds rpc_timeout{10000};  // Register's deadline
  // Fault injection (tests): the first reliable message of this kind ("finished", "checkpoint")
  // is lost on the wire: kept as unacknowledged but never written, and the stream is cancelled,
  // as a connection that breaks right after a write would. Empty: never.
  std::string debug_break_stream_on;
};

struct SessionEvents {
  // Every coordinator message, on the session thread, in stream order. Must not block for long.
  std::function<void(const v1::CoordinatorMessage&)> on_message;
  // The generation this process held is gone (fenced, or unknown to a restarted coordinator):
  // anything it was running for the coordinator must stop. Called before re-registering.
  std::function<void(const std::string& reason)> on_generation_lost;
  // A session (re)opened with this generation.
  std::function<void(uint64_t generation)> on_connected;
  // What Register reports as held checkpoints (after on_generation_lost, so the rank is stopping).
  std::function<std::vector<v1::HeldCheckpoints>()> held_checkpoints;
};

// Counters for /metrics.
struct SessionCounters {
  std::atomic<uint64_t> registrations{0};
  std::atomic<uint64_t> reconnects{0};  // streams opened after the first
  std::atomic<uint64_t> heartbeats_sent{0};
  std::atomic<uint64_t> acks{0};
  std::atomic<uint64_t> send_failures{0};  // messages dropped with no stream open
  std::atomic<uint64_t> resent{0};         // reliable messages written again on a new stream
  std::atomic<uint64_t> generations_lost{0};
};

class SessionClient {
 public:
  SessionClient(std::shared_ptr<Connection> connection, SessionOptions options,
                SessionEvents events);
  ~SessionClient();  // Stop()

  // Starts the session thread (register, stream, reconnect) and the heartbeat timer.
  void Start();
  // Ends the stream and joins the threads. Idempotent.
  void Stop();

  // Sends with this session's worker id, generation and the next seq. A `reliable` message asks
  // for the coordinator's Ack and is kept until it comes: one that finds no open stream, or whose
  // stream breaks before the Ack, is written again when a stream with the same generation
  // reopens (dropped if the generation is lost: the coordinator has failed its attempt). Others
  // are dropped with no stream open, and false returned.
  bool Send(v1::WorkerMessage message, bool reliable = false);

  bool connected() const { return connected_.load(); }
  // The coordinator's heartbeat timeout from the last Register (10 s until then).
  std::chrono::milliseconds heartbeat_timeout() const {
    return std::chrono::milliseconds(heartbeat_timeout_ms_.load());
  }
  uint64_t generation() const { return generation_.load(); }
  std::string worker_id() const;
  const SessionCounters& counters() const { return counters_; }
  // Waits until a stream is open (true) or the timeout passes (false).
  bool WaitConnected(std::chrono::milliseconds timeout);
  // Tells the coordinator this generation leaves on purpose (its job fails over now, not after
  // the heartbeat timeout). Best effort within `timeout`; false if it did not get through.
  bool Leave(const std::string& reason, std::chrono::milliseconds timeout);

 private:
  void Loop();
  void HeartbeatLoop();
  bool Register(std::string* error);
  // Runs one stream until it ends; returns its final status.
  grpc::Status RunStream();
  bool SleepUnlessStopped(std::chrono::milliseconds d);

  std::shared_ptr<Connection> connection_;
  SessionOptions options_;
  SessionEvents events_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;
  SessionCounters counters_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::string worker_id_;
  std::string session_secret_;  // of generation_ (RegisterResponse); never logged
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> connected_{false};
  std::chrono::milliseconds heartbeat_interval_{1000};
  std::atomic<int64_t> heartbeat_timeout_ms_{10000};
  uint64_t seq_ = 0;
  grpc::ClientContext* context_ = nullptr;  // of the open stream, for cancellation
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream_;
  std::mutex write_mu_;                    // one writer at a time on the stream
  std::deque<v1::WorkerMessage> unsent_;   // reliable messages waiting for a stream
  std::deque<v1::WorkerMessage> unacked_;  // reliable messages written to the open stream
  bool debug_broke_ = false;               // debug_break_stream_on has fired

  std::thread thread_;
  std::thread heartbeat_;
};

}  // namespace geofp8::worker
