// build_info and process_* series (see process_metrics.h). The /proc formats are proc(5)'s:
// /proc/self/stat fields 14, 15 (utime, stime) and 22 (starttime) in clock ticks after the
// parenthesised command name, /proc/self/statm field 2 (resident pages), /proc/stat's btime.
#include "platform/common/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "geofp8_build_version.h"  // generated in the build folder by client/ctl/version.cmake

namespace geofp8::http {
namespace {

prometheus::MetricFamily One(const char* name, const char* help, prometheus::MetricType type,
                             double value) {
  prometheus::ClientMetric m;
  m.gauge.value = value;
  m.counter.value = value;
  return prometheus::MetricFamily{name, help, type, {m}};
}

// Fields after "(comm)" of /proc/self/stat: index 0 is field 3 (state).
std::vector<std::string> StatFields() {
  std::ifstream f("/proc/self/stat");
  std::string line;
  if (!std::getline(f, line)) return {};
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return {};
  std::istringstream rest(line.substr(close + 1));
  std::vector<std::string> fields;
  for (std::string s; rest >> s;) fields.push_back(s);
  return fields;
}

double BootTimeSeconds() {
  std::ifstream f("/proc/stat");
  for (std::string key; f >> key;) {
    if (key == "btime") {
      double v = -1;
      f >> v;
      return v;
    }
    f.ignore(1 << 20, '\n');
  }
  return -1;
}

}  // namespace

const char* BuildVersion() { return GEOFP8CTL_VERSION; }
const char* BuildGitCommit() { return GEOFP8CTL_GIT_DESCRIBE; }

std::vector<prometheus::MetricFamily> ProcessFamilies() {
  std::vector<prometheus::MetricFamily> out;
  prometheus::ClientMetric info;
  info.label = {{"git_commit", BuildGitCommit()}, {"version", BuildVersion()}};
  info.gauge.value = 1;
  out.push_back({"geofp8_build_info",
                 "Always 1; labels name the build (git describe of the tree)",
                 prometheus::MetricType::Gauge,
                 {info}});

  const double ticks = double(sysconf(_SC_CLK_TCK));
  const std::vector<std::string> stat = StatFields();
  if (stat.size() > 19 && ticks > 0) {
    // stat[11], stat[12]: utime, stime (fields 14, 15); stat[19]: starttime (field 22).
    const double cpu = (std::stod(stat[11]) + std::stod(stat[12])) / ticks;
    out.push_back(One("process_cpu_seconds_total",
                      "Total user and system CPU time spent in seconds.",
                      prometheus::MetricType::Counter, cpu));
    const double boot = BootTimeSeconds();
    if (boot >= 0) {
      out.push_back(One("process_start_time_seconds",
                        "Start time of the process since unix epoch in seconds.",
                        prometheus::MetricType::Gauge, boot + std::stod(stat[19]) / ticks));
    }
  }
  std::ifstream statm("/proc/self/statm");
  double size_pages = 0, resident_pages = 0;
  if (statm >> size_pages >> resident_pages) {
    const double page = double(sysconf(_SC_PAGESIZE));
    out.push_back(One("process_resident_memory_bytes", "Resident memory size in bytes.",
                      prometheus::MetricType::Gauge, resident_pages * page));
    out.push_back(One("process_virtual_memory_bytes", "Virtual memory size in bytes.",
                      prometheus::MetricType::Gauge, size_pages * page));
  }
  if (DIR* d = opendir("/proc/self/fd")) {
    int n = 0;
    while (const dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
    // The directory stream's own descriptor is listed too.
    out.push_back(One("process_open_fds", "Number of open file descriptors.",
                      prometheus::MetricType::Gauge, double(n - 1)));
  }
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    out.push_back(One("process_max_fds", "Maximum number of open file descriptors.",
                      prometheus::MetricType::Gauge, double(lim.rlim_cur)));
  }
  return out;
}

}  // namespace geofp8::http
