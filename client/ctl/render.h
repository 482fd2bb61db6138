// Output of geofp8ctl: -o table (aligned columns), json (proto3 JSON) and yaml (the same data in
// block YAML), plus the human forms of `describe` and the `watch` progress line.
#pragma once

#include <string>
#include <vector>

#include "client/ctl/doc.h"
#include "geofp8/v1/geofp8.pb.h"

namespace geofp8::ctl {

enum class OutputFormat { kTable, kJson, kYaml };

// The document -o json, yaml and jsonpath print: FromProto (doc.h: enums by their table names,
// times as RFC 3339), with a job's progress.step and val_step counted as the table counts them
// (steps done, see StepsDone).
Doc OutputDoc(const google::protobuf::Message& m);
// OutputDoc as JSON (field names as in the .proto) or block YAML.
std::string ToJson(const google::protobuf::Message& m);
std::string ToYaml(const google::protobuf::Message& m);

// Aligned columns: the first row is the header.
std::string Table(const std::vector<std::vector<std::string>>& rows);

std::string JobsTable(const std::vector<v1::Job>& jobs, int64_t now_ms);
std::string WorkersTable(const v1::ListWorkersResponse& workers, int64_t now_ms);
std::string PolicyTable(const v1::Policy& policy);
// VERSION, EFFECTIVE-STEP, TAKEN-STEP (the step the ranks put it in force; "-" not yet, "never"
// when a newer version overtook it), AUTHOR, PATCHES, REASON; wide adds age, default, refresh.
std::string PolicyHistoryTable(const v1::ListPolicyVersionsResponse& versions);
std::string PolicyHistoryWideTable(const v1::ListPolicyVersionsResponse& versions, int64_t now_ms);
std::string DescribeJob(const v1::Job& job, const v1::Policy* policy, int64_t now_ms);

// "JOB_RUNNING" -> "RUNNING".
std::string StateName(v1::JobState s);
std::string WorkerStateName(v1::WorkerState s);
// 90s -> "1m30s"; negative -> "-".
std::string Duration(double seconds);
// 1536 -> "1.5 KiB".
std::string Bytes(double bytes);

// One progress line for `watch`:
// "[#######...........]  350/1000  35%  loss 3.214  12.3k tok/s  saved 71% (1.2 GiB)  ETA 4m10s"
// steps_per_second <= 0 prints "ETA -".
std::string ProgressLine(const v1::Job& job, double steps_per_second, int bar_width);

}  // namespace geofp8::ctl

namespace geofp8::ctl {

// Steps per second over a sliding window (default the last 30 s) of (time, steps done) samples,
// so that an ETA neither jumps with one slow report nor lags behind a real change of pace.
// No estimate (Rate() == 0) until the samples span min_span_s; a step count that goes backwards
// (a restart from a checkpoint) starts over.
class StepRate {
 public:
  explicit StepRate(double window_s = 30, double min_span_s = 5)
      : window_s_(window_s), min_span_s_(min_span_s) {}
  void Add(double t_s, int64_t steps_done);
  double Rate() const;

 private:
  double window_s_, min_span_s_;
  std::vector<std::pair<double, int64_t>> samples_;  // oldest first
};

// Which watch updates a non-TTY `watch` prints: every state change and every `percent` % of the
// steps (percent <= 0: every update).
class WatchThrottle {
 public:
  explicit WatchThrottle(double percent) : percent_(percent) {}
  bool ShouldPrint(const v1::Job& job);

 private:
  double percent_;
  bool first_ = true;
  v1::JobState state_ = v1::JOB_STATE_UNSPECIFIED;
  int64_t bucket_ = -1;
};

// Steps done (the last index completed + 1; all of them for a SUCCEEDED job).
int64_t StepsDone(const v1::Job& job);

// -o wide: the table columns plus progress detail (jobs) or host and name (workers).
std::string JobsWideTable(const std::vector<v1::Job>& jobs, int64_t now_ms);
std::string WorkersWideTable(const v1::ListWorkersResponse& workers, int64_t now_ms);

// A command tree for shell completion: its name, the options (with whether they take a value)
// and subcommands.
struct CommandNode {
  std::string name;
  std::vector<std::pair<std::string, bool>> options;  // "--server", takes a value
  std::vector<std::string> choices;                   // positional values offered, e.g. bash zsh
  bool takes_job = false;                             // a job id or name positional
  std::vector<CommandNode> children;
};
// A bash completion script for `program` ("bash") or a zsh one (zsh's bashcompinit).
// Job positionals complete with the ids and names of `program get jobs`.
std::string CompletionScript(const CommandNode& root, const std::string& shell);

}  // namespace geofp8::ctl
