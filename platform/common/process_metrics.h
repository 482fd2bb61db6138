// Series every GeoFP8 daemon exports besides its own: geofp8_build_info{version,git_commit} = 1
// and the standard process_* series (CPU seconds, resident memory, start time, open and maximum
// file descriptors), read from /proc at scrape time. Linux only; where /proc is missing a series
// is left out rather than reported as 0.
#pragma once

#include <prometheus/metric_family.h>

#include <string>
#include <vector>

namespace geofp8::http {

// The families above, as of now.
std::vector<prometheus::MetricFamily> ProcessFamilies();

// The version and `git describe` baked in at build time (platform/CMakeLists.txt).
const char* BuildVersion();
const char* BuildGitCommit();

}  // namespace geofp8::http
