// The worker's side of `geofp8ctl logs`: answers the coordinator's LogRead with a bounded piece
// of a command job's rank output file (rank<R>.out or .err under CommandJobDir).
#pragma once

#include <cstdint>
#include <string>

#include "geofp8/v1/geofp8.pb.h"

namespace geofp8::worker {

// The most a LogData carries, whatever the LogRead asks: one answer never holds the session
// stream for long, and the coordinator buffers at most this much per reader.
inline constexpr int32_t kMaxLogReadBytes = 64 << 10;
// `tail_lines` looks back at most this far from the end; longer lines make the tail start
// inside a line, at end - kMaxTailScanBytes.
inline constexpr int64_t kMaxTailScanBytes = int64_t{8} << 20;

// The file a LogRead names; empty (with *error set) for a job id that is not a plain name.
std::string RankLogPath(const std::string& data_dir, const v1::LogRead& request,
                        std::string* error);

// Reads what `request` asks from the rank's file under data_dir: at most
// min(max_bytes, kMaxLogReadBytes) bytes from request.offset, or from the start of the last
// tail_lines lines. A file that does not exist is `missing`, not an error.
v1::LogData ReadRankLog(const std::string& data_dir, const v1::LogRead& request);

}  // namespace geofp8::worker
