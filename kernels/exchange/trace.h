// A timeline of the exchange engine's work, for finding where a step's time goes: one span per
// collective and per codec stage, on the lane (thread) that ran it. Written as Chrome trace JSON
// (load it in ui.perfetto.dev or chrome://tracing): one process per rank, one thread per lane.
// Times are steady_clock microseconds, so the files of ranks on one machine line up when loaded
// together; across machines they are offset by the machines' clocks.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace geofp8 {

class ExchangeTrace {
 public:
  using Clock = std::chrono::steady_clock;

  enum Lane : int {
    kMainLane = 0,     // the exchanger's thread: fingerprints, all-to-alls, baseline all-reduces
    kSideLane = 1,     // the side channel's thread: two_phase's all-gathers, allgather's odd groups
    kCodecLane = 2,    // the pipeline's helper: divide, geometry, encode, sum, decode
    kTrainerLane = 3,  // a trainer's own thread: forward and backward, the wait, the optimizer
  };

  struct Span {
    const char* name = "";  // a string literal: "fingerprints", "all_to_all", "encode", ...
    Lane lane = kMainLane;
    uint64_t step = 0;
    int group = -1;        // pipeline group (-1: not per group)
    int64_t begin_us = 0;  // steady_clock, microseconds
    int64_t duration_us = 0;
  };

  // Keeps at most `max_spans` spans (about 48 bytes each); later ones are counted as dropped.
  explicit ExchangeTrace(size_t max_spans = size_t{1} << 20) : max_spans_(max_spans) {}

  // Thread-safe.
  void Add(const char* name, Lane lane, uint64_t step, int group, Clock::time_point begin,
           Clock::time_point end);

  std::vector<Span> spans() const;
  size_t dropped() const;

  // Chrome trace JSON ("X" events, pid = rank, tid = lane, args step and group). Throws
  // geofp8::Error naming the path if it cannot be written.
  void WriteChromeJson(const std::string& path, int rank) const;

 private:
  mutable std::mutex mu_;
  std::vector<Span> spans_;
  size_t max_spans_;
  size_t dropped_ = 0;
};

// Records [construction, destruction) into `trace` when it is not null.
class TraceScope {
 public:
  TraceScope(ExchangeTrace* trace, const char* name, ExchangeTrace::Lane lane, uint64_t step,
             int group = -1)
      : trace_(trace),
        name_(name),
        lane_(lane),
        step_(step),
        group_(group),
        begin_(trace ? ExchangeTrace::Clock::now() : ExchangeTrace::Clock::time_point{}) {}
  ~TraceScope() {
    if (trace_) trace_->Add(name_, lane_, step_, group_, begin_, ExchangeTrace::Clock::now());
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  ExchangeTrace* trace_;
  const char* name_;
  ExchangeTrace::Lane lane_;
  uint64_t step_;
  int group_;
  ExchangeTrace::Clock::time_point begin_;
};

}  // namespace geofp8
