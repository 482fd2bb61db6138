// Output of geofp8ctl: -o table (aligned columns), json (proto3 JSON) and yaml (the same data in
// block YAML), plus the human forms of `describe` and the `watch` progress line.
#pragma once

#include <string>
#include <vector>

#include "geofp8/v1/geofp8.pb.h"

namespace geofp8::ctl {

enum class OutputFormat { kTable, kJson, kYaml };

// Proto as JSON (field names as in the .proto) or block YAML.
std::string ToJson(const google::protobuf::Message& m);
std::string ToYaml(const google::protobuf::Message& m);

// Aligned columns: the first row is the header.
std::string Table(const std::vector<std::vector<std::string>>& rows);

std::string JobsTable(const std::vector<v1::Job>& jobs, int64_t now_ms);
std::string WorkersTable(const v1::ListWorkersResponse& workers, int64_t now_ms);
std::string PolicyTable(const v1::Policy& policy);
std::string PolicyHistoryTable(const v1::ListPolicyVersionsResponse& versions);
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
